"""Errors that the command line reports as one line (no traceback)."""


class ConfigError(ValueError):
    """A config value is invalid. The message names the field and how to fix it."""


class CheckpointError(RuntimeError):
    """Checkpoints cannot be saved or restored for a reason that is not damage to them (a full
    disk, a permission, a bug): the run stops and every checkpoint is left as it is."""

"""Errors that the command line reports as one line (no traceback)."""


class ConfigError(ValueError):
    """A config value is invalid. The message names the field and how to fix it."""

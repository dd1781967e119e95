"""The permissions of the files we write: what the user's umask gives any file they create.

Files drafted privately and renamed into place keep their draft's mode (mkstemp and safetensors
create 0600, mkdtemp 0700); a dataset prepared into shared storage or a model handed to an
evaluation team would then be unreadable to everyone else. Such files get `umask_mode()` before
they are published.
"""

from __future__ import annotations

import contextlib
import os


def umask_mode(directory: bool = False) -> int:
    """The mode this process's umask gives a new file (or directory)."""
    mask = None
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status", encoding="ascii") as f:  # read without setting it (Linux)
            mask = next((int(line.split()[1], 8) for line in f if line.startswith("Umask:")), None)
    if mask is None:
        mask = os.umask(0o022)
        os.umask(mask)
    return (0o777 if directory else 0o666) & ~mask


def give_umask_modes(directory: str) -> None:
    """`umask_mode` for `directory` and everything under it (all of it written by this process)."""
    file_mode, directory_mode = umask_mode(), umask_mode(directory=True)
    os.chmod(directory, directory_mode)
    for parent, dirs, files in os.walk(directory):
        for name in dirs:
            os.chmod(os.path.join(parent, name), directory_mode)
        for name in files:
            os.chmod(os.path.join(parent, name), file_mode)

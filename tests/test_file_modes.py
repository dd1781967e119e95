"""Files we write get the mode the user's umask gives any file (issue #35): a dataset prepared into
shared storage, an exported model, checkpoints and run logs are readable by a second user where
the umask lets others read. Files drafted privately (mkstemp, safetensors: 0600; mkdtemp: 0700)
used to keep that mode when renamed into place."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile

import pytest
from conftest import run_command

from fbt_jax import permissions

NOBODY = 65534


def modes_not_from_umask(root: str) -> list[str]:
    """Every file or directory under `root` whose permission bits are not the umask's."""
    odd = []
    for parent, dirs, files in os.walk(root):
        for name, directory in [(d, True) for d in dirs] + [(f, False) for f in files]:
            path = os.path.join(parent, name)
            mode = stat.S_IMODE(os.lstat(path).st_mode)
            if not os.path.islink(path) and mode != permissions.umask_mode(directory):
                odd.append(f"{oct(mode)} {os.path.relpath(path, root)}")
    return odd


def unreadable_by_another_user(root: str) -> list[str]:
    """The files under `root` that uid 65534 cannot read, asked of `find` run as that uid."""
    result = subprocess.run(
        ["find", root, "-type", "f", "!", "-readable"],
        user=NOBODY,  # switched in the child by subprocess itself (no Python runs between fork and exec)
        group=NOBODY,
        extra_groups=[],
        capture_output=True,
        text=True,
        check=False,
    )
    assert not result.stderr, result.stderr  # a directory it cannot enter would be reported here
    return result.stdout.split()


def test_umask_mode_follows_the_umask():
    previous = os.umask(0o027)
    try:
        assert (permissions.umask_mode(), permissions.umask_mode(directory=True)) == (0o640, 0o750)
    finally:
        os.umask(previous)
    assert permissions.umask_mode() == 0o666 & ~previous


@pytest.mark.slow
def test_prepared_data_exports_checkpoints_and_logs_are_readable_by_another_user(prepared, trained_run, tmp_path):
    _, records, _ = prepared
    model = str(tmp_path / "model")
    run_command(["fbt-export", trained_run, model], check=True)
    wrong = {name: modes_not_from_umask(root) for name, root in [("prepared", records), ("run", trained_run),
                                                                  ("export", model)]}  # fmt: skip
    assert wrong == {"prepared": [], "run": [], "export": []}
    if os.geteuid() != 0:
        pytest.skip("the modes are the umask's; reading them as a second user needs root to switch uid")
    if permissions.umask_mode() & 0o004 == 0:
        pytest.skip(f"the umask ({oct(0o666 & ~permissions.umask_mode())}) lets no other user read: nothing to check")
    shared = tempfile.mkdtemp(prefix="fbt-modes-")  # pytest's own directories are private to this user
    try:
        os.chmod(shared, 0o755)
        for name, root in [("prepared", records), ("run", trained_run), ("export", model)]:
            shutil.copytree(root, os.path.join(shared, name), symlinks=True)  # modes are copied with the files
        assert unreadable_by_another_user(shared) == []
    finally:
        shutil.rmtree(shared, ignore_errors=True)

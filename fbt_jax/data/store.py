"""Files of a prepared dataset, local or in a bucket, written so that readers never see half of one.

Locally a file is written under a temporary name and renamed; in a bucket an object appears only
once its upload is complete. Either way a reader that sees a name sees all of its bytes, which is
what lets a killed preparation resume from the files that exist (`preparation.py`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any

from fbt_jax import paths, permissions


def join(base: str, *names: str) -> str:
    if paths.is_url(base):
        return "/".join([base.rstrip("/"), *names])
    return os.path.join(base, *names)


def exists(path: str) -> bool:
    if paths.is_url(path):
        from etils import epath

        return epath.Path(path).exists()
    return os.path.exists(path)


def read_json(path: str) -> Any:
    """The JSON document at `path`, or None where there is none."""
    try:
        if paths.is_url(path):
            from etils import epath

            return json.loads(epath.Path(path).read_text())
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def size(path: str) -> int | None:
    """The size of the file at `path` in bytes, or None where there is none."""
    try:
        if paths.is_url(path):
            from etils import epath

            return epath.Path(path).stat().length
        return os.path.getsize(path)
    except FileNotFoundError:
        return None


def publish(local: str, path: str) -> None:
    """Move the finished local file `local` to `path` (a rename, or an upload then a delete)."""
    if paths.is_url(path):
        from etils import epath

        with open(local, "rb") as src, epath.Path(path).open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 24)
        os.remove(local)
    else:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        os.chmod(local, permissions.umask_mode())  # drafted privately; published as any file the user writes
        os.replace(local, path)


def write_json(path: str, value: Any, staging: str) -> None:
    """Write `value` as JSON to `path` whole; `staging` is a local directory for the draft."""
    os.makedirs(staging, exist_ok=True)
    fd, draft = tempfile.mkstemp(prefix=".draft-", suffix=".json", dir=staging)  # 0600 until published
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2)
    publish(draft, path)


def listdir(path: str) -> list[str]:
    if paths.is_url(path):
        from etils import epath

        target = epath.Path(path)
        return sorted(p.name for p in target.iterdir()) if target.exists() else []
    return sorted(os.listdir(path)) if os.path.isdir(path) else []

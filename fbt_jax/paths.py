"""Paths a user gives, resolved once at the entry point.

A local path becomes absolute (relative to the directory the command was started from), so that a
run behaves the same whatever changes the working directory later (orbax, worker processes) and a
resumed run finds its files from any directory. A URL (`gs://bucket/dir`) is kept as it is and
checked once, before any expensive work, so that a typo or an unreachable bucket is one line, not
a traceback after compiling.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
from collections.abc import Iterator
from typing import Any

from fbt_jax.errors import ConfigError, describe

_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*):/")
# Schemes the storage layers (etils.epath / fsspec, orbax's tensorstore) can write to.
CLOUD_SCHEMES = ("gs",)
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]$")


def is_url(path: str) -> bool:
    return bool(_SCHEME.match(str(path)))


def resolve(path: str, flag: str) -> str:
    """An absolute local path or a checked URL; "" stays "" (the field is unset)."""
    path = str(path)
    if not path:
        return path
    match = _SCHEME.match(path)
    if match is None:
        return os.path.abspath(os.path.expanduser(path))
    scheme = match.group(1).lower()
    if scheme not in CLOUD_SCHEMES:
        raise ConfigError(
            f"{flag}={path!r} uses the scheme {scheme}://, which is not supported; use a local path or gs://bucket/dir"
        )
    rest = path[len(scheme) + 1 :]
    if not rest.startswith("//"):
        raise ConfigError(f"{flag}={path!r} is not a valid URL; write it as {scheme}://bucket/dir")
    bucket = rest[2:].split("/", 1)[0]
    if not _BUCKET.match(bucket):
        raise ConfigError(f"{flag}={path!r} names no valid bucket ({bucket!r}); write it as {scheme}://bucket/dir")
    return f"{scheme}://{rest[2:].rstrip('/')}"


def check_reachable(url: str, flag: str, writable: bool = False) -> None:
    """ConfigError unless the bucket of `url` can be reached (and, with `writable`, written to),
    checked once, at start-up.

    The storage client retries a failing request for about a minute and logs a traceback per try,
    so the endpoint is tried first: a DNS lookup of Cloud Storage, or a connection to the emulator
    that STORAGE_EMULATOR_HOST names, each of which fails at once.
    """
    if not is_url(url):
        return
    bucket = url.split("://", 1)[1].split("/", 1)[0]
    _check_endpoint(flag, url)
    from etils import epath

    with _quiet_storage_client():
        try:
            exists = epath.Path(f"gs://{bucket}").exists()
        except Exception as err:  # the client raises many types; every one is reported, as one line
            raise ConfigError(
                f"{flag}={url!r}: bucket gs://{bucket} cannot be read ({describe(err)}); "
                "check its name and your credentials (gcloud auth application-default login)"
            ) from None
        if not exists:
            raise ConfigError(f"{flag}={url!r}: bucket gs://{bucket} does not exist; create it or fix the name")
        if writable:
            probe = epath.Path(url) / f".fbt-write-check-{socket.gethostname()}-{os.getpid()}"
            try:
                probe.write_text("fbt-jax checks that it may write here before it starts")
                probe.unlink()
            except Exception as err:
                raise ConfigError(
                    f"{flag}={url!r}: cannot write to bucket gs://{bucket} ({describe(err)}); grant this account "
                    "write access (roles/storage.objectUser) or choose another bucket"
                ) from None


def _check_endpoint(flag: str, url: str) -> None:
    emulator = os.environ.get("STORAGE_EMULATOR_HOST", "")
    if not emulator:
        try:
            socket.getaddrinfo("storage.googleapis.com", 443)
        except OSError as err:
            raise ConfigError(
                f"{flag}={url!r}: cannot reach Google Cloud Storage ({err.strerror or err}); "
                "check the network, or use a local path"
            ) from None
        return
    endpoint = emulator if "://" in emulator else f"http://{emulator}"
    host_port = endpoint.split("://", 1)[1].split("/", 1)[0]
    host, _, port = host_port.rpartition(":") if ":" in host_port else (host_port, "", "")
    port_number = int(port) if port.isdigit() else (443 if endpoint.startswith("https") else 80)
    try:
        socket.create_connection((host or host_port, port_number), timeout=5).close()
    except OSError as err:
        raise ConfigError(
            f"{flag}={url!r}: cannot reach the storage emulator STORAGE_EMULATOR_HOST={emulator} "
            f"({err.strerror or err}); start it, or unset STORAGE_EMULATOR_HOST to use Cloud Storage"
        ) from None


@contextlib.contextmanager
def _quiet_storage_client() -> Iterator[None]:
    """gcsfs logs every retried request; the one-line error says what went wrong."""
    quiet = logging.getLogger("gcsfs")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        quiet.setLevel(level)


def resolve_inputs(spec: str, flag: str) -> str:
    """`resolve` for each comma-separated glob of an input spec, and for an `@FILE` listing."""
    return ",".join(
        "@" + resolve(part.strip()[1:], flag) if part.strip().startswith("@") else resolve(part.strip(), flag)
        for part in str(spec).split(",")
        if part.strip()
    )


# Config fields that hold paths, with whether a URL is allowed there (data.path: see resolve_inputs).
CONFIG_PATH_FIELDS = (
    ("workdir", True),
    ("checkpoint.dir", True),
    ("init_from", True),
    ("fork_from", True),
    ("data.cache_dir", False),  # prepared records are read through the local file system
    ("data.tfds_data_dir", True),
)


# Directories a run writes into, checked before any work: a file in their place is an error.
CONFIG_OUTPUT_DIRS = ("workdir", "checkpoint.dir", "data.cache_dir")


def check_config_dirs(config: Any) -> None:
    """ConfigError if a directory the run writes into is a file, lies under one, or (unless this is a
    dry run, which writes nothing) cannot be written: the workdir first, so that a read-only workdir
    is named as such, not as the first of its subdirectories that the run would make."""
    for field in CONFIG_OUTPUT_DIRS:
        section, _, name = field.rpartition(".")
        value = (config[section] if section else config)[name]
        if value:  # check_output_dir is check_dir_path and writability
            (check_dir_path if config.get("dry_run") else check_output_dir)(str(value), f"--config.{field}")


def check_config_urls(config: Any) -> None:
    """Check, once, that every bucket the config names is reachable."""
    seen = set()
    named = []
    for field, _ in CONFIG_PATH_FIELDS:
        section, _, name = field.rpartition(".")
        named.append((field, (config[section] if section else config)[name]))
    named += [("data.path", part.lstrip("@")) for part in str(config.data.path).split(",")]
    for field, value in named:
        writable = field in CONFIG_OUTPUT_DIRS
        if is_url(value) and (value.split("/")[2], writable) not in seen:
            seen.add((value.split("/")[2], writable))
            check_reachable(value, f"--config.{field}", writable=writable)


def check_output_file(path: str, flag: str) -> None:
    """ConfigError unless `path` can be written as a file (checked before the work is done)."""
    if is_url(path):
        return
    if os.path.isdir(path):
        raise ConfigError(f"{flag}={path!r} is a directory; give a file path")
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        raise ConfigError(f"{flag}={path!r}: its directory {parent} does not exist; create it first")
    if not os.access(parent, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ConfigError(f"{flag}={path!r} is not writable; choose another path")


def check_dir_path(path: str, flag: str) -> str:
    """ConfigError if the local directory `path` cannot exist because it, or the nearest existing
    directory above it, is a file; returns that nearest existing path ("" for a URL)."""
    if is_url(path):
        return ""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{flag}={path!r} is a file; give a directory")
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigError(f"{flag}={path!r} cannot be created: {existing} is a file; give a directory")
    return existing


def check_output_dir(path: str, flag: str) -> None:
    """ConfigError unless `path` is, or can be made, a writable directory."""
    if is_url(path):
        return
    existing = check_dir_path(path, flag)
    if not os.access(existing, os.W_OK):
        raise ConfigError(f"{flag}={path!r} is not writable ({existing}); choose another directory")

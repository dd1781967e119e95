"""Paths: local ones made absolute once, at the entry point; gs:// URLs kept, checked, and routed to
the cloud storage layer (exercised against a local stand-in for the Cloud Storage JSON API)."""

import http.server
import json
import os
import threading
import time

import pytest
from conftest import ROOT, cpu_env, last_line, load_config, run_command

from fbt_jax import paths
from fbt_jax.config import resolve_config_paths
from fbt_jax.errors import ConfigError


def test_local_paths_become_absolute_from_the_starting_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert paths.resolve("runs/tiny", "--config.workdir") == str(tmp_path / "runs" / "tiny")
    assert paths.resolve("~/x", "--output") == os.path.join(os.path.expanduser("~"), "x")
    assert paths.resolve("", "--config.init_from") == ""  # unset stays unset
    config = load_config("tiny")
    config.workdir, config.data.path, config.init_from = "runs/a", "corpus/*.txt", "../trunk"
    resolve_config_paths(config)
    assert config.workdir == str(tmp_path / "runs" / "a")
    assert config.data.path == str(tmp_path / "corpus" / "*.txt")  # globs too
    assert config.init_from == str(tmp_path.parent / "trunk")


def test_urls_are_kept_as_urls():
    for url in ("gs://bucket/runs/1b", "gs://my.bucket-2/a/b/", "GS://bucket/x"):
        resolved = paths.resolve(url, "--config.workdir")
        assert resolved.startswith("gs://") and not os.path.isabs(resolved)
    assert paths.resolve("gs://bucket/runs/1b/", "--config.workdir") == "gs://bucket/runs/1b"


@pytest.mark.parametrize(
    "url, message",
    [
        ("gs:/bucket/run", "is not a valid URL; write it as gs://bucket/dir"),
        ("gs://", "names no valid bucket"),
        ("gs://UPPER_case!/run", "names no valid bucket"),
        ("s3://bucket/run", "scheme s3://, which is not supported"),
    ],
)
def test_malformed_urls_are_one_line_errors(url, message):
    with pytest.raises(ConfigError, match=message) as err:
        paths.resolve(url, "--config.workdir")
    assert "\n" not in str(err.value) and "--config.workdir" in str(err.value)


def test_the_data_cache_must_be_local():
    config = load_config("tiny")
    config.data.cache_dir = "gs://bucket/cache"
    with pytest.raises(ConfigError, match="data.cache_dir.*must be a local directory"):
        resolve_config_paths(config)


def test_a_read_only_workdir_is_named_before_its_compilation_cache(tmp_path, monkeypatch):
    """With the default train.compilation_cache_dir=auto the cache lies in the workdir; a read-only
    workdir is reported as the workdir (it was reported as the cache flag, which the user never set).
    Root ignores permissions, so the file system's answer is what this test sets."""
    from fbt_jax.validation import validate_config

    workdir = tmp_path / "ro"
    workdir.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(workdir) else real_access(p, mode))
    config = load_config("tiny")
    config.workdir = str(workdir)
    with pytest.raises(ConfigError) as err:
        validate_config(config)
    assert str(err.value).startswith(f"--config.workdir={str(workdir)!r} is not writable")
    config.dry_run = True  # a dry run writes nothing: a read-only workdir is fine
    validate_config(config)


def test_a_compilation_cache_variable_is_named_as_the_variable(tmp_path, monkeypatch):
    from fbt_jax import run_services as services

    config = load_config("tiny")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path))
    assert services.compilation_cache_flag(config) == "JAX_COMPILATION_CACHE_DIR"
    config.train.compilation_cache_dir = str(tmp_path)
    assert services.compilation_cache_flag(config) == "--config.train.compilation_cache_dir"


class FakeCloudStorage(http.server.ThreadingHTTPServer):
    """Answers the Cloud Storage JSON API with 404 for every bucket but READ_ONLY, which exists and
    refuses every write with 403 (what a bucket without write permission answers); records the
    requests. (A bucket that works is the emulator's: tests/test_bucket.py.)"""

    READ_ONLY = "fbt-read-only"

    def __init__(self):
        self.requests: list[str] = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def answer(handler, code, body):  # noqa: N805
                data = json.dumps(body).encode()
                handler.send_response(code)
                handler.send_header("Content-Type", "application/json")
                handler.send_header("Content-Length", str(len(data)))
                handler.end_headers()
                handler.wfile.write(data)

            def do_GET(handler):  # noqa: N805
                self.requests.append(handler.path)
                if handler.path.split("?")[0] == f"/storage/v1/b/{self.READ_ONLY}":
                    return handler.answer(200, {"kind": "storage#bucket", "name": self.READ_ONLY})
                handler.answer(404, {"error": {"code": 404, "message": "Not Found"}})

            def do_POST(handler):  # noqa: N805
                self.requests.append(f"POST {handler.path}")
                handler.rfile.read(int(handler.headers.get("Content-Length", 0)))
                message = "does not have storage.objects.create access"
                handler.answer(403, {"error": {"code": 403, "message": message}})

            def log_message(handler, *args):  # noqa: N805
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self):
        return f"http://127.0.0.1:{self.server_address[1]}"


@pytest.fixture
def cloud():
    server = FakeCloudStorage()
    yield server
    server.shutdown()


def test_a_gs_workdir_reaches_cloud_storage_and_a_missing_bucket_is_one_line(cloud, tmp_path):
    result = run_command(
        ["fbt-train", f"--config={ROOT}/configs/tiny.py", "--config.workdir=gs://fbt-no-bucket/run"],
        cpu_env(8, STORAGE_EMULATOR_HOST=cloud.url),
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[-1] == (
        "fbt-train: config error: --config.workdir='gs://fbt-no-bucket/run': bucket gs://fbt-no-bucket does not exist; "
        "create it or fix the name"
    )
    assert "Traceback" not in result.stderr and "compiled" not in result.stdout
    assert any(r.startswith("/storage/v1/b/fbt-no-bucket") for r in cloud.requests)  # the cloud layer was asked
    assert os.listdir(tmp_path) == []  # nothing local was made of the URL (no ./gs:/...)


def test_fbt_prepare_to_a_missing_bucket_is_one_line(cloud, tmp_path):
    corpus = tmp_path / "doc.txt"
    corpus.write_text("some text " * 100)
    result = run_command(
        ["fbt-prepare", f"--input={corpus}", "--output=gs://fbt-no-bucket/prepared", "--seq-len=16"],
        cpu_env(8, STORAGE_EMULATOR_HOST=cloud.url),
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 2 and "bucket gs://fbt-no-bucket does not exist" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and sorted(os.listdir(tmp_path)) == ["doc.txt"]


def test_a_bucket_without_write_permission_is_one_line_before_any_work(cloud, tmp_path):
    result = run_command(
        ["fbt-train", f"--config={ROOT}/configs/tiny.py", f"--config.workdir=gs://{cloud.READ_ONLY}/run"],
        cpu_env(1, STORAGE_EMULATOR_HOST=cloud.url, GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false"),
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    last = last_line(result.stderr)
    assert last.startswith(
        f"fbt-train: config error: --config.workdir='gs://{cloud.READ_ONLY}/run': cannot write to bucket "
        f"gs://{cloud.READ_ONLY} ("
    ), last
    assert "grant this account write access" in last and "compiled" not in result.stdout
    assert any(r.startswith("POST") for r in cloud.requests)


def test_an_unreachable_emulator_is_one_line_at_once(tmp_path):
    from storage_emulator import free_port

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    started = time.monotonic()
    result = run_command(
        ["fbt-train", f"--config={ROOT}/configs/tiny.py", "--config.workdir=gs://fbt-test/run"],
        cpu_env(1, STORAGE_EMULATOR_HOST=url),
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    last = last_line(result.stderr)
    assert last.startswith(
        f"fbt-train: config error: --config.workdir='gs://fbt-test/run': cannot reach the storage emulator "
        f"STORAGE_EMULATOR_HOST={url} ("
    ), last
    assert time.monotonic() - started < 60  # not the client's minute of retries

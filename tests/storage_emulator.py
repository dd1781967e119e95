"""A local Cloud Storage emulator for the bucket tests and benchmarks: `gcp-storage-emulator` (a
test dependency) speaking the JSON API on a loopback port, in its own process, with both storage
clients pointed at it.

- gcsfs (etils.epath, fsspec, TFDS) reads `STORAGE_EMULATOR_HOST`;
- tensorstore (orbax's checkpoints) reads `TENSORSTORE_GCS_HTTP_URL`, and takes
  `GOOGLE_AUTH_TOKEN_FOR_TESTING` in place of credentials (what tensorstore's own tests use);
- gcsfs's bucket-type probe (gRPC, not emulated) is turned off.

`emulated_bucket()` starts one, creates the bucket, yields the environment a command needs, and
stops it (with everything in it) afterwards.

One gap of the emulator is filled here (run as `python tests/storage_emulator.py PORT BUCKET`):
its media downloads carry no `x-goog-generation` header, which tensorstore reads as generation 0
and then refuses to revalidate ("Malformed StorageGeneration": every checkpoint save failed). The
download handler is wrapped to send the object's generation, as Cloud Storage does. And it has no
Objects: move (`.../moveTo/...`, answered 501), which gcsfs renames with and retries for half a
minute per directory before it copies and deletes: served here as copy and delete.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def client_env(url: str) -> dict[str, str]:
    """The variables that point gcsfs and tensorstore at the emulator at `url`."""
    return {
        "STORAGE_EMULATOR_HOST": url,
        "TENSORSTORE_GCS_HTTP_URL": url,
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator",
        # gcsfs asks the Storage Control (gRPC) API whether a bucket is hierarchical, which the
        # emulator does not serve: a warning per bucket, then the JSON API anyway.
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
    }


@contextlib.contextmanager
def emulated_bucket(bucket: str = "fbt-test", timeout: float = 30.0) -> Iterator[dict[str, str]]:
    """Run an emulator holding an empty `bucket`; yields the clients' environment variables."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="fbt-gcs-emulator-") as home:
        log = open(os.path.join(home, "emulator.log"), "wb")
        # The emulator keeps objects in memory; its working directory is a throw-away one.
        proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), str(port), bucket],
            cwd=home,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                    break
                except OSError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        log.flush()
                        raise RuntimeError(
                            f"the storage emulator did not start: {open(log.name, 'rb').read()[-2000:].decode()}"
                        ) from None
                    time.sleep(0.1)
            yield client_env(f"http://127.0.0.1:{port}")
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()


def serve(port: int, bucket: str) -> None:
    """The emulator, in memory, with the generation header on downloads; runs until terminated."""
    import logging
    import signal
    import threading

    from gcp_storage_emulator import server, settings
    from gcp_storage_emulator.handlers import objects

    logging.disable(logging.CRITICAL)  # one line per request, and tracebacks for clients that hang up

    original = objects.download

    def download(request, response, storage, *args, **kwargs):
        original(request, response, storage, *args, **kwargs)
        if response.status.value in (200, 206):
            obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
            response["x-goog-generation"] = str(obj["generation"])
            response["x-goog-metageneration"] = str(obj["metageneration"])

    objects.download = download  # `objects.get` (?alt=media) calls it by name
    for _, handlers in server.HANDLERS:
        for method, handler in list(handlers.items()):
            if handler is original:
                handlers[method] = download

    def move(request, response, storage, *args, **kwargs):
        """Objects: move (what gcsfs renames with), as copy and delete."""
        request.params["dest_bucket_name"] = request.params["bucket_name"]
        objects.copy(request, response, storage)
        if response.status.value == 200:
            storage.delete_file(request.params["bucket_name"], request.params["object_id"])

    moves = [
        (
            rf"^{base}/b/(?P<bucket_name>[-.\w]+)/o/(?P<object_id>.*[^/]+)/moveTo/o/(?P<dest_object_id>.*[^/]+)$",
            {server.POST: move},
        )
        for base in (settings.API_ENDPOINT, "")
    ]
    server.HANDLERS = (*moves, *server.HANDLERS)  # before the generic object route that would take it
    emulator = server.create_server("127.0.0.1", port, in_memory=True, default_bucket=bucket)
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    emulator.start()
    stopped.wait()
    emulator.stop()


if __name__ == "__main__":
    serve(int(sys.argv[1]), sys.argv[2])

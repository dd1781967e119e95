"""The fbt-* commands of the tests, started warm (test-only).

Most of the suite's time went to hundreds of short commands, each importing jax, flax, optax and
orbax again (about 1.5 s of every command on a 2-core machine). Here one process per pytest worker
imports them once and forks a child per command: the child takes the caller's stdin, stdout and
stderr, its arguments, environment and directory, and runs the installed script as
`python SCRIPT ARGS` would, from its first line to its exit (its own process, pid, exit code, atexit
handlers and signals). fbt_jax itself is imported fresh in every child, from the working tree.

What calls it is a shim named like the command (`shims()`, first on the PATH a test gives, or
called directly by conftest.run_command): it forwards its descriptors and then the signals it
receives (SIGTERM, SIGINT, ...) to the child, and exits as the child did (killed by a signal: by
the same signal). If the shim dies (SIGKILL, a timeout), the server kills the child.

A command runs cold, as the real script, when warm would not be the same program: its environment
differs from the server's in a variable read when those libraries were imported (JAX_*, TF_*,
PYTHON*, thread counts, locale, HOME, TMPDIR, ...), a warm command is already its ancestor (the
tests kill such trees as they like), or it is not one of SERVED (fbt-prepare and
fbt-train-tokenizer do not import jax). Tests that start a command to signal or kill it start it
cold (conftest.start_command).

Usage: `python warm_commands.py SOCKET BIN SHIM_DIR` (conftest starts it; see `start`).
"""

from __future__ import annotations

import array
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from warm_shim import CHILD_MARK  # set in a warm command's environment: its own fbt-* commands run cold

SERVED = ("fbt-train", "fbt-eval", "fbt-decode", "fbt-sweep", "fbt-import", "fbt-export", "fbt-self-train")
# What every served command imports before its first line of work (fbt_jax.attention: Pallas and
# the Splash kernel).
PREIMPORTED = (
    "numpy",
    "jax",
    "jax.numpy",
    "flax.nnx",
    "optax",
    "orbax.checkpoint",
    "jax.experimental.pallas.ops.tpu.splash_attention",
)
# Variables that the preimported libraries (or Python itself) read when they start: a command whose
# value differs from the server's runs cold. XLA_FLAGS is read when the backend starts, in the child.
READ_AT_IMPORT = ("JAX_", "TF_", "TPU_", "PYTHON", "OMP_", "OPENBLAS", "MKL_", "LD_", "HOME", "TMPDIR", "LANG", "LC_")

SHIM = """#!{python} -S
# conftest's warm shim for {program}: tests/warm_commands.py.
import sys
sys.path.insert(0, {tests!r})
import warm_shim
warm_shim.main({socket!r}, {script!r})
"""


def differs_at_import(env: dict[str, str], base: dict[str, str], set_at_import: dict[str, str]) -> list[str]:
    """The variables of `env` that make its command another program than the server's, started with
    `base`, which its imports extended by `set_at_import`."""
    keys = {k for k in set(env) | set(base) if env.get(k) != base.get(k)}
    read = (k for k in keys if k.startswith(READ_AT_IMPORT) and k != "PYTHON")  # $PYTHON: the launchers'
    return sorted({*read, *(k for k in keys if k in set_at_import)})


# --- the server --------------------------------------------------------------------------------------------


def serve(path: str, base: dict[str, str]) -> dict:
    """Accept requests until one is forked: returns its request in the child, never in the server.
    `base`: the server's environment before its imports."""
    set_at_import = {k: v for k, v in os.environ.items() if base.get(k) != v}  # TF_CPP_MIN_LOG_LEVEL, ...
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wakeup_r, wakeup_w = os.pipe()
    os.set_blocking(wakeup_w, False)
    signal.set_wakeup_fd(wakeup_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(wakeup_r, selectors.EVENT_READ, "reap")
    children: dict[int, socket.socket] = {}
    closed: set[socket.socket] = set()  # connections of children whose shim is gone
    parent = os.getppid()
    while True:
        if os.getppid() != parent:  # the pytest worker is gone, without stopping this server
            sys.exit(0)
        for key, _ in selector.select(timeout=1.0):
            if key.data == "accept":
                conn, _ = listener.accept()
                request, fds = receive(conn)
                env = request["env"]
                if CHILD_MARK in env or differs_at_import(env, base, set_at_import):
                    conn.sendall(b"cold\n")
                    conn.close()
                    for fd in fds:
                        os.close(fd)
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    selector.close()
                    for fd in (listener.fileno(), wakeup_r, wakeup_w, *(c.fileno() for c in children.values())):
                        os.close(fd)
                    conn.close()
                    os.setpgid(0, 0)  # a command that signals its own group reaches only itself
                    for target, fd in enumerate(fds):
                        os.dup2(fd, target)
                        os.close(fd)
                    request["env"] = {**env, **set_at_import}  # as its own imports would have
                    return request
                for fd in fds:
                    os.close(fd)
                conn.sendall(f"pid {pid}\n".encode())
                children[pid] = conn
                selector.register(conn, selectors.EVENT_READ, pid)
            elif key.data == "reap":
                os.read(wakeup_r, 4096)
                for pid in list(children):
                    done, status = os.waitpid(pid, os.WNOHANG)
                    if done:
                        conn = children.pop(pid)
                        if conn in closed:
                            closed.discard(conn)
                        else:
                            selector.unregister(conn)
                        code = os.waitstatus_to_exitcode(status)
                        try:
                            conn.sendall(f"exit {code}\n".encode())
                        except OSError:
                            pass
                        conn.close()
            else:  # the shim closed its connection before its child ended: it was killed
                pid = key.data
                if conn_closed(key.fileobj):
                    selector.unregister(key.fileobj)
                    closed.add(key.fileobj)
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass


def conn_closed(conn: socket.socket) -> bool:
    try:
        return conn.recv(1) == b""
    except OSError:
        return True


def receive(conn: socket.socket) -> tuple[dict, list[int]]:
    fds = array.array("i")
    data = b""
    while not data.endswith(b"\n"):
        message, ancillary, _, _ = conn.recvmsg(1 << 20, socket.CMSG_SPACE(3 * fds.itemsize))
        if not message:
            raise ConnectionError("the shim left before its request")
        data += message
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    return json.loads(data), list(fds)


def run_child(request: dict) -> None:
    """Become the command: its directory, environment and arguments, then its script as __main__."""
    import runpy

    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ[CHILD_MARK] = "1"
    script = request["script"]
    sys.argv = [script, *request["args"]]
    sys.path[0] = os.path.dirname(script)
    runpy.run_path(script, run_name="__main__")


# --- the side of the tests ----------------------------------------------------------------------------------


def start(bin_dir: str, env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    """A server for this pytest worker (its environment `env`) and the directory of its shims."""
    root = tempfile.mkdtemp(prefix="fbt-jax-warm-")
    path = os.path.join(root, "socket")
    shim_dir = os.path.join(root, "bin")
    os.makedirs(shim_dir)
    tests = os.path.dirname(os.path.abspath(__file__))
    for program in SERVED:
        script = os.path.join(bin_dir, program)
        if os.path.exists(script):
            shim = os.path.join(shim_dir, program)
            with open(shim, "w") as f:
                f.write(SHIM.format(python=sys.executable, program=program, tests=tests, socket=path, script=script))
            os.chmod(shim, 0o755)
    server = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), path],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.time() + 120
    while not os.path.exists(path):
        if server.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"the warm command server did not start (exit {server.poll()})")
        time.sleep(0.02)
    return server, shim_dir


def stop(server: subprocess.Popen, root_bin: str) -> None:
    server.kill()
    server.wait()
    shutil.rmtree(os.path.dirname(root_bin), ignore_errors=True)


if __name__ == "__main__":
    import importlib

    started_with = dict(os.environ)
    for name in PREIMPORTED:
        importlib.import_module(name)
    request = serve(sys.argv[1], started_with)
    run_child(request)

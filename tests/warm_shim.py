"""The shim side of tests/warm_commands.py: stdlib only, started with `python -S` (milliseconds).

It hands its stdin, stdout and stderr, arguments, environment and directory to the warm server,
forwards the signals it receives to the child that the server forked, and exits as that child did.
Where the server says so (or is not there), it becomes the real script instead."""

from __future__ import annotations

import array
import json
import os
import signal
import socket
import sys

CHILD_MARK = "FBT_TEST_WARM_CHILD"
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def cold(script: str) -> None:
    os.execv(sys.executable, [sys.executable, script, *sys.argv[1:]])


def main(socket_path: str, script: str) -> None:
    env = dict(os.environ)
    if CHILD_MARK in env or os.environ.get("FBT_TEST_COLD") or not os.path.exists(socket_path):
        cold(script)
    request = json.dumps({"script": script, "args": sys.argv[1:], "env": env, "cwd": os.getcwd()}) + "\n"
    data = request.encode()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:  # until the server has forked the command, anything amiss means: run it cold
        conn.connect(socket_path)
        sent = conn.sendmsg([data[:4096]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [0, 1, 2]))])
        conn.sendall(data[sent:])
        reader = conn.makefile("r")
        reply = reader.readline().split()
    except OSError:
        reply = []
    if reply[:1] != ["pid"]:
        conn.close()
        cold(script)
    pid = int(reply[1])
    for number in SIGNALS:
        signal.signal(number, lambda received, _frame: os.kill(pid, received))
    reply = reader.readline().split()
    if reply[:1] != ["exit"]:
        sys.stderr.write(f"{os.path.basename(script)} (warm test shim): the server ended before pid {pid} did\n")
        sys.exit(70)
    code = int(reply[1])
    if code < 0:  # killed by a signal: so is the shim, so that its parent sees the same
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code if code >= 0 else 128 - code)

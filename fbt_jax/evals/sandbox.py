"""Run a generated Python program (a model's completion plus the task's tests) and decide pass/fail.

The program may loop, fork, fill the disk, touch our files, use the network or exit 0 early; none of
it may change the verdict or anything outside its temporary directory. It runs as `python -I` in a new
session, in a fresh empty directory removed afterwards, with a minimal environment and rlimits, under
a wall-clock timeout and a disk quota watched from outside; its process group is killed at the end,
then whatever is left in its session or with its uid. As root, each run gets a fresh unprivileged uid
(not a shared `nobody`: runs cannot touch each other, RLIMIT_NPROC counts one run, escapees are found
by uid); where that uid cannot reach the interpreter (a pyenv under /root) it keeps CAP_DAC_READ_SEARCH
and reads what root reads. A new network namespace leaves it no network. "passed" needs exit status 0
and a per-run nonce, given through stdin, that the harness prints once the program ran to its end.
`containment()` says what is in force; `Limits(isolate=False)` (`--no-sandbox`) keeps only the
process, the timeout, the group kill and the directory.

A safeguard against careless or runaway code, not a security boundary. Known gaps: deliberate
introspection of the harness's interpreter (frames, gc) finds the nonce; the program reads
world-readable files and writes where anyone may (/tmp, /dev/shm) or to files it deleted but holds
open, bounded per file by RLIMIT_FSIZE and in time by the timeout but unseen by the quota; without
root (no uid drop), a grandchild that calls setsid() survives the run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import resource
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

_CLONE_NEWNET = 0x40000000
_POLL_S, _UID_BASE, _UID_SPAN = 0.01, 2_000_000_000, 100_000_000  # fresh uids: far above any account, < 2**31

# The harness contains itself before anything of the program runs (no preexec_fn: forking our
# multithreaded process to run Python before exec can deadlock): network, uid, one capability, rlimits.
# A failure there is exit 97 and a verdict of "error". Then the nonce is read before the program can
# read stdin, and printed once it returned; os._exit skips atexit and thread joins.
_CONTAIN = r"""import ctypes, json, os, resource, sys
plan = json.loads(sys.argv[1])
try:
    libc = ctypes.CDLL(None, use_errno=True)
    if plan["net"] and libc.unshare(plan["net"]) != 0:  # first, while we hold root's capabilities
        raise OSError(ctypes.get_errno(), "unshare")
    if plan["uid"] is not None:
        os.setgroups([]); os.setgid(plan["uid"])
        if plan["keep_read"]: libc.prctl(8, 1, 0, 0, 0)  # PR_SET_KEEPCAPS: keep it through setuid
        os.setuid(plan["uid"])
        if plan["keep_read"]:  # CAP_DAC_READ_SEARCH effective, and ambient for programs it starts
            header, caps = (ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)(4, 4, 4, 0, 0, 0)
            if libc.capset(header, caps) != 0 or libc.prctl(47, 2, 2, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "capset")
    for res, soft, hard in plan["rlimits"]:  # last: a low RLIMIT_AS could fail any allocation after it
        resource.setrlimit(res, (soft, hard))
    import decimal, json.decoder  # noqa: modules not loaded yet: the interpreter's files stay readable
except Exception as err:
    os.write(2, f"sandbox containment failed: {err!r}\n".encode()); os._exit(97)
"""
_HARNESS = (
    _CONTAIN
    + r"""import types
nonce = os.read(0, 256).strip()
null = os.open(os.devnull, os.O_RDONLY); os.dup2(null, 0); os.close(null)
source = open("program.py", "rb").read(); os.remove("program.py")
module = sys.modules["__main__"] = types.ModuleType("__main__")  # a fresh __main__: not this one
exec(compile(source, "program.py", "exec"), module.__dict__)
try: sys.stdout.flush()
except Exception: pass
os.write(1, b"\n" + nonce + b"\n"); os._exit(0)"""
)


@dataclasses.dataclass(frozen=True)
class Limits:
    timeout_s: float = 10.0  # wall clock
    cpu_s: int = 10  # RLIMIT_CPU
    memory_mb: int = 1024  # RLIMIT_AS
    file_size_mb: int = 16  # RLIMIT_FSIZE (one file)
    disk_mb: int = 64  # total bytes under the program's directory, watched from outside
    processes: int = 64  # RLIMIT_NPROC, only with the per-run uid (for ours it would count all our threads)
    isolate: bool = True  # False: only the process, the timeout, the group kill and the directory


@dataclasses.dataclass(frozen=True)
class Outcome:
    verdict: str  # "passed" | "failed" | "timeout" | "error" (the sandbox itself could not run it)
    returncode: int | None
    seconds: float
    detail: str  # one short line


_uid_lock, _probe_lock, _live_uids = threading.Lock(), threading.Lock(), set()  # _live_uids: those of runs in flight
_plan: dict[str, int] = {}  # what the probe found to work: containment(), net (unshare flags), keep_read


def _rlimits(limits: Limits, nproc: bool) -> list[tuple[int, int, int]]:
    mem, fsize, n = limits.memory_mb << 20, limits.file_size_mb << 20, limits.processes
    # The hard CPU limit comes a second later: SIGXCPU first tells a CPU timeout from other kills.
    want = [(resource.RLIMIT_CPU, limits.cpu_s, limits.cpu_s + 1), (resource.RLIMIT_AS, mem, mem)]
    want += [(resource.RLIMIT_FSIZE, fsize, fsize), (resource.RLIMIT_CORE, 0, 0)]
    want += nproc * [(resource.RLIMIT_NPROC, n, n)]
    # Never above our own hard limits, which the dropped uid could not raise (RLIM_INFINITY is -1 on Linux).
    want = [(res, soft, ours if 0 <= (ours := resource.getrlimit(res)[1]) < hard else hard) for res, soft, hard in want]
    return [(res, min(soft, hard), hard) for res, soft, hard in want]


def _harness_plan(net: int, uid: int | None, keep_read: bool, rlimits: list[tuple[int, int, int]]) -> str:
    return json.dumps({"net": net, "uid": uid, "keep_read": keep_read, "rlimits": rlimits})


def _fresh_uid() -> int:
    with _uid_lock:
        draws = iter(lambda: _UID_BASE + secrets.randbelow(_UID_SPAN), 0)
        _live_uids.add(uid := next(u for u in draws if u not in _live_uids))
        return uid


def _probe() -> dict[str, int]:
    def works(net: int = 0, drop_uid: bool = False, keep_read: bool = False, rlimits: bool = False) -> bool:
        uid = _fresh_uid() if drop_uid else None
        try:  # the interpreter must start under it: a uid that cannot read it is no use
            plan = _harness_plan(net, uid, keep_read, _rlimits(Limits(), drop_uid) if rlimits else [])
            argv = [sys.executable, "-I", "-c", _CONTAIN, plan]
            return not subprocess.run(argv, cwd="/", env={}, capture_output=True).returncode
        except Exception:  # whatever the reason, not on this platform
            return False
        finally:
            _live_uids.discard(uid)

    with _probe_lock:
        if not _plan:
            modes = (False, True) if os.geteuid() == 0 else ()  # plain first; the capability only if needed
            keep_read = next((k for k in modes if works(drop_uid=True, keep_read=k)), None)
            net = _CLONE_NEWNET if works(_CLONE_NEWNET) else 0
            _plan.update(net=net, keep_read=bool(keep_read), network=bool(net), rlimits=works(rlimits=True))
            _plan.update(unprivileged_user=keep_read is not None)
        return _plan


def containment() -> dict[str, bool]:
    """What is in force on this platform, probed once: no network, a fresh unprivileged uid, rlimits."""
    return {key: _probe()[key] for key in ("network", "unprivileged_user", "rlimits")}


def _disk_bytes(root: str) -> int:
    total = 0
    for folder, _, names in os.walk(root):
        for name in names:
            with contextlib.suppress(OSError):  # it may vanish while we look
                total += os.lstat(os.path.join(folder, name)).st_size
    return total


def _kill(sid: int, uid: int | None) -> None:
    """Kills the group, then what left it for another or left the session. `sid` (the pid) is unreaped: still ours."""
    with contextlib.suppress(OSError):
        os.killpg(sid, signal.SIGKILL)
    for _ in range(100):  # a forking escapee is outrun: each round kills all those found
        found = []
        for name in filter(str.isdigit, os.listdir("/proc") if os.path.isdir("/proc") else []):
            with contextlib.suppress(OSError, KeyError, ValueError):
                with open(f"/proc/{name}/status", "rb") as f:
                    info = {key: value.split() for key, value in (line.split(b":", 1) for line in f)}
                mine = int(info[b"NSsid"][0]) == sid or int(info[b"Uid"][0]) == uid
                if mine and info[b"State"][0] not in (b"Z", b"X"):  # not dead already, waiting for a parent
                    os.kill(int(name), signal.SIGKILL)
                    found.append(int(name))
        if not found:
            return
        time.sleep(_POLL_S)


def run_program(source: str, limits: Limits = Limits()) -> Outcome:
    """Runs `source` (completion plus tests) contained as `limits` and the platform allow (see the module doc)."""
    plan = _probe() if limits.isolate else {"net": 0, "keep_read": 0}
    start, uid, workdir, reason = time.monotonic(), None, None, None
    quota = ("failed", f"exceeded disk quota {limits.disk_mb} MiB")
    try:
        uid = _fresh_uid() if limits.isolate and plan["unprivileged_user"] else None
        workdir = tempfile.mkdtemp(prefix="fbt-sandbox-")
        with open(os.path.join(workdir, "program.py"), "wb") as f:
            f.write(source.encode("utf-8", "replace"))
        for path in (workdir, f.name) if uid is not None else ():  # the program owns these, nothing else of ours
            os.chown(path, uid, uid)
        rlimits = _rlimits(limits, uid is not None) if plan.get("rlimits") else []
        contain = _harness_plan(plan["net"], uid, bool(plan["keep_read"]), rlimits if limits.isolate else [])
        env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"}
        nonce, pipe, out, err = secrets.token_hex(16).encode(), subprocess.PIPE, bytearray(), bytearray()
        kw = {"stdin": pipe, "stdout": pipe, "stderr": pipe, "start_new_session": True}
        proc = subprocess.Popen([sys.executable, "-I", "-c", _HARNESS, contain], cwd=workdir, env=env, **kw)
        with proc.stdout, proc.stderr, selectors.DefaultSelector() as sel:

            def drain(timeout: float) -> None:  # keeping the tail: where the nonce and the error are
                for key, _ in sel.select(max(timeout, 0.0)):
                    data = os.read(key.fd, 1 << 16)
                    if not data:
                        sel.unregister(key.fileobj)
                    key.data.extend(data)
                    del key.data[: -64 << 10]

            with contextlib.suppress(OSError), proc.stdin:  # a program dead already has its exit status to tell
                os.write(proc.stdin.fileno(), nonce + b"\n")
            sel.register(proc.stdout, selectors.EVENT_READ, out)
            sel.register(proc.stderr, selectors.EVENT_READ, err)
            try:  # WNOWAIT leaves an exited program a zombie: its ids stay ours until the kill
                while not reason and os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
                    if time.monotonic() >= start + limits.timeout_s:
                        reason = ("timeout", f"exceeded {limits.timeout_s:g}s wall clock")
                    elif limits.isolate and _disk_bytes(workdir) > limits.disk_mb << 20:
                        reason = quota
                    drain(_POLL_S)
            finally:
                _kill(proc.pid, uid)
                _, status, usage = os.wait4(proc.pid, 0)
                proc.returncode = rc = os.waitstatus_to_exitcode(status)
            seconds, end = time.monotonic() - start, time.monotonic() + 0.5
            while sel.get_map() and time.monotonic() < end:  # the rest of the output: its writers are dead
                drain(_POLL_S)
        if not reason and limits.isolate and _disk_bytes(workdir) > limits.disk_mb << 20:
            reason = quota  # written too fast for the watcher, before the program exited
        last = next((x.strip() for x in reversed(err.decode("utf-8", "replace").splitlines()) if x.strip()), "")[:200]
        if reason:  # we stopped it: (verdict, detail)
            return Outcome(reason[0], rc, seconds, reason[1])
        if limits.isolate and (
            rc == -signal.SIGXCPU or (rc == -signal.SIGKILL and usage.ru_utime + usage.ru_stime >= limits.cpu_s)
        ):
            return Outcome("timeout", rc, seconds, f"exceeded {limits.cpu_s}s CPU time")
        if rc == 97 and last.startswith("sandbox containment failed"):
            return Outcome("error", rc, seconds, last)
        if rc == 0 and out.rstrip(b"\n").rsplit(b"\n", 1)[-1] == nonce:
            return Outcome("passed", rc, seconds, "ok")
        if rc == 0:
            return Outcome("failed", rc, seconds, "exited 0 before the end of the program")
        if rc < 0:
            return Outcome("failed", rc, seconds, f"killed by {signal.strsignal(-rc) or -rc}: {last}".rstrip(": "))
        return Outcome("failed", rc, seconds, last or f"exit status {rc}")
    except Exception as exc:  # the sandbox's own failure, never a verdict on the program
        return Outcome("error", None, time.monotonic() - start, f"sandbox: {type(exc).__name__}: {exc}"[:200])
    finally:
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)
        _live_uids.discard(uid)


def run_programs(sources: list[str], limits: Limits = Limits(), workers: int = 0) -> list[Outcome]:
    """`run_program` on each source, `workers` at a time (0: one per CPU); outcomes in input order."""
    _probe()  # once, rather than by every worker at the same time
    with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
        return list(pool.map(lambda source: run_program(source, limits), sources))

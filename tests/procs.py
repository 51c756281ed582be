"""Every process a test starts, in a session (and process group) of its own that is killed with
everything in it when the test is done with it: on a timeout, a failure, Ctrl-C, and after a normal
exit too (a launcher that exits early leaves no rank behind). ``run`` is ``subprocess.run``, ``popen`` is
``subprocess.Popen`` as a context manager, ``spawn`` is ``torch.multiprocessing.start_processes``;
``sweep`` (the suite's end and interpreter exit: tests/conftest.py) kills the groups still alive.

A torchrun launcher killed alone leaves its ranks running; killing its session (the launcher, its
ranks, and the compilers ninja starts in process groups of their own) leaves nothing. Being a new
session (``start_new_session``), a terminal's Ctrl-C reaches pytest only, and pytest's own handling
(a KeyboardInterrupt through the ``finally`` here) kills the sessions.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import time
import traceback
from contextlib import contextmanager

_groups: dict[int, subprocess.Popen] = {}  # session (and process group) id -> its leader, while it may be alive
_spawned: list = []  # multiprocessing children (spawn): not groups of their own, killed by pid


def _kill_group(pgid: int) -> bool:
    """SIGKILL every process of group ``pgid``; whether any was there."""
    try:
        os.killpg(pgid, signal.SIGKILL)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def kill_session(sid: int) -> bool:
    """SIGKILL every process of the session ``sid`` leads: its process group, and the groups of its
    own that a tool puts its children in (ninja runs each compiler in one, so a build killed by its
    group alone leaves its compilers running). Whether any was there."""
    found = _kill_group(sid)
    for _ in range(2):  # (twice: a process forked while the first pass ran)
        for pid in _members(sid):
            try:
                os.kill(pid, signal.SIGKILL)
                found = True
            except (ProcessLookupError, PermissionError):
                pass
    return found


def _members(sid: int) -> list[int]:
    out = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    for entry in entries:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] not in ("Z", "X"):
                out.append(int(entry))
    return out


def _finish(proc: subprocess.Popen) -> None:
    kill_session(proc.pid)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass
    _groups.pop(proc.pid, None)


@contextmanager
def popen(cmd, **kw):
    """``subprocess.Popen(cmd, **kw)`` in a new process group, killed whole when the block ends."""
    kw["start_new_session"] = True
    proc = subprocess.Popen(cmd, **kw)
    _groups[proc.pid] = proc
    try:
        yield proc
    finally:  # (not Popen's own `with`: its exit waits for the process, forever if it hangs)
        _finish(proc)
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()


def run(cmd, *, input=None, capture_output=False, timeout=None, check=False, **kw) -> subprocess.CompletedProcess:
    """``subprocess.run`` whose process, and every process it started, is killed on a timeout, an
    exception (pytest-timeout's, KeyboardInterrupt) or its exit."""
    if input is not None:
        kw["stdin"] = subprocess.PIPE
    if capture_output:
        kw["stdout"] = kw["stderr"] = subprocess.PIPE
    with popen(cmd, **kw) as proc:
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            kill_session(proc.pid)
            out, err = proc.communicate()
            raise subprocess.TimeoutExpired(proc.args, timeout, output=out, stderr=err) from exc
        code = proc.poll()
    if check and code:
        raise subprocess.CalledProcessError(code, proc.args, output=out, stderr=err)
    return subprocess.CompletedProcess(proc.args, code, out, err)


def spawn(fn, args=(), nprocs=1, **kw):
    """``torch.multiprocessing.start_processes`` (start_method="spawn", join=False): its processes are
    recorded, so ``kill_spawned`` and ``sweep`` can end them."""
    import torch.multiprocessing as mp

    kw.setdefault("start_method", "spawn")
    ctx = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, **kw)
    _spawned.extend(ctx.processes)
    return ctx


def join(ctx, limit: float) -> bool:
    """Wait up to ``limit`` s for ``spawn``'s processes; whether they finished. On a hang, or an
    exception while waiting (a rank's failure, pytest-timeout, Ctrl-C), they are killed."""
    deadline = time.monotonic() + limit
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                kill_spawned(ctx)
                return False
    except BaseException:
        kill_spawned(ctx)
        raise
    kill_spawned(ctx)  # (all ended: this only forgets them)
    return True


def kill_spawned(ctx) -> None:
    for p in ctx.processes:
        if p.is_alive():
            p.kill()
        p.join(timeout=30)
        if p in _spawned:
            _spawned.remove(p)


@contextmanager
def children_killed():
    """Kill, when the block ends, the children of this process that started inside it and are still
    alive (a framework's own ``spawn`` launcher: Lightning's ddp_spawn), and their groups."""
    before = _children()
    try:
        yield
    finally:
        for pid in _children() - before:
            _kill_pid(pid)


def _children() -> set[int]:
    me, out = os.getpid(), set()
    try:
        for task in os.listdir(f"/proc/{me}/task"):
            with open(f"/proc/{me}/task/{task}/children") as f:
                out.update(int(p) for p in f.read().split())
    except OSError:
        pass
    return out


def _kill_pid(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError, PermissionError):
        pass


def forked(log: str, body) -> int:
    """Fork a child that writes its stdout and stderr to the file ``log``, runs ``body()`` and exits
    with 0, or with 1 after printing the traceback, never returning into the code that forked it (a
    fork server's child); the child's pid, to the parent."""
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        body()
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def split(argv: list[str], sep: str) -> list[list[str]]:
    """``argv`` cut at each ``sep`` (a command line that carries several commands)."""
    parts: list[list[str]] = [[]]
    for arg in argv:
        if arg == sep:
            parts.append([])
        else:
            parts[-1].append(arg)
    return parts


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return False


def sweep() -> list[int]:
    """Kill every group still alive that a test started here, and every recorded spawned process;
    returns the group ids that were still there."""
    left = [sid for sid in list(_groups) if kill_session(sid)]
    for pgid in list(_groups):
        _finish(_groups[pgid])
    for p in list(_spawned):
        if p.is_alive():
            p.kill()
            left.append(p.pid)
        p.join(timeout=5)
    _spawned.clear()
    return left


def wait_gone(pids, timeout: float = 10.0) -> list[int]:
    """The pids of ``pids`` still alive after waiting up to ``timeout`` s for them to end."""
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in pids if alive(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


atexit.register(sweep)

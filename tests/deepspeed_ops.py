"""The DeepSpeed CPU ops the suite loads, built once into the checkout's own cache, and the build
locks that would make every DeepSpeed process wait forever, found and cleared.

DeepSpeed compiles its C++ ops the first time a process loads them (torch's JIT extensions), under
a lock file (``<cache>/<op>/lock``) that every other process waits on, forever, until it is gone.
A build killed half-way (a test's timeout, Ctrl-C) leaves the lock behind. So:

- ``python tests/deepspeed_ops.py`` (what ``scripts/ensure-deps test`` runs before pytest starts)
  builds the ops below into ``<checkout>/.torch_extensions`` (git-ignored) with a timeout of its
  own and a progress line; run again with the ops built, it returns at once (a stamp file names
  the DeepSpeed, torch and Python they were built for).
- tests/conftest.py points ``TORCH_EXTENSIONS_DIR`` at that same folder for the suite and every
  process it starts, so the user's own cache (``~/.cache/torch_extensions``) is never touched.
- A lock no live process holds (torch keeps the lock file open while it builds), or one older than
  any build could be, is reported and cleared: here before building, and by the suite before its
  DeepSpeed cases run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".torch_extensions"
# the CPU accelerator's builder -> the op's folder: what the suite's DeepSpeed cases load
OPS = {
    "ShareMemCommBuilder": "deepspeed_shm_comm",  # every DeepSpeed process on the CPU (deepspeed.comm's init)
    "CPUAdamBuilder": "cpu_adam",  # DeepSpeedCPUAdam, ZeRO-Offload's optimizer (tests/deepspeed_accum_cases.py)
    "FusedAdamBuilder": "fused_adam",  # the config's {"optimizer": {"type": "Adam"}} (tests/deepspeed_cases.py)
}
STALE_AFTER_S = 3600  # a lock older than this is stale whoever holds it: no op here builds for an hour
BUILD_TIMEOUT_S = 1800  # all three on 2 busy cores take a few minutes; this is for a machine far slower
PROGRESS_EVERY_S = 30


def _say(message: str) -> None:
    print(message, flush=True)


def stamp() -> str:
    """What the built ops are valid for (read without importing DeepSpeed or torch)."""
    from importlib.metadata import version

    return f"deepspeed {version('deepspeed')}, torch {version('torch')}, python {sys.version.split()[0]}\n"


def _holders(lock: Path) -> tuple[set[int], bool]:
    """The processes with ``lock`` open, and whether every process's files could be read."""
    pids, complete = set(), True
    try:
        entries = os.listdir("/proc")
    except OSError:
        return pids, False
    target = str(lock)
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{entry}/fd")
        except FileNotFoundError:
            continue  # (it ended meanwhile)
        except OSError:
            complete = False
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{entry}/fd/{fd}") == target:
                    pids.add(int(entry))
            except OSError:
                pass
    return pids, complete


def stale_locks(cache: Path = CACHE) -> list[tuple[Path, str]]:
    """The build locks under ``cache`` no build will ever release, each with why it is stale."""
    out = []
    for lock in sorted(Path(cache).glob("*/lock")):
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            continue  # (released meanwhile)
        holders, complete = _holders(lock.resolve())
        if age > STALE_AFTER_S:
            out.append((lock, f"{age / 60:.0f} min old, longer than any build takes"))
        elif not holders and complete:
            out.append((lock, f"{age:.0f} s old and held by no process (its build was killed)"))
    return out


def clear_stale_locks(cache: Path = CACHE, say=_say) -> list[Path]:
    """Remove the stale locks under ``cache``, saying which and why; returns them."""
    cleared = []
    for lock, why in stale_locks(cache):
        say(f"gradhealth: removing a stale torch build lock {lock} ({why}); the op is rebuilt at its next load")
        try:
            lock.unlink()
        except FileNotFoundError:
            pass
        cleared.append(lock)
    return cleared


def is_built(cache: Path = CACHE) -> bool:
    stamp_file = Path(cache) / "stamp"
    return (stamp_file.exists() and stamp_file.read_text() == stamp()
            and all((Path(cache) / op / f"{op}.so").exists() and not (Path(cache) / op / "lock").exists()
                    for op in OPS.values()))


def _load(builder: str) -> None:
    """Load (so build) one op, in this process: DeepSpeed's own loader, as a test's process calls it."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.accelerator import get_accelerator

    get_accelerator().create_op_builder(builder).load(verbose=False)


def build(cache: Path = CACHE, timeout: float = BUILD_TIMEOUT_S, say=_say) -> None:
    """Build every op in OPS into ``cache``, one process each (its own process group, killed on
    timeout or Ctrl-C), with a progress line; nothing to do when they are built already."""
    cache = Path(cache)
    if is_built(cache):
        return
    cache.mkdir(parents=True, exist_ok=True)
    clear_stale_locks(cache, say)
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(cache), DS_ACCELERATOR="cpu", PYTHONWARNINGS="ignore")
    start = time.monotonic()
    say(f"gradhealth: building DeepSpeed's CPU ops ({', '.join(OPS.values())}) into {cache}, once "
        f"(a few minutes on 2 cores; later runs reuse them)")
    for builder, op in OPS.items():
        began = time.monotonic()
        proc = subprocess.Popen([sys.executable, __file__, "--load", builder], env=env, start_new_session=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            while True:
                try:
                    log = proc.communicate(timeout=PROGRESS_EVERY_S)[0]
                    break
                except subprocess.TimeoutExpired:
                    waited = time.monotonic() - start
                    if waited > timeout:
                        raise TimeoutError(f"building DeepSpeed's {op} took longer than {timeout:.0f} s") from None
                    say(f"gradhealth:   {op}: building ({time.monotonic() - began:.0f} s)")
        except BaseException:
            _kill(proc)
            (cache / op / "lock").unlink(missing_ok=True)  # (its only holder is gone)
            raise
        if proc.returncode != 0:
            raise RuntimeError(f"building DeepSpeed's {op} failed (exit {proc.returncode}):\n{log[-4000:]}")
        say(f"gradhealth:   {op}: built in {time.monotonic() - began:.0f} s")
    (cache / "stamp").write_text(stamp())
    say(f"gradhealth: DeepSpeed's CPU ops built in {time.monotonic() - start:.0f} s")


def _kill(proc: subprocess.Popen) -> None:
    """The build's whole session: its process group, and ninja's compilers (each in a group of its own)."""
    from procs import kill_session  # (tests/procs.py: this file's folder is on sys.path, run or imported)

    kill_session(proc.pid)
    proc.wait()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--load"]:
        _load(sys.argv[2])
    else:
        from importlib.util import find_spec

        if find_spec("deepspeed") is None:
            sys.exit(0)  # nothing of the suite loads DeepSpeed's ops then
        try:
            build()
        except (TimeoutError, RuntimeError) as exc:
            print(f"gradhealth: {exc}", file=sys.stderr)
            sys.exit(1)
        except KeyboardInterrupt:
            print("gradhealth: the build of DeepSpeed's ops was interrupted; the next run starts it again", file=sys.stderr)
            sys.exit(130)

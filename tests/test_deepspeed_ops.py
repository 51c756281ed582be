"""tests/deepspeed_ops.py: DeepSpeed's CPU ops come from the checkout's own cache, built once; a
build lock no build will release is cleared, never waited on; and a build killed half-way leaves a
cache the next DeepSpeed case runs from (it rebuilds the op; no hang)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import deepspeed_ops
import procs
from conftest import free_port

HERE = Path(__file__).resolve().parent
SHM = "deepspeed_shm_comm"  # the op every DeepSpeed process on the CPU loads, and the quickest to build


def _ops_built():
    pytest.importorskip("deepspeed")
    # the premise: make deps (or the suite's start) built them here
    assert deepspeed_ops.is_built(), f"DeepSpeed's ops are not built in {deepspeed_ops.CACHE}: run `make deps`"


def test_the_cache_is_the_checkouts_own_and_git_ignores_it():
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(deepspeed_ops.CACHE)  # (set by conftest, inherited by children)
    assert deepspeed_ops.CACHE.parent == HERE.parent
    if (HERE.parent / ".git").exists():
        res = procs.run(["git", "check-ignore", "-q", str(deepspeed_ops.CACHE / SHM / "lock")], cwd=HERE.parent,
                        timeout=60)
        assert res.returncode == 0  # a lock, an object, a library: none can ever be committed


@pytest.mark.slow
def test_deepspeed_loads_its_op_from_the_checkouts_cache_not_the_users():
    _ops_built()
    code = ("import os; os.environ.setdefault('DS_ACCELERATOR', 'cpu')\n"
            "from deepspeed.accelerator import get_accelerator\n"
            "from torch.utils.cpp_extension import get_default_build_root\n"
            f"m = get_accelerator().create_op_builder('ShareMemCommBuilder').load(verbose=False)\n"
            "print(m.__file__); print(get_default_build_root())")
    res = procs.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)  # (the suite's env)
    assert res.returncode == 0, res.stderr[-3000:]
    loaded, users = res.stdout.split()[-2:]
    assert Path(loaded).resolve() == (deepspeed_ops.CACHE / SHM / f"{SHM}.so").resolve()
    assert not Path(loaded).resolve().is_relative_to(Path(users).resolve())  # (~/.cache/torch_extensions)


@pytest.mark.slow  # (cheap, but it needs the ops `make test` builds and `make test-fast` does not)
def test_a_second_build_with_the_ops_built_does_nothing():
    _ops_built()
    libraries = {op: (deepspeed_ops.CACHE / op / f"{op}.so").stat().st_mtime_ns for op in deepspeed_ops.OPS.values()}
    res = procs.run([sys.executable, str(HERE / "deepspeed_ops.py")], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout == "" and res.stderr == "", res.stdout + res.stderr
    assert libraries == {op: (deepspeed_ops.CACHE / op / f"{op}.so").stat().st_mtime_ns for op in libraries}


# a build's lock as torch's FileBaton takes it (torch/utils/file_baton.py): created exclusively, held open
HOLD = "import os, sys, time; fd = os.open(sys.argv[1], os.O_CREAT | os.O_EXCL); print('held', flush=True); time.sleep(600)"


def test_a_lock_a_live_build_holds_is_kept_and_one_it_left_is_cleared(tmp_path):
    held, left = tmp_path / "op_a" / "lock", tmp_path / "op_b" / "lock"
    held.parent.mkdir()
    left.parent.mkdir()
    left.touch()  # (a build killed half-way: the file stays, no process has it open)
    with procs.popen([sys.executable, "-c", HOLD, str(held)], stdout=subprocess.PIPE, text=True) as holder:
        assert holder.stdout.readline() == "held\n"
        said = []
        assert deepspeed_ops.clear_stale_locks(tmp_path, say=said.append) == [left]
        assert held.exists() and not left.exists()
        assert len(said) == 1 and str(left) in said[0] and "held by no process" in said[0], said
        # older than any build could be: cleared even though a process holds it (a build hung for an hour)
        old = time.time() - deepspeed_ops.STALE_AFTER_S - 60
        os.utime(held, (old, old))
        assert deepspeed_ops.clear_stale_locks(tmp_path, say=said.append) == [held]
        assert "min old" in said[-1], said


@pytest.mark.slow
def test_a_deepspeed_case_runs_after_a_build_killed_half_way(tmp_path):
    _ops_built()
    cache = tmp_path / "extensions"  # a throwaway copy of the suite's cache, of the op every case loads
    shutil.copytree(deepspeed_ops.CACHE / SHM, cache / SHM)
    (cache / SHM / f"{SHM}.so").unlink()  # so loading it builds (links) it again
    lock = cache / SHM / "lock"
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(cache), DS_ACCELERATOR="cpu", PYTHONWARNINGS="ignore",
               OMP_NUM_THREADS="1")
    with procs.popen([sys.executable, str(HERE / "deepspeed_ops.py"), "--load", "ShareMemCommBuilder"], env=env,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as build:
        deadline = time.monotonic() + 240
        while not lock.exists():
            assert build.poll() is None, "the build ended before its lock was seen"
            assert time.monotonic() < deadline, "the build took no lock in 240 s"
            time.sleep(0.002)
        procs.kill_session(build.pid)  # mid-way: the lock is there, the library is not (ninja's linker too)
        build.wait()
    assert procs.wait_gone(procs._members(build.pid)) == []
    # the premise: the lock is left behind, and torch's own baton (what every loader calls) finds it taken
    from torch.utils.file_baton import FileBaton

    assert lock.exists() and not (cache / SHM / f"{SHM}.so").exists()
    assert FileBaton(str(lock)).try_acquire() is False
    said = []
    assert deepspeed_ops.clear_stale_locks(cache, say=said.append) == [lock]  # what the suite does at its start
    out = tmp_path / "case.json"
    env.update(MASTER_PORT=str(free_port()), PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent)]))
    res = procs.run([sys.executable, str(HERE / "deepspeed_nan_once.py"), str(out), "1", "bf16"], env=env,
                    capture_output=True, text=True, timeout=280)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    case = json.loads(out.read_text())
    assert case["finite_loss"] and case["skipped_steps"] == 2  # it ran: DeepSpeed skipped the two inf steps
    assert (cache / SHM / f"{SHM}.so").exists() and not lock.exists()  # rebuilt, and released

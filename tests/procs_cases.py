"""Tests that hang, for tests/test_procs.py to run in a pytest of their own and interrupt (this file
is collected only when named on pytest's command line: no ``test_`` prefix). Each writes the pids
of the processes it started to the file ``$GH_PIDS`` names, then waits forever."""

from __future__ import annotations

import os
import sys
import time

import procs

# a launcher that starts two ranks, as torchrun does (the ranks are its children), and exits
STARTS_RANKS = """
import os, subprocess, sys, time
# (the second in a process group of its own, as ninja runs each compiler: only its session holds it)
ranks = [subprocess.Popen([sys.executable, "-S", "-c", "import time; time.sleep(600)"], process_group=group)
         for group in (None, 0)]
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(" ".join(str(pid) for pid in [os.getpid()] + [r.pid for r in ranks]))
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
"""
LAUNCHER = STARTS_RANKS + "time.sleep(600)\n"  # ... and waits for them


def write_pid_and_sleep(rank: int, path: str) -> None:
    with open(f"{path}.{rank}.tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(f"{path}.{rank}.tmp", f"{path}.{rank}")
    time.sleep(600)


def test_a_launcher_hangs():
    procs.run([sys.executable, "-S", "-c", LAUNCHER, os.environ["GH_PIDS"]])  # (no timeout of its own)


def test_spawned_ranks_hang():
    ctx = procs.spawn(write_pid_and_sleep, args=(os.environ["GH_PIDS"],), nprocs=2)
    procs.join(ctx, 600)


def test_forked_ranks_hang():
    """The distributed tests' ranks (tests/test_distributed.py's spawn): forked by multiprocessing's
    fork server, which is this process's child; its pid written to ``$GH_PIDS.server``."""
    import multiprocessing.forkserver as forkserver

    from test_distributed import _fork_server

    _fork_server()
    path = os.environ["GH_PIDS"]
    with open(f"{path}.server.tmp", "w") as f:
        f.write(str(forkserver._forkserver._forkserver_pid))
    os.replace(f"{path}.server.tmp", f"{path}.server")
    ctx = procs.spawn(write_pid_and_sleep, args=(path,), nprocs=2, start_method="forkserver")
    procs.join(ctx, 600)

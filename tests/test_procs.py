"""tests/procs.py: a process a test starts, and every process it starts, ends with the test, however
the test ends: its own timeout, pytest-timeout's, Ctrl-C. The launcher here starts two ranks and
sleeps, as a torchrun launcher whose ranks hang does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import procs
from procs_cases import LAUNCHER, STARTS_RANKS

ROOT = Path(__file__).resolve().parent.parent
RANKS_STARTED_S = 3  # long enough for a launcher to start its ranks and write their pids, on a busy machine
# (python -S: no site-packages to scan, a start in milliseconds)


def _pids(path: Path, timeout: float = 120.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} was not written in time"
        time.sleep(0.05)
    return [int(p) for p in path.read_text().split()]


def test_a_timed_out_launcher_leaves_none_of_its_ranks(tmp_path):
    # the premise: subprocess.run's own timeout kills the launcher and leaves its ranks running
    plain = tmp_path / "plain"
    with pytest.raises(subprocess.TimeoutExpired):
        subprocess.run([sys.executable, "-S", "-c", LAUNCHER, str(plain)], timeout=RANKS_STARTED_S)
    launcher, *ranks = _pids(plain, timeout=0)
    try:
        assert procs.wait_gone([launcher]) == [] and all(procs.alive(r) for r in ranks)
    finally:
        for r in ranks:
            os.kill(r, signal.SIGKILL)
    ours = tmp_path / "ours"
    with pytest.raises(subprocess.TimeoutExpired):
        procs.run([sys.executable, "-S", "-c", LAUNCHER, str(ours)], timeout=RANKS_STARTED_S)
    pids = _pids(ours, timeout=0)
    assert len(pids) == 3 and procs.wait_gone(pids) == []


def test_a_launcher_that_exits_leaves_none_of_its_ranks(tmp_path):
    """A launcher that exits while its ranks still run (a launcher that crashed alone): they go too."""
    # (output not captured: a pipe the ranks inherit would keep run() waiting for them, as subprocess.run does)
    res = procs.run([sys.executable, "-S", "-c", STARTS_RANKS, str(tmp_path / "pids")], timeout=120)
    assert res.returncode == 0
    launcher, *ranks = _pids(tmp_path / "pids", timeout=0)
    assert len(ranks) == 2 and procs.wait_gone([launcher, *ranks]) == []


def _sigint_default() -> None:
    """SIGINT at its default in the inner pytest, as a terminal's foreground pytest has it: this pytest
    may run with SIGINT ignored (a background job of a non-interactive shell, `make test &`, nohup),
    and an ignored signal stays ignored across exec, so the inner one would never see the Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


#: the inner pytest's plugins left out: what a run of tests/procs_cases.py never uses (xdist at -n 0 does
#: nothing), about 2 s of CPU an inner pytest at their import; the suite's conftest and pytest-timeout stay
UNUSED_PLUGINS = [a for name in ("xdist", "xdist.looponfail", "hypothesispytest", "benchmark", "anyio")
                  for a in ("-p", f"no:{name}")]


def _inner_pytest(case: str, pids: Path, *extra: str):
    env = dict(os.environ, GH_PIDS=str(pids), PYTHONWARNINGS="ignore")
    return procs.popen([sys.executable, "-m", "pytest", "-q", *UNUSED_PLUGINS, "-p", "no:cacheprovider", *extra,
                        f"tests/procs_cases.py::{case}"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, preexec_fn=_sigint_default)


@pytest.mark.slow
def test_a_test_timed_out_by_pytest_timeout_leaves_no_process(tmp_path):
    with _inner_pytest("test_a_launcher_hangs", tmp_path / "pids", "--timeout=8") as run:
        pids = _pids(tmp_path / "pids")
        assert all(procs.alive(p) for p in pids)  # the premise: the launcher and its ranks run
        log = run.communicate(timeout=120)[0]
    assert run.returncode == 1 and "Timeout" in log, log[-3000:]
    assert procs.wait_gone(pids) == [], log[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("case,count", [("test_a_launcher_hangs", 3), ("test_spawned_ranks_hang", 2),
                                        ("test_forked_ranks_hang", 3)])
def test_ctrl_c_on_a_sleeping_multi_process_test_leaves_no_process(tmp_path, case, count):
    pids_file = tmp_path / "pids"
    with _inner_pytest(case, pids_file) as run:
        if case in ("test_spawned_ranks_hang", "test_forked_ranks_hang"):
            pids = [_pids(Path(f"{pids_file}.{rank}"))[0] for rank in range(2)]
            if case == "test_forked_ranks_hang":  # (and the fork server they were forked from)
                pids += _pids(Path(f"{pids_file}.server"))
        else:
            pids = _pids(pids_file)
        assert len(pids) == count and all(procs.alive(p) for p in pids)  # the premise: they run
        os.kill(run.pid, signal.SIGINT)  # (pytest alone, as the hardest case: its children get no signal)
        log = run.communicate(timeout=120)[0]
    assert run.returncode == 2 and "KeyboardInterrupt" in log, log[-3000:]
    assert procs.wait_gone(pids) == [], log[-3000:]


def test_children_killed_ends_the_children_started_inside_it_only():
    """What run_spawned wraps a Lightning ddp_spawn fit in: its ranks are this process's children."""
    before = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        with procs.children_killed():
            inside = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        assert procs.wait_gone([inside.pid]) == [] and procs.alive(before.pid)
    finally:
        before.kill()
        before.wait()

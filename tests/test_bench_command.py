"""The bench command as a user runs it (a process of its own): its sections run and print their
ratios. Apart from test_demo.py so that the two slowest of them can run beside the demo's tests."""

import subprocess
import sys


def test_bench_command_runs_and_prints_ratios():
    res = subprocess.run(
        [sys.executable, "-m", "gradhealth", "bench", "--shapes", "0", "--rounds", "1", "--sections", "checks,deltas,tracer"],
        capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr
    for method in ("floor", "naive loop", "check()", "x floor"):
        assert method in res.stdout


def test_bench_distributed_section_runs():
    res = subprocess.run([sys.executable, "-m", "gradhealth", "bench", "--rounds", "1", "--sections", "distributed"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "at world size 2" in res.stdout and "the collective adds" in res.stdout
    assert "the same check again (what this measurement's noise is)" in res.stdout
    assert "without the replicas' gradient agreement" in res.stdout and "with the lockstep counts" in res.stdout
    assert "grad_sync='in_optimizer'" in res.stdout and "with the rank-origin comm hook" in res.stdout

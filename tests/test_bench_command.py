"""The bench command as a user runs it (a process of its own): its sections run and print their
ratios. Apart from test_demo.py so that the two slowest of them can run beside the demo's tests."""

import os
import re
import sys

import pytest

import procs

# the bench in a process of its own for a minute (the distributed section on two and four
# processes): in `make test`, not in the quick `make test-fast`. (One command for the three tests,
# with a time limit of three: it took 100 s on busy cores.)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def bench():
    """One ``gradhealth bench`` with every section these tests read, as a user would run it: the
    counts section at its default steps (the counts do not depend on the other options), the
    timed ones on one shape and one round. (Three commands before: each its own interpreter's
    start-up and imports, the same sections.) The deltas and tracer sections run too: only that
    they run and print their rows is asserted."""
    return procs.run(
        [sys.executable, "-m", "gradhealth", "bench", "--shapes", "0", "--rounds", "1", "--count-steps", "9",
         "--sections", "counts,checks,deltas,tracer,distributed"],
        capture_output=True, text=True, timeout=840
    )


def counted(stdout: str) -> dict:
    """The counts section's rows: {(shape, variant): (first, ops/check, +hooks, py instr/check, its
    mean of 8, syncs)}, as the bench prints them."""
    rows = {}
    for line in stdout.splitlines():
        for variant in ("synchronous", "deferred (lag=1)", "clip_grad_norm_().item()"):
            if f"  {variant}" in line:
                shape = line.split(variant)[0].strip().rsplit(None, 1)[0]
                first, ops, hooks, syncs, py, py_mean = line.split(variant)[1].split()
                rows[shape, variant] = (int(first), float(ops), float(hooks), float(py), float(py_mean), float(syncs))
    return rows


def test_bench_command_runs_and_prints_ratios(bench):
    res = bench
    assert res.returncode == 0, res.stderr
    for method in ("floor", "naive loop", "check()", "x floor"):
        assert method in res.stdout
    assert "update norms from the optimizer's rule vs an exact copy" in res.stdout  # (deltas)
    assert "NaN tracer: one forward+backward" in res.stdout and "tracer armed" in res.stdout  # (tracer)


def test_bench_distributed_section_runs(bench):
    res = bench
    assert res.returncode == 0, res.stderr
    assert "at world size 2" in res.stdout and "the collective adds" in res.stdout
    assert "the same check again (what this measurement's noise is)" in res.stdout
    assert "without the replicas' gradient agreement" in res.stdout and "with the lockstep counts" in res.stdout
    assert "grad_sync='in_optimizer'" in res.stdout and "with the rank-origin comm hook" in res.stdout


def test_bench_counts_section_prints_ops_and_instructions_per_check(bench):
    """``gradhealth bench --sections counts``: per shape (a vanishing one and a frozen base among them), the synchronous
    monitor, the deferred one and the one number, each with its ops, host reads (syncs) and Python
    instructions per check; the counts hold the launch budget (a constant per group: a few ops,
    whatever the tensor count), and on healthy models the synchronous check reads once per step,
    the deferred one never (the one number: once)."""
    res = bench
    assert res.returncode == 0, res.stderr
    rows = counted(res.stdout)
    shapes = {s for s, _ in rows}
    assert "200x(Linear(64),Tanh): vanishing" in shapes and len(shapes) == 5, shapes
    assert len(rows) == 15
    for (shape, variant), (first, ops, hooks, py, py_mean, syncs) in rows.items():
        assert py > 0 and py_mean > 0 and ops >= 1, (shape, variant)
        if not shape.endswith("vanishing"):  # (there the zero gradients' partner test reads, when due)
            # (+0.2: the norm history's module medians, refreshed every 16 checks from a host table on a
            # model of many modules: a read the counter sees, no device read on a GPU)
            expected = {"synchronous": 1.0, "deferred (lag=1)": 0.0}.get(variant, 1.0)
            assert expected <= syncs <= expected + (0.2 if shape == "400 small tensors" else 0.0), (shape, variant, syncs)
        if variant == "clip_grad_norm_().item()":
            continue
        assert ops <= 16, (shape, variant, ops)  # 400 tensors included: not one op per tensor (the vanishing
        # model's exact re-check and partner test add a few, per chunk)
        assert rows[shape, "deferred (lag=1)"][1] <= rows[shape, "synchronous"][1], shape
    vanishing, healthy = rows["200x(Linear(64),Tanh): vanishing", "synchronous"], rows["400 small tensors", "synchronous"]
    assert vanishing[1] <= 2 * healthy[1], (vanishing, healthy)
    for variant in ("synchronous", "deferred (lag=1)"):  # Python work: 400 healthy tensors cost what 6 do,
        assert rows["400 small tensors", variant][3] <= 1.3 * rows["6-tensor MLP", variant][3], variant
        # and so does a frozen base of 396 (LoRA): FROZEN is decided in C, not walked
        assert rows["400 tensors, 396 frozen (LoRA)", variant][3] <= 1.3 * rows["6-tensor MLP", variant][3], variant


# ------------------------------------------------------------- the cost of a check, as the docs show it
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COUNTED = {"6-tensor MLP": ("6-tensor MLP", "6-tensor MLP"),
           "400 small tensors": ("100x (Linear(64), LayerNorm)", "400 small tensors"),
           "400 tensors, 396 frozen (LoRA)": ("the same, all but 4 tensors frozen", "400 tensors, 396 frozen"),
           "200x(Linear(64),Tanh): vanishing": ("200x (Linear(64, 64), Tanh)", "200x (Linear, Tanh)")}
CELL = re.compile(r"(\d+) ops, ([\d.]+) reads?, ([\d.]+)k")


@pytest.mark.parametrize("shape", list(COUNTED))
def test_the_counted_costs_shown_are_what_the_bench_counts(shape, bench):
    """cost.md's and the README's counts tables (``gradhealth bench --sections counts``): ops and host
    reads per check exactly as counted now, Python instructions (the mean over 8 checks, as the bench
    prints it) within 15%. (Read from the bench command above, which counts these shapes at its
    default steps; from tests/test_docs_output.py, which counted them again in its own process.)"""
    from gradhealth.benchmarks.counts import VARIANTS

    assert bench.returncode == 0, bench.stderr
    rows = counted(bench.stdout)
    for page, prefix in zip(("docs/cost.md", "README.md"), COUNTED[shape]):
        text = open(os.path.join(ROOT, page), encoding="utf-8").read()
        [cells] = [CELL.findall(line) for line in text.splitlines()
                   if line.startswith(f"| {prefix}") and len(CELL.findall(line)) == 3]
        for variant, (ops, reads, kilo) in zip(VARIANTS, cells):
            _, now_ops, _, _, now_py_mean, now_reads = rows[shape, variant]
            assert int(ops) == now_ops, (page, shape, variant, ops, rows[shape, variant])
            assert float(reads) == now_reads, (page, shape, variant, reads, rows[shape, variant])
            assert abs(float(kilo) * 1000 - now_py_mean) <= 0.15 * now_py_mean, (page, shape, variant, kilo, rows[shape, variant])

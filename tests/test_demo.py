"""The demo's planted bugs, each identified at the right stage; the healthy run silent."""

import os
import subprocess

import pytest
import sys

from gradhealth.demos import plain as demo


def test_detached_output_is_a_loss_side_problem():
    out = demo.scenario_detached(3)
    assert len(out.said) == 1 and out.said[0].startswith("GradModeError")
    assert ".detach()" in out.said[0]
    assert out.report is None  # stopped before backward: no parameter-level verdict was needed


def test_frozen_layer_is_frozen():
    out = demo.scenario_frozen(3)
    assert out.report.status["encoder.0.weight"] == "FROZEN" and out.report.status["encoder.0.bias"] == "FROZEN"
    assert out.report.findings_of("UNEXPECTED_FROZEN")[0].params == ("encoder.0.weight", "encoder.0.bias")
    assert "UNEXPECTED_FROZEN" in out.said[0]


def test_layer_missing_from_optimizer():
    out = demo.scenario_not_in_optimizer(3)
    assert out.report.problems == {"head.weight": "NOT_IN_OPTIMIZER", "head.bias": "NOT_IN_OPTIMIZER"}


def test_division_by_zero_is_non_finite_everywhere():
    out = demo.scenario_division_by_zero(1)
    assert set(out.report.status.values()) == {"NON_FINITE_GRAD"}
    assert "all 6 parameters have NaN" in out.said[0]


def test_healthy_run_is_silent():
    out = demo.scenario_healthy(5)
    assert out.said == [] and out.report.ok


def test_demo_command_runs_the_lightning_scenarios(tmp_path):
    res = subprocess.run([sys.executable, "-m", "gradhealth", "demo", "--steps", "4", "--logdir", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    for words in ["GradModeError", "UNEXPECTED_FROZEN", "NOT_IN_OPTIMIZER", "STALE_GRAD", "NOT_UPDATED", "EMPTY_VALID_SET",
                  "GRAD_MODE", "module 'norm', at DivBackward0", "module 'act', at ExpBackward0", "it reproduced",
                  "gradhealth said nothing", f"tensorboard --logdir {tmp_path}", f"gradhealth report {tmp_path}"]:
        assert words in out, words
    # one line per scenario: Lightning's progress bar is off, each scenario's verdict under its title
    assert "Epoch 0" not in res.stdout + res.stderr and "it/s" not in res.stderr
    titles = [line for line in out.splitlines() if line.startswith("[")]
    assert len(titles) == 12 and all(line.startswith(f"[{i}/12] ") for i, line in enumerate(titles, 1))
    runs = {d for d in os.listdir(tmp_path)}
    assert {"none", "nan_batch", "frozen"} <= runs


def test_plain_demo_command_runs():
    res = subprocess.run([sys.executable, "-m", "gradhealth", "demo", "--plain", "--steps", "2"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "NOT_IN_OPTIMIZER" in res.stdout and "gradhealth said nothing" in res.stdout


def test_bench_command_runs_and_prints_ratios():
    res = subprocess.run(
        [sys.executable, "-m", "gradhealth", "bench", "--shapes", "0", "--rounds", "1", "--sections", "checks,deltas,tracer"],
        capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr
    for method in ("floor", "naive loop", "check()", "x floor"):
        assert method in res.stdout


def test_missing_zero_grad_is_stale():
    out = demo.scenario_missing_zero_grad(3)
    assert any("STALE_GRAD" in m for m in out.said)
    assert out.report.findings_of("STALE_GRAD")


def test_lr_zero_is_not_updated():
    out = demo.scenario_lr_zero(3)
    assert out.report.findings_of("NOT_UPDATED")


def test_all_masked_batch_is_empty_valid_set():
    out = demo.scenario_all_masked(2)
    assert out.report.findings_of("EMPTY_VALID_SET")


def test_mask_after_divide_origin():
    out = demo.scenario_mask_after_divide(3)
    origin = [m for m in out.said if "NONFINITE_ORIGIN" in m]
    assert origin and "module 'norm'" in origin[0] and "DivBackward0" in origin[0]
    assert "z = (h - h.mean(dim=0, keepdim=True)) / std" in origin[0]


def test_where_overflow_origin():
    out = demo.scenario_where_overflow(3)
    origin = [m for m in out.said if "NONFINITE_ORIGIN" in m]
    assert origin and "module 'act'" in origin[0] and "ExpBackward0" in origin[0]


@pytest.mark.slow
def test_bench_distributed_section_runs():
    res = subprocess.run([sys.executable, "-m", "gradhealth", "bench", "--rounds", "1", "--sections", "distributed"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "at world size 2" in res.stdout and "the collective adds" in res.stdout
    assert "the replicas' gradient agreement in the same collective" in res.stdout


def test_bench_sections_for_experts_and_many_tensors_run(capsys):
    from gradhealth.benchmarks.experts import bench_experts
    from gradhealth.benchmarks.many import bench_many

    bench_many(1, sizes=(200, 400))
    bench_experts(1)
    out = capsys.readouterr().out
    assert "check mean" in out and "mean x floor" in out and "     400" in out
    assert "per-expert judging costs" in out and "check(), per expert" in out

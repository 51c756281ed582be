"""The demo's planted bugs, each identified at the right stage; the healthy run silent."""

import json
import math
import os
import subprocess
import tempfile

import pytest

import gradhealth as gh
from gradhealth.demos import plain as demo
import page_server


def _last(out):
    return out.reports[-1]


def test_detached_output_is_a_loss_side_problem():
    out = demo.scenario_detached(3)
    assert out.error is not None and ".detach()" in out.error
    assert out.reports == []  # stopped before backward: no parameter-level verdict was needed


def test_frozen_layer_is_frozen():
    out = demo.scenario_frozen(3)
    r = _last(out)
    assert r.status["encoder.0.weight"] == "FROZEN" and r.status["encoder.0.bias"] == "FROZEN"
    assert r.findings_of("UNEXPECTED_FROZEN")[0].params == ("encoder.0.weight", "encoder.0.bias")


def test_layer_missing_from_optimizer():
    out = demo.scenario_not_in_optimizer(3)
    assert _last(out).problems == {"head.weight": "NOT_IN_OPTIMIZER", "head.bias": "NOT_IN_OPTIMIZER"}


def test_division_by_zero_is_non_finite_everywhere():
    out = demo.scenario_division_by_zero(1)
    assert set(_last(out).status.values()) == {"NON_FINITE_GRAD"}
    assert any(line.startswith("origin: in the loss") for line in gh.brief(_last(out)))


def test_plain_demo_has_the_lightning_scenarios_and_its_own_eval_and_nan_batch():
    from gradhealth.demos.lightning_fit import SCENARIOS as LIGHTNING

    assert [s[0] for s in demo.SCENARIOS] == [s[0] for s in LIGHTNING]
    r = _last(demo.scenario_eval_mode(2))
    assert r.findings_of("GRAD_MODE") and "the model was in eval() mode" in r.findings_of("GRAD_MODE")[0].message
    nan = demo.scenario_nan_batch(4)
    bad = [x for x in nan.reports if not x.grads_finite]
    assert [x.step for x in bad] == [2]  # only that batch, and the step after it is clean (not poisoned)
    [origin] = [f for f in bad[0].findings if f.kind == "NONFINITE_ORIGIN" and f.data.get("source")]
    assert "plain.py" in origin.data["source"] and origin.data["op"] == "div"


def test_healthy_run_is_silent_and_learns():
    out = demo.scenario_healthy(5)
    assert all(r.ok and not r.findings for r in out.reports) and len(out.reports) == 5
    assert out.losses[-1] < out.losses[0]


@pytest.fixture(scope="module")
def gradhealth_command(tmp_path_factory):
    """``python -m gradhealth ARGS`` (a CompletedProcess), each in a process of its own where gradhealth
    was never imported, forked from a server (tests/page_server.py) that imported what the command
    imports first, once: torch, and Lightning but for ``--plain`` (``gradhealth demo --help`` and
    ``--only`` errors import the Lightning demo too, to parse its options: 9-10 s of CPU a command)."""
    servers = {plain: page_server.Server(["torch"] if plain else ["torch", "lightning.pytorch"], dict(os.environ))
               for plain in (True, False)}

    def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        output = tempfile.mkdtemp(dir=tmp_path_factory.getbasetemp())
        code, out, err = servers["--plain" in args].run(["-m", "gradhealth", *args], cwd=os.getcwd(),
                                                        env=dict(os.environ), output=output, timeout=timeout)
        return subprocess.CompletedProcess(["python", "-m", "gradhealth", *args], code, out, err)

    yield run
    for server in servers.values():
        server.close()


def _lines_ok(text: str, width: int = 100, path: str = "\0") -> None:
    lines = [line for line in text.splitlines() if path not in line]  # a path the user chose is as long as it is
    assert max(len(line) for line in lines) <= width, max(lines, key=len)


@pytest.fixture(scope="module")
def lightning_demo(tmp_path_factory, gradhealth_command):
    """``gradhealth demo --steps 4 --logdir DIR`` once (the 12 scenarios, 53 s on busy cores), and DIR:
    its output is read by the test below, its TensorBoard logs by ``gradhealth report``'s test after
    it (one run of the same command for both, not two). Neither test writes to DIR."""
    logdir = tmp_path_factory.mktemp("demo_logs")
    return gradhealth_command("demo", "--steps", "4", "--logdir", str(logdir)), logdir


@pytest.mark.slow  # (the 12 scenarios in a process of their own: 53 s on busy cores)
def test_demo_command_runs_the_lightning_scenarios(lightning_demo):
    res, tmp_path = lightning_demo
    assert res.returncode == 0, res.stderr
    out = res.stdout
    for words in ["GradModeError", "UNEXPECTED_FROZEN", "NOT_IN_OPTIMIZER", "STALE_GRAD", "NOT_UPDATED", "EMPTY_VALID_SET",
                  "GRAD_MODE", "module 'norm', DivBackward0 at lightning_parts.py:",
                  "module 'act', ExpBackward0 at lightning_parts.py:", "silent: every parameter trains",
                  "configure_optimizers", "skip_nonfinite=True", f"tensorboard --logdir {tmp_path}",
                  f"gradhealth report {tmp_path}", "CUSTOM SCALARS and IMAGES", "what gradhealth said, per scenario:"]:
        assert words in out, words
    # Lightning users are never told to guard optimizer.step() themselves, nor to go and trace a NaN
    # whose origin is already named
    assert "grads_finite" not in out and "trace_nonfinite" not in out and "SCALARS tab" not in out
    # short: one line per scenario title, a few lines under it, nothing wider than 100 columns
    assert "Epoch 0" not in res.stdout + res.stderr and "it/s" not in res.stderr
    titles = [line for line in out.splitlines() if line.startswith("[")]
    assert len(titles) == 12 and all(line.startswith(f"[{i}/12] ") for i, line in enumerate(titles, 1))
    _lines_ok(out, path=str(tmp_path))
    assert len(out) < 8000 and len(out.splitlines()) < 110, (len(out), len(out.splitlines()))
    table = out.split("what gradhealth said, per scenario:")[1].splitlines()[1:13]
    verdicts = dict(line.split(None, 1) for line in table)
    assert verdicts["none"] == "silent" and verdicts["detached"].startswith("GradModeError")
    assert verdicts["not_in_optimizer"].startswith("2 NOT_IN_OPTIMIZER") and "NONFINITE_ORIGIN" in verdicts["nan_batch"]
    runs = {d for d in os.listdir(tmp_path)}
    assert {"none", "nan_batch", "frozen"} <= runs


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_report_on_the_demo_logs_names_the_planted_problems(lightning_demo, gradhealth_command):
    """``gradhealth report`` on the TensorBoard logs the demo command wrote (the run above; from
    tests/test_tensorboard.py, which ran the same command again for its logs)."""
    res, tmp_path = lightning_demo
    assert res.returncode == 0, res.stderr
    rep = gradhealth_command("report", str(tmp_path), "--format", "json", timeout=120)
    items = json.loads(rep.stdout)
    kinds = {(i["run"].split(os.sep)[0], i["kind"]) for i in items}
    for expected in [("not_in_optimizer", "NOT_IN_OPTIMIZER"), ("lr_zero", "NOT_UPDATED"), ("all_masked", "EMPTY_VALID_SET"),
                     ("missing_zero_grad", "STALE_GRAD"), ("frozen", "UNEXPECTED_FROZEN"), ("eval_mode", "GRAD_MODE"),
                     ("nan_batch", "NON_FINITE_GRAD"), ("division_by_zero", "NON_FINITE_GRAD"), ("detached", "STOPPED")]:
        assert expected in kinds, expected
    assert not [i for i in items if i["run"].startswith("none")]
    nan = next(i for i in items if i["run"].startswith("nan_batch") and i["kind"] == "NON_FINITE_GRAD")
    assert nan["step"] == 2 and "reproduced" in nan["detail"]
    where = next(i for i in items if i["run"].startswith("mask_after_divide") and i["kind"] == "NON_FINITE_GRAD")
    assert "module 'norm', at DivBackward0" in where["detail"]
    csv_out = gradhealth_command("report", str(tmp_path), "--format", "csv", timeout=120).stdout
    assert csv_out.splitlines()[0] == "run,kind,step,detail,names"


@pytest.mark.slow  # (over 10 s: make test runs it, make test-fast does not)
def test_plain_demo_command_runs_every_scenario_short(gradhealth_command):
    res = gradhealth_command("demo", "--plain")
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "NOT_IN_OPTIMIZER" in out and "silent: every parameter trains (loss" in out
    assert len([line for line in out.splitlines() if line.startswith("[")]) == 12
    _lines_ok(out)
    assert len(out) < 6000, len(out)


@pytest.mark.slow  # (over 10 s: make test runs it, make test-fast does not)
def test_unknown_only_names_are_an_error_listing_the_valid_ones(gradhealth_command):
    for args in (["demo", "--only", "bogus"], ["demo", "--plain", "--only", "frozen,bogus"]):
        res = gradhealth_command(*args)
        assert res.returncode != 0 and "'bogus'" in res.stderr and "not_in_optimizer" in res.stderr, res.stderr
        assert "[1/" not in res.stdout  # nothing ran


@pytest.mark.slow  # (a process of its own; the CLI imports Lightning to show the demo's help)
def test_demo_help_lists_every_form(gradhealth_command):
    res = gradhealth_command("demo", "--help")
    assert res.returncode == 0
    assert "--plain" in res.stdout and "--transformers" in res.stdout and "--only" in res.stdout


def test_missing_zero_grad_is_stale():
    out = demo.scenario_missing_zero_grad(3)
    assert _last(out).findings_of("STALE_GRAD")


def test_lr_zero_is_not_updated():
    out = demo.scenario_lr_zero(3)
    assert _last(out).findings_of("NOT_UPDATED")


def test_all_masked_batch_is_empty_valid_set():
    out = demo.scenario_all_masked(2)
    assert _last(out).findings_of("EMPTY_VALID_SET")


def _origins(out):
    return [f for r in out.reports for f in r.findings_of("NONFINITE_ORIGIN") if f.level == "error"]


def test_mask_after_divide_origin():
    [first, *_] = _origins(demo.scenario_mask_after_divide(3))
    assert first.data["backward_origin"] == "norm" and first.data["op"] == "DivBackward0"
    assert "z = (h - h.mean(dim=0, keepdim=True)) / std" in first.data["source"]


def test_where_overflow_origin():
    [first, *_] = _origins(demo.scenario_where_overflow(3))
    assert first.data["backward_origin"] == "act" and first.data["op"] == "ExpBackward0"


@pytest.mark.slow
def test_bench_sections_for_experts_and_many_tensors_run(capsys):
    from gradhealth.benchmarks.experts import bench_experts
    from gradhealth.benchmarks.many import bench_many

    bench_many(1, sizes=(200, 400))
    bench_experts(1)
    out = capsys.readouterr().out
    assert "check mean" in out and "mean x floor" in out and "     400" in out
    assert "per-expert judging costs" in out and "check(), per expert" in out


def test_whole_step_bench_measures_every_variant(capsys):
    import torch

    from gradhealth.benchmarks.core import build_model
    from gradhealth.benchmarks.whole_step import VARIANTS, _print, measure

    res = measure(lambda: build_model(3, 8), torch.randn(8, 8), rounds=2, steps=2)
    assert set(res) == set(VARIANTS)
    for row in res.values():
        assert row["mean"] > 0 and row["median"] > 0 and row["floor"] > 0
        assert math.isfinite(row["extra_mean"]) and math.isfinite(row["extra_median"])  # against the plain blocks
    assert res["plain step"]["extra_mean"] == 0.0
    _print("tiny", res, batch=256)
    out = capsys.readouterr().out
    assert "default monitor" in out and "floors" in out and "% step" in out and "every_n_steps=10" in out
    assert "batch 256" in out and "the floor alone is" in out


def test_the_demo_keeps_problems_of_different_modules_apart(capsys):
    """Only step numbers are folded together: layer3 and layer4 are two problems, not one."""
    from gradhealth.demos.console import show

    def report(step, bad):
        status = {"layer3.w": gh.Status.OK, "layer4.w": gh.Status.OK, "x.w": gh.Status.OK}
        status[bad] = gh.Status.NOT_IN_OPTIMIZER
        return gh.Report(step=step, status=status, grad_norm={}, total_grad_norm=1.0)

    show([report(0, "layer3.w"), report(1, "layer3.w"), report(2, "layer4.w")])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("    step 0 (and step 1): NOT_IN_OPTIMIZER in layer3.w")
    assert out[2].startswith("    step 2: NOT_IN_OPTIMIZER in layer4.w")


def test_bench_small_section_prints_the_ratio_to_the_one_number(capsys):
    from gradhealth.benchmarks.small import PARTS, SMALL, bench_small

    res = bench_small(rounds=1, steps=3)
    out = capsys.readouterr().out
    assert set(res) == set(SMALL) and "x one number" in out
    for label in SMALL:
        assert label in out
        row = res[label]
        assert {"plain step", "clip_grad_norm_().item()", "default monitor", "deferred monitor (lag=1)", *PARTS} == set(row)
        assert row["plain step"]["median"] > 0
        # where the cost lands: the one number's own call is the check part; the plain step has none
        phases = {name: v["phases"] for name, v in row.items()}
        assert set(phases["plain step"]) == {"zero_grad", "forward", "backward", "check", "step"}
        assert min(phases["plain step"][k] for k in ("forward", "backward", "step")) > 0
        assert phases["clip_grad_norm_().item()"]["check"] > 10 * phases["plain step"]["check"]
        assert phases["default monitor"]["check"] > 10 * phases["plain step"]["check"]
        for name in PARTS:  # the default monitor with one part off: its check is a real one
            assert phases[name]["check"] > 10 * phases["plain step"]["check"]
    for name in PARTS:  # a row of the ratio table ("  name") and of the split ("    name") for every shape
        assert out.count(f"\n  {name} ") == len(SMALL) and out.count(f"\n    {name} ") == len(SMALL)
    assert "where it goes" in out and "each part off in turn" in out

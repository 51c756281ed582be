"""Report: problems, ok, str() grouping, to_frame()."""

import math

import pytest
import torch
from torch import nn

import gradhealth as gh
from gradhealth.report import group_by_module, is_problem

S = gh.Status


def test_status_enum_contract():
    assert [s.name for s in S] == ["FROZEN", "NO_GRAD", "NON_FINITE_GRAD", "NOT_IN_OPTIMIZER", "ZERO_GRAD", "OK"]
    assert all(isinstance(s, str) and s.value == s.name for s in S)
    assert f"{S.OK}" == "OK"


def test_group_by_module_collapses_only_whole_modules():
    status = {
        "encoder.0.weight": S.FROZEN, "encoder.0.bias": S.FROZEN,
        "encoder.1.weight": S.FROZEN, "encoder.1.bias": S.OK,
        "head.weight": S.NO_GRAD, "head.bias": S.NO_GRAD, "scale": S.ZERO_GRAD,
    }
    rows = group_by_module(status, lambda n, s: s is not S.OK)
    assert [(label, len(names), state) for label, names, state in rows] == [
        ("encoder.0.*", 2, S.FROZEN), ("encoder.1.weight", 1, S.FROZEN), ("head.*", 2, S.NO_GRAD), ("scale", 1, S.ZERO_GRAD)]
    assert group_by_module({"a.w": S.NO_GRAD, "b.w": S.NO_GRAD}, is_problem)[0][0] == "*"


def _report(mlp_status, norms):
    return gh.Report(step=3, status=mlp_status, grad_norm=norms, total_grad_norm=math.hypot(*norms.values()))


def test_problems_ok_and_str():
    status = {f"enc.{i}.weight": S.FROZEN for i in range(24)} | {"head.weight": S.NOT_IN_OPTIMIZER, "head.bias": S.NOT_IN_OPTIMIZER, "out.w": S.OK}
    r = _report(status, {"head.weight": 3.0, "head.bias": 4.0, "out.w": 1.0})
    assert r.problems == {"head.weight": S.NOT_IN_OPTIMIZER, "head.bias": S.NOT_IN_OPTIMIZER}
    assert not r.ok
    text = str(r)
    assert "step 3: 2 NOT_IN_OPTIMIZER" in text
    assert "24 FROZEN" in text and "1 OK" in text
    row = next(line for line in text.splitlines() if line.strip().startswith("head.*"))
    assert row.split()[1:] == ["2", "NOT_IN_OPTIMIZER", "5"]  # group norm sqrt(3^2+4^2)
    assert "enc." not in text.split("where")[1]  # frozen is not listed as a problem
    assert len(text.splitlines()) < 8


def test_str_is_compact_for_large_models():
    status = {f"layer{i}.weight": S.OK for i in range(10_000)}
    status["layer7.weight"] = S.ZERO_GRAD
    r = _report(status, {n: 1.0 for n in status})
    assert len(str(r).splitlines()) <= 5


def test_ok_with_findings():
    r = _report({"w": S.OK}, {"w": 1.0})
    r.findings.append(gh.Finding("AMP_SKIPPED", "skipped", level="info"))
    assert r.ok
    r.findings.append(gh.Finding("STALE_GRAD", "stale"))
    assert not r.ok


def test_to_frame_from_a_real_check():
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    model[0].bias.requires_grad_(False)
    opt = torch.optim.SGD([model[0].weight, model[1].weight], lr=0.1)
    model(torch.randn(2, 3)).sum().backward()
    r = gh.GradHealth(model, opt, on_problem="ignore").check()
    df = r.to_frame()
    assert list(df.index) == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert df.loc["0.bias", "status"] == "FROZEN" and not df.loc["0.bias", "requires_grad"]
    assert df.loc["1.bias", "status"] == "NOT_IN_OPTIMIZER" and not df.loc["1.bias", "in_optimizer"]
    assert df.loc["0.weight", "numel"] == 12 and df.loc["0.weight", "dtype"] == "float32" and df.loc["0.weight", "device"] == "cpu"
    assert df.loc["1.weight", "grad_norm"] == pytest.approx(model[1].weight.grad.norm().item())
    assert math.isnan(df.loc["0.bias", "grad_norm"])


def test_nan_and_inf_norms_combine_the_same_everywhere():
    """str(report), the metrics and the module norms agree: NaN with an inf is NaN, not inf."""
    from gradhealth.metrics import report_metrics
    from gradhealth.stats import combine_norms

    assert math.isnan(combine_norms([math.inf, math.nan])) and combine_norms([math.inf, 1.0]) == math.inf
    assert combine_norms([3.0, 4.0]) == 5.0 and combine_norms([]) == 0.0
    model = nn.Sequential(nn.Linear(3, 2))
    model[0].weight.grad = torch.full((2, 3), math.inf)
    model[0].bias.grad = torch.tensor([math.nan, 1.0])
    r = gh.GradHealth(model, on_problem="ignore", trace_on_nonfinite=False).check()
    assert math.isnan(r.total_grad_norm) and math.isnan(r.module_grad_norm["0"])
    assert math.isnan(report_metrics(r, "module")["gradhealth/grad_norm/0"])
    assert math.isnan(report_metrics(r, "param")["gradhealth/grad_norm/total"])
    assert "nan" in str(r) and " inf" not in str(r)

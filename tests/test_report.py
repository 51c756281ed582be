"""Report: problems, ok, str() grouping, to_frame()."""

import math

import pytest
import torch
from torch import nn

import gradhealth as gh
from gradhealth.base.report import group_by_module, is_problem

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


def _naive_groups(status, select):
    """The grouping by its definition, top down: every module's parameters listed and tested
    again at each level (the reference for :func:`group_by_module`, which walks only the chosen)."""
    tree = {}
    for name in status:
        node = tree
        for part in name.split("."):
            node = node.setdefault(part, {})

    def under(prefix, node):
        return [prefix] if not node else [n for part, child in node.items()
                                          for n in under(f"{prefix}.{part}" if prefix else part, child)]

    def uniform(names):
        states = {status[n] for n in names}
        return next(iter(states)) if len(states) == 1 and all(select(n, status[n]) for n in names) else None

    rows = []

    def visit(prefix, node):
        for part, child in node.items():
            path = f"{prefix}.{part}" if prefix else part
            if not child:
                if select(path, status[path]):
                    rows.append((path, [path], status[path]))
                continue
            names = under(path, child)
            state = uniform(names)
            if state is not None:
                rows.append((f"{path}.*", names, state))
            elif any(select(n, status[n]) for n in names):
                visit(path, child)

    everything = list(status)
    state = uniform(everything) if len(everything) > 1 else None
    if state is not None:
        return [("*", everything, state)]
    visit("", tree)
    return rows


def test_group_by_module_agrees_with_the_naive_walk_on_random_trees():
    import random

    rng = random.Random(0)
    states = [S.OK, S.ZERO_GRAD, S.NO_GRAD, S.FROZEN]
    for trial in range(400):
        names = []
        for _ in range(rng.randint(1, 40)):  # (interleaved modules: a.b.x, a.c.y, a.b.z)
            depth = rng.randint(1, 4)
            names.append(".".join(rng.choice("abc") for _ in range(depth - 1)) + ("." if depth > 1 else "") + f"p{rng.randint(0, 3)}")
        names = list(dict.fromkeys(n for n in names if not any(m.startswith(n + ".") for m in names)))
        status = {n: rng.choice(states[:rng.randint(1, 4)]) for n in names}
        chosen = {n for n in names if rng.random() < rng.choice((0.2, 0.7, 1.0))}
        for select in (lambda n, s: n in chosen, lambda n, s: s is not S.OK, is_problem):
            assert group_by_module(status, select) == _naive_groups(status, select), (trial, status, chosen)
        assert group_by_module(status, chosen) == _naive_groups(status, lambda n, s: n in chosen)


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
    from gradhealth.publish.metrics import report_metrics
    from gradhealth.measure.stats import combine_norms

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


def test_module_norms_read_off_runs_equal_the_general_sum():
    """Modules whose entries are consecutive are combined from slices; the result equals the
    per-entry accumulation for any mix of zeros, tiny, huge, inf and NaN norms, also where only
    some entries have a gradient (a frozen base model's hold none: a module without any is left out)."""
    import random

    from gradhealth.measure import stats

    rng = random.Random(0)
    for _ in range(3000):
        n = rng.randint(1, 12)
        first: dict[int, int] = {}
        module_of = [first.setdefault(m, len(first)) for m in sorted(rng.randint(0, 4) for _ in range(n))]
        modules = [f"m{k}" for k in range(len(first))]
        runs = [slice(module_of.index(k), n - module_of[::-1].index(k)) for k in range(len(modules))]
        norms = [rng.choice([0.0, 1e-200, 1e200, math.inf, math.nan, rng.random()]) for _ in range(n)]
        with_grad = list(range(n)) if rng.random() < 0.5 else sorted(rng.sample(range(n), rng.randint(0, n)))
        norms = [norms[i] for i in with_grad]
        general = stats.module_norms(with_grad, norms, module_of, modules)
        fast = stats.module_norms(with_grad, norms, module_of, modules, runs)
        assert list(general) == list(fast)
        for k in general:
            a, b = general[k], fast[k]
            assert (math.isnan(a) and math.isnan(b)) or a == b or abs(a - b) <= 1e-12 * abs(a), (norms, module_of)


def test_a_model_whose_modules_interleave_has_no_runs():
    class Odd(nn.Module):  # its own named_parameters() order interleaves two modules
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

        def named_parameters(self, *args, **kwargs):
            return iter([("a.weight", self.a.weight), ("b.weight", self.b.weight), ("a.bias", self.a.bias),
                         ("b.bias", self.b.bias)])

    from gradhealth.model.params import ParamView

    view = ParamView(Odd(), [])
    assert view.module_index == [0, 1, 0, 1] and view.module_runs is None
    assert ParamView(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), []).module_runs == [slice(0, 2), slice(2, 4)]
    model = Odd()  # and a check over it combines each module from its own entries
    (model.a(torch.ones(1, 2)).sum() + 2 * model.b(torch.ones(1, 2)).sum()).backward()
    r = gh.GradHealth(model, on_problem="ignore").check()
    for m in ("a", "b"):
        want = math.hypot(*(getattr(model, m).weight.grad.norm().item(), getattr(model, m).bias.grad.norm().item()))
        assert r.module_grad_norm[m] == pytest.approx(want, rel=1e-6)


def test_to_frame_dtype_and_device_are_live():
    m = nn.Linear(2, 2)
    mon = gh.GradHealth(m)
    m(torch.randn(3, 2)).sum().backward()
    r = mon.check()
    assert set(r.to_frame()["dtype"]) == {"float32"}
    m.double()  # the same Parameter objects, new data
    assert set(r.to_frame()["dtype"]) == {"float64"} and set(r.to_frame()["device"]) == {"cpu"}

"""STALE_GRAD only where it belongs: the four loop variants."""

import torch

import gradhealth as gh
from conftest import MLP


def run(variant, steps=4):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = gh.GradHealth(model, opt, on_problem="ignore")
    reports = []
    for _ in range(steps):
        if variant == "set_to_none":
            opt.zero_grad(set_to_none=True)
        elif variant == "zero_fill":
            opt.zero_grad(set_to_none=False)
        elif variant == "model_zero_grad":
            model.zero_grad()
        if variant == "accumulate":
            opt.zero_grad()
            for _ in range(4):
                model(torch.randn(4, 8)).square().mean().backward()
                reports.append(mon.check())
        else:
            model(torch.randn(4, 8)).square().mean().backward()
            reports.append(mon.check())
        opt.step()
    return reports


def kinds(reports):
    return [[f.kind for f in r.findings] for r in reports]


def test_zero_grad_set_to_none_is_clean():
    assert all(k == [] for k in kinds(run("set_to_none")))


def test_zero_grad_zero_fill_is_clean():
    assert all(k == [] for k in kinds(run("zero_fill")))


def test_model_zero_grad_is_clean():
    assert all(k == [] for k in kinds(run("model_zero_grad")))


def test_accumulation_is_clean():
    assert all(k == [] for k in kinds(run("accumulate")))


def test_missing_zero_grad_is_stale():
    reports = run("missing")
    assert kinds(reports)[0] == []  # the first backward has nothing stale to add onto
    for r in reports[1:]:
        f = r.findings_of("STALE_GRAD")
        assert f, kinds(reports)
        assert set(f[0].params) == {n for n, _ in MLP().named_parameters()}
        assert f[0].message.startswith("all 6 parameters") and "zero_grad" in f[0].message


def test_a_half_left_unzeroed_is_stale_whichever_half():
    """The few witnesses are spread over the optimizer's parameters: a loop that zeroes only one
    half of the model (``encoder.zero_grad()`` where the whole model trains) is still named."""
    for zeroed in ("front", "back"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(6)])  # 12 tensors
        front, back = model[:3], model[3:]
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        mon = gh.GradHealth(model, opt, on_problem="ignore")
        found = []
        for step in range(3):
            (front if zeroed == "front" else back).zero_grad()
            before = [p.grad.clone() if p.grad is not None else None for p in model.parameters()]
            model(torch.randn(4, 8)).square().mean().backward()
            kept = [b is not None and b.abs().sum() > 0 for b in before]  # the premise: a half kept its gradients
            assert step == 0 or sum(kept) == 6, (zeroed, kept)
            found.append(mon.check().findings_of("STALE_GRAD"))
            opt.step()
        assert found[0] == [] and found[1] and found[2], (zeroed, found)


def test_lightning_clearing_the_gradients_before_validation_does_not_resolve_a_missing_zero_grad():
    """Lightning sets the gradients to None before each validation run: the check right after it is
    clean, the next one stale again. The loop still never zeroes them: not "resolved"."""
    import warnings

    import lightning.pytorch as pl

    from gradhealth.demos.lightning_parts import DemoModule, SyntheticData
    from gradhealth.integrations.lightning import GradHealthCallback

    class Kept:
        def __init__(self):
            self.reports = []

        def write(self, report):
            self.reports.append(report)

    kept = Kept()
    trainer = pl.Trainer(max_steps=12, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         val_check_interval=4, limit_val_batches=2,
                         callbacks=[GradHealthCallback(on_problem="warn", sinks=[kept], log=False)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(DemoModule(bug="missing_zero_grad"), SyntheticData(n_batches=8))
    said = [str(w.message) for w in caught if issubclass(w.category, gh.GradHealthWarning)]
    stale = [bool(r.findings_of("STALE_GRAD")) for r in kept.reports]
    # premise: clean right after each validation run (steps 4 and 8), stale again at the next backward
    assert stale == [False, True, True, True, False, True, True, True, False, True, True, True]
    assert not [s for s in said if "resolved" in s], said
    assert len([s for s in said if "STALE_GRAD" in s]) == 1  # said once, at step 1


def test_a_loop_that_starts_zeroing_is_resolved_at_its_second_clean_check():
    import warnings

    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = gh.GradHealth(model, opt, on_problem="warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(8):
            if step >= 4:  # the fix, from step 4 on
                opt.zero_grad()
            model(torch.randn(4, 8)).square().mean().backward()
            mon.check()
            opt.step()
    said = [str(w.message) for w in caught if issubclass(w.category, gh.GradHealthWarning)]
    assert [s.split(":")[0] for s in said] == ["gradhealth step 1", "gradhealth step 5"]
    assert "resolved: STALE_GRAD (error, since step 1)" in said[1]

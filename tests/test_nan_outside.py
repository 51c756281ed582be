"""NaN origins outside the modules: the operation and the source line, in a traced block, a replay,
and the Lightning replay; outputs that are dataclasses or namespaces are walked."""

import dataclasses
import types
import warnings

import torch
from torch import nn

import gradhealth as gh
from gradhealth.origin import snapshot


def weighted_loss(model, x, w):
    out = model(x).squeeze(1)
    per = out / w  # a per-sample weight of 0 divided by: the NaN is born here
    return torch.where(w > 0, per, torch.zeros_like(per)).mean()


def test_division_in_the_loss_names_the_op_and_line():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    x, w = torch.randn(8, 4), torch.tensor([1.0, 0, 1, 1, 0, 1, 1, 1])
    with gh.trace_nonfinite(model) as t:
        weighted_loss(model, x, w).backward()
    assert t.forward_origin is None and t.backward_origin is None  # no module made it
    phase, op, source = t.outside
    assert (phase, op) == ("forward", "div") and "per = out / w" in source and "test_nan_outside.py" in source
    assert "outside the model's modules" in t.explain() and "per = out / w" in t.explain()
    assert not torch.is_anomaly_enabled()  # the block left anomaly mode as it found it
    torch.ones(2) / torch.zeros(2)  # no mode left behind: this is not recorded anywhere


def test_replay_in_a_plain_loop_names_it_too():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = gh.GradHealth(model, opt, on_problem="ignore", trace_on_nonfinite=False)
    x, w = torch.randn(8, 4), torch.tensor([1.0, 0, 1, 1, 0, 1, 1, 1])
    rng = snapshot.rng_state()
    weighted_loss(model, x, w).backward()
    report = mon.check()
    assert not report.grads_finite
    finding = gh.replay_nonfinite(model, lambda: weighted_loss(model, x, w).backward(), rng=rng, step=report.step)
    assert finding.kind == "NONFINITE_ORIGIN" and finding.level == "error"
    assert finding.data["op"] == "div" and "per = out / w" in finding.data["source"]


def test_lightning_replay_names_the_division_in_the_loss():
    import lightning.pytorch as pl

    from gradhealth.integrations.lightning import GradHealthCallback
    from gradhealth.demos.lightning_parts import DemoModule, SyntheticData

    cb = GradHealthCallback(on_problem="ignore", log=False)
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[cb],
                         limit_val_batches=0, num_sanity_val_steps=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(DemoModule(bug="division_by_zero"), SyntheticData(n_batches=4))
    found = [f for f in cb.last_report.findings if f.kind == "NONFINITE_ORIGIN" and not f.data.get("from_loss")]
    assert found and found[0].data["op"] and found[0].data["source"] and "lightning_parts.py" in found[0].data["source"]
    assert "no module produced a NaN or inf in this step (it may" not in found[0].message


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    extra: object = None


class Blow(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.kind = kind

    def forward(self, x):
        y = self.lin(x).log()  # negative inputs: NaN born inside this module
        return Out(y) if self.kind == "dataclass" else types.SimpleNamespace(logits=y)


def test_non_tensor_outputs_are_walked():
    for kind in ("dataclass", "namespace"):
        torch.manual_seed(0)
        model = nn.Sequential()
        model.add_module("blow", Blow(kind))
        with gh.trace_nonfinite(model) as t:
            model.blow(torch.randn(6, 4)).logits.sum().backward()
        assert t.forward_origin == "blow", kind


def test_the_plain_loop_monitor_names_the_operation_when_no_module_is_the_origin():
    # the seed's central case in a plain loop: a mask applied after the division, in the loss
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    mon = gh.GradHealth(model, opt, on_problem="ignore")
    x, w = torch.randn(8, 4), torch.tensor([1.0, 0, 1, 1, 0, 1, 1, 1])
    origins = []
    for _ in range(4):
        opt.zero_grad()
        loss = weighted_loss(model, x, w)
        loss.backward()
        r = mon.check(loss=loss)
        assert torch.isfinite(loss) and not r.grads_finite  # the premise: a finite loss, NaN gradients
        said = r.findings_of("NONFINITE_ORIGIN")
        # at every failing check, the finite output with a NaN gradient reaching it: made in the loss
        assert [f.level for f in said if f.data.get("from_loss")] == (["error"] if not any(
            f.level == "error" and not f.data.get("from_loss") for f in said) else [])
        origins.append([f for f in said if not f.data.get("from_loss")])
    # the first failing check replays the model's calls: no module makes it, so the op watch is armed
    [first] = origins[0]
    assert first.level == "info" and "traced operation by operation" in first.message and first.data["replayed"]
    for found in origins[1:]:  # from then on: the operation and its line
        [f] = found
        assert f.level == "error" and f.data["op"] == "div" and "per = out / w" in f.data["source"]
        assert "per = out / w" in f.message and "test_nan_outside.py" in f.message
    mon.close()
    assert not torch.is_anomaly_enabled() and not torch._C._is_torch_function_mode_enabled()

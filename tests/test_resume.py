"""A resumed run continues every story the monitor kept: run N steps, save (model, optimizers,
monitor), build everything anew from the checkpoint, load, run M more; the reports from step N on
(states, tolerated names, findings with their levels and words, the warnings said) equal the
uninterrupted run's. Each case also shows its premise: the story is there after step N in the
uninterrupted run, and a monitor that starts fresh at the checkpoint tells another story (so the
state is what carries it)."""

from __future__ import annotations

import copy
import io
import json
import re
import warnings
from dataclasses import dataclass, field

import pytest
import torch
from torch import nn

import gradhealth as gh


# ------------------------------------------------------------------ the harness
class Recorder:
    """A sink: every report a run published (summarised at the end: later deliveries included)."""

    def __init__(self):
        self.reports = []

    def write(self, report):
        self.reports.append(report)


def summary(report, said=(), numbers=True) -> tuple:
    words = (lambda s: s) if numbers else (lambda s: re.sub(r"\d+(\.\d+)?(e[-+]?\d+)?", "#", s))  # noqa: E731
    return (report.step, {n: s.value for n, s in report.status.items()}, sorted(report.tolerated),
            [(str(f.kind), f.level, words(f.message), f.params) for f in report.findings],
            [words(w) for w in said])


class Layers(nn.Module):
    """Four small layers; ``skip`` (a set of layer indices) leaves layers out of a forward."""

    def __init__(self, width=6, depth=4):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x, skip=()):
        for k, layer in enumerate(self.layers):
            if k not in skip:
                x = torch.tanh(layer(x))
        return self.head(x)


def batch(i: int, width=6):
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(8, width, generator=g), torch.randn(8, 1, generator=g)


@dataclass
class Case:
    name: str
    n: int  # steps before the checkpoint
    m: int  # steps after it
    story: str  # a finding kind (or "warning") the uninterrupted run shows from step n on
    optimizers: object = None  # model -> list of optimizers (default: one SGD)
    step: object = None  # (i, model, optimizers, monitor) -> None: one training step with its check
    options: dict = field(default_factory=dict)
    numbers: bool = True  # the words compared with their numbers (False: the gradients themselves differ)
    model: object = Layers

    def build(self, seed: int):
        torch.manual_seed(seed)
        model = self.model()
        opts = (self.optimizers or (lambda mdl: [torch.optim.SGD(mdl.parameters(), lr=0.05)]))(model)
        return model, opts

    def monitor(self, model, opts):
        rec = Recorder()
        mon = gh.GradHealth(model, opts if len(opts) > 1 else opts[0], sinks=(rec,),
                            **{"on_problem": "warn", **self.options})
        return mon, rec

    def run(self, steps, model, opts, mon) -> dict[int, list[str]]:
        said = {}
        for i in steps:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                (self.step or plain_step)(i, model, opts, mon)
            said[i] = [str(w.message) for w in caught if issubclass(w.category, gh.GradHealthWarning)]
        return said

    def reports(self, rec, said, since):
        return [summary(r, said.get(r.step, ()), self.numbers) for r in rec.reports if r.step >= since]


def plain_step(i, model, opts, mon, skip=(), loss_scale=1.0):
    x, y = batch(i)
    for o in opts:
        o.zero_grad()
    loss = ((model(x, skip) - y) ** 2).mean() * loss_scale
    loss.backward()
    mon.check(loss=loss)
    for o in opts:
        o.step()


def through_a_checkpoint(obj):
    """What a checkpoint file gives back: ``torch.save`` (weights only), and JSON (the HF Trainer's)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=True)
    assert json.loads(json.dumps(back["monitor"])) == json.loads(json.dumps(obj["monitor"]))  # (JSON keeps it)
    back["monitor"] = json.loads(json.dumps(back["monitor"]))
    return back


def resume_plain(case: Case, load=True):
    """The reports from step n on of a run that stopped at step n and was resumed from its checkpoint."""
    model, opts = case.build(0)
    mon, _ = case.monitor(model, opts)
    case.run(range(case.n), model, opts, mon)
    ckpt = through_a_checkpoint({"model": model.state_dict(), "opts": [o.state_dict() for o in opts],
                                 "monitor": mon.state_dict()})
    mon.close()
    model, opts = case.build(1)  # (other weights: the checkpoint's are loaded)
    model.load_state_dict(ckpt["model"])
    for o, s in zip(opts, ckpt["opts"]):
        o.load_state_dict(s)
    mon, rec = case.monitor(model, opts)
    if load:
        mon.load_state_dict(ckpt["monitor"])
    else:  # (the control: a monitor that knows the step count only)
        mon.carry.calls = mon.carry.checks = case.n
    said = case.run(range(case.n, case.n + case.m), model, opts, mon)
    return case.reports(rec, said, case.n)


def uninterrupted(case: Case):
    model, opts = case.build(0)
    mon, rec = case.monitor(model, opts)
    said = case.run(range(case.n + case.m), model, opts, mon)
    return case.reports(rec, said, case.n)


def shows(reports, story: str) -> bool:
    return any(story in r[1].values() or any(f[0] == story for f in r[3]) for r in reports)


# --------------------------------------------------------------------- stories
def two_groups(lr_second):
    def make(model):
        rest = [p for n, p in model.named_parameters() if not n.startswith("layers.0.")]
        return [torch.optim.SGD([{"params": rest, "lr": 0.05}, {"params": model.layers[0].parameters(), "lr": lr_second}])]
    return make


def scheduled(lr_at):
    def step(i, model, opts, mon):
        for g in opts[0].param_groups:
            g["lr"] = lr_at(i)
        plain_step(i, model, opts, mon)
    return step


def layer_drop(i, model, opts, mon):  # layer 2 skipped at one step in three, as LayerDrop does
    plain_step(i, model, opts, mon, skip={2} if i % 3 == 1 else ())


def drop_then_stop(i, model, opts, mon):  # ... then never used again from step 14 on: an error, dated by its past
    plain_step(i, model, opts, mon, skip={2} if i % 3 == 1 or i >= 14 else ())


def thawed_then_cut(i, model, opts, mon):  # layer 1 frozen for 6 steps, thawed, then cut from the graph
    for p in model.layers[1].parameters():
        p.requires_grad_(not 3 <= i < 9)
    plain_step(i, model, opts, mon, skip={1} if i >= 12 else ())


def nothing_to_learn(i, model, opts, mon):  # batches whose loss is exactly 0 now and then (tied rewards)
    plain_step(i, model, opts, mon, loss_scale=0.0 if i % 4 == 3 else 1.0)


def spikes(i, model, opts, mon):  # two spikes in a row across the checkpoint: an error at the second
    plain_step(i, model, opts, mon, loss_scale=1e4 if i in (23, 24) else 1.0)


class Stopped(torch.optim.SGD):
    """An update rule that stopped working: its step runs and changes nothing."""

    @torch.no_grad()
    def step(self, closure=None):
        return None


def out_of_optimizer(model):
    return [torch.optim.SGD([p for n, p in model.named_parameters() if not n.startswith("head.")], lr=0.05)]


def gan_pair(model):
    return [torch.optim.SGD(model.layers.parameters(), lr=0.05), torch.optim.SGD(model.head.parameters(), lr=0.05)]


def only_first_steps(i, model, opts, mon):  # both zeroed, only the first steps: the head's gradients thrown away
    x, y = batch(i)
    for o in opts:
        o.zero_grad()
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    mon.check(loss=loss)
    opts[0].step()


def pile_up(i, model, opts, mon):  # the head's optimizer never steps nor zeroes: its gradients pile up
    x, y = batch(i)
    opts[0].zero_grad()
    loss = ((model(x) - 10.0) ** 2).mean()  # (far from the target: each backward adds a gradient of one sign)
    loss.backward()
    mon.check(loss=loss)
    opts[0].step()


class NanAt(Layers):
    """A NaN made inside layer 1 at one step (a log of a negative number)."""

    bad = False

    def forward(self, x, skip=()):
        for k, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if k == 1 and self.bad:
                x = torch.log(x - 10.0)
        return self.head(x)


def nan_at(steps):
    def step(i, model, opts, mon):
        model.bad = i in steps
        plain_step(i, model, opts, mon)
    return step


CASES = [
    Case("lr held at 0 on purpose", 4, 4, "NOT_UPDATED", two_groups(0.0)),
    Case("warm-up from 0 that never rises", 2, 4, "NOT_UPDATED", step=scheduled(lambda i: 0.0)),
    Case("lr fell to 0 and stays", 5, 3, "NOT_UPDATED", step=scheduled(lambda i: 0.05 if i < 4 else 0.0)),
    Case("LayerDrop's transient gaps", 12, 8, "TRANSIENT_GRAD", step=layer_drop),
    Case("a LayerDrop layer that stops", 13, 5, "NO_GRAD", step=drop_then_stop, options={"on_problem": "ignore"}),
    Case("frozen, thawed, then cut", 10, 5, "NO_GRAD", step=thawed_then_cut, options={"on_problem": "ignore"}),
    Case("nothing to learn, said once", 6, 6, "NOTHING_TO_LEARN", step=nothing_to_learn),
    Case("two spikes in a row", 24, 2, "EXPLODING_GRAD", step=spikes),
    Case("an update rule that stopped", 2, 4, "NOT_UPDATED", lambda model: [Stopped(model.parameters(), lr=0.05)],
         options={"on_problem": "ignore"}),
    Case("a problem said once", 3, 3, "NOT_IN_OPTIMIZER", out_of_optimizer),
    Case("an optimizer that never steps", 2, 4, "NOT_STEPPED", gan_pair, step=only_first_steps,
         options={"on_problem": "ignore"}),
    Case("gradients piling up", 9, 3, "GRAD_PILEUP", gan_pair, step=pile_up, options={"on_problem": "ignore"},
         numbers=False),
    Case("the tracer armed after a NaN", 4, 2, "NONFINITE_ORIGIN", step=nan_at({3, 4}), model=NanAt,
         options={"on_problem": "ignore", "trace_on_nonfinite": True}),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_a_resumed_plain_loop_tells_the_uninterrupted_story(case, one_thread):
    whole = uninterrupted(case)
    fresh = resume_plain(case, load=False)
    assert shows(whole, case.story) or shows(fresh, case.story), f"premise: {case.story} from step {case.n} on"
    assert fresh != whole, "premise: a monitor that starts fresh at the checkpoint tells another story"
    assert resume_plain(case) == whole

"""``gradhealth demo``: a small model on synthetic data, one planted bug at a time.

Each scenario trains a few steps of a plain PyTorch loop with one classic mistake and prints what
gradhealth said about it; the last one is a healthy run, which says nothing.
"""

from __future__ import annotations

import argparse
import re
import textwrap
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from gradhealth.errors import GradHealthWarning, GradModeError
from gradhealth.guards import check_loss
from gradhealth.monitor import GradHealth


class Net(nn.Module):
    def __init__(self, d_in: int = 16, d_hidden: int = 32, n_classes: int = 4):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(d_in, d_hidden), nn.ReLU(), nn.Linear(d_hidden, d_hidden), nn.ReLU())
        self.head = nn.Linear(d_hidden, n_classes)

    def forward(self, x):
        return self.head(self.encoder(x))


def synthetic_batches(n: int, batch: int = 32, d_in: int = 16, n_classes: int = 4, seed: int = 0):
    """A learnable toy task: the class is the argmax of a fixed random projection of x."""
    g = torch.Generator().manual_seed(seed)
    proj = torch.randn(d_in, n_classes, generator=g)
    for _ in range(n):
        x = torch.randn(batch, d_in, generator=g)
        yield x, (x @ proj).argmax(dim=1)


@dataclass
class Outcome:
    said: list[str]
    report: object = None


def _run(train_step: Callable, monitor_kw: dict, steps: int = 5, model_fn=Net, opt_fn=None) -> Outcome:
    torch.manual_seed(0)
    model = model_fn()
    opt = (opt_fn or (lambda m: torch.optim.SGD(m.parameters(), lr=0.1)))(model)
    said: list[str] = []
    report = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", GradHealthWarning)
        with GradHealth(model, opt, **monitor_kw) as monitor:
            for x, y in synthetic_batches(steps):
                try:
                    report = train_step(model, opt, monitor, x, y) or report
                except GradModeError as exc:
                    said.append(f"GradModeError: {exc}")
                    break
    said += [str(w.message) for w in caught if issubclass(w.category, GradHealthWarning)]
    return Outcome(said, report)


def _step(model, opt, monitor, x, y, forward=None, loss_fn=None, zero_grad=True):
    if zero_grad:
        opt.zero_grad(set_to_none=True)
    out = (forward or model)(x)
    loss = (loss_fn or nn.functional.cross_entropy)(out, y)
    check_loss(loss, model)  # the loss-side check: names why backward() could not work
    loss.backward()
    report = monitor.check(loss=loss)
    if report is None or report.grads_finite:  # never apply NaN/inf gradients
        opt.step()
    return report


def scenario_detached(steps: int) -> Outcome:
    # The model's output is detached before the loss (e.g. to log it) and that tensor is used.
    return _run(lambda m, o, mon, x, y: _step(m, o, mon, x, y, forward=lambda x: m(x).detach()), {}, steps)


def scenario_frozen(steps: int) -> Outcome:
    # A leftover freeze from fine-tuning code: the first encoder layer never trains.
    def model_fn():
        net = Net()
        net.encoder[0].requires_grad_(False)
        return net

    return _run(_step, {"expect_frozen": []}, steps, model_fn=model_fn)


def scenario_not_in_optimizer(steps: int) -> Outcome:
    # The optimizer was built from the encoder alone; the head gets gradients but never moves.
    return _run(_step, {}, steps, opt_fn=lambda m: torch.optim.SGD(m.encoder.parameters(), lr=0.1))


def scenario_division_by_zero(steps: int) -> Outcome:
    # A per-sample weight that is 0 for a padded sample, divided by instead of multiplied.
    def loss_fn(out, y):
        weight = torch.ones(out.shape[0])
        weight[0] = 0.0
        return (nn.functional.cross_entropy(out, y, reduction="none") / weight).mean()

    return _run(lambda m, o, mon, x, y: _step(m, o, mon, x, y, loss_fn=loss_fn), {}, steps)


def scenario_missing_zero_grad(steps: int) -> Outcome:
    # optimizer.zero_grad() forgotten: each backward adds onto the gradients already applied.
    return _run(lambda m, o, mon, x, y: _step(m, o, mon, x, y, zero_grad=False), {}, steps)


def scenario_lr_zero(steps: int) -> Outcome:
    # A warm-up scheduler that starts at 0 and never leaves it (a typo in its length, say).
    return _run(_step, {}, steps, opt_fn=lambda m: torch.optim.SGD(m.parameters(), lr=0.0))


def scenario_all_masked(steps: int) -> Outcome:
    # A padding mask that, for this batch, selects no position: the mean over nothing is NaN.
    def loss_fn(out, y):
        valid = torch.zeros(out.shape[0], dtype=torch.bool)  # every sample is padding
        return nn.functional.cross_entropy(out[valid], y[valid])

    return _run(lambda m, o, mon, x, y: _step(m, o, mon, x, y, loss_fn=loss_fn), {}, steps)


class _Standardize(nn.Module):
    """Divides each feature by its batch std, then masks the constant (std 0) features: after."""

    def forward(self, h):
        std = h.std(dim=0, keepdim=True)
        z = (h - h.mean(dim=0, keepdim=True)) / std
        return torch.where(std > 0, z, torch.zeros_like(z))


class _MaskAfterDivideNet(Net):
    def __init__(self):
        super().__init__()
        self.norm = _Standardize()

    def forward(self, x):
        h = self.encoder(x)
        h = h * (torch.arange(h.shape[1]) != 0)  # feature 0 is switched off: its std is 0
        return self.head(self.norm(h))


class _Softplus(nn.Module):
    """log(1 + exp(x)), with torch.where replacing the overflowed values: after the fact."""

    def forward(self, x):
        e = x.exp()
        return torch.where(torch.isinf(e), x, e.log1p())


class _WhereOverflowNet(Net):
    def __init__(self):
        super().__init__()
        self.act = _Softplus()

    def forward(self, x):
        return self.head(self.act(self.encoder(x) * 100))  # large activations overflow exp


def scenario_mask_after_divide(steps: int) -> Outcome:
    return _run(_step, {}, steps, model_fn=_MaskAfterDivideNet)


def scenario_where_overflow(steps: int) -> Outcome:
    return _run(_step, {}, steps, model_fn=_WhereOverflowNet)


def scenario_healthy(steps: int) -> Outcome:
    return _run(_step, {}, steps)


SCENARIOS: list[tuple[str, str, Callable[[int], Outcome]]] = [
    ("detached output", "out = model(x).detach() before the loss", scenario_detached),
    ("frozen layer", "encoder.0 left frozen (expect_frozen=[] says nothing should be)", scenario_frozen),
    ("layer missing from the optimizer", "SGD(model.encoder.parameters()) leaves out the head", scenario_not_in_optimizer),
    ("division by zero", "a per-sample weight of 0 divided by", scenario_division_by_zero),
    ("missing zero_grad", "optimizer.zero_grad() left out of the loop", scenario_missing_zero_grad),
    ("learning rate 0", "a scheduler stuck at lr=0", scenario_lr_zero),
    ("all-masked batch", "a padding mask that selects nothing, mean over the empty set", scenario_all_masked),
    ("mask after divide", "standardize by std, then mask the std=0 feature (the forward is clean)", scenario_mask_after_divide),
    ("torch.where over an overflow", "log(1+exp(x)) with the infs replaced by torch.where", scenario_where_overflow),
    ("healthy run", "the same loop with no bug", scenario_healthy),
]


def show(said: list[str]) -> None:
    """What gradhealth said in one scenario, each different message once (the same words come on
    many steps), indented under the scenario's title. Used by every demo."""
    if not said:
        print("    gradhealth said nothing: every parameter trains normally.")
        return
    seen: dict[str, str] = {}
    for message in said:
        seen.setdefault(re.sub(r"step \d+|batch \d+", "N", message), message)
    for message in seen.values():
        print(textwrap.indent(message, "    "))
    extra = len(said) - len(seen)
    if extra:
        print(f"    (and {extra} more warning{'' if extra == 1 else 's'} like these on the following steps)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gradhealth demo", description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5, help="training steps per scenario")
    args = ap.parse_args(argv)
    print("gradhealth demo: a 3-layer classifier on synthetic data, one planted bug per scenario\n")
    for i, (title, what, fn) in enumerate(SCENARIOS, 1):
        print(f"[{i}/{len(SCENARIOS)}] {title}: {what}")
        show(fn(args.steps).said)
        print()
    return 0

"""``gradhealth demo``: a small model on synthetic data, one planted bug at a time.

Each scenario trains a few steps of a plain PyTorch loop with one classic mistake and prints what
gradhealth said about it, in short; the last one is a healthy run, which says nothing. The
scenarios are the Lightning demo's, under the same names.
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from gradhealth.base.errors import GradModeError
from gradhealth.judge.guards import check_loss
from gradhealth.origin.replay import replay_nonfinite
from gradhealth.origin.snapshot import rng_state
from gradhealth.monitor import GradHealth
from gradhealth.demos.console import Capture, show, table, verdict


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
    reports: list = field(default_factory=list)
    error: str | None = None
    losses: list = field(default_factory=list)


def _run(train_step: Callable, monitor_kw: dict, steps: int = 5, model_fn=Net, opt_fn=None) -> Outcome:
    torch.manual_seed(0)
    model = model_fn()
    opt = (opt_fn or (lambda m: torch.optim.SGD(m.parameters(), lr=0.1)))(model)
    out, capture = Outcome(), Capture()
    with warnings.catch_warnings(record=True):  # the demo prints the short form instead
        warnings.simplefilter("always")
        with GradHealth(model, opt, sinks=[capture], **monitor_kw) as monitor:
            for i, (x, y) in enumerate(synthetic_batches(steps)):
                try:
                    report = train_step(model, opt, monitor, x, y, i)
                except GradModeError as exc:
                    out.error = str(exc)
                    break
                if report is not None and report.loss is not None:
                    out.losses.append(report.loss)
    out.reports = capture.reports
    return out


def _step(model, opt, monitor, x, y, i=0, forward=None, loss_fn=None, zero_grad=True, replay=False):
    if zero_grad:
        opt.zero_grad(set_to_none=True)
    rng = rng_state() if replay else None
    compute = lambda: (loss_fn or nn.functional.cross_entropy)((forward or model)(x), y)  # noqa: E731
    loss = compute()
    check_loss(loss, model)  # the loss-side check: names why backward() could not work
    loss.backward()
    report = monitor.check(loss=loss)
    if report is not None and not report.grads_finite and replay:  # run it again under the tracer
        found = replay_nonfinite(model, lambda: compute().backward(), rng=rng, step=report.step, label=f"batch {i}")
        if found is not None:
            report.findings.append(found)
    if report is None or report.grads_finite:  # never apply NaN/inf gradients
        opt.step()
    return report


def scenario_detached(steps: int) -> Outcome:
    # The model's output is detached before the loss (e.g. to log it) and that tensor is used.
    return _run(lambda m, o, mon, x, y, i: _step(m, o, mon, x, y, i, forward=lambda x: m(x).detach()), {}, steps)


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

    return _run(lambda m, o, mon, x, y, i: _step(m, o, mon, x, y, i, loss_fn=loss_fn), {}, steps)


def scenario_missing_zero_grad(steps: int) -> Outcome:
    # optimizer.zero_grad() forgotten: each backward adds onto the gradients already applied.
    return _run(lambda m, o, mon, x, y, i: _step(m, o, mon, x, y, i, zero_grad=False), {}, steps)


def scenario_lr_zero(steps: int) -> Outcome:
    # A warm-up scheduler that starts at 0 and never leaves it (a typo in its length, say).
    return _run(_step, {}, steps, opt_fn=lambda m: torch.optim.SGD(m.parameters(), lr=0.0))


def scenario_all_masked(steps: int) -> Outcome:
    # A padding mask that, for this batch, selects no position: the mean over nothing is NaN.
    def loss_fn(out, y):
        valid = torch.zeros(out.shape[0], dtype=torch.bool)  # every sample is padding
        return nn.functional.cross_entropy(out[valid], y[valid])

    return _run(lambda m, o, mon, x, y, i: _step(m, o, mon, x, y, i, loss_fn=loss_fn), {}, steps)


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


def scenario_eval_mode(steps: int) -> Outcome:
    # A validation helper that ran model.eval() and never put the model back in train().
    def step(m, o, mon, x, y, i):
        m.eval()
        return _step(m, o, mon, x, y, i)

    return _run(step, {}, steps, model_fn=lambda: nn.Sequential(Net(), nn.Dropout(0.1)))


def scenario_nan_batch(steps: int) -> Outcome:
    # A per-sample weight of 0 divided by, masked after the division, on batch 2 only: the loss
    # is finite, its gradient NaN. The loop replays that batch under the tracer to find the origin.
    def loss_fn_at(i):
        def loss_fn(out, y):
            per = nn.functional.cross_entropy(out, y, reduction="none")
            den = torch.ones_like(per)
            if i == 2:
                den[0] = 0.0
            return torch.where(den != 0, per / den, torch.zeros_like(per)).mean()
        return loss_fn

    return _run(lambda m, o, mon, x, y, i: _step(m, o, mon, x, y, i, loss_fn=loss_fn_at(i), replay=True), {}, steps)


def scenario_healthy(steps: int) -> Outcome:
    return _run(_step, {}, steps)


#: (name for --only, title, what is planted, run); the names and order are the Lightning demo's
SCENARIOS: list[tuple[str, str, str, Callable[[int], Outcome]]] = [
    ("detached", "detached output", "out = model(x).detach() before the loss", scenario_detached),
    ("frozen", "frozen layer", "encoder.0 left frozen; expect_frozen=[] says nothing should be", scenario_frozen),
    ("not_in_optimizer", "layer missing from the optimizer", "SGD(model.encoder.parameters()) leaves out the head",
     scenario_not_in_optimizer),
    ("division_by_zero", "division by zero", "a per-sample weight of 0 divided by", scenario_division_by_zero),
    ("missing_zero_grad", "missing zero_grad", "optimizer.zero_grad() left out of the loop", scenario_missing_zero_grad),
    ("lr_zero", "learning rate 0", "a scheduler stuck at lr=0", scenario_lr_zero),
    ("all_masked", "all-masked batch", "a padding mask that selects nothing: mean over the empty set",
     scenario_all_masked),
    ("eval_mode", "model left in eval()", "a validation helper that forgot model.train()", scenario_eval_mode),
    ("mask_after_divide", "mask after divide", "standardize by std, then mask the std=0 feature (forward is clean)",
     scenario_mask_after_divide),
    ("where_overflow", "torch.where over an overflow", "log(1+exp(x)) with the infs replaced by torch.where",
     scenario_where_overflow),
    ("nan_batch", "NaN on one batch", "a zero weight divided by on batch 2 only: replayed to find the origin",
     scenario_nan_batch),
    ("none", "healthy run", "the same loop with no bug", scenario_healthy),
]


def choose(only: str | None, names: list[str], prog: str) -> list[str]:
    """The scenario names ``--only`` picks; an unknown name is an error listing the valid ones."""
    if only is None:
        return names
    picked = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in picked if n not in names]
    if unknown or not picked:
        raise SystemExit(f"{prog}: error: unknown scenario{'s' if len(unknown) > 1 else ''} "
                         f"{', '.join(map(repr, unknown)) or repr(only)} for --only; the scenarios are: {', '.join(names)}")
    return picked


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gradhealth demo --plain", description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5, help="training steps per scenario")
    ap.add_argument("--only", default=None, help="comma-separated scenario names (default: all): "
                    + ", ".join(s[0] for s in SCENARIOS))
    args = ap.parse_args(argv)
    chosen = [s for s in SCENARIOS if s[0] in choose(args.only, [s[0] for s in SCENARIOS], ap.prog)]
    print(f"gradhealth demo --plain: a PyTorch loop on synthetic data, {len(chosen)} scenario{'' if len(chosen) == 1 else 's'}"
          "\n(what gradhealth said, in short: gh.brief(report); its warnings carry the full words)\n")
    rows = []
    for i, (name, title, what, fn) in enumerate(chosen, 1):
        print(f"[{i}/{len(chosen)}] {title}: {what}")
        out = fn(args.steps)
        show(out.reports, out.error, "plain", out.losses)
        rows.append((name, verdict(out.reports, out.error)))
        print()
    table(rows)
    return 0

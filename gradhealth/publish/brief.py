"""The short form of a report, for a console a person reads at a glance: one line per problem
(what is wrong and where), then one line saying what to do, worded for the framework the run
uses ("plain", "lightning" or "transformers"). The full words stay in the warnings and ``str(report)``.
"""

from __future__ import annotations

import os

from ..base.findings import FindingKind as K
from ..base.naming import terminal_safe
from ..base.report import LONG, Report, describe_groups, describe_names, group_by_module
from ..base.status import Status

__all__ = ["brief", "FRAMEWORKS"]

FRAMEWORKS = ("plain", "lightning", "transformers")

_WHAT = {
    Status.NO_GRAD: "no gradient reaches them",
    Status.NON_FINITE_GRAD: "NaN/inf gradients",
    Status.NOT_IN_OPTIMIZER: "gradients, but in no optimizer param group",
    Status.ZERO_GRAD: "gradients exactly zero",
}

# what a finding says, in a few words (the others: their message up to its first colon)
_SAY = {
    K.STALE_GRAD: "this backward added onto gradients optimizer.step() had already used",
    K.NOT_UPDATED: "optimizer.step() left them unchanged although their gradients are not zero",
    K.EMPTY_VALID_SET: "a NaN loss with every gradient zero: a mean over an empty mask",
    K.UNEXPECTED_FROZEN: "frozen, but not in expect_frozen",
    K.UNEXPECTED_TRAINABLE: "trainable, but in expect_frozen",
    K.DEAD_EXPERT: "experts that get no tokens",
}

_SKIP = {"plain": "step only if report.grads_finite",
         "lightning": "GradHealthCallback(skip_nonfinite=True) drops such a step",
         "transformers": "GradHealthCallback(skip_nonfinite=True) drops such a step"}

# what to do, per state / finding kind and framework ("plain" is the fallback)
_DO = {
    Status.NO_GRAD: {"plain": "put them on the path to the loss, or freeze them (requires_grad_(False))"},
    Status.NOT_IN_OPTIMIZER: {
        "plain": "build the optimizer from model.parameters()",
        "lightning": "configure_optimizers: build the optimizer from self.parameters()",
        "transformers": "create_optimizer: include every trainable parameter (or use Trainer's default)"},
    Status.ZERO_GRAD: {"plain": "look for dead ReLUs, a multiplication by zero, a mask that selected nothing"},
    K.STALE_GRAD: {"plain": "call optimizer.zero_grad() before each backward",
                   "lightning": "do not override optimizer_zero_grad (use accumulate_grad_batches to accumulate)",
                   "transformers": "do not skip zero_grad in a custom training_step (use gradient_accumulation_steps)"},
    K.NOT_UPDATED: {"plain": "check the learning-rate schedule (lr stuck at 0)"},
    K.GRAD_MODE: {"plain": "call model.train() after evaluating",
                  "lightning": "do not call .eval() in training hooks (Lightning restores train() after validation)"},
    K.EMPTY_VALID_SET: {"plain": "skip batches whose mask selects nothing, or gh.masked_mean(..., empty='zero')"},
    K.UNEXPECTED_FROZEN: {"plain": "unfreeze them (requires_grad_(True)) or list them in expect_frozen"},
    K.UNEXPECTED_TRAINABLE: {"plain": "freeze them (requires_grad_(False)) or change expect_frozen"},
    K.DEAD_EXPERT: {"plain": "raise the load-balancing loss, or add router noise or capacity"},
    K.CHECKPOINT_NO_GRAD: {"plain": "checkpoint with use_reentrant=False"},
    K.VANISHING_GRAD: {"plain": "keep the gradient's scale through the layers: an init for the activation (Xavier for tanh), "
                                "normalisation layers, residual connections"},
}


def _do(key, framework: str) -> str | None:
    table = _DO.get(key)
    return None if table is None else table.get(framework, table["plain"])


def _where(source: str | None) -> str:
    """`` at file.py:56: z = ... / std`` from a tracer's ``/path/file.py:56 in forward: z = ... / std``."""
    if not source:
        return ""
    place, _, code = source.partition(" in ")
    path, _, line = place.rpartition(":")
    code = code.partition(": ")[2].strip()
    return f" at {os.path.basename(path)}:{line}" + (f": {code}" if code else "")


def _origin(f) -> tuple[str, str | None]:
    d = f.data
    if d.get("poisoned"):
        return (f"the weights of {d.get('forward_origin')!r} are already NaN/inf (an earlier step applied NaN "
                "gradients)", "poisoned")
    if d.get("from_loss"):
        return ("in the loss: the model's output was finite, the gradient reaching it NaN/inf (a 0/0, such as a mean "
                "over an empty mask)", "loss")
    if d.get("input_nonfinite"):
        return "the batch itself holds NaN/inf (the data, not the model)", "data"
    if d.get("backward_origin"):
        op = f", {d['op']}" if d.get("op") else ""
        return f"the backward of module {d['backward_origin']!r}{op}{_where(d.get('source'))}", "module"
    if d.get("forward_origin"):
        return f"the forward of module {d['forward_origin']!r}", "module"
    if d.get("op"):
        return f"outside the modules, {d['op']}{_where(d.get('source'))}", "outside"
    return _first_words(f.message), None


def _names(report, params) -> str:
    """Parameters grouped by module (``enc.* (4 params)``); other names (modules) as they are."""
    if params and all(p in report.status for p in params):
        return describe_names(report.status, params, most=LONG)
    return ", ".join(params[:3]) + (" ..." if len(params) > 3 else "")


def brief(report, framework: str = "plain") -> list[str]:
    """What is wrong in ``report``, a few short lines: ``STATE in where: what``, the loss, the
    origin of a NaN, the findings by kind, then ``do: ...`` (the most specific fix: the origin's,
    then a finding's, then a state's). Empty when healthy."""
    if not isinstance(report, Report):
        raise TypeError(f"brief: report must be a gradhealth Report (what monitor.check() returns); got "
                        f"{type(report).__name__}")
    if framework not in FRAMEWORKS:
        raise ValueError(f"brief: framework must be one of {', '.join(FRAMEWORKS)}; got {framework!r}")
    lines, todo, state_todo = [], [], []
    errors = report.errors
    by_state: dict[Status, list] = {}
    for row in group_by_module(report.status, errors):
        by_state.setdefault(row[2], []).append(row)
    for state, rows in by_state.items():
        lines.append(f"{state.value} in {describe_groups(rows, LONG)}: {_WHAT.get(state, state.value)}")
        state_todo.append(_do(state, framework))
    kinds = set()
    # the most precise origin first: one that names an operation and line, then the others
    for f in sorted(report.findings, key=lambda f: f.kind is not K.NONFINITE_ORIGIN or not f.data.get("source")):
        if f.level == "info" or f.kind in kinds:
            continue
        kinds.add(f.kind)
        if f.kind is K.NONFINITE_ORIGIN:
            text, how = _origin(f)
            lines.append(f"origin: {text}")
            todo.insert(0, {"poisoned": _SKIP[framework] + "; reload the last good checkpoint",
                            "module": "mask or clamp before the division/log/exp (gh.safe_div, gh.safe_log, gh.safe_where)",
                            "outside": "mask or clamp before the division/log/exp (gh.safe_div, gh.safe_log, gh.safe_where)",
                            "loss": "gh.masked_mean(values, mask, empty='zero'), or guard the division (gh.safe_div)",
                            "data": "find and skip the bad samples: (~torch.isfinite(x)).flatten(1).any(1)"}.get(how))
        elif f.kind is K.NON_FINITE_LOSS:
            lines.append(f"the loss is {f.data.get('value', 'NaN/inf')}")
        else:
            where = _names(report, f.params) if f.params and not f.message.startswith("the model") else ""
            say = {"underflow": "the gradient underflows to exact zeros on its way through the layers",
                   "subnormal": "the gradient vanishes below the normal range on its way through the layers"}.get(
                       f.data.get("cause")) or _SAY.get(f.kind) or _first_words(f.message)
            lines.append(f"{f.kind.value}" + (f" in {where}" if where else "") + f": {say}")
            todo.append(_do(f.kind, framework))
    todo = [t for t in todo + state_todo if t]
    if todo:
        lines.append(f"do: {todo[0]}")
    return [terminal_safe(line) for line in lines]


def _first_words(message: str, limit: int = 70) -> str:
    """The message up to its first colon, or its first ``limit`` characters at a word boundary."""
    head = message.split(": ")[0]
    if len(head) <= limit:
        return head
    return head[:limit].rsplit(" ", 1)[0] + " ..."

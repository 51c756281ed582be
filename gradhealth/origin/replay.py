"""Where a NaN came from: the NONFINITE_ORIGIN finding, and a replay of the failing step.

``replay_nonfinite`` runs a step that produced NaN/inf gradients once more with the tracer
armed, from the same random state, then puts back parameters, gradients, buffers and random
state, so training goes on exactly as without the replay. The Lightning callback uses it for the
failing batch; a plain loop can too::

    report = monitor.check()
    if not report.grads_finite:
        finding = gh.replay_nonfinite(model, lambda: loss_fn(model, batch).backward(), rng=rng_before_step)
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import torch
from torch import nn

from ..base.errors import GradHealthInternalWarning
from ..base.findings import Finding, FindingKind
from ..model.params import check_model
from ..measure import stats
from .snapshot import ModuleState, rng_state, set_rng_state
from .trace import NonFiniteTracer

__all__ = ["origin_finding", "replay_nonfinite", "producers", "shared_origin"]


def origin_finding(tracer: NonFiniteTracer, step: int, context: str, level: str | None = None, **data) -> Finding:
    """NONFINITE_ORIGIN from a resolved tracer (``context`` opens the message): an error when it
    named a module, else info."""
    named = tracer.forward_origin or tracer.backward_origin or tracer.outside
    return Finding(FindingKind.NONFINITE_ORIGIN, f"{context}{tracer.explain()}",
                   level=level or ("error" if named else "info"), step=step,
                   data={"forward_origin": tracer.forward_origin, "backward_origin": tracer.backward_origin,
                         "op": tracer.backward_op or (tracer.outside[1] if tracer.outside else None),
                         "source": tracer.op_source or (tracer.outside[2] if tracer.outside else None),
                         "poisoned": tracer.forward_origin is not None and tracer.forward_origin in tracer.nonfinite_weights,
                         "input_nonfinite": tracer.forward_origin is not None and tracer.input_nonfinite, **data})


def traced(carry, model: nn.Module, report, arm: bool) -> list[Finding]:
    """The monitor's own tracing: resolve the tracer armed after the last check with NaN/inf
    gradients (its NONFINITE_ORIGIN goes into this report), and arm one for the next step if
    ``arm``. When a traced failing step named no module, the next tracer also watches every
    operation (for that one step) so that it names the operation and its source line."""
    tracer, found = carry.tracer, []
    if tracer is not None and tracer.armed and carry.trace_wait:  # (lag=1: this report's forward ran before it)
        carry.trace_wait = False
        tracer.pause()  # (it saw the step it watches: no later forward feeds it)
    elif tracer is not None and tracer.armed:
        tracer.resolve()
        carry.tracer = None
        named = tracer.forward_origin or tracer.backward_origin or tracer.outside
        # only a step whose own gradients (or loss) are non-finite can name an origin: a NaN/inf the
        # hooks saw in a clean step never reached a gradient (masked inside an operation, a fresh
        # allocation's contents, another code path's forward)
        clean = report.grads_finite and (report.loss is None or math.isfinite(report.loss))
        if clean:
            named = None
        elif tracer.forward_origin or tracer.backward_origin:
            carry.trace_ops = False
        else:
            carry.trace_ops = True  # born outside the modules: the op watch names it at the next failing step
        if clean:
            found.append(Finding(FindingKind.NONFINITE_ORIGIN, f"the NaN/inf gradients of step {carry.trace_from} did not "
                                 f"recur at step {report.step} (traced): the cause is in that batch; run it again inside "
                                 "gh.trace_nonfinite(model), or use gh.replay_nonfinite, to name the operation and its line",
                                 level="info", step=report.step, data={"recurred": False}))
        elif not named and not tracer.watched_ops:
            found.append(Finding(FindingKind.NONFINITE_ORIGIN, f"traced at step {report.step} after NaN/inf gradients at step "
                                 f"{carry.trace_from}: no module produced the NaN/inf, so it is born outside them (the "
                                 "loss, functional code between modules); the next failing step is traced operation by "
                                 "operation to name the operation and its source line", level="info", step=report.step))
        else:
            found.append(origin_finding(tracer, report.step, f"traced at step {report.step} after NaN/inf gradients at "
                                                             f"step {carry.trace_from}: "))
    if arm:
        arm_tracer(carry, model, report.step)
    return found


def arm_tracer(carry, model: nn.Module, step: int) -> None:
    """Arm the monitor's tracer for the step after check ``step`` (unless one is armed)."""
    if carry.tracer is None:
        tracer = NonFiniteTracer(model)
        tracer._said = carry.trace_said  # (a hook's failure said once per monitor)
        carry.tracer, carry.trace_from = tracer.arm(ops=carry.trace_ops), step
        carry.trace_wait = carry.launching


def replay_nonfinite(model: nn.Module, run, *, rng=None, step: int = 0, label: str = "the failing step",
                     labels=None, **data) -> Finding | None:
    """Replay a step whose gradients were NaN/inf under the tracer; leave everything as it was.

    ``run()`` does the forward and backward of that step (its return value is ignored). ``rng``
    (from [gh.rng_state][gradhealth.rng_state], taken before the failing step) replays the same
    dropout masks and random draws. Returns the NONFINITE_ORIGIN finding, which also says whether
    the NaN reproduced; None (with a warning) if the replay itself failed.

    Under gradient accumulation pass the window's micro-batches: ``run`` a list of callables (one
    forward and backward each, in order), ``rng`` the list of their random states, ``labels``
    their names (``"batch 9"``; default ``"micro-batch k"``). Each is replayed alone, from no
    gradient, until one makes NaN/inf: the finding names it (``data["micro_batch"]``, its index
    in the list). The caller holds the window's inputs until the step: that is the memory this
    costs (references to the batches, no copies).
    """
    check_model(model)
    window = isinstance(run, (list, tuple))
    runs = list(run) if window else [run]
    if not runs or not all(callable(r) for r in runs):
        raise TypeError("replay_nonfinite: run must be a callable that does the step's forward and backward, or a "
                        f"non-empty list of them (one per micro-batch); got {type(run).__name__}")
    rngs = list(rng) if window and rng is not None else [rng] * len(runs)
    names = list(labels) if labels is not None else [f"micro-batch {k + 1}" for k in range(len(runs))] if window else [label]
    if len(rngs) != len(runs) or len(names) != len(runs):
        raise ValueError(f"replay_nonfinite: {len(runs)} runs, {len(rngs)} rng states and {len(names)} labels; give "
                         "one of each per micro-batch")
    tracer, k = None, 0
    for k, (one, state) in enumerate(zip(runs, rngs)):
        try:
            tracer, reproduced = _replay_one(model, one, state)
        except Exception as exc:
            warnings.warn(f"gradhealth: the replay of {names[k] if window else label} failed ({type(exc).__name__}: "
                          f"{exc}); training continues unchanged", GradHealthInternalWarning, stacklevel=2)
            return None
        if reproduced:
            break
    if not window:
        where = f"{label} at step {step}"
    elif reproduced:
        where = (f"{names[k] + ', ' if labels is not None else ''}micro-batch {k + 1} of the {len(runs)} accumulated "
                 f"into step {step} (each replayed alone)")
        data = {**data, "micro_batch": k}
    else:
        where = f"the {len(runs)} micro-batches accumulated into step {step} ({', '.join(names)}), each replayed alone"
    if reproduced:
        verdict = ("it reproduced on a replay of the same batch with the same random state: the cause is deterministic, "
                   "in this batch's data or in the model")
    elif window:
        verdict = ("none made NaN/inf again with the same random state: a numerical or hardware transient, or an "
                   "overflow of their accumulated sum")
    else:
        verdict = ("it did NOT reproduce on a replay of the same batch with the same random state: a numerical or "
                   "hardware transient (non-deterministic kernels, a flaky device)")
    return origin_finding(tracer, step, f"{where}: {verdict}. ", level="error", reproduced=reproduced, **data)


def _replay_one(model: nn.Module, run: Callable[[], object], rng: dict | None) -> tuple[NonFiniteTracer, bool]:
    """One forward and backward under the full tracer, from no gradient; everything put back."""
    params = list(model.parameters())
    saved = ModuleState(model)
    now = rng_state()
    tracer = NonFiniteTracer(model)
    try:
        if rng is not None:
            set_rng_state(rng)
        for p in params:
            p.grad = None
        tracer.arm(ops=True)
        with torch.enable_grad(), tracer.alone():  # (the monitor's tracer, armed for the next step, sees nothing)
            run()
        tracer.resolve()
        norms, _, _ = stats.grad_norms([p.grad for p in params if p.grad is not None])
        return tracer, any(not math.isfinite(v) for v in norms)
    finally:
        tracer.disarm()
        saved.restore()
        set_rng_state(now)


def producers(report, rank: int) -> bool:
    """Should this rank replay the failing step? Under torch.distributed, only the ranks DDP's hook
    saw produce the NaN/inf (every rank when none was seen: no hook, or it came later)."""
    ranks = next((f.data.get("ranks") for f in report.findings if f.kind == FindingKind.NONFINITE_RANK), None)
    return not ranks or rank in ranks


def shared_origin(finding: Finding | None, rank: int, world: int) -> Finding | None:
    """One origin verdict for every rank: each rank's replay finding (or None) is gathered once
    (called by every rank, at a check whose reduced gradients are non-finite), and every rank
    keeps the same one, from the lowest rank whose replay reproduced the NaN (else the lowest that
    replayed), said as that rank's: ``on rank 1: batch 2 at step 2: it reproduced ...``."""
    import torch.distributed as tdist

    mine = None if finding is None else (str(finding.kind), finding.message, finding.level, finding.step, finding.data)
    got: list = [None] * world
    tdist.all_gather_object(got, mine)
    found = [(r, g) for r, g in enumerate(got) if g is not None]
    if not found:
        return None
    r, (kind, message, level, step, data) = next(((r, g) for r, g in found if g[4].get("reproduced")), found[0])
    return Finding(FindingKind(kind), f"on rank {r}: {message}", level=level, step=step, data={**data, "rank": r})

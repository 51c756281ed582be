"""The judges: pure functions from what a check observed to the findings it makes.

Each takes plain values (statuses, counts, flags; no model, no tensors) and returns a list of
:class:`Finding` (empty when all is well), so each can be tested from a table of cases. The state
that spans checks (which optimizer step is pending, how many AMP skips in a row) is kept by
:class:`gradhealth.check.carry.Carry`, which hands the judges what they need.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Collection, Mapping
from itertools import compress, repeat

from ..base.findings import Finding, FindingKind
from ..base.naming import on_ranks, agree, matches
from ..base.report import describe_names
from ..base.status import Status
from ..measure import stats
from ..measure.observe import ForwardRecord
from .guards import frozen_norms, norm_eval, norm_idioms  # noqa: F401 (judges of the eval-mode idioms)

__all__ = ["loss_cause", "empty_valid_set", "eval_mode", "stale_grad", "expect_frozen", "not_updated",
           "frozen_but_changed", "skipped_step", "optimizer_skip", "amp_skip", "amp_floor", "transient_grads", "frozen_norms",
           "checkpoint_no_grad", "norm_eval", "norm_idioms", "nan_from_loss", "idle_experts", "nonfinite_experts", "meta_params"]

K = FindingKind
_MASKED_MEAN = "gh.masked_mean(..., empty='zero')"


def _ordered(status: Mapping[str, Status], chosen: Collection[str]) -> tuple[str, ...]:
    return tuple(filter((chosen if isinstance(chosen, (set, frozenset, dict)) else set(chosen)).__contains__, status))


def loss_cause(cause: str | None, step: int, where: str = "") -> list[Finding]:
    """GRAD_MODE when the loss cannot produce gradients (``cause`` from ``guards.diagnose_loss``)."""
    if cause is None:
        return []
    return [Finding(K.GRAD_MODE, f"loss cannot produce gradients{where}: {cause}", step=step)]


def empty_valid_set(valid_counts: Mapping[str, int], loss: float | None, norms: Collection[float], step: int,
                    ranks: list[int] | None = None) -> list[Finding]:
    """EMPTY_VALID_SET from a tracked count of 0, or from its signature (a non-finite loss with
    every gradient exactly zero); NON_FINITE_LOSS for any other non-finite loss (``ranks``: under
    torch.distributed, the ranks whose own loss was non-finite)."""
    empty = [n for n, c in valid_counts.items() if c == 0]
    if empty and norms and all(v == 0.0 for v in norms) and (loss is None or math.isfinite(loss)):
        # made harmless (a guarded mean, TRL's clamped token count): no NaN, yet the step is not a no-op
        return [Finding(K.EMPTY_VALID_SET, f"the valid mask {', '.join(repr(n) for n in empty)} selected nothing at step "
                        f"{step}: the loss is {loss if loss is not None else 'guarded'} and every gradient is exactly zero, "
                        "but optimizer.step() still moves the weights (weight decay, and the momentum of earlier steps in "
                        "Adam's moments); skip such batches in the data (or the step: no optimizer.step() when the count "
                        "is 0)", level="warning", step=step, data={"counts": dict(valid_counts)})]
    if empty:
        return [Finding(K.EMPTY_VALID_SET, f"the valid mask {', '.join(repr(n) for n in empty)} selected nothing at step "
                        f"{step}: a mean over it is NaN (or 0 with a guarded mean) and the step still moves the weights "
                        f"through weight decay and momentum; skip such batches or use {_MASKED_MEAN}", step=step,
                        data={"counts": dict(valid_counts)})]
    if loss is None or math.isfinite(loss):
        return []
    if norms and all(v == 0.0 for v in norms):
        return [Finding(K.EMPTY_VALID_SET, f"the loss is {loss} while every gradient is exactly zero at step {step}: the "
                        "signature of a mean over an empty selection (a mask that selected nothing, a cross-entropy "
                        "whose targets are all ignore_index). The step still moves the weights through weight decay; "
                        f"skip such batches or use {_MASKED_MEAN}, and call monitor.track_valid(mask) to see the counts",
                        step=step)]
    where = f" on {on_ranks(ranks)}" if ranks else ""
    return [Finding(K.NON_FINITE_LOSS, f"the loss is {loss}{where}: check the inputs and targets of {'its' if ranks else 'this'} "
                    "batch, a log or division inside the loss, or a mean over an empty mask (gh.masked_mean makes the "
                    "empty case explicit)", step=step, data={"value": loss, "ranks": ranks})]


def eval_mode(record: ForwardRecord | None, step: int, where: str = "") -> list[Finding]:
    """GRAD_MODE when a training forward (one a backward went through) ran in eval() mode: an error
    where a module that ran computes differently for it (``record.readers``: dropout with p > 0, a
    norm on its running statistics, a forward that reads ``self.training``), a warning that says so
    where none did (eval() changed nothing; the model may not be the user's to change)."""
    if record is None:
        return []
    if not record.training:
        what = "the model was in eval() mode during the training forward"
    else:
        shown = ", ".join(record.eval_modules[:5]) + (" ..." if len(record.eval_modules) > 5 else "")
        one = len(record.eval_modules) == 1
        what = f"{'submodule' if one else 'submodules'} {shown} {'was' if one else 'were'} in eval() mode during the training forward"
    readers = record.readers
    if readers == ():  # observed: nothing that ran reads the mode
        return [Finding(K.GRAD_MODE, f"{what}{where}. Call model.train() after validation, before training resumes, "
                        "or the first dropout or batch norm added to the model will train in eval() mode",
                        step=step, params=record.eval_modules, data={"readers": ()},
                        against="nothing that ran in this forward reads `training` (no dropout with p > 0, no batch "
                                "norm with running statistics, no forward that branches on self.training): it computed "
                                "what train() mode computes")]
    shown = f"{', '.join(readers[:5])}{' ...' if len(readers) > 5 else ''} ran in eval() mode, so " if readers else ""
    return [Finding(K.GRAD_MODE, f"{what}{where}: {shown}dropout is off and batch norm uses (and no longer updates) its "
                    "running statistics. Call model.train() after validation, before training resumes", step=step,
                    params=record.eval_modules, data={"readers": readers})]


def checkpoint_no_grad(no_grad: Collection[str], checkpointing: bool, status: Mapping[str, Status],
                       step: int, reentrant: bool = False) -> list[Finding]:
    """CHECKPOINT_NO_GRAD (warning): persistent NO_GRAD in a model that checkpoints reentrantly
    (``checkpointing``: set to, e.g. ``gradient_checkpointing_kwargs={"use_reentrant": True}``;
    ``reentrant``: seen in its forwards), which gives no gradient to a segment whose inputs do not
    require grad (typically after frozen embeddings). Non-reentrant checkpointing cannot: not blamed."""
    if not no_grad or not (checkpointing or reentrant):
        return []
    how = ("runs torch.utils.checkpoint(..., use_reentrant=True) in its forward" if reentrant and not checkpointing
           else "checkpoints its layers with use_reentrant=True")
    return [Finding(K.CHECKPOINT_NO_GRAD, f"{describe_names(status, no_grad)} {agree(no_grad, 'get', 'gets')} no gradient and the model {how}: "
                    "reentrant torch.utils.checkpoint (Hugging Face's "
                    "gradient_checkpointing_enable() default on older versions) gives no gradient to a checkpointed "
                    "segment whose inputs do not require grad, e.g. after frozen embeddings. Call "
                    "model.enable_input_require_grads(), or checkpoint with use_reentrant=False "
                    "(gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False}))",
                    params=_ordered(status, no_grad), level="warning", step=step)]


def stale_grad(status: Mapping[str, Status], stale: Collection[str], step: int, where: str = "") -> list[Finding]:
    """STALE_GRAD for the parameters whose gradients the backward added onto after a step."""
    chosen = set(stale) & set(status)
    if not chosen:
        return []
    return [Finding(K.STALE_GRAD, f"{describe_names(status, chosen)}{where}: this backward added onto gradients that "
                    "optimizer.step() had already used (no zero_grad in between), so every step applies the sum of "
                    "all past gradients. Call optimizer.zero_grad() before each backward (or after each step)",
                    params=_ordered(status, chosen), step=step)]


def expect_frozen(status: Mapping[str, Status], patterns: tuple[str, ...] | None, step: int, spelled=None) -> list[Finding]:
    """UNEXPECTED_FROZEN / UNEXPECTED_TRAINABLE against the ``expect_frozen`` name patterns (``spelled``: :func:`gradhealth.model.wrappers.respell`)."""
    if patterns is None:
        return []
    out, match = [], spelled if spelled is not None else patterns
    wrong_frozen = tuple(n for n, s in status.items() if s is Status.FROZEN and not matches(n, match))
    wrong_trainable = tuple(n for n, s in status.items() if s is not Status.FROZEN and matches(n, match))
    if wrong_frozen:
        out.append(Finding(K.UNEXPECTED_FROZEN, f"{describe_names(status, wrong_frozen)} {agree(wrong_frozen, 'are', 'is')} frozen but not matched by "
                           f"expect_frozen={list(patterns)}: unfreeze {agree(wrong_frozen, 'them', 'it')} (requires_grad_(True)) or add "
                           f"{agree(wrong_frozen, 'them', 'it')} to expect_frozen", params=wrong_frozen, step=step))
    if wrong_trainable:
        out.append(Finding(K.UNEXPECTED_TRAINABLE, f"{describe_names(status, wrong_trainable)} {agree(wrong_trainable, 'match', 'matches')} "
                           f"expect_frozen={list(patterns)} but {agree(wrong_trainable, 'are', 'is')} trainable: freeze "
                           f"{agree(wrong_trainable, 'them', 'it')} (requires_grad_(False)) or "
                           "change expect_frozen", params=wrong_trainable, step=step))
    return out


def not_updated(status: Mapping[str, Status], unchanged: Mapping[str, str], step: int,
                still: int = 1, patience: int = 1, gone: bool = False) -> list[Finding]:
    """NOT_UPDATED: OK gradients, in the optimizer, yet its step left these parameters unchanged.

    ``unchanged`` maps each name to its learning rate's word (:mod:`gradhealth.measure.lrstory`): "new" (0 at this
    step: a warm-up from 0, or a decay's last step; info), "again" (fell to 0 and stayed: an error),
    "stuck" (0 since the first step while nothing else trains: an error), "held" (0 since the first
    step, no schedule, while others train: a hold, info once), "quiet" (a hold already said), ""
    (lr > 0). With lr > 0, an error only when the step changed none of the parameters it was
    seen to judge for ``patience`` steps in a row (``still``): an update rule that does nothing, or
    updates below the precision of the weights everywhere. Some parameters left unchanged while
    others move is info: their updates fell below the precision of the weights (a converged
    parameter, vanishing gradients).
    """
    out, by_word = [], {w: set() for w in ("new", "again", "stuck", "held", "quiet", "")}
    for w in set(unchanged.values()):  # (a word at a time, picked in C: usually one)
        by_word[w] = set(compress(unchanged, map(operator.eq, unchanged.values(), repeat(w))))
    scheduled, stuck, never, held, rest = (by_word[w] for w in ("new", "again", "stuck", "held", ""))
    if rest and gone:  # the check's gradients were gone (set to None) when the step began
        out.append(Finding(K.NOT_UPDATED, f"{describe_names(status, rest)} had {agree(rest, 'finite, non-zero gradients', 'a finite, non-zero gradient')} "
                           f"at step {step}, but {agree(rest, 'they were', 'it was')} gone (set to None) when optimizer.step() "
                           f"ran, so the step left {agree(rest, 'them', 'it')} unchanged: optimizer.zero_grad() is called between "
                           "backward() and step(). Call zero_grad() before the forward (or right after step())",
                           params=_ordered(status, rest), step=step, data={"cause": "zero_grad_before_step"}))
        rest = set()
    if rest and still < patience:
        out.append(Finding(K.NOT_UPDATED, f"{describe_names(status, rest)} {agree(rest, 'were', 'was')} left exactly unchanged by "
                           f"optimizer.step() at step {step} although {agree(rest, 'their gradients are', 'its gradient is')} "
                           f"not zero: {agree(rest, 'their updates', 'its update')} fell "
                           "below the precision of the weights (a converged parameter, vanishing gradients); an error "
                           f"only if a step changes nothing at all {patience} times in a row",
                           params=_ordered(status, rest), level="info", step=step))
        rest = set()
    if scheduled:
        out.append(Finding(K.NOT_UPDATED, f"{describe_names(status, scheduled)} {agree(scheduled, 'were', 'was')} not changed by optimizer.step() "
                           f"at step {step} because {agree(scheduled, 'their', 'its')} learning rate was 0 at that step: expected when a warmup "
                           "schedule starts at 0 (an error if it stays 0)", params=_ordered(status, scheduled),
                           level="info", step=step, data={"lr": 0.0}))
    if held:
        out.append(Finding(K.NOT_UPDATED, f"{describe_names(status, held)} {agree(held, 'are', 'is')} held at lr 0: not trained, "
                           f"on purpose? {agree(held, 'Their', 'Its')} param group has had a learning rate of 0 since its first "
                           "step, with no schedule that raises it, while the others train (a layer held fixed, as with "
                           "skorch's param_groups=[('embedding.*', {'lr': 0.0})]). Said once; if it should train, give "
                           f"{agree(held, 'their', 'its')} group a learning rate (or freeze it with requires_grad_(False) "
                           "and leave it out of the optimizer)", params=_ordered(status, held), level="info", step=step,
                           data={"lr": 0.0, "held": True}))
    if never:
        out.append(Finding(K.NOT_UPDATED, f"{describe_names(status, never)} had {agree(never, 'finite, non-zero gradients', 'a finite, non-zero gradient')} "
                           f"at step {step} yet optimizer.step() left {agree(never, 'them', 'it')} unchanged: "
                           f"{agree(never, 'their', 'its')} learning rate has been 0 since the first step, past any warm-up, "
                           "and nothing else trains. Set the optimizer's lr, or check the scheduler (a warm-up whose "
                           "peak is 0, a schedule that never rises)", params=_ordered(status, never), step=step,
                           data={"lr": 0.0}))
    if stuck:
        out.append(Finding(K.NOT_UPDATED, f"{describe_names(status, stuck)} had {agree(stuck, 'finite, non-zero gradients', 'a finite, non-zero gradient')} "
                           f"at step {step} "
                           f"yet optimizer.step() left {agree(stuck, 'them', 'it')} unchanged: {agree(stuck, 'their', 'its')} "
                           "learning rate fell to 0 and has been 0 for two steps in a row; check the scheduler (a decay "
                           f"that reached 0 before the run ends, a schedule that writes 0) and the lr of {agree(stuck, 'their', 'its')} param group", params=_ordered(status, stuck), step=step, data={"lr": 0.0}))
    if rest:
        out.append(Finding(K.NOT_UPDATED, f"{describe_names(status, rest)} had {agree(rest, 'finite, non-zero gradients', 'a finite, non-zero gradient')} "
                           f"at step {step} "
                           f"yet optimizer.step() has changed no parameter for {still} steps in a row although the "
                           "learning rate is not 0: an update rule that does nothing, or updates smaller than the "
                           "precision of the weights (bf16/fp16 weights with a small learning rate: keep fp32 master "
                           "weights)", params=_ordered(status, rest), step=step, data={"steps": still}))
    return out


def frozen_but_changed(status: Mapping[str, Status], moved: Collection[str], step: int) -> list[Finding]:
    """FROZEN_BUT_CHANGED: frozen parameters left in the optimizer that its step moved."""
    if not moved:
        return []
    return [Finding(K.FROZEN_BUT_CHANGED, f"{describe_names(status, moved)} {agree(moved, 'are', 'is')} frozen but optimizer.step() moved "
                    f"{agree(moved, 'them', 'it')} "
                    f"at step {step}: weight decay or momentum still acts on frozen parameters left in the optimizer; "
                    "build the optimizer from the trainable parameters only ([p for p in model.parameters() if "
                    "p.requires_grad])", params=_ordered(status, moved), step=step)]


def skipped_step(status: Mapping[str, Status], in_optimizer: Mapping[str, bool] | None, step: int) -> list[Finding]:
    """NOT_UPDATED for a step that never ran although the gradients of check ``step`` were
    finite and then thrown away (zeroed or set to None): a skipped ``optimizer.step()``."""
    if in_optimizer is None or any(s is Status.NON_FINITE_GRAD for s in status.values()):
        return []  # skipping a step with NaN/inf gradients is the right reaction
    chosen = {n for n, s in status.items() if s is Status.OK and in_optimizer.get(n)}
    if not chosen:
        return []
    return [Finding(K.NOT_UPDATED, f"{describe_names(status, chosen)} had {agree(chosen, 'gradients', 'a gradient')} at step {step} but "
                    f"no optimizer.step() ran before {agree(chosen, 'they were', 'it was')} zeroed: the step was skipped (a condition around "
                    "optimizer.step(), or an exception swallowed)", params=_ordered(status, chosen), step=step)]


def optimizer_skip(info: dict, status: Mapping[str, Status], step: int, alarm_after: int) -> list[Finding]:
    """OPTIMIZER_SKIPPED: a step the optimizer skipped by itself (a mixed-precision or ZeRO wrapper
    whose overflow check found inf/NaN: :mod:`gradhealth.model.masters`) with no dynamic loss scale to lower (that
    one is a grad scaler's skip, AMP_SKIPPED): nothing changes while the gradients stay non-finite.
    An error once every step so far, or ``alarm_after`` in a row, was skipped; else a warning."""
    name, steps, skips, row = info["optimizer"], info["steps"], info["skips"], info["in_a_row"]
    bad = _ordered(status, {n for n, s in status.items() if s is Status.NON_FINITE_GRAD})
    counts = f"{skips} of its {steps} steps skipped so far" + (", so the weights have never changed" if skips == steps else "")
    cause = (f"inf/NaN in the gradients of {describe_names(status, set(bad))}" if bad
             else "its overflow check found inf/NaN in the gradients")
    alarm = skips == steps or row >= alarm_after
    return [Finding(K.OPTIMIZER_SKIPPED, f"{name} skipped the optimizer step after step {step}: {cause}, "
                    f"and with no dynamic loss scale to lower it skips every step while they stay non-finite ({counts}). "
                    "Find where they come from (gh.trace_nonfinite around forward and backward), or mask before the "
                    "operation that produces them (gh.safe_div, gh.masked_mean)", step=step,
                    level="error" if alarm else "warning", params=bad, data=info)]


def amp_skip(scale: float, consecutive: int, alarm_after: int, step: int, settling: bool = False) -> list[Finding]:
    """AMP_SKIPPED: info while the scale settles (every skip before the first step that ran, from
    any ``init_scale``; the scale floor still catches a model that overflows at every scale) and
    now and then after; an error after ``alarm_after`` skips in a row once a step has run."""
    alarm = consecutive >= alarm_after and not settling
    if settling:
        tail = (f"; the scale is still settling from its initial value ({consecutive} halvings so far, normal for "
                "a large init_scale)")
    elif alarm:
        tail = (f", {consecutive} steps in a row: the model itself produces non-finite gradients, not an fp16 overflow "
                "the scaler can absorb (trace it with gh.trace_nonfinite)")
    else:
        tail = "; expected now and then while the scale settles"
    return [Finding(K.AMP_SKIPPED, f"the grad scaler skips optimizer.step() at step {step}: inf/NaN in the scaled "
                    f"gradients at scale {scale:g}{tail}", step=step, level="error" if alarm else "info",
                    data={"scale": scale, "consecutive": consecutive})]


def amp_floor(scale: float, floor: float, step: int) -> list[Finding]:
    """AMP_SKIPPED (error) when the scaler's scale fell below ``floor``."""
    if scale >= floor:
        return []
    return [Finding(K.AMP_SKIPPED, f"the grad scaler's scale collapsed to {scale:g} (floor {floor:g}): nearly every step "
                    "overflows; the model produces non-finite gradients at any scale", step=step, data={"scale": scale})]


def transient_grads(status: Mapping[str, Status], verdict, patience: int, partners: Collection[str],
                    step: int) -> tuple[frozenset[str], list[Finding]]:
    """Which NO_GRAD / ZERO_GRAD units the persistence rule tolerates now (``verdict`` from
    :meth:`gradhealth.judge.patience.Persistence.judge`), with an info finding naming them."""
    gaps = verdict.gaps
    tolerated = frozenset(gaps) - verdict.errors
    out = []
    partnered = tolerated & set(partners)
    if partnered:
        out.append(Finding(K.TRANSIENT_GRAD, f"{describe_names(status, partnered)} got {agree(partnered, 'exactly zero gradients', 'an exactly zero gradient')} "
                           f"at step {step} "
                           f"because a partner weight beside {agree(partnered, 'them', 'it')} is exactly zero (a zero-initialised LoRA B / adapter "
                           "up-projection or residual branch): expected at the first step; they train once the partner "
                           "has moved", params=_ordered(status, partnered), level="info", step=step))
    rest = tolerated - partnered
    fresh = {n for n in rest if n not in verdict.history}
    skipping = rest - fresh
    if fresh:
        longest = max(gaps[n] for n in fresh)
        why = (f"{longest} of the {patience} consecutive checks tolerated before it counts as an error" if longest < patience
               else f"{longest} checks; tolerated longer because its siblings (experts, blocks of its stack) go without now and then")
        out.append(Finding(K.TRANSIENT_GRAD, f"{describe_names(status, fresh)} got no usable gradient at step {step} "
                           f"({why}): normal now and then for mixture-of-experts experts that got no tokens in this "
                           "batch, layers skipped by LayerDrop / stochastic depth, conditionally executed branches or "
                           "heads used every other step", params=_ordered(status, fresh), level="info", step=step,
                           data={"streak": {n: gaps[n] for n in fresh}}))
    if skipping:
        used = sum(verdict.history[n][0] for n in skipping)
        seen = used + sum(verdict.history[n][1] for n in skipping)
        out.append(Finding(K.TRANSIENT_GRAD, f"{describe_names(status, skipping)} got no usable gradient at step {step} "
                           f"(gaps of up to {max(gaps[n] for n in skipping)} checks; {agree(skipping, 'they', 'it')} had one at "
                           f"{used} of {seen} earlier checks): intermittent use, as with LayerDrop / stochastic depth or "
                           "an expert that got no tokens in this batch; an error once a gap is improbable at "
                           f"{agree(skipping, 'their', 'its')} own past rate", params=_ordered(status, skipping), level="info",
                           step=step, data={"streak": {n: gaps[n] for n in skipping},
                                            "history": {n: verdict.history[n] for n in skipping}}))
    return tolerated, out


def _experts(units) -> str:
    units = sorted(units)
    return ", ".join(units[:6]) + (f" and {len(units) - 6} more" if len(units) > 6 else "")


_ROUTER_ADVICE = ("Add or raise the load-balancing auxiliary loss (Hugging Face: output_router_logits=True with "
                  "router_aux_loss_coef), add router noise (router_jitter_noise) or capacity, or check the routing code")


def idle_experts(gaps: Mapping[str, int], dead: Collection[str], history: Mapping[str, tuple[int, int]], step: int,
                 tokens: Mapping[str, int] | None = None) -> list[Finding]:
    """DEAD_EXPERT (error) for stacked experts whose idle gap the persistence rule counts as
    persistent; TRANSIENT_GRAD (info) for the idle ones it tolerates (no tokens in this batch)."""
    out = []
    if dead:
        gap = min(gaps[u] for u in dead)
        past = [history[u] for u in dead if u in history]
        how = (f", after having one at {past[0][0]} of {sum(past[0])} earlier checks" if past else ", never since the first check")
        seen = ""
        if tokens:
            zero = [u for u in dead if tokens.get(u) == 0]
            seen = f"; the router logits agree: 0 tokens routed to {_experts(zero)} at this check" if zero else ""
        out.append(Finding(K.DEAD_EXPERT, f"expert{'s' if len(dead) != 1 else ''} {_experts(dead)} got an exactly zero gradient "
                           f"(no tokens) for {gap} checks in a row{how}{seen}: a dead expert, the router collapsed onto "
                           f"the others. {_ROUTER_ADVICE}",
                           params=tuple(sorted(dead)), step=step, data={"gaps": {u: gaps[u] for u in dead}}))
    idle = set(gaps) - set(dead)
    if idle:
        out.append(Finding(K.TRANSIENT_GRAD, f"expert{'s' if len(idle) != 1 else ''} {_experts(idle)} got no tokens at step {step} "
                           f"(gaps of up to {max(gaps[u] for u in idle)} checks): normal now and then for a router; an "
                           "error once a gap is improbable at the expert's own rate", params=tuple(sorted(idle)),
                           level="info", step=step, data={"streak": {u: gaps[u] for u in idle}}))
    return out


def nonfinite_experts(states: Mapping[str, Status], step: int) -> list[Finding]:
    """NONFINITE_EXPERT: which experts of a stacked tensor hold the NaN/inf (the tensor itself is
    NON_FINITE_GRAD)."""
    bad = [u for u, s in states.items() if s is Status.NON_FINITE_GRAD]
    if not bad:
        return []
    return [Finding(K.NONFINITE_EXPERT, f"the NaN/inf gradients of the stacked experts are in expert"
                    f"{'s' if len(bad) != 1 else ''} {_experts(bad)} (the other experts' slices are finite): look at the "
                    "tokens routed to it and at its weights", params=tuple(sorted(bad)), step=step)]


def meta_params(names: Collection[str], step: int) -> list[Finding]:
    """META_PARAM: parameters on the meta device (no data) that cannot be judged or trained."""
    if not names:
        return []
    return [Finding(K.META_PARAM, f"{', '.join(names)} {agree(names, 'are', 'is')} on the meta device and hold"
                    f"{agree(names, '', 's')} no data: {agree(names, 'they', 'it')} cannot be judged or trained. Materialise "
                    f"{agree(names, 'them', 'it')} (module.to_empty(device=...) and initialise the weights, or "
                    "load_state_dict(..., assign=True))", params=tuple(names), step=step)]


def nan_from_loss(seen, step: int, origin_found: bool) -> list[Finding]:
    """NONFINITE_ORIGIN when the model's output was finite but the gradient reaching it was not:
    the NaN/inf was made between the output and the loss (one transfer, only at a check with NaN/inf
    gradients). ``seen`` is the forward watch's (output finite, gradient finite)."""
    if seen is None or origin_found:
        return []
    out_max, grad_max = stats.fetch(list(seen))  # (max |x|: finite exactly when every element is)
    if not math.isfinite(out_max) or math.isfinite(grad_max):
        return []
    return [Finding(K.NONFINITE_ORIGIN, "the model's output was finite but the gradient reaching it was already NaN/inf: "
                    "the NaN was made in the loss, between the model's output and loss.backward(), not in the model "
                    "(a 0/0 such as a mean over an empty mask, a division by a zero count or weight, log(0)); compute "
                    "that mean with gh.masked_mean(values, mask, empty='zero') or guard the division (gh.safe_div)",
                    step=step, data={"from_loss": True})]

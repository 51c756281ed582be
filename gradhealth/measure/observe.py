"""Gather and read back: a check's device numbers, in ONE transfer, as an ``Observation``.

Gathers the judged gradients, packs their exact norms together with this check's extras (the
loss, valid counts, the previous optimizer step's update norms, the grad scaler's scale) by a
named :class:`Layout`, reads them with one transfer (``stats.grad_norms``), and unscales the
norms under a grad scaler. What the rank saw that is not a number (a loss that cannot train, an
eval-mode forward, stale gradients) rides along as plain Python.
"""

from __future__ import annotations

import math
import operator
from collections import deque
from dataclasses import dataclass, field
from itertools import compress, repeat

import torch
from torch import Tensor

from ..base import distributed as dist
from ..base.quick import quick
from ..model import experts
from ..model.gradients import grad_of, grads_of, is_fragment
from ..model.params import ParamView, Selection
from . import expert_norms, stats
from .layout import Layout
from .steps import StepStats
from .window import Seen, Window

__all__ = ["ForwardRecord", "Observation", "Pending", "observe", "unscaled_params"]


@dataclass(frozen=True)
class ForwardRecord:
    """Python state seen when the model's forward last ran (recorded by the monitor's pre-hook)."""

    grad_enabled: bool
    inference: bool
    training: bool
    #: submodules with dropout or batch norm that were in eval() mode while the model ran
    eval_modules: tuple[str, ...] = ()
    #: the modules in eval() mode that ran in that forward and compute differently for it
    #: (:func:`gradhealth.model.modes.mode_matters`); None: not observed (another rank's record)
    readers: tuple[str, ...] | None = None


@dataclass
class Observation:
    """What one rank saw at a check, on the host. After the cross-rank reduction, the numbers
    (norms, loss, valid counts, update values) are every rank's."""

    idx: list[int]  # entry indices judged
    norm_of: list[float | None]  # per entry: exact gradient norm, None without a gradient
    loss: float | None = None
    valid: dict[str, int] = field(default_factory=dict)
    updates: list[StepStats] = field(default_factory=list)  # measured optimizer steps, values filled
    scale: float | None = None
    loss_cause: str | None = None
    eval_record: ForwardRecord | None = None
    stale: set[int] = field(default_factory=set)
    sharded: set[int] = field(default_factory=set)  # entries whose gradient is a shard (FSDP)
    #: sharded entries whose elements are each held by several ranks (HSDP's replicas, FSDP2 + TP's
    #: TP-replicated parameters): entry -> how many; 1 when absent
    holders: dict[int, int] = field(default_factory=dict)
    #: those entries' (this rank's shard, how many shards): the holders of one shard are replicas
    pieces: dict[int, tuple[int, int]] = field(default_factory=dict)
    loss_ranks: list[int] | None = None  # (after the reduction) the ranks whose loss was non-finite
    #: sharded stacked experts: entry -> per expert, this rank's squared norm over 1/holders (summed
    #: across the ranks into ``slices``)
    ex_parts: dict[int, list[float]] = field(default_factory=dict)
    slices: dict[int, list[float]] = field(default_factory=dict)  # stacked experts: entry -> slice norms
    router: list[list[float]] | None = None  # tokens routed to each expert, per MoE layer
    #: the accumulation window this check ends, as its deferred checks saw it (:mod:`.window`); None
    #: when no check was deferred before it
    window: Seen | None = None
    local: bool = False  # the gradients are known to be this rank's own (a check made inside DDP's no_sync())

    with_grad: list[int] = field(default_factory=list)  # judged entries with a gradient, in order
    norms: list[float] = field(default_factory=list)  # their norms, aligned with ``with_grad``

    def set_norms(self, norm_of: list[float | None]) -> None:
        self.norm_of = norm_of
        self.with_grad = [i for i in self.idx if norm_of[i] is not None]
        self.norms = [norm_of[i] for i in self.with_grad]


_OBSERVATION = quick(Observation)  # (as Observation(...) makes it: :mod:`gradhealth.base.quick`)


def unscaled_params(scaler, optimizers, consumed=()) -> set[int]:
    """ids of the parameters whose gradients the scaler has already unscaled: by ``unscale_`` in
    this step, or for a step that already ran on them (``consumed``: optimizers whose gradients
    are those their last step used; ``scaler.step`` unscales first, and ``scaler.update`` then
    forgets it: a one-call step such as timm's ``NativeScaler`` checked after the call)."""
    from torch.amp.grad_scaler import OptState

    out: set[int] = set()
    states = scaler._per_optimizer_states
    for opt in optimizers:
        st = states.get(id(opt)) if hasattr(states, "get") else None
        if (st is not None and st.get("stage") in (OptState.UNSCALED, OptState.STEPPED)) or opt in consumed:
            out |= {id(p) for g in opt.param_groups for p in g["params"]}
    return out


def observe(view: ParamView, sel: Selection, loss, valid: dict[str, Tensor], updates: list[StepStats], scaler,
            plan, distributed: bool = False, all_sharded: bool = False, router=None,
            consumed=(), captured=None, deferred: bool = False, window: Window | None = None) -> tuple[Observation, object]:
    """Norms of the selection's gradients and the extras, read back in one transfer (``consumed``:
    :func:`unscaled_params`; ``captured``: norms of gradients a step inside backward freed, by
    parameter id, judged as this backward's; ``window``: the deferred checks' losses and counts of
    the accumulation window this check ends, read in the same transfer).

    Returns the observation and the grouping plan to pass back next time; ``deferred``: a
    :class:`Pending` in its place, whose numbers are read later.
    """
    params = view.params
    everything = len(sel.idx) == len(params)  # (idx: sorted, distinct)
    grads: list[Tensor] = grads_of(params if everything else [params[i] for i in sel.idx])  # (.grad, or main_grad)
    with_grad: list[int] = list(sel.idx)
    if any(map(operator.is_, grads, repeat(None))):
        there = list(map(operator.is_not, grads, repeat(None)))
        with_grad, grads = list(compress(sel.idx, there)), list(compress(grads, there))
    sharded: set[int] = set()
    holders: dict[int, int] = {}
    pieces: dict[int, tuple[int, int]] = {}
    cut: dict[int, tuple[int, int]] = {}  # sharded stacked experts: (this rank's shard, shards)
    ex_parts: dict[int, list[float]] = {}  # their experts' squared norms from this rank's shard
    if distributed:
        for k, i in enumerate(with_grad):
            grads[k] = dist.settle_partial(grads[k])
            if all_sharded or (is_fragment(params[i]) and params[i].grad is None):  # (ZeRO: this rank's fragment)
                sharded.add(i)
            elif dist.is_sharded(grads[k]):
                shards, held, shard = dist.placement_counts(grads[k])
                if shards > 1:  # (sharded over a mesh dimension of size 1 only: a replicated tensor)
                    sharded.add(i)
                    if held > 1:
                        holders[i], pieces[i] = held, (shard, shards)
                    if i in view.stacks:
                        cut[i] = (shard, shards)
            if i in view.stacks and view.stacks[i].place is not None:  # (an expert module's: summed at its place)
                cut[i] = (0, 1)
                if i not in sharded and experts.per_rank(view.stacks[i], dist.world_size()):  # (not every rank's replica)
                    sharded.add(i)
                    holders[i] = view.stacks[i].copies
            grads[k] = dist.to_local(grads[k])

    loss_t = loss.detach() if isinstance(loss, Tensor) and loss.numel() == 1 else None
    scale_t = scaler._scale if scaler is not None and scaler.is_enabled() and getattr(scaler, "_scale", None) is not None else None
    lay = Layout()  # the extras, each in a named slot
    if loss_t is not None:
        lay.put("loss", loss_t, 1)
    for j, name in enumerate(valid):
        lay.put(f"valid{j}", valid[name], 1)
    if window is not None:  # (the window's micro-batches: their losses and counts as they are, no op)
        w_losses, w_counts = window.parts(valid)
        lay.put("wloss", w_losses, len(w_losses))
        for j, name in enumerate(w_counts):
            lay.put(f"wcount{j}", w_counts[name], len(w_counts[name]))
    for j, u in enumerate(updates):
        lay.put(f"update{j}", u.packed, u.size)  # (a tensor, or several)
    if scale_t is not None:
        lay.put("scale", scale_t, 1)
    # gradients an optimizer step inside backward freed: their norms, taken then (see UpdateTracker)
    freed = [i for i in sel.idx if grad_of(params[i]) is None and view.pids[i] in captured] if captured else []
    if freed:
        if distributed:  # (a ZeRO fragment's norm, taken before the step freed it, is a shard's too)
            sharded.update(i for i in freed if is_fragment(params[i]))
        lay.put("freed", torch.stack([captured[view.pids[i]] for i in freed]))
    if router:
        lay.put("router", torch.cat([c.reshape(-1).to(router[0].device) for c in router]))
    # stacked experts: their slices' norms replace the tensor's own (one pass), read in the same transfer
    stacked = [k for k, i in enumerate(with_grad) if i in view.stacks and grads[k].layout is torch.strided
               and not grads[k].is_complex()] if view.stacks else []
    # (a shard holds some experts whole, or part of every expert: its own slices, summed across ranks later)
    local = {k: expert_norms.local_stack(view.stacks[with_grad[k]], grads[k], cut.get(with_grad[k])) for k in stacked}
    if stacked:
        lay.put("slices", torch.cat([expert_norms.slice_norms(grads[k], local[k][0]) for k in stacked]),
                sum(local[k][0].count for k in stacked))
        whole = set(stacked)
        plain = [g for k, g in enumerate(grads) if k not in whole]
    else:
        plain = grads
    launched = stats.Launched(plain, lay.parts, plan, later=deferred)
    plan = launched.plan

    def finish(norms: list[float], flat: list[float]) -> Observation:
        nonlocal with_grad, ex_parts
        got = lay.unpack(flat)
        slices: dict[int, list[float]] = {}
        if stacked:
            counts = [local[k][0].count for k in stacked]
            flat_slices, values, pos = got["slices"], [], 0
            for c in counts:
                values.append(list(flat_slices[pos:pos + c]))
                pos += c
            values = expert_norms.finish_slices([grads[k] for k in stacked], [local[k][0] for k in stacked], values)
            for j, k in enumerate(stacked):  # a shard's slices: its squares at their experts, reduced across ranks
                i, stack = with_grad[k], view.stacks[with_grad[k]]
                if i in cut:  # (a placed expert's gradient is whole on ``copies`` ranks, or partitioned among them)
                    ex_parts[i] = expert_norms.spread_squares(values[j], local[k][1], stack.count, holders.get(
                        i, 1) if stack.place is None or i in sharded else stack.copies)
                elif stack.place is not None:  # (one process: every expert is here)
                    values[j] = [math.sqrt(v) for v in expert_norms.spread_squares(values[j], stack.place, stack.count, 1)]
            it = iter(norms)
            merged, at = [], dict(zip(stacked, values))
            for k in range(len(grads)):
                merged.append(stats.combine_norms(at[k]) if k in at else next(it))  # a stack's norm: its slices'
            norms = merged
            slices = {with_grad[k]: v for k, v in at.items() if with_grad[k] not in cut}

        scale = got["scale"][0] if scale_t is not None else None
        if scale:
            done = unscaled_params(scaler, view.optimizers, consumed)
            pids = view.pids
            norms = [v if pids[i] in done else v / scale for i, v in zip(with_grad, norms)]
            slices = {i: vs if pids[i] in done else [v / scale for v in vs] for i, vs in slices.items()}
            ex_parts = {i: vs if pids[i] in done else [v / scale**2 for v in vs] for i, vs in ex_parts.items()}
        for j, u in enumerate(updates):
            u.fetched(got[f"update{j}"])
        if freed:  # (in entry order, with the others)
            pairs = sorted([*zip(with_grad, norms), *zip(freed, got["freed"])])
            with_grad, norms = [i for i, _ in pairs], [v for _, v in pairs]
        if len(norms) == len(view):  # every entry has a gradient
            norm_of: list[float | None] = list(norms)
        else:
            norm_of = [None] * len(view)
            deque(map(norm_of.__setitem__, with_grad, norms), maxlen=0)  # (scattered in C: a frozen base's many)
        obs = _OBSERVATION(idx=sel.idx, norm_of=norm_of, loss=got["loss"][0] if loss_t is not None else None,
                          valid={name: int(got[f"valid{j}"][0]) for j, name in enumerate(valid)},
                          updates=updates, scale=scale, sharded=sharded, with_grad=with_grad, norms=norms, slices=slices,
                          holders=holders, pieces=pieces, ex_parts=ex_parts)
        if window is not None:  # the window's counts are its micro-batches' sums
            obs.window = window.seen(list(got["wloss"]), {name: list(got[f"wcount{j}"]) for j, name in enumerate(w_counts)},
                                     valid)
            obs.valid = dict(obs.window.sums)
        if router:
            flat_r, obs.router, pos = got["router"], [], 0
            for c in router:
                obs.router.append(list(flat_r[pos:pos + c.numel()]))
                pos += c.numel()
        return obs

    if deferred:  # read later: :mod:`gradhealth.check.deferred`
        return Pending(launched, finish, with_grad, (valid, updates)), plan  # (with_grad: this check's own list)
    return finish(*launched.read()), plan


class Pending:
    """An observation whose numbers are on their way to the host (:mod:`gradhealth.check.deferred`). (A plain
    class: made at every deferred check, it costs the host no more than it holds.)"""

    __slots__ = ("launched", "finish", "with_grad", "asked", "loss_cause", "eval_record", "stale", "local")

    def __init__(self, launched: stats.Launched, finish, with_grad: list[int], asked: tuple):
        self.launched, self.finish = launched, finish  # (finish: (norms, extras) -> Observation)
        self.with_grad = with_grad  # the judged entries with a gradient
        self.asked = asked  # (valid masks, measured steps): what a failed completion still joins the ranks with
        # (``loss_cause``, ``eval_record``, ``stale``, ``local``: what the rank saw besides numbers, set at launch)

    def complete(self, values: list[float]) -> Observation:
        """The observation of ``values`` read back (a plain check's is made by :mod:`gradhealth.check.quiet`)."""
        obs = self.finish(*self.launched.resolve(values))
        obs.loss_cause, obs.eval_record, obs.stale, obs.local = self.loss_cause, self.eval_record, self.stale, self.local
        return obs


def failed_observation(view: ParamView, sel: Selection, valid: dict, updates: list[StepStats]) -> Observation:
    """An empty contribution for a rank whose check failed, so it still joins the collective."""
    for u in updates:
        u.set_triple([math.nan] * (3 * len(u.indices)))
    return Observation(sel.idx, [None] * len(view), valid=dict.fromkeys(valid, 0), updates=updates)

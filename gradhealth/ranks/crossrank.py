"""One verdict on every rank: pack a rank's ``Observation``, reduce, unpack; the rank findings.

The vector's layout (a :class:`Layout`, the same on every rank) holds, per judged parameter,
the squared gradient norm (divided by the world size for replicated gradients, as is for
shards, so the SUM is the global square), has-a-gradient, non-finite-here and non-zero-here
flags, and what the DDP hook saw before the all-reduce (bit ``2**rank``); then the loss, valid
counts, local findings as rank masks, the last step's update numbers and a failure flag.
``all_reduce(SUM)`` of the packed vectors is the only collective; :func:`combine` is the pure
function of the summed vector, so tests can sum per-rank vectors in-process.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..base import distributed as dist
from ..base.findings import Finding, FindingKind
from ..base.naming import agree, on_ranks
from ..base.report import Report, describe_names
from ..base.status import Status
from ..measure.layout import Layout
from ..measure.observe import ForwardRecord
from ..measure.observe import Observation
from ..measure.stats import SMALLEST_SUBNORMAL
from . import lockstep

__all__ = ["rank_layout", "pack_rank", "combine", "Across", "rank_findings", "disagree_findings", "desync_findings", "AGREE_TOL"]

_PER_PARAM = ("sq", "has", "bad", "nz", "n1", "pre_bad", "pre_zero")
_FLAGS = ("has_pre", "loss_sum", "loss_bad", "loss_n", "cause", "eval", "stale", "failed", "unsynced", "nosync_step",
          "missed", "local", "window")
_COUNTS = ("checks1", "checks2", "steps1", "steps2")
#: the lockstep counts in the collective (off only to time what they cost, like AGREEMENT)
COUNTS = True
#: replicas agree when the spread of their gradient norms, mean(n**2) - mean(n)**2, is at most this
#: times mean(n**2): the float64 rounding of the two sums (a few 1e-16 relative for any world size
#: one can run) and nothing else, since one all-reduce hands every rank the same gradient
AGREE_TOL = 1e-10
#: compare the replicas' gradients in the collective (off only to time what it costs: every rank
#: must agree on it, as on the whole layout)
AGREEMENT = True


def rank_layout(n: int, valid_names: list[str], entries: int, fingerprint: bool = False, pieces: int = 0,
                experts: int = 0) -> Layout:
    """The same on every rank whatever each one measured: per judged entry, per valid name, and a
    fixed grid over every entry for the last step's update numbers (a rank that skipped or took
    another step than the others must still meet them in a collective of the same size)."""
    lay = Layout()
    for name in _PER_PARAM:
        if name != "n1" or AGREEMENT or fingerprint:
            lay.add(name, n)
    if pieces:  # sharded gradients held by several replicas (HSDP): per shard, its holders' mean and mean square
        lay.add("s1", pieces).add("s2", pieces)
    if experts:  # sharded stacked experts: each expert's squared norm, from the ranks' shards
        lay.add("ex", experts)
    if fingerprint:  # the replicas' parameters (gradients reduced inside the optimizer): their mean square
        lay.add("pf2", n)  # (and their mean in n1's place: the gradients are not compared then)
    for name in _FLAGS + (_COUNTS if COUNTS else ()):
        lay.add(name)
    for v in valid_names:
        lay.add(f"valid:{v}").add(f"empty:{v}")
    if entries:
        lay.add("upd_sq", entries).add("par_sq", entries).add("changed", entries).add("upd_n", entries)
    return lay


def weights(obs: Observation, idx, inv: float) -> list[float]:
    """Per entry, what this rank's squared norm counts for in the SUM over ranks: 1/world for a
    replicated tensor, 1 for a shard, 1/holders for a shard whose elements several ranks hold."""
    sharded, holders = obs.sharded, obs.holders
    return [(1.0 / holders.get(i, 1)) if i in sharded else inv for i in idx]


def pack_rank(obs: Observation, rank: int, world: int, pre=None, failed: bool = False,
              unsynced: bool = False, counts: tuple[int, int] = (0, 0), fingerprint: list[float] | None = None,
              nosync_step: bool = False, steps: bool | None = None, missed: bool = False) -> tuple[Tensor, Layout]:
    """This rank's float64 vector (CPU) and its layout. ``pre``: the DDP hook's (non-finite,
    all-zero) flags per judged parameter before the all-reduce, or None; ``unsynced``: a DDP
    training backward ran here without DDP's communication hook; ``counts``: this rank's checks
    and optimizer steps so far (lockstep); ``fingerprint``: per judged entry, its parameter's
    fingerprint (:mod:`.replicas`); ``nosync_step``: an optimizer step ran here on gradients DDP
    did not reduce; ``steps``: the monitor measures optimizer steps (the same on every rank: the
    grid of update numbers is always there then; None: when this rank has any); ``missed``: this
    rank's loop did not call ``check()``, its optimizer step joined it (:mod:`.lockstep`)."""
    b, inv, idx = dist.bit(rank), 1.0 / world, obs.idx
    raw = torch.tensor([0.0 if obs.norm_of[i] is None else obs.norm_of[i] for i in idx], dtype=torch.float64)
    weight = torch.tensor(weights(obs, idx, inv), dtype=torch.float64)
    pre_bad, pre_zero = pre if pre is not None else ([0.0] * len(idx), [0.0] * len(idx))
    loss = obs.loss
    valid_names = sorted(obs.valid)
    parts = dict(
        sq=raw * raw * weight, has=[0.0 if obs.norm_of[i] is None else 1.0 for i in idx],
        bad=(~torch.isfinite(raw)).to(torch.float64) * b, nz=(raw != 0).to(torch.float64),
        # the replicas' agreement: with sq, the mean of the norms and of their squares over the ranks
        n1=torch.where(torch.isfinite(raw), raw * inv, torch.zeros_like(raw)) * (weight == inv),
        pre_bad=[x * b for x in pre_bad], pre_zero=[x * b for x in pre_zero], has_pre=[1.0 if pre is not None else 0.0],
        loss_sum=[loss * inv if loss is not None and math.isfinite(loss) else 0.0],
        loss_bad=[b if loss is not None and not math.isfinite(loss) else 0.0], loss_n=[1.0 if loss is not None else 0.0],
        cause=[b if obs.loss_cause else 0.0], eval=[b if obs.eval_record is not None else 0.0],
        stale=[b if obs.stale else 0.0], failed=[b if failed else 0.0], unsynced=[b if unsynced else 0.0],
        nosync_step=[b if nosync_step else 0.0], missed=[b if missed else 0.0],
        local=[b if obs.local else 0.0], window=[b if getattr(obs.window, "notable", False) else 0.0],
    )
    if COUNTS:
        parts.update(checks1=[counts[0] * inv], checks2=[counts[0] ** 2 * inv], steps1=[counts[1] * inv],
                     steps2=[counts[1] ** 2 * inv])
    if fingerprint is not None:
        f = torch.as_tensor(fingerprint, dtype=torch.float64)
        parts["n1"], parts["pf2"] = f * inv, f * f * inv
    if not (AGREEMENT or fingerprint is not None):
        del parts["n1"]
    for v in valid_names:
        parts[f"valid:{v}"] = [float(obs.valid[v])]
        parts[f"empty:{v}"] = [b if obs.valid[v] == 0 else 0.0]
    entries = len(obs.norm_of) if (bool(obs.updates) if steps is None else steps) else 0
    if entries:  # values: [update norms, param norms, changed] per parameter, on the grid of entries
        grid = torch.zeros(4, entries, dtype=torch.float64)
        for u in obs.updates:
            n, at = len(u.indices), torch.tensor(u.indices, dtype=torch.long)
            w = torch.tensor(weights(obs, u.indices, inv), dtype=torch.float64)
            v = torch.tensor(u.triple(), dtype=torch.float64)
            grid[0, at], grid[1, at], grid[2, at] = v[:n] ** 2 * w, v[n : 2 * n] ** 2 * w, v[2 * n :]
            grid[3, at] += 1.0
        parts.update(upd_sq=grid[0], par_sq=grid[1], changed=grid[2], upd_n=grid[3])
    held = [(j, i) for j, i in enumerate(idx) if i in obs.pieces] if obs.pieces else []  # (in order, on every rank)
    total = sum(obs.pieces[i][1] for _, i in held)
    if held:  # this rank's norm at its shard's slot of each such entry
        sizes = [obs.pieces[i][1] for _, i in held]
        starts = torch.tensor([0] + sizes[:-1], dtype=torch.long).cumsum(0)
        at = starts + torch.tensor([obs.pieces[i][0] for _, i in held], dtype=torch.long)
        v = raw[torch.tensor([j for j, _ in held], dtype=torch.long)]
        v = torch.where(torch.isfinite(v), v, torch.zeros_like(v))
        h = torch.tensor([float(obs.holders[i]) for _, i in held], dtype=torch.float64)
        s1, s2 = torch.zeros(total, dtype=torch.float64), torch.zeros(total, dtype=torch.float64)
        s1[at], s2[at] = v / h, v * v / h
        parts.update(s1=s1, s2=s2)
    ex = [obs.ex_parts[i] for i in idx if i in obs.ex_parts]  # (the same entries and sizes on every rank)
    if ex:
        parts["ex"] = [v for vs in ex for v in vs]
    lay = rank_layout(len(idx), valid_names, entries, fingerprint is not None, total, sum(map(len, ex)))
    return lay.pack(**parts), lay


@dataclass
class Across:
    """What only the reduction knows: which ranks saw what (bit masks), for the rank findings."""

    world: int
    failed: float
    pre_bad: list[float]
    pre_zero: list[float]
    has_pre: bool
    empty_masks: dict[str, float]
    cause_mask: float
    eval_mask: float
    stale_mask: float
    unsynced_mask: float = 0.0
    bad_mask: list[float] | None = None  # per judged parameter: the ranks holding a non-finite gradient
    disagree: list[int] | None = None  # positions (in obs.idx) of replicated gradients that differ across ranks
    local_norm: list | None = None  # this rank's own norms per entry, before the reduction
    comparable_at: list[int] | None = None  # their positions (only where some differ)
    comparable: int = 0  # replicated gradients held by every rank, finite everywhere, non-zero somewhere: the
    # evidence of whether a reduction ran (what ``disagree`` is out of)
    nosync_step_mask: float = 0.0  # ranks that stepped on gradients DDP did not reduce
    window_mask: float = 0.0  # ranks with something to say about the accumulation window this check ends
    missed_mask: float = 0.0  # ranks whose check was joined from their optimizer step (no check() call)
    lockstep: bool = True  # every rank at the same check and optimizer step counts
    fp_disagree: list[int] | None = None  # positions whose replicated parameters differ across ranks


def combine(reduced: Tensor, lay: Layout, obs: Observation, world: int) -> Across:
    """Turn the summed vector into every rank's numbers (written into ``obs``) and the masks."""
    t = lay.unpack(reduced)
    got = {k: v.tolist() for k, v in t.items() if k not in _PER_PARAM[:5]}
    across = Across(world, got["failed"][0], got["pre_bad"], got["pre_zero"], got["has_pre"][0] > 0,
                    {v: got[f"empty:{v}"][0] for v in obs.valid}, got["cause"][0], got["eval"][0], got["stale"][0],
                    got["unsynced"][0], t["bad"].tolist())
    if across.failed > 0:
        return across
    sq, has, bad, nz = t["sq"], t["has"].tolist(), t["bad"], t["nz"]
    across.nosync_step_mask, across.missed_mask, across.window_mask = (got[k][0] for k in ("nosync_step", "missed", "window"))
    for c in ("checks", "steps") if COUNTS else ():  # the spread of the counts over the ranks: 0 when all agree
        across.lockstep = across.lockstep and got[f"{c}2"][0] - got[f"{c}1"][0] ** 2 <= 1e-9 * max(1.0, got[f"{c}2"][0])
    replicated = torch.tensor([i not in obs.sharded for i in obs.idx], dtype=torch.bool)
    if "n1" in t and "pf2" not in t and not got["local"][0]:  # replicated, everywhere, finite: agree? (not in no_sync())
        spread = sq - t["n1"] * t["n1"]
        comparable = replicated & (bad == 0) & (t["has"] == world)
        across.disagree = (comparable & (spread > AGREE_TOL * sq)).nonzero().reshape(-1).tolist()
        across.comparable = int((comparable & (nz > 0)).sum())  # (zero on every rank: equal whether reduced or not)
        if across.disagree:
            across.comparable_at = (comparable & (nz > 0)).nonzero().reshape(-1).tolist()
    if "ex" in t:  # sharded stacked experts: every expert's norm, whole
        flat, pos = got["ex"], 0
        for i in [i for i in obs.idx if i in obs.ex_parts]:
            n = len(obs.ex_parts[i])
            obs.slices[i] = [math.sqrt(v) if v == v else v for v in flat[pos:pos + n]]
            pos += n
    if "s1" in t:  # a sharded gradient agrees when each of its shards agrees across the ranks holding it
        held = [(j, i) for j, i in enumerate(obs.idx) if i in obs.pieces]
        s1, s2 = t["s1"], t["s2"]
        entry = torch.repeat_interleave(torch.arange(len(held)), torch.tensor([obs.pieces[i][1] for _, i in held]))
        odd = torch.zeros(len(held)).index_add_(0, entry, (s2 - s1 * s1 > AGREE_TOL * s2).float()) > 0
        js = torch.tensor([j for j, _ in held], dtype=torch.long)
        usable = (t["has"][js] == world) & (bad[js] == 0)
        across.comparable += int((usable & (nz[js] > 0)).sum())
        found = js[usable & odd].tolist()
        if found:
            across.disagree = sorted(set(across.disagree or []) | set(found))
    if "pf2" in t:  # the parameters' fingerprints: their mean (in n1) and mean square over the ranks
        pf2 = t["pf2"]
        odd = replicated & torch.isfinite(pf2) & (pf2 - t["n1"] * t["n1"] > AGREE_TOL * pf2)
        across.fp_disagree = odd.nonzero().reshape(-1).tolist()
    across.local_norm = list(obs.norm_of)  # this rank's own norms, before the reduction replaces them
    # non-finite anywhere: inf unless the squares hold a NaN; zero only if zero everywhere; a
    # non-zero gradient never rounds to a zero norm
    norm = torch.where(bad > 0, torch.where(torch.isfinite(sq), torch.full_like(sq, math.inf), sq),
                       torch.where(nz == 0, torch.zeros_like(sq), sq.sqrt().clamp(min=SMALLEST_SUBNORMAL))).tolist()
    norm_of: list[float | None] = [None] * len(obs.norm_of)
    for j, i in enumerate(obs.idx):
        if has[j] > 0:
            norm_of[i] = norm[j]
    obs.set_norms(norm_of)
    loss_sum, loss_bad, loss_n = got["loss_sum"][0], got["loss_bad"][0], got["loss_n"][0]
    obs.loss = (math.nan if loss_bad > 0 else loss_sum * world / loss_n) if loss_n > 0 else None
    obs.loss_ranks = dist.ranks_of(loss_bad, world) if loss_bad > 0 else None
    obs.valid = {v: int(round(got[f"valid:{v}"][0])) for v in obs.valid}
    if "upd_n" in got:  # changed anywhere: changed; undecided (nan) anywhere, or not measured everywhere: unknown
        upd, par, chg, cnt = got["upd_sq"], got["par_sq"], got["changed"], got["upd_n"]
        for u in obs.updates:
            every = [cnt[i] == world for i in u.indices]  # (a rank without this step: LOCKSTEP says so)
            u.set_triple([math.sqrt(upd[i]) if ok else math.nan for i, ok in zip(u.indices, every)]
                         + [math.sqrt(par[i]) if ok else math.nan for i, ok in zip(u.indices, every)]
                         + [(chg[i] if chg[i] != chg[i] else (1.0 if chg[i] > 0 else 0.0)) if ok else math.nan
                            for i, ok in zip(u.indices, every)])
    return across


def reduce_updates(updates: list, entries: int, shards: tuple[set, dict], ranks) -> None:
    """The update numbers of a flush (no check around them), reduced across the ranks with the
    check's own packing: a shard's update norm is the whole parameter's. Every rank calls it."""
    obs = Observation([], [None] * entries, updates=updates, sharded=shards[0], holders=shards[1])
    vec, lay = pack_rank(obs, ranks.rank, ranks.world, steps=True)
    combine(dist.all_reduce_tensor(vec, ranks.device), lay, obs, ranks.world)


def rank_findings(report: Report, across: Across, obs: Observation, names: list[str],
                  scaler_skips: bool = False) -> list[Finding]:
    """Findings from what single ranks saw, the same on every rank: NONFINITE_RANK, PARTIALLY_USED
    and EMPTY_VALID_SET on some ranks only. (The loss, eval-mode and stale masks go through the
    ordinary judges with ``where=``; see :func:`where`.) ``scaler_skips``: a grad scaler skips this
    step as it settles (``AMP_SKIPPED`` at info): the ranks whose scaled gradients overflowed are
    said at info too, not an error."""
    out: list[Finding] = []
    world, idx, status = across.world, obs.idx, report.status
    if across.has_pre:
        bad = {names[i]: m for i, m in zip(idx, across.pre_bad) if m > 0}
        if bad:
            ranks = sorted({r for m in set(bad.values()) for r in dist.ranks_of(m, world)})
            then = ("the grad scaler skips this step (its scale is settling): nothing to do" if scaler_skips
                    else "look at that rank's batch")
            out.append(Finding(FindingKind.NONFINITE_RANK, f"the non-finite gradients were produced on {on_ranks(ranks)} "
                               f"before DDP's all-reduce spread them to every rank ({describe_names(status, bad)}): "
                               f"{then}", params=tuple(bad), step=report.step, data={"ranks": ranks},
                               level="info" if scaler_skips else "error"))
        partly = {names[i]: m for i, m in zip(idx, across.pre_zero)
                  if 0 < m and status.get(names[i]) not in (Status.NO_GRAD, Status.ZERO_GRAD, Status.FROZEN)}
        if partly:
            ranks = sorted({r for m in partly.values() for r in dist.ranks_of(m, world)})
            out.append(Finding(FindingKind.PARTIALLY_USED, f"{describe_names(status, partly)} got no gradient on "
                               f"{on_ranks(ranks)} (DDP zero-filled their part before averaging): used by some ranks' "
                               "batches only, not a dead layer", params=tuple(partly), level="info", step=report.step,
                               data={"ranks_without": ranks}))
        dead = {names[i] for i, m in zip(idx, across.pre_zero)
                if status.get(names[i]) is Status.ZERO_GRAD and len(dist.ranks_of(m, world)) == world}
        if dead:
            out.append(Finding(FindingKind.PARTIALLY_USED, f"{describe_names(status, dead)}: zero on every rank before "
                               "the all-reduce: DDP zero-filled them, no rank used them in this step",
                               params=tuple(sorted(dead)), level="info", step=report.step))
    if across.unsynced_mask > 0:
        ranks = dist.ranks_of(across.unsynced_mask, world)
        out.append(Finding(FindingKind.DDP_NOT_SYNCED, f"DistributedDataParallel did not synchronise the gradients of this "
                           f"backward on {on_ranks(ranks) if ranks else 'some ranks'} (its communication hook never ran): "
                           "each rank trains on its own gradients. Usual causes: the parameters were replaced or moved "
                           "after wrapping (.to(), .cuda(), .double()/.float() after DistributedDataParallel(...): DDP's "
                           "hooks stay on the old tensors), or the model was called around its wrapper (module(x) instead "
                           "of ddp(x)). Move the model before wrapping it (or wrap it again), and call the wrapper for "
                           "every training forward", step=report.step, data={"ranks": ranks}))
    if across.has_pre and across.bad_mask is not None:
        made = {names[i]: m for i, m, before in zip(idx, across.bad_mask, across.pre_bad) if m > 0 and before == 0}
        if made:
            ranks = sorted({r for m in set(made.values()) for r in dist.ranks_of(m, world)})
            out.append(Finding(FindingKind.NONFINITE_COLLECTIVE, f"{describe_names(status, made)}: finite on every rank before "
                               f"DDP's all-reduce, non-finite after it on {on_ranks(ranks)}: the communication broke them "
                               "(a faulty communication hook, a flaky link or device), not the model's math or the data; "
                               "check the comm hook, the interconnect and that rank's device", params=tuple(made),
                               step=report.step, data={"ranks": ranks}))
    for n, m in across.empty_masks.items():  # empty on some ranks only: the global count hides it
        if m > 0 and obs.valid.get(n):
            out.append(Finding(FindingKind.EMPTY_VALID_SET, f"the valid mask {n!r} selected nothing{where(m, world)} at "
                               f"step {report.step}: that rank's mean over it is NaN or 0 and DDP averages it into every "
                               "rank's gradients; skip such batches or use gh.masked_mean(..., empty='zero')",
                               step=report.step))
    return out


def where(mask: float, world: int) -> str:
    """`` (on rank 1)`` for a summed rank mask."""
    ranks = dist.ranks_of(mask, world)
    return f" (on {on_ranks(ranks)})" if ranks else " (on some ranks)"


def remote_record(record: ForwardRecord | None) -> ForwardRecord:
    """The eval-mode record to judge when another rank saw it (this one has none of its own)."""
    return record or ForwardRecord(True, False, False, ())


def disagree_findings(across: Across, obs: Observation, names: list[str], status, step: int, device) -> list[Finding]:
    """The replicas' gradients differ after the reduction (``across.disagree``, the same on every
    rank): their norms are gathered once, only then, to name the ranks that differ from rank 0."""
    if not across.disagree:
        return []
    idx = [obs.idx[j] for j in across.disagree]
    local = across.local_norm or obs.norm_of
    n = len(idx)  # each rank's norms, then which shard it holds (a replica is compared with the shard's first holder)
    rows = dist.all_gather([local[i] if local[i] is not None else math.nan for i in idx]
                           + [float(obs.pieces.get(i, (0, 1))[0]) for i in idx], device)
    differ: dict[str, list[int]] = {}
    for k, i in enumerate(idx):
        first = {}
        for r, row in enumerate(rows):
            first.setdefault(row[n + k], r)
        odd = [r for r, row in enumerate(rows) if row[k] != rows[first[row[n + k]]][k]]
        differ[names[i]] = odd
    ranks = sorted({r for rs in differ.values() for r in rs})
    return [Finding(FindingKind.GRAD_DISAGREE, f"the replicas' gradients of {describe_names(status, differ)} differ between "
                    f"rank 0 and {on_ranks(ranks)} after the gradient reduction: the ranks are no longer training one "
                    "model (a gradient left out of an all-reduce by hand, DDP's hooks lost after the parameters were "
                    "replaced or moved, a forward around the DDP wrapper, a communication hook or link that delivers "
                    "part of a bucket wrong); the parameters will drift apart", params=tuple(differ), step=step,
                    data={"ranks": differ, "norms": {names[i]: [row[k] for row in rows] for k, i in enumerate(idx)}})]


def replica_findings(across: Across, obs: Observation, names: list[str], status, step: int, device, replicas,
                     counts: tuple[int, int], fingerprint: list[float] | None, missed=None) -> list[Finding]:
    """The replicas, the same on every rank: LOCKSTEP (ranks at different checks or steps, a rank
    that did not call check(): :mod:`.lockstep`), DDP_NOT_SYNCED for a step on unreduced gradients,
    and agreement: of the gradients (GRAD_DISAGREE, or the optimizer's reduction still to come) or
    of the parameters (DESYNC)."""
    found: list[Finding] = []
    if across.missed_mask > 0:
        found += lockstep.missed_findings(across.missed_mask, across.world, step, missed)
    if not across.lockstep:  # (every rank sees the mismatch in the sum: every rank gathers)
        found += lockstep.count_findings(dist.all_gather([float(counts[0]), float(counts[1])], device), step)
    if across.nosync_step_mask > 0:
        ranks = dist.ranks_of(across.nosync_step_mask, across.world)
        found.append(Finding(FindingKind.DDP_NOT_SYNCED, f"optimizer.step() ran on {on_ranks(ranks) if ranks else 'some ranks'} "
                             "on gradients DistributedDataParallel did not reduce: the last training forward before it ran "
                             "inside no_sync() (or with require_backward_grad_sync False). Run the last micro-step of each "
                             "window outside no_sync() (nanoGPT: require_backward_grad_sync = micro_step == "
                             "gradient_accumulation_steps - 1) on every rank", step=step,
                             data={"ranks": ranks, "cause": "step_on_local_gradients"}))
    pending = replicas.take_pending()  # (a guess verified inside the step it concerns)
    if replicas.compare_grads and across.disagree:
        across.disagree, said = replicas.judge_disagreement(across.disagree, across.comparable, step,
                                                            across.comparable_at, obs.idx)
        found += said
        found += disagree_findings(across, obs, names, status, step, device)
    if across.fp_disagree:
        idx = [obs.idx[j] for j in across.fp_disagree]
        rows = dist.all_gather([float(fingerprint[j]) for j in across.fp_disagree], device)
        differ = {names[i]: [r for r, row in enumerate(rows) if row[k] != rows[0][k]] for k, i in enumerate(idx)}
        ranks = sorted({r for rs in differ.values() for r in rs})
        found.append(Finding(FindingKind.DESYNC, f"{describe_names(status, differ)} {agree(differ, 'differ', 'differs')} "
                             f"between rank 0 and {on_ranks(ranks)} after the optimizer's step: the gradients are reduced "
                             "inside optimizer.step() (grad_sync='in_optimizer'), and that rank's step applied other "
                             "gradients to them (a parameter its reduction left out, a rank-dependent branch in the "
                             "optimizer); the replicas train apart from here", params=tuple(differ), step=step,
                             data={"ranks": differ}))
    named = {n for f in found if f.kind == FindingKind.DESYNC for n in f.params}  # (said once, by the check's own)
    return found + [f for f in pending if not set(f.params) <= named]


def desync_findings(params: list[Tensor], names: list[str], status, step: int, device) -> list[Finding]:
    """DESYNC: a fingerprint (sum and norm) of every replicated parameter, all-gathered once."""
    pairs, shard_of = [], []  # replicated parameters, and sharded ones whose shards several replicas hold (HSDP)
    for n, p in zip(names, params):
        pieces = dist.placement_counts(p) if dist.is_sharded(p) else (1, 2, 0)
        if pieces[0] == 1 or pieces[1] > 1:
            pairs.append((n, p))
            shard_of.append(float(pieces[2]))
    if not pairs:
        return []
    local = [dist.to_local(p).detach() for _, p in pairs]
    with torch.no_grad():
        sums = torch.stack([t.sum(dtype=torch.float32) if t.numel() else torch.zeros((), device=t.device) for t in local])
        norms = torch.stack(torch._foreach_norm(local)).to(sums.dtype)
    rows = dist.all_gather(torch.cat([sums, norms]).double().tolist() + shard_of, device)
    n = len(pairs)
    differ: dict[str, list[int]] = {}
    for j, (name, _) in enumerate(pairs):
        first: dict[float, list[float]] = {}  # each rank against the first rank holding the same shard
        for row in rows:
            first.setdefault(row[2 * n + j], row)
        refs = [first[row[2 * n + j]] for row in rows]
        odd = [r for r, (row, ref) in enumerate(zip(rows, refs)) if (row[j], row[n + j]) != (ref[j], ref[n + j])
               and not (math.isnan(row[j]) and math.isnan(ref[j]))]
        if odd:
            differ[name] = odd
    if not differ:
        return []
    ranks = sorted({r for rs in differ.values() for r in rs})
    return [Finding(FindingKind.DESYNC, f"{describe_names(status, differ)} {agree(differ, 'differ', 'differs')} between rank 0 and {on_ranks(ranks)}: "
                    "the replicas have drifted apart (a parameter changed on one rank only, a different initialisation "
                    "seed, a non-deterministic update, or a skipped all-reduce); broadcast from rank 0 or fix the code "
                    "that changes one rank", params=tuple(differ), step=step, data={"ranks": differ})]

"""Replicas as real code runs them: are the gradients reduced yet, do the replicas agree, are the
ranks at the same check.

``grad_sync`` says where the gradients are reduced:

* ``"before_check"``: by DDP or by hand before ``check()``: replicated gradients must agree
  (``GRAD_DISAGREE`` names the ones that differ);
* ``"in_optimizer"``: inside ``optimizer.step()`` (ZeRO-2 style optimizers: nanochat's
  ``DistMuonAdamW``, modded-nanogpt's ``DistAdam``): at the check every rank legitimately holds its
  own gradients, so the replicas are compared on their *parameters* instead, after the step: a
  fingerprint of every replicated parameter (the sum of squares of the whole of a small one, of
  at most ``WHOLE`` elements, else of a fixed sample of ``SAMPLE`` in blocks of ``BLOCK`` neighbours) rides in the check's
  one collective, and one that differs is ``DESYNC`` at that check (a drift in elements the sample
  leaves out is found by the periodic whole-tensor ``DESYNC`` check, every ``desync_every``);
* ``"auto"`` (default): with a DDP wrapper known (passed, found by an adapter, or found from the
  module the monitor was given), ``before_check``; without one, ``before_check`` until a check
  where most of the replicated gradients that are non-zero differ between the ranks: that is a
  reduction still to come, said once at info (``GRAD_SYNC``), and from then on ``in_optimizer``
  (zero gradients, e.g. behind nanochat's zero-initialised projections, are no evidence). A loop
  that reduced most gradients by hand and missed some keeps ``GRAD_DISAGREE`` naming exactly
  those; a wrong guess is a replica that steps on its own gradients: ``DESYNC`` at the next check.
  No guess is made for an optimizer whose step cannot reduce: torch's own (``torch.optim``: their
  ``step()`` calls no collective), so gradients of its groups that differ at the check are a
  reduction that missed them, ``GRAD_DISAGREE`` at that check (modded-nanogpt's Adam, whose
  gradients the loop all-reduces by hand: one left out differs at check 0, where its other groups'
  gradients may all be zero and say nothing).

Whether the ranks are at the same check (the lockstep counts, a rank that skipped ``check()``) is
:mod:`gradhealth.ranks.lockstep`.
"""

from __future__ import annotations

import torch

from ..base.distributed import to_local
from ..base.findings import Finding, FindingKind

__all__ = ["Replicas", "GRAD_SYNC", "SAMPLE", "BLOCK", "WHOLE", "group_members", "verify_step", "may_reduce", "reduce_check"]

GRAD_SYNC = ("auto", "before_check", "in_optimizer")
#: elements per parameter in its fingerprint: the whole of a tensor up to WHOLE elements, else a
#: sample of SAMPLE in blocks of BLOCK neighbours spread over it (views, no copies); stacked in
#: chunks of at most CHUNK elements
SAMPLE, BLOCK, WHOLE, CHUNK = 64, 16, 256, 1 << 20


class Replicas:
    def __init__(self, mode: str, ranks):
        self.mode = mode
        self.in_optimizer = mode == "in_optimizer"
        self._ranks = ranks  # (its DDP wrapper may be found at the first forward)
        self._said = False
        self._views: list | None = None
        self._key: tuple | None = None
        self._n = 0
        #: () -> [(id of an optimizer, the entry indices of one of its param groups, whether its step
        #: may reduce)] (set by the monitor): the reduction is inferred per param group
        self.members = None
        #: optimizers whose step is to be verified once, right after it runs (the guess it concerns)
        self.verify: set[int] = set()
        self._pending: list[Finding] = []

    @property
    def ddp_known(self) -> bool:
        return self._ranks.ddp is not None

    @property
    def compare_grads(self) -> bool:
        return not self.in_optimizer

    def fingerprints(self, params: list, idx: list[int], sharded: set[int]):
        """Per judged entry, a float64 sum of squares of its replicated parameter, 0 for shards: of
        the whole tensor up to ``WHOLE`` elements, else of a fixed sample of ``SAMPLE`` (in blocks). One
        stacked copy per size and kind of view (whole tensors, in chunks of at most ``CHUNK``
        elements, apart from samples: torch.stack of the two mixed takes a slow path), so
        a check copies a few thousand elements per hundred parameters. None unless the replicas
        are compared on their parameters."""
        if not self.in_optimizer:
            return None
        key = (id(params), id(idx), len(idx), len(sharded))
        if key != self._key:  # views (no copies): made once, they follow the parameters' updates
            groups: dict[tuple, tuple[list[int], list]] = {}
            for j, i in enumerate(idx):
                t = to_local(params[i].detach())
                if i in sharded or t.numel() == 0 or not t.is_contiguous():
                    continue
                flat = t.view(-1)
                whole = t.numel() <= WHOLE
                # a sample in blocks of BLOCK neighbours: a few cache lines per tensor, not SAMPLE
                view = flat if whole else flat.as_strided((SAMPLE // BLOCK, BLOCK), (t.numel() // (SAMPLE // BLOCK), 1))
                kind = (view.numel(), t.dtype, whole)
                pos, views = groups.setdefault(kind, ([], []))
                if len(views) * view.numel() >= CHUNK:  # a full chunk: start the next one
                    groups[(*kind, j)] = groups.pop(kind)
                    pos, views = groups.setdefault(kind, ([], []))
                pos.append(j)
                views.append(view)
            self._views = [(torch.tensor(pos), views) for pos, views in groups.values()]
            self._key, self._n = key, len(idx)
        out = torch.zeros(self._n, dtype=torch.float64)
        for pos, views in self._views:
            x = torch.stack(views)  # (float32 accumulation is ample: the agreement test needs ~1e-5 relative)
            kw = {"dtype": torch.float32} if x.dtype in (torch.float16, torch.bfloat16) else {}
            out[pos] = torch.linalg.vector_norm(x, dim=tuple(range(1, x.dim())), **kw).double().square().cpu()
        return out

    def take_pending(self) -> list[Finding]:
        found, self._pending = self._pending, []
        return found

    def verified(self, opt, params: list, names: list[str], step: int | None, device) -> None:
        """Inside ``opt``'s step post-hook, once after a guess that its reduction happens inside
        ``optimizer.step()``: its replicated parameters compared across the ranks now, before a
        re-broadcast (a fresh DDP wrapper) can hide a step that applied each rank's own gradients.
        The decision to verify is the same on every rank (made from the check's reduced numbers),
        so every rank runs the collective at the same step."""
        if id(opt) not in self.verify:
            return
        self.verify.discard(id(opt))
        from .crossrank import desync_findings  # (crossrank imports this module)
        from ..base.status import Status

        found = desync_findings(params, names, {n: Status.OK for n in names}, step, device)
        self._pending += [Finding(f.kind, f"{f.message} (compared right after the step that followed the guess that "
                                          "the gradients are reduced inside optimizer.step(): the guess was wrong, "
                                          "this step applied each rank's own gradients)", params=f.params,
                                  level=f.level, step=f.step, data=f.data) for f in found]

    def _per_optimizer(self, disagree: list[int], comparable_at: list[int], idx: list[int]):
        """Per param group, the majority of its own evidence: (positions whose optimizer reduces them
        inside its step, positions left to a reduction before the check that missed them)."""
        groups = self.members() if self.members is not None else []
        inside, fault, seen = [], [], set()
        for _, members, reduces in groups:
            d = [j for j in disagree if idx[j] in members]
            e = sum(1 for j in comparable_at if idx[j] in members)
            seen.update(d)
            (inside if d and reduces and 2 * len(d) > e else fault).append(d)
        fault = [j for d in fault for j in d] + [j for j in disagree if j not in seen]
        return [j for d in inside for j in d], sorted(fault), sum(1 for d in inside if d)

    def judge_disagreement(self, disagree: list[int], evidence: int, step: int, comparable_at=None,
                           idx=None) -> tuple[list[int], list[Finding]]:
        """(the disagreeing positions that are a fault, findings). In ``auto`` without a DDP
        wrapper, the evidence decides, per param group where there are several (modded-nanogpt reduces
        Adam's gradients by hand before the check and Muon's inside its step): the replicated
        gradients that are non-zero somewhere (a gradient that is zero on every rank is equal whether
        reduced or not). Where most of an optimizer's differ, nothing has reduced them yet: its
        reduction is still to come. Where most agree, the few that differ are a reduction that
        missed them. A guess of "inside the step" is verified inside that step (:meth:`verified`),
        and the parameters are compared after every step from then on (``DESYNC``)."""
        if self.mode != "auto" or self.ddp_known or not disagree:
            return disagree, []
        groups = self.members() if self.members is not None else None
        if groups and not any(reduces for *_, reduces in groups):  # (torch's own optimizers: no reduction to come)
            return disagree, []
        several = groups is not None and comparable_at is not None and len(groups) > 1
        if several:
            inside, fault, count = self._per_optimizer(disagree, comparable_at, idx)
            if not inside:
                return disagree, []
        elif 2 * len(disagree) <= evidence:
            return disagree, []
        else:
            fault, count = [], 1
        self.in_optimizer = True
        self.verify = {key for key, _, reduces in groups if reduces} if groups is not None else set()
        if self._said:
            return fault, []
        self._said = True
        return fault, [Finding(
            FindingKind.GRAD_SYNC, f"at step {step} the replicated gradients differ between the ranks ({len(disagree)} of "
            f"the {evidence} that are non-zero) and no DDP wrapper is known: the gradients are reduced later, inside "
            "optimizer.step() (a ZeRO-style optimizer such as nanochat's DistMuonAdamW or modded-nanogpt's DistAdam). "
            "The replicas are compared on their parameters after each step from now on; pass grad_sync='in_optimizer' "
            "to say so (or 'before_check' if your loop reduces them before check())", level="info", step=step,
            data={"differ": len(disagree), "evidence": evidence})]


def may_reduce(opt) -> bool:
    """Can ``opt.step()`` reduce the gradients across the ranks? Not where its step is torch's own
    (a function of ``torch.optim``, under any wrapping of it, a subclass that keeps it included): those
    read the gradients they are given and call no collective. Any other step may (DistAdam, Muon's
    distributed versions, ZeRO's)."""
    step = getattr(type(opt), "step", None)
    while hasattr(step, "__wrapped__"):
        step = step.__wrapped__
    module = getattr(step, "__module__", None) or ""
    return not (module == "torch.optim" or module.startswith("torch.optim."))


def group_members(pids: list[int], optimizers) -> list[tuple[int, set[int], bool]]:
    """(id of an optimizer, the entries of one of its param groups, whether its step may reduce:
    :func:`may_reduce`), per param group: where the replicas are reduced is inferred per group (one
    optimizer may reduce a group inside its step and leave another to a reduction by hand before it)."""
    at = {p: i for i, p in enumerate(pids)}
    return [(id(o), {at[id(q)] for q in g["params"] if id(q) in at}, may_reduce(o)) for o in optimizers
            for g in o.param_groups]


def verify_step(monitor, opt) -> None:
    """(after ``opt``'s step) Verify where its replicas are reduced, over its param groups' entries."""
    if monitor.replicas.verify:
        v = monitor.view
        idx = sorted(i for key, members, _ in group_members(v.pids, monitor.optimizers) if key == id(opt) for i in members)
        monitor.replicas.verified(opt, [v.params[i] for i in idx], [v.names[i] for i in idx],
                                  monitor.tracker.armed_step, monitor.ranks.device)


def reduce_check(self, obs, seen=None):  # (``self``: the monitor)
    """THE collective of monitor ``self``'s check: every rank's numbers summed, the same verdict
    everywhere. ``seen``: what DDP's hooks saw, as of a deferred check's launch (:mod:`gradhealth.check.deferred`)."""
    from . import crossrank
    from ..base.distributed import all_reduce_tensor, ranks_of

    r = self.ranks
    if seen is None:
        seen = (r.origin.snapshot([self.view.params[i] for i in obs.idx]) if r.origin else None, None,
                r.origin is not None and r.origin.unsynced() and bool(obs.with_grad), r.take_nosync_step())
    snap, fetched, unsynced, nosync = seen
    if fetched is None and snap is not None and snap[1] is not None:
        fetched = snap[1].tolist()
    pre = r.origin.judge(snap, fetched or [], [obs.norm_of[i] for i in obs.idx]) if r.origin else None
    self._counts, self._fp, self._shards = ((self.carry.checks, self.tracker.total_steps if self.tracker else 0),
                                            self.replicas.fingerprints(self.view.params, obs.idx, obs.sharded),
                                            (obs.sharded, obs.holders))
    vec, lay = crossrank.pack_rank(obs, r.rank, r.world, pre, self._failed is not None, unsynced, self._counts,
                                   self._fp, nosync, self.tracker is not None,
                                   self._missed is not None and self._missed.joining)
    if self._deferred is not None:  # (numbers on the host, a check late: reduced there, no device involved)
        total = all_reduce_tensor(vec, torch.device("cpu"), r.host_group())
    else:
        total = all_reduce_tensor(vec, r.device)
    across = crossrank.combine(total, lay, obs, r.world)
    if across.failed:
        failed = ranks_of(across.failed, r.world)
        here = f": {type(self._failed).__name__}: {self._failed}" if self._failed is not None else ""
        raise RuntimeError(f"the check failed on rank(s) {failed or 'some'}{here}; every rank skips it")
    return across

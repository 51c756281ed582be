"""Each param group's learning rate across steps: a hold at 0 on purpose, a warm-up from 0, or stuck.

Read on the host at every step, whatever the optimizer (its ``param_groups``: a wrapper's, or a
:class:`~gradhealth.model.masters.MasterView`'s live groups). What a verdict rests on is what the steps
showed, never a scheduler object looked up elsewhere:

* **rose**: the group's lr was above 0 at some step seen (so a schedule, or the user, moved it:
  a later 0 is a fall);
* **zeros**: the steps in a row it has been exactly 0;
* what the others do: a group at 0 since its first step while another trains is a hold (on
  purpose, or a schedule that starts it later); every group at 0 is nothing training at all.

The words, per group (said by :func:`gradhealth.judge.judges.not_updated`):

* ``""``: lr above 0, or not readable without a sync (a device lr);
* ``"new"`` (info): the first step at 0 after it rose (a decay's last step), or one of the first
  ``WARMUP`` steps of a group at 0 from the start that is not a hold (a warm-up from 0: torch's,
  Hugging Face's and DeepSpeed's ``WarmupLR`` with ``warmup_min_lr: 0`` start there);
* ``"again"`` (error): 0 for a second step in a row after it rose (a schedule that fell to 0);
* ``"stuck"`` (error): 0 since the first step, past ``WARMUP`` steps, while nothing else trains
  (every group of every optimizer at 0);
* ``"held"`` (info, once per group): 0 since its first step while another group trains: a layer held
  fixed on purpose (skorch's ``param_groups=[("embedding.*", {"lr": 0})]``), or a schedule that
  starts a group later (its base above 0: it is a fall once it rose); ``"quiet"`` at the steps
  after (nothing said).
"""

from __future__ import annotations

import math

from torch import Tensor

from ..base import saved as checked

__all__ = ["LrStory", "lr_of", "all_positive", "WARMUP"]

#: steps at lr 0 from the first one that a warm-up may take before it rises (DeepSpeed's log
#: warm-up from ``warmup_min_lr: 0`` is exactly 0 at its first two steps)
WARMUP = 2


def lr_of(group) -> float:
    """The group's lr as a float; nan where reading it would sync (a device tensor) or it is not a
    number (Adafactor's ``lr=None`` with a relative step)."""
    lr = group.get("lr")
    if lr.__class__ is float:
        return lr
    if isinstance(lr, Tensor):
        return float(lr) if lr.device.type == "cpu" and lr.numel() == 1 else math.nan
    try:
        return float(lr)
    except (TypeError, ValueError):
        return math.nan


def all_positive(opt) -> bool:
    """No group at lr 0 (the usual step: decided in one pass over the groups)."""
    for g in opt.param_groups:
        lr = g["lr"]
        if lr.__class__ is not float or not lr > 0:
            if lr_of(g) == 0:
                return False
    return True


class LrStory:
    """Per (optimizer, group): [rose, zeros, said]; the words of a step (see the module docstring)."""

    def __init__(self, optimizers=()):
        self.optimizers = list(optimizers)
        self._groups: dict[tuple[int, int], list] = {}
        self.zero: set[tuple[int, int]] = set()  # groups at lr 0 at their last step
        self.rose: set[int] = set()  # optimizers whose groups were all above 0 at a step (marked once)

    def mark_rose(self, opt) -> None:
        """A step at which every group of ``opt`` was above 0 (the usual step, seen without words)."""
        self.rose.add(id(opt))
        for gi in range(len(opt.param_groups)):
            rec = self._groups.setdefault((id(opt), gi), [False, 0, False])
            rec[0], rec[1] = True, 0

    def _others_train(self, opt) -> bool:
        for o in self.optimizers:
            for g in o.param_groups:
                lr = lr_of(g)
                if lr != 0:  # (above 0, or unreadable: not known to be held)
                    return True
        return False

    def zero_ids(self) -> set[int]:
        """Ids of the parameters in the groups at lr 0 at their last step."""
        if not self.zero:
            return set()
        out = set()
        for o in self.optimizers:
            for gi, g in enumerate(o.param_groups):
                if (id(o), gi) in self.zero:
                    out.update(map(id, g["params"]))
        return out

    def quiet(self, opt) -> bool:
        """Every group of ``opt`` at lr 0 is a hold already said (no change test needed for it)."""
        for gi, g in enumerate(opt.param_groups):
            if lr_of(g) == 0:
                rec = self._groups.get((id(opt), gi))
                if rec is None or not rec[2]:
                    return False
        return True

    def unskip(self, keys) -> None:
        """The step that counted these groups' zeros skipped itself (a grad scaler's found inf, an
        optimizer's own overflow check): it did not run, and a schedule that does not advance on a
        skipped step (Hugging Face's) is still at its first value: it is not a step at lr 0."""
        for key in keys:
            rec = self._groups.get(key)
            if rec is not None and rec[1] > 0:
                rec[1] -= 1

    def words(self, opt) -> list[str]:
        """This step's word per group of ``opt`` (called once per step, after it ran)."""
        out = []
        others = None
        for gi, g in enumerate(opt.param_groups):
            key = (id(opt), gi)
            rec = self._groups.get(key)
            if rec is None:
                rec = self._groups[key] = [False, 0, False]
            lr = lr_of(g)
            if lr != 0:
                rec[0] = rec[0] or lr > 0
                rec[1] = 0
                self.zero.discard(key)
                out.append("")
                continue
            self.zero.add(key)
            rec[1] += 1
            if rec[0]:  # it rose before: a fall
                out.append("new" if rec[1] == 1 else "again")
                continue
            if rec[2]:  # a hold already said stays one (what stops the others is theirs to say)
                out.append("quiet")
                continue
            if others is None:
                others = self._others_train(opt)
            if others:  # (a schedule base above 0 too: a schedule may start a group later on purpose)
                out.append("held")
                rec[2] = True
                continue
            out.append("new" if rec[1] <= WARMUP else "stuck")
        return out

    # -------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict:
        """Per group, by (optimizer index, group index): [rose, zeros, said]; the groups at 0 at
        their last step; the optimizers seen with every group above 0."""
        where = {id(o): k for k, o in enumerate(self.optimizers)}
        return {"groups": [[where[o], g, *rec] for (o, g), rec in sorted(self._groups.items(), key=lambda kv: (
                    where.get(kv[0][0], -1), kv[0][1])) if o in where],
                "zero": sorted([where[o], g] for o, g in self.zero if o in where),
                "rose": sorted(where[o] for o in self.rose if o in where)}

    def load_state_dict(self, state: dict) -> None:
        """Every key checked (:mod:`gradhealth.check.state`), then loaded."""
        checked.exact(state, ("groups", "zero", "rose"), "state['lrs']")
        n, ids = len(self.optimizers), [id(o) for o in self.optimizers]
        for key in state:
            if not isinstance(state[key], list):
                raise TypeError(f"state['lrs'][{key!r}] must be a list")
        groups = {}
        for k, rec in enumerate(state["groups"]):
            path = f"state['lrs']['groups'][{k}]"
            if not isinstance(rec, list) or len(rec) != 5:
                raise TypeError(f"{path} must be [optimizer, group, rose, zeros, said]")
            key = (ids[checked.index(rec[0], f"{path}[0]", n)], checked.count(rec[1], f"{path}[1]"))
            groups[key] = [checked.flag(rec[2], f"{path}[2]"), checked.count(rec[3], f"{path}[3]"),
                           checked.flag(rec[4], f"{path}[4]")]
        zero = set()
        for k, pair in enumerate(state["zero"]):
            if not isinstance(pair, list) or len(pair) != 2:
                raise TypeError(f"state['lrs']['zero'][{k}] must be [optimizer, group]")
            zero.add((ids[checked.index(pair[0], f"state['lrs']['zero'][{k}][0]", n)],
                      checked.count(pair[1], f"state['lrs']['zero'][{k}][1]")))
        rose = {ids[checked.index(o, f"state['lrs']['rose'][{k}]", n)] for k, o in enumerate(state["rose"])}
        self._groups, self.zero, self.rose = groups, zero, rose

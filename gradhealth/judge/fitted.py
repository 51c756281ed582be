"""What the loss explains about the gradients: a batch with nothing to learn, a batch already fitted.

Read only where ``check(loss=...)`` gave the loss (one float, already on the host with the check's
numbers). Two rules:

* **nothing to learn from this batch**: the loss is exactly 0 (finite) and every gradient of the
  judged parameters is exactly 0. The zeros are the loss's, not the model's: every GRPO/PPO group whose
  rewards tie has advantages of 0 (TRL logs ``frac_reward_zero_std`` = 1), a selection that picked
  nothing weights every term by 0. One such batch is routine (TRL logs the share of tied groups as
  ``frac_reward_zero_std``): info, with the count. A run where most batches are tied (at least
  ``MOSTLY`` of the window's checks, and more than half of them) is the warning, said once; the
  ZERO_GRAD units of such a check are not counted as misses by the persistence rule, and the norm
  history does not take the check (it says nothing of the gradients' scale).
* **a batch already fitted**: a VANISHING_GRAD collapse that the loss's own collapse explains. A
  batch whose loss is an order of magnitude below the run's running median (``loss / median <=
  FIT_RATIO``) is one the model already fits: near a minimum the gradient goes to 0 faster than the
  loss does (the residuals of a fitted batch cancel in its mean gradient), so its collapse is the
  fit's: info, not a warning. Also where the loss fell about as far as the gradients did
  (``loss / median <= FIT_SLACK * norm / median`` for every low module). A real collapse
  (saturated activations, dead ReLUs, a cut path) leaves the loss where it was, or raises it.
* **a spike the clip contains**: an EXPLODING_GRAD error (a spike at two checks in a row) where the
  run clips by norm (``monitor.clip_grad_norm_`` ran after the last check, with a ``max_norm`` within
  the spike rule's ``spike_factor`` x the running median, so the step the optimizer takes is no
  spike) and the loss is not climbing (the last ``RECENT`` checks' losses do not rank above the
  window's earlier ones beyond chance: a one-sided rank-sum test, ``CLIMB_Z``). Batch size 1 makes heavy-tailed
  per-sample norms, and two large ones in a row happen by chance; the clip is there for them.
  Said as a warning with what was seen (``Finding.against``). A loss that climbs, or a run that
  does not clip, keeps the error.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

from ..base import saved as checked
from ..base.findings import Finding, FindingKind as K
from ..base.report import describe_names
from ..base.status import Status

__all__ = ["LossFit", "WINDOW"]

#: the running median of the loss is taken over this many recent checks (at least WARMUP of them)
WINDOW, WARMUP = 100, 5
#: a batch's mean loss and its gradient are not exactly proportional (each sample's error and inputs
#: weigh differently): the loss's fall explains the gradients' within this factor
FIT_SLACK = 10.0
#: a batch whose loss is this far below the running median is already fitted
FIT_RATIO = 0.1
#: a run is mostly tied (NOTHING_TO_LEARN as a warning) from this many such checks in the window, and
#: more than half of its checks
MOSTLY = 4
#: the loss's recent median is over this many checks (this one included), against the window's earlier ones
RECENT = 16
#: the recent losses rank above the earlier ones with z above this (one-sided p < 0.01): the loss climbs
CLIMB_Z = 2.33
#: the spike's advice, not given to a run that clips already
_CLIP_ADVICE = "; clip gradients (clip_grad_norm_) to contain it"


class LossFit:
    def __init__(self) -> None:
        self.losses: deque[float] = deque(maxlen=WINDOW)
        self.nothing = 0  # checks with nothing to learn so far
        self.first: int | None = None
        self.tied: deque[bool] = deque(maxlen=WINDOW)  # per recent check: nothing to learn from it
        self._tied_now = False
        self.warned = False  # the mostly-tied warning was said
        #: what the framework's own logs said about the batches (the Trainer adapter writes TRL's
        #: ``frac_reward_zero_std`` here, with the step it was logged at)
        self.notes: dict[str, tuple[float, int]] = {}
        #: the ``max_norm`` of a clip by norm that ran since the last check (``monitor.clip_grad_norm_``)
        self.clip: float | None = None

    def clipped(self, max_norm: float) -> None:
        """A clip by 2-norm at ``max_norm`` ran on the last check's gradients."""
        self.clip = float(max_norm)

    def state_dict(self) -> dict:
        return {"losses": list(self.losses), "nothing": self.nothing, "first": self.first,
                "notes": {k: list(v) for k, v in self.notes.items()}, "tied": list(self.tied), "warned": self.warned,
                "clip": self.clip}

    def load_state_dict(self, state: dict) -> None:
        """Every key checked (:mod:`gradhealth.check.state`), then loaded."""
        checked.exact(state, ("losses", "nothing", "first", "notes", "tied", "warned", "clip"), "state['fit']")
        losses = state["losses"]
        if not isinstance(losses, list) or len(losses) > WINDOW:
            raise TypeError(f"state['fit']['losses'] must be a list of at most {WINDOW} losses")
        losses = [checked.number(v, f"state['fit']['losses'][{k}]") for k, v in enumerate(losses)]
        first = state["first"]
        first = None if first is None else checked.count(first, "state['fit']['first']")
        if not isinstance(state["notes"], dict) or not all(isinstance(k, str) for k in state["notes"]):
            raise TypeError("state['fit']['notes'] must map names to [value, step]")
        notes = {}
        for k, v in state["notes"].items():
            if not isinstance(v, list) or len(v) != 2:
                raise TypeError(f"state['fit']['notes'][{k!r}] must be [value, step]")
            notes[k] = (checked.number(v[0], f"state['fit']['notes'][{k!r}][0]"),
                        checked.count(v[1], f"state['fit']['notes'][{k!r}][1]"))
        tied, warned, clip = state["tied"], state["warned"], state["clip"]
        if not isinstance(tied, list) or len(tied) > WINDOW or not all(isinstance(t, bool) for t in tied):
            raise TypeError(f"state['fit']['tied'] must be a list of at most {WINDOW} bools")
        if not isinstance(warned, bool):
            raise TypeError("state['fit']['warned'] must be a bool")
        clip = None if clip is None else checked.number(clip, "state['fit']['clip']")
        self.losses = deque(losses, maxlen=WINDOW)
        self.nothing, self.first, self.notes = checked.count(state["nothing"], "state['fit']['nothing']"), first, notes
        self.tied, self.warned, self.clip = deque(tied, maxlen=WINDOW), warned, clip

    def add(self, loss: float | None) -> None:
        if loss is not None and math.isfinite(loss):
            self.losses.append(loss)
        self.tied.append(self._tied_now)
        self._tied_now = False
        self.clip = None  # (the next check's spike is contained only by a clip after this one)

    def explain(self, found: list[Finding], loss: float | None, step: int) -> list[Finding]:
        """The norm history's findings, with what the loss and the clip explain (:meth:`vanishing`,
        :meth:`contained`)."""
        return self.contained(self.vanishing(found, loss, step), loss)

    def trend(self, loss: float | None) -> tuple[float, float, int, int, float] | None:
        """(recent median, earlier median, their counts, z) of the loss, ``loss`` (this check's)
        counted among the ``RECENT`` recent ones; None when there is too little to tell. ``z``: the
        rank-sum statistic of the recent losses against the earlier ones (Mann-Whitney, normal
        approximation): above ``CLIMB_Z`` the recent ones are larger than chance allows, the loss
        climbs. Ranks, not means: with small batches the per-batch losses are heavy-tailed."""
        if loss is None or not math.isfinite(loss):
            return None
        past = list(self.losses)
        cut = max(len(past) - RECENT + 1, 0)
        recent, earlier = past[cut:] + [loss], past[:cut]
        n, k = len(recent), len(earlier)
        if k < WARMUP:
            return None
        ranked = sorted([(v, 1) for v in recent] + [(v, 0) for v in earlier])
        u = sum(r for r, (_, new) in enumerate(ranked, 1) if new) - n * (n + 1) / 2
        z = (u - n * k / 2) / math.sqrt(n * k * (n + k + 1) / 12)
        return statistics.median(recent), statistics.median(earlier), n, k, z

    def contained(self, found: list[Finding], loss: float | None) -> list[Finding]:
        """``found``, with an EXPLODING_GRAD error the clip contains while the loss is not climbing
        said as a warning with what was seen."""
        if self.clip is None or not any(f.kind == K.EXPLODING_GRAD and f.level == "error" for f in found):
            return found
        out = []
        for f in found:
            total, median, factor = (f.data.get(k) for k in ("total", "median", "factor"))
            trend = self.trend(loss) if f.kind == K.EXPLODING_GRAD and f.level == "error" and median else None
            if trend is None or trend[4] > CLIMB_Z or not total > self.clip or self.clip > factor * median:
                out.append(f)
                continue
            now, before, n, k, _ = trend
            seen = (f"the run clips by norm: clip_grad_norm_ (max_norm {self.clip:g}) scales these gradients by "
                    f"{self.clip / total:.2g}, so the step applies no spike, and the loss is not climbing (median "
                    f"{now:.3g} over the last {n} checks, {before:.3g} over the {k} before)")
            out.append(Finding(f.kind, f.message.replace(_CLIP_ADVICE, ""), params=f.params, level=f.level, step=f.step,
                               data={**f.data, "clip": self.clip, "loss_medians": (now, before)}, against=seen))
        return out

    def nothing_to_learn(self, report) -> list[Finding]:
        """NOTHING_TO_LEARN for a check whose loss is exactly 0 with every gradient exactly 0; its
        ZERO_GRAD parameters are tolerated. [] otherwise."""
        loss, status = report.loss, report.status
        if loss != 0.0 or not report.not_ok or any(c == 0 for c in report.valid_counts.values()):
            return []  # (a tracked count of 0: EMPTY_VALID_SET says it)
        zero = [n for n, s in status.items() if s is Status.ZERO_GRAD]
        if not zero or any(s is Status.OK or s is Status.NON_FINITE_GRAD or s is Status.NOT_IN_OPTIMIZER
                           for s in status.values()):
            return []
        self.nothing += 1
        if self.first is None:
            self.first = report.step
        self._tied_now = True
        tied, checks = sum(self.tied) + 1, len(self.tied) + 1
        mostly = tied >= MOSTLY and 2 * tied > checks
        warn = mostly and not self.warned
        self.warned = self.warned or warn
        # (no streak is counted at such a check: a parameter without a gradient now, a branch this
        # batch did not take, is judged by the checks around it, not by this one)
        report.tolerated = report.tolerated | frozenset(n for n, s in status.items() if s is Status.ZERO_GRAD
                                                        or s is Status.NO_GRAD)
        seen = self.notes.get("frac_reward_zero_std")
        trl = (f" TRL logged frac_reward_zero_std = {seen[0]:g} at step {seen[1]}: the rewards of "
               f"{'every' if seen[0] >= 1 else 'a share of the'} prompt group{'s' if seen[0] < 1 else ''} tied, so "
               "their advantages are 0." if seen is not None and seen[0] > 0 else "")
        count = ("" if self.nothing == 1 else f" ({self.nothing} such checks so far, the first at step {self.first})")
        share = f"{tied} of the last {checks} checks had nothing to learn"
        last = (f"Most batches are tied: {share}, so most steps train nothing. Make the rewards vary (harder or "
                "easier prompts, a graded reward) or skip such batches" if mostly else
                f"One such batch now and then is routine ({share}); a warning if most are")
        return [Finding(K.NOTHING_TO_LEARN, f"nothing to learn from this batch at step {report.step}: the loss is exactly 0 "
                        f"and every gradient is exactly 0, so the zeros come from the loss, not from the model "
                        f"({describe_names(status, zero)}).{trl} Likely: tied rewards / zero advantages (every completion "
                        "of a GRPO/PPO group scored the same: a task too hard or too easy for now), or an empty "
                        f"selection (a mask or weights that kept no term of the loss){count}. {last}",
                        level="warning" if warn else "info", step=report.step,
                        data={"count": self.nothing, "first": self.first, "tied": tied, "checks": checks})]

    def vanishing(self, found: list[Finding], loss: float | None, step: int) -> list[Finding]:
        """``found`` (the norm history's findings), with a VANISHING_GRAD collapse the loss's own
        collapse explains turned into info (the batch is already fitted)."""
        if loss is None or not math.isfinite(loss) or len(self.losses) < WARMUP \
                or not any(f.kind == K.VANISHING_GRAD for f in found):
            return found
        median = statistics.median(self.losses)
        if not median > 0 or loss < 0:  # (a loss that crosses 0, an RL or GAN objective: no ratio tells a fit)
            return found
        ratio = loss / median
        out = []
        for f in found:
            ratios = f.data.get("ratios") if f.kind == K.VANISHING_GRAD else None
            if ratios and (ratio <= FIT_RATIO or all(ratio <= FIT_SLACK * r for r in ratios.values())):
                out.append(Finding(K.VANISHING_GRAD, f"the batch is already fitted at step {step}: the loss {loss:.3g} is "
                                   f"{ratio:.3g}x its running median {median:.3g}, and the gradients of "
                                   f"{', '.join(list(ratios)[:5])}{' ...' if len(ratios) > 5 else ''} fell with it (to "
                                   f"{max(ratios.values()):.3g}x their median at most): nothing to fix",
                                   params=f.params, level="info", step=step,
                                   data={"loss_ratio": ratio, "ratios": ratios, "fitted": True}))
            else:
                out.append(f)
        return out

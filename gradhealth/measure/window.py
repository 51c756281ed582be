"""An accumulation window as its checks saw it: each micro-batch's loss and valid counts.

A check inside a window (DDP's ``no_sync()``, between an engine's accumulation boundaries) is
deferred: the gradients are partial, the check that ends the window judges them. What that call was
given is not thrown away: its loss (``check(loss=...)``) and the valid counts of ``track_valid``
since the call before are kept as they are, on the device (no host sync), and ride in the
transfer of the check that ends the window. That check then says what happened inside the window
(:func:`findings`): a micro-batch whose loss was non-finite (which one, on which rank), one whose
valid mask selected nothing, where the gradients of the whole window only show NON_FINITE_GRAD. The
window's valid counts are the sums over its micro-batches, as before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from torch import Tensor

from ..base.findings import Finding, FindingKind

__all__ = ["Window", "Seen", "quiet_row", "findings"]


class Window:
    """The deferred checks of the current window, in order (each one a micro-batch)."""

    __slots__ = ("losses", "counts", "n")

    def __init__(self):
        self.losses: list[tuple[int, Tensor]] = []  # (micro-batch, its loss: a scalar on its device)
        self.counts: list[tuple[int, dict[str, Tensor]]] = []  # (micro-batch, the valid counts taken at its call)
        self.n = 0

    def add(self, loss, valid: dict[str, Tensor]) -> None:
        """One deferred call: its loss (a scalar tensor, else nothing) and the counts since the last call."""
        if isinstance(loss, Tensor) and loss.numel() == 1 and (loss.is_floating_point() or loss.is_complex()):
            self.losses.append((self.n, loss.detach().reshape(())))
        if valid:
            self.counts.append((self.n, valid))
        self.n += 1

    def take(self) -> Window | None:
        """The window so far (None when no call was deferred), and a fresh one in its place."""
        if not self.n:
            return None
        out = Window()
        out.losses, out.counts, out.n = self.losses, self.counts, self.n
        self.losses, self.counts, self.n = [], [], 0
        return out

    def parts(self, valid: dict[str, Tensor]) -> tuple[list[Tensor], dict[str, list[Tensor]]]:
        """The device tensors to read with the window's last check (no op on them: they join its
        transfer as they are): its losses, and per valid name its micro-batches' counts (the last
        check's own ``valid`` last)."""
        names = dict.fromkeys([name for _, c in self.counts for name in c] + list(valid))
        counts = {name: [c[name] for _, c in self.counts if name in c] + ([valid[name]] if name in valid else [])
                  for name in names}
        return [t for _, t in self.losses], counts

    def seen(self, losses: list[float], counts: dict[str, list[float]], valid: dict[str, Tensor]) -> Seen:
        """What the window showed, from the values read back (:meth:`parts`' order)."""
        at = {name: [k for k, c in self.counts if name in c] + ([self.n] if name in valid else []) for name in counts}
        bad = [(k, v) for (k, _), v in zip(self.losses, losses) if not math.isfinite(v)]
        empty = {name: [k for k, c in zip(at[name], vals) if c == 0] for name, vals in counts.items()}
        return Seen(self.n + 1, bad, {n: ks for n, ks in empty.items() if ks},
                    {name: int(sum(vals)) for name, vals in counts.items()})


@dataclass
class Seen:
    """A window on the host: ``micro`` micro-batches (the last one the check that ends it); ``bad``:
    (micro-batch, loss) of those before it whose loss was non-finite; ``empty``: per valid name, the
    micro-batches whose count was 0; ``sums``: the window's count per valid name."""

    micro: int
    bad: list[tuple[int, float]] = field(default_factory=list)
    empty: dict[str, list[int]] = field(default_factory=dict)
    sums: dict[str, int] = field(default_factory=dict)

    def row(self, names: list[str]) -> list[float]:
        """This rank's part of the window's gather: the micro-batches, the first non-finite loss
        (micro-batch, value) and, per valid name (in ``names``' order), the first empty micro-batch
        (-1: none, or the whole window empty)."""
        first = self.bad[0] if self.bad else (-1, 0.0)
        out = [float(self.micro), float(first[0]), first[1]]
        for name in names:  # (a window empty as a whole is the usual EMPTY_VALID_SET's)
            ks = self.empty.get(name, []) if self.sums.get(name, 0) else []
            out.append(float(ks[0]) if ks else -1.0)
        return out

    @property
    def notable(self) -> bool:
        """Something inside the window to say (a non-finite loss, a micro-batch that selected nothing
        in a window that selected something)."""
        return bool(self.bad) or any(self.sums.get(name, 0) for name in self.empty)


def quiet_row(names: list[str]) -> list[float]:
    """The gather row of a rank without a window (no check deferred before this one)."""
    return Seen(1).row(names)


def findings(rows: list[list[float]], names: list[str], step: int, grads_finite: bool, ranked: bool) -> list[Finding]:
    """What happened inside the accumulation window a check ends, from every rank's row (one row,
    ``ranked`` False, on one process): NON_FINITE_LOSS for a micro-batch whose loss was
    non-finite, EMPTY_VALID_SET for one whose valid mask selected nothing (with the NaN loss it made,
    one finding: the emptiness is its cause), each naming the micro-batch and the rank. An empty
    micro-batch whose loss was not seen non-finite, in a window whose gradients are finite (a guarded
    mean), added nothing to them: said, not taken as an error."""
    bad: dict[int, tuple[int, int, float]] = {}  # rank -> (micro-batch, micro-batches, loss)
    empty: dict[str, dict[int, tuple[int, int]]] = {}  # name -> rank -> (micro-batch, micro-batches)
    made: dict[str, float] = {}  # name -> the non-finite loss an empty micro-batch of it made
    for r, row in enumerate(rows):
        n, k, v = int(row[0]), int(row[1]), row[2]
        for j, name in enumerate(names):
            e = int(row[3 + j])
            if e >= 0:
                empty.setdefault(name, {})[r] = (e, n)
                if e == int(row[1]):  # (its NaN loss: said with the emptiness that made it)
                    k, made[name] = -1, v
        if k >= 0:
            bad[r] = (k, n, v)

    def at(where: dict) -> str:
        return " in " + ", ".join(f"micro-batch {k + 1} of {n}{f' on rank {r}' if ranked else ''}"
                                  for r, (k, n, *_) in sorted(where.items()))

    def data(where: dict) -> dict:
        return {"ranks": sorted(where) if ranked else None, "micro_batches": {r: w[0] for r, w in where.items()},
                "window": max(w[1] for w in where.values())}

    found = []
    if bad:
        values = sorted({str(v) for _, _, v in bad.values()})
        found.append(Finding(
            FindingKind.NON_FINITE_LOSS, f"the loss was {' / '.join(values)}{at(bad)} of the accumulation window that "
            f"ends at step {step} (that micro-batch's check() waited for the window's end, where its gradients are "
            "summed with the others'): check the inputs and targets of that batch, a log or division inside the loss, "
            "or a mean over an empty mask (monitor.track_valid(mask) counts it; gh.masked_mean makes the empty case "
            "explicit)", step=step, data={**data(bad), "value": next(iter(bad.values()))[2]}))
    for name, where in empty.items():
        loss = f"its loss was {made[name]}" if name in made else "a mean over it is NaN (or 0 with a guarded mean)"
        found.append(Finding(
            FindingKind.EMPTY_VALID_SET, f"the valid mask {name!r} selected nothing{at(where)} of the accumulation "
            f"window that ends at step {step}: {loss}, and that micro-batch's gradients are summed into the window's; "
            "skip such batches or use gh.masked_mean(..., empty='zero')", step=step,
            data={**data(where), "name": name, "value": made.get(name)},
            against="its loss was not non-finite and the window's gradients are finite: a guarded mean, that "
                    "micro-batch added nothing to them" if grads_finite and name not in made else ""))
    return found

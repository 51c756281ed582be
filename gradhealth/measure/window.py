"""An accumulation window as its checks saw it: each micro-batch's loss and valid counts.

A check inside a window (DDP's ``no_sync()``, between an engine's accumulation boundaries) is
deferred: the gradients are partial, the check that ends the window judges them. What that call was
given is not thrown away: its loss (``check(loss=...)``) and the valid counts of ``track_valid``
since the call before are kept as they are, on the device (no host sync), and ride in the
transfer of the check that ends the window. That check then says what happened inside the window
(:mod:`gradhealth.judge.micro_batches`): a micro-batch whose loss was non-finite (which one, on which rank), one whose
valid mask selected nothing, where the gradients of the whole window only show NON_FINITE_GRAD. The
window's valid counts are the sums over its micro-batches, as before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from torch import Tensor

__all__ = ["Window", "Seen", "quiet_row"]


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



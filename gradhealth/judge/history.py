"""A running, outlier-robust baseline of gradient norms: exploding and vanishing gradients.

Kept on the host, in plain Python, from numbers every check already fetched (the total norm and
per-module norms), over a sliding window of checks: the baseline is the median, the spread the
MAD. A spike is a total norm far above both (``spike_factor`` x the median and ``spike_mads`` MADs
above it) or above an absolute ``ceiling``; a collapse is a module's norm below ``vanish_factor``
x its median. Nothing is judged during the first ``warmup`` checks. Per-module medians are
refreshed every ``refresh`` checks: the baseline moves slowly, and recomputing it every check
would cost more than the check itself.
"""

from __future__ import annotations

import bisect
import math
import operator
import statistics
from collections import deque

import torch

from ..base.findings import Finding, FindingKind

__all__ = ["NormHistory", "MAD_TO_SIGMA"]

_INF, _LT, _insort, _bisect_left = math.inf, operator.lt, bisect.insort, bisect.bisect_left

#: the MAD times this estimates the standard deviation of normally distributed values
MAD_TO_SIGMA = 1.4826


#: up to this many modules, their medians are sorted in plain Python, not as a tensor
NARROW = 16


def _median(ordered: list[float]) -> float:
    """``statistics.median`` of values already sorted."""
    n = len(ordered)
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def _column_medians(rows, width: int, warmup: int) -> list[float]:
    """Each column's median over ``rows`` as ``torch.nanmedian`` gives it (the lower middle value;
    NaN and a short row's missing columns left out), NaN with fewer than ``warmup`` values."""
    out = []
    if rows and min(map(len, rows)) >= width:  # the usual table: whole columns, sorted in C
        columns = [list(col) for col in zip(*rows)][:width]
    else:
        columns = [[r[c] for r in rows if c < len(r)] for c in range(width)]
    for col in columns:
        vals = sorted([v for v in col if v == v] if any(map(math.isnan, col)) else col)
        out.append(vals[(len(vals) - 1) // 2] if len(vals) >= warmup else math.nan)
    return out


class NormHistory:
    def __init__(
        self,
        window: int = 100,
        warmup: int = 20,
        spike_factor: float = 10.0,
        spike_mads: float = 10.0,
        vanish_factor: float = 1e-3,
        ceiling: float | None = None,
        refresh: int = 16,
    ):
        if window < 3 or warmup < 1 or warmup > window:
            raise ValueError(f"history needs window >= 3 and 1 <= warmup <= window; got window={window}, warmup={warmup}")
        if spike_factor <= 1 or not 0 < vanish_factor < 1:
            raise ValueError(f"spike_factor must be > 1 and vanish_factor in (0, 1); got {spike_factor}, {vanish_factor}")
        self.window = window
        self.warmup = warmup
        self.spike_factor = spike_factor
        self.spike_mads = spike_mads
        self.vanish_factor = vanish_factor
        self.ceiling = ceiling
        self.refresh = refresh
        self.total: deque[float] = deque(maxlen=window)
        self._sorted: list[float] = []  # the same values, sorted (the median without a sort per check)
        self.modules: list[str] = []
        self._col: dict[str, int] = {}
        self._rows: deque[list[float]] = deque(maxlen=window)  # one row of module norms per check
        self.seen = 0
        self._medians: list[float] = []
        self._floors: list[float] = []  # vanish_factor x the medians
        self._medians_at = -1
        self._table: torch.Tensor | None = None  # the rows as of check ``_table_seen``, for the medians
        self._table_seen = 0
        self._spiked = False  # the previous check was a spike

    # --------------------------------------------------------------- storage
    def _row(self, module_norms: dict[str, float]) -> list[float]:
        if len(module_norms) == len(self.modules) and list(module_norms) == self.modules:  # the usual check
            row = list(module_norms.values())
            if math.isfinite(sum(row)):
                return row
            return [v if math.isfinite(v) else math.nan for v in row]
        col = self._col
        for n in module_norms:
            if n not in col:
                col[n] = len(self.modules)
                self.modules.append(n)
                self._medians_at = -1
        row = [math.nan] * len(self.modules)
        for n, v in module_norms.items():
            row[col[n]] = v if math.isfinite(v) else math.nan
        return row

    def _module_medians(self) -> list[float]:
        if self._medians_at < 0 or self.seen - self._medians_at >= self.refresh:
            width = len(self.modules)
            if not self._rows or not width:
                self._medians, self._medians_at = [math.nan] * width, self.seen
                self._floors = self._medians
                return self._medians
            # the table of the window's rows as a tensor, extended by the rows added since the last
            # refresh only (converting 100 rows of Python floats costs more than the check itself)
            fresh, rows = self.seen - self._table_seen, self._rows
            if width <= NARROW:  # a few modules: sorted in plain Python (cheaper than the tensor ops)
                self._medians, self._medians_at = _column_medians(rows, width, self.warmup), self.seen
                self._floors = [self.vanish_factor * m for m in self._medians]
                return self._medians
            pad = lambda r: r + [math.nan] * (width - len(r)) if len(r) < width else r  # noqa: E731
            if self._table is None or self._table.shape[1] != width or fresh >= len(rows):
                table = torch.tensor([pad(r) for r in rows], dtype=torch.float64)
            else:
                new = [pad(rows[k]) for k in range(len(rows) - fresh, len(rows))]
                table = torch.cat([self._table, torch.tensor(new, dtype=torch.float64).reshape(-1, width)])[-len(rows):]
            self._table, self._table_seen = table, self.seen
            counts = (~torch.isnan(table)).sum(0)
            meds = table.nanmedian(dim=0).values
            meds[counts < self.warmup] = math.nan  # not enough history for that module yet
            self._medians, self._medians_at = meds.tolist(), self.seen
            self._floors = [self.vanish_factor * m for m in self._medians]
        return self._medians

    # --------------------------------------------------------------- judging
    def update(self, step: int, total: float, module_norms: dict[str, float], intermittent=()) -> list[Finding]:
        """Judge this check against the baseline, then add it to the baseline. ``intermittent``:
        modules whose gradients come and go (skipped layers, experts): their norm follows how many
        tokens reached them, so a low one is no collapse."""
        findings: list[Finding] = []
        if not math.isfinite(total) or total < 0:
            return findings  # non-finite gradients are a parameter state already; keep them out
        row = self._row(module_norms)
        judged = self.seen >= self.warmup
        if self.ceiling is not None and total > self.ceiling:
            findings.append(
                Finding(FindingKind.EXPLODING_GRAD, f"total grad norm {total:.3g} is above the ceiling {self.ceiling:.3g}: lower "
                        "the learning rate, clip gradients (clip_grad_norm_), or look for a bad batch",
                        step=step, data={"total": total, "ceiling": self.ceiling})
            )
        elif judged and (med := _median(self._sorted)) > 0:
            # (a zero median is no baseline yet: a loss term weighted 0 until now, a GAN phase
            # whose loss starts at 0; a spike is judged once the run's norms have a scale)
            spike = total > self.spike_factor * med  # (the MAD only then)
            spike = spike and total > med + self.spike_mads * MAD_TO_SIGMA * statistics.median(abs(v - med) for v in self.total)
            again, self._spiked = self._spiked and spike, spike
            if spike:
                meds = self._module_medians()
                jumps = [(v / m, c) for c, (v, m) in enumerate(zip(row, meds)) if m > 0 and v > self.spike_factor * m]
                names = tuple(self.modules[c] for _, c in sorted(jumps, reverse=True)[:5])
                where = f"; largest jumps in {', '.join(names)}" if names else ""
                # one spike is a warning (small batches and a bad sample make them in healthy runs);
                # two checks in a row is an error: the run is diverging
                findings.append(
                    Finding(FindingKind.EXPLODING_GRAD, f"total grad norm {total:.3g} is {total / med:.3g}x its running median "
                            f"{med:.3g}{where}{', at two checks in a row' if again else ''}: a bad batch (look at its inputs "
                            "and targets), a learning rate too high, or an fp16 overflow; clip gradients "
                            "(clip_grad_norm_) to contain it", params=names, step=step, level="error" if again else "warning",
                            data={"total": total, "median": med, "factor": self.spike_factor})
                )
        if judged:
            meds = self._module_medians()
            f = self.vanish_factor
            # NaN compares False; the list only when some module is low
            low = [c for c, (v, m) in enumerate(zip(row, meds)) if v < f * m and self.modules[c] not in intermittent] \
                if any(map(operator.lt, row, self._floors)) else []
            if low:
                desc = ", ".join(f"{self.modules[c]} ({row[c]:.3g} vs median {meds[c]:.3g})" for c in low[:5])
                more = f" and {len(low) - 5} more" if len(low) > 5 else ""
                findings.append(
                    Finding(FindingKind.VANISHING_GRAD, f"gradients collapsed below {f:g}x their running median in "
                            f"{desc}{more}: saturated activations, dead ReLUs, a learning rate that blew the weights up, "
                            "or a mask that cut the path", params=tuple(self.modules[c] for c in low), level="warning",
                            step=step, data={"ratios": {self.modules[c]: row[c] / meds[c] for c in low}})
                )
        self.seen += 1
        if len(self.total) == self.window:  # (the oldest leaves the window)
            del self._sorted[bisect.bisect_left(self._sorted, self.total[0])]
        self.total.append(total)
        bisect.insort(self._sorted, total)
        self._rows.append(row)
        return findings

    def quiet(self, total: float, module_norms: dict[str, float]) -> bool:
        """``update`` of a check it judges and finds nothing in, where that is sure before anything
        else changes (no ceiling, past the warm-up, the same modules as every row, finite norms, no
        module under its floor, no spike against the median): True, and the check added to the
        baseline as ``update`` adds it; else False, and nothing changed but the module medians
        refreshed when due, as ``update`` refreshes them (``update`` decides)."""
        seen = self.seen
        if self.ceiling is not None or seen < self.warmup or not 0.0 <= total < _INF:
            return False
        row = list(module_norms.values())  # (norms: >= 0, so a sum below inf holds no inf nor NaN)
        if not sum(row) < _INF or list(module_norms) != self.modules:
            return False
        if self._medians_at < 0 or seen - self._medians_at >= self.refresh:
            self._module_medians()  # (refreshed when due, as update refreshes them at a check it judges)
        if any(map(_LT, row, self._floors)):
            return False
        ordered = self._sorted
        n = len(ordered)
        med = ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2
        if med > 0:
            if total > self.spike_factor * med:  # (a spike, maybe: the MAD decides, in update)
                return False
            self._spiked = False
        self.seen = seen + 1
        totals = self.total
        if len(totals) == self.window:  # (the oldest leaves the window)
            del ordered[_bisect_left(ordered, totals[0])]
        totals.append(total)
        _insort(ordered, total)
        self._rows.append(row)
        return True

    def forget_last(self) -> None:
        """Take the newest check back out of the baseline (a step the guard skipped as a spike)."""
        if self.total:
            del self._sorted[bisect.bisect_left(self._sorted, self.total.pop())]
            self._rows.pop()
            self.seen -= 1
            self._medians_at, self._table = -1, None  # (the medians and the table held that row)

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        return {
            "seen": self.seen,
            "total": list(self.total),
            "modules": list(self.modules),
            "rows": [list(r) for r in self._rows],
            "spiked": self._spiked,  # (a spike at the next check is the second in a row: an error)
            # the module medians in use and the check they were taken at (refreshed every ``refresh`` checks)
            "medians": None if self._medians_at < 0 else {"at": self._medians_at, "values": list(self._medians)},
        }

    def load_state_dict(self, state: dict) -> None:
        """``state`` checked already (`gradhealth.base.saved.check_history`)."""
        self.seen = int(state["seen"])
        self.total = deque((float(v) for v in state["total"]), maxlen=self.window)
        self._sorted = sorted(self.total)
        self.modules = [str(m) for m in state["modules"]]
        self._col = {m: c for c, m in enumerate(self.modules)}
        self._rows = deque(([float(v) for v in r] for r in state["rows"]), maxlen=self.window)
        self._medians_at, self._table = -1, None
        self._spiked = bool(state["spiked"])
        medians = state["medians"]
        if medians is not None:
            self._medians, self._medians_at = [float(v) for v in medians["values"]], int(medians["at"])
            self._floors = [self.vanish_factor * m for m in self._medians]

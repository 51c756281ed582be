"""A running, outlier-robust baseline of gradient norms: exploding and vanishing gradients.

Kept on the host from numbers every check already fetched (the total norm and per-module norms),
over a sliding window of checks: the baseline is the median, the spread the MAD. A spike is a norm
far above both (``spike_factor`` x the median and ``spike_mads`` MADs above it) or above an absolute
``ceiling``; a collapse is a module's norm below ``vanish_factor`` x its median. Nothing is judged
during the first ``warmup`` checks.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

from .report import Finding

__all__ = ["NormHistory", "module_of"]


def module_of(name: str) -> str:
    return name.rpartition(".")[0] or "(root)"


class NormHistory:
    def __init__(
        self,
        window: int = 100,
        warmup: int = 20,
        spike_factor: float = 10.0,
        spike_mads: float = 10.0,
        vanish_factor: float = 1e-3,
        ceiling: float | None = None,
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
        self.total: deque[float] = deque(maxlen=window)
        self.modules: dict[str, deque[float]] = {}
        self.seen = 0

    @staticmethod
    def _baseline(values) -> tuple[float, float]:
        med = statistics.median(values)
        mad = statistics.median(abs(v - med) for v in values) * 1.4826
        return med, mad

    def _spiky(self, value: float, values) -> tuple[bool, float]:
        med, mad = self._baseline(values)
        return value > self.spike_factor * med and value > med + self.spike_mads * mad, med

    def update(self, step: int, total: float, module_norms: dict[str, float]) -> list[Finding]:
        """Judge this check against the baseline, then add it to the baseline."""
        findings: list[Finding] = []
        if not math.isfinite(total):
            return findings  # non-finite gradients are a parameter state already; keep them out
        judged = self.seen >= self.warmup
        if self.ceiling is not None and total > self.ceiling:
            findings.append(
                Finding("EXPLODING_GRAD", f"total grad norm {total:.3g} is above the ceiling {self.ceiling:.3g}: lower "
                        "the learning rate, clip gradients (clip_grad_norm_), or look for a bad batch",
                        step=step, data={"total": total, "ceiling": self.ceiling})
            )
        elif judged:
            spike, med = self._spiky(total, self.total)
            if spike:
                worst = sorted(
                    (m for m, v in module_norms.items() if m in self.modules and len(self.modules[m]) >= self.warmup
                     and v > self.spike_factor * statistics.median(self.modules[m])),
                    key=lambda m: -module_norms[m] / max(statistics.median(self.modules[m]), 1e-300),
                )[:5]
                where = f"; largest jumps in {', '.join(worst)}" if worst else ""
                findings.append(
                    Finding("EXPLODING_GRAD", f"total grad norm {total:.3g} is {total / med:.3g}x its running median "
                            f"{med:.3g}{where}: a bad batch (look at its inputs and targets), a learning rate too high, "
                            "or an fp16 overflow; clip gradients (clip_grad_norm_) to contain it",
                            params=tuple(worst), step=step, data={"total": total, "median": med})
                )
        if judged:
            vanished = []
            for m, v in module_norms.items():
                hist = self.modules.get(m)
                if hist is None or len(hist) < self.warmup:
                    continue
                med = statistics.median(hist)
                if med > 0 and v < self.vanish_factor * med:
                    vanished.append((m, v, med))
            if vanished:
                desc = ", ".join(f"{m} ({v:.3g} vs median {med:.3g})" for m, v, med in vanished[:5])
                more = f" and {len(vanished) - 5} more" if len(vanished) > 5 else ""
                findings.append(
                    Finding("VANISHING_GRAD", f"gradients collapsed below {self.vanish_factor:g}x their running median in "
                            f"{desc}{more}: saturated activations, dead ReLUs, a learning rate that blew the weights up, "
                            "or a mask that cut the path", params=tuple(m for m, _, _ in vanished), level="warning",
                            step=step)
                )
        self.seen += 1
        self.total.append(total)
        for m, v in module_norms.items():
            if math.isfinite(v):
                self.modules.setdefault(m, deque(maxlen=self.window)).append(v)
        return findings

    def state_dict(self) -> dict:
        return {"seen": self.seen, "total": list(self.total), "modules": {m: list(v) for m, v in self.modules.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.seen = int(state["seen"])
        self.total = deque((float(v) for v in state["total"]), maxlen=self.window)
        self.modules = {m: deque((float(x) for x in v), maxlen=self.window) for m, v in state["modules"].items()}

"""The CUSTOM SCALARS layout of one run, written for what that run logs.

A chart enters the layout once the run has written its series at two checks (one point is a dot,
not a line); the sink then writes the layout again, at the current step (TensorBoard shows a run's
latest layout). The first chart says in one line whether anything is wrong: how many parameters
are in trouble (0 when healthy) and a dot per finding. Titles say what healthy looks like.

Titles and patterns do not depend on the run (but for the update cadence, which is the monitor's
``update_every``, said once three gaps in a row between measured steps are the same: the first checks
are measured more densely), so TensorBoard, which merges the runs' layouts chart by chart, shows each chart
once for several runs.
"""

from __future__ import annotations

from gradhealth.publish.metrics import PREFIX, TROUBLE
from gradhealth.base.report import Report
from gradhealth.base.status import Status

__all__ = ["RunLayout", "layout", "NOT_OK"]

#: the states of the per-state chart: every state but OK
NOT_OK = "|".join(s.value for s in Status if s is not Status.OK)


def _charts(norm: str, every: int | None) -> dict[str, tuple[str, list[str]]]:
    """chart key -> (title, tag patterns), in the order of the layout."""
    cadence = "at every check" if every == 1 else f"every {every} steps" if every else "when measured"
    return {
        "trouble": ("parameters in trouble (healthy: 0); a dot per finding",
                    [rf"{PREFIX}/{TROUBLE}.*", rf"{PREFIX}/findings/.*"]),
        "loss": ("loss (healthy: falling)", [rf"{PREFIX}/loss.*"]),
        "grad": (f"gradient norm{' before clipping' if norm.endswith('preclip') else ''} by parameter or module (healthy: steady, above 0)",
                 [rf"{PREFIX}/{norm}/.*"]),
        "states": ("parameters by state, the states other than OK", [rf"{PREFIX}/status/({NOT_OK}).*"]),
        "update": (f"update ratio |Δθ|/|θ| by parameter or module, {cadence} (healthy: about 1e-3, steady)",
                   [rf"{PREFIX}/update_ratio/.*"]),
        "skipped": ("steps the step guard skipped (healthy: 0)", [rf"{PREFIX}/skipped.*"]),
        "valid": ("valid counts (healthy: above 0 at every step)", [rf"{PREFIX}/valid/.*"]),
        "experts": ("expert utilization by MoE layer (healthy: near 1; 0: collapse)",
                    [rf"{PREFIX}/experts/utilization/.*"]),
        "expert_norms": ("expert gradient norm, min and max by MoE layer (healthy: min above 0)",
                         [rf"{PREFIX}/experts/grad_norm_m.*"]),
    }


def layout(norm: str = "grad_norm", charts=None, every: int | None = None) -> dict:
    """The custom-scalars layout with the given charts (keys of the chart table; all by default)."""
    table = _charts(norm, every)
    keys = list(table) if charts is None else [k for k in table if k in charts]
    return {"gradhealth": {table[k][0]: ["Multiline", table[k][1]] for k in keys}}


class RunLayout:
    """Which charts a run has earned: counts, per chart, the checks that wrote its series."""

    def __init__(self, norm: str):
        self.norm = norm
        self._points: dict[str, int] = {}
        self._update_steps: list[int] = []
        self._written: tuple | None = None

    def _saw(self, key: str) -> None:
        self._points[key] = self._points.get(key, 0) + 1

    def saw_report(self, report: Report) -> None:
        """The series a written report puts in the charts (the keys of :func:`report_metrics`)."""
        self._saw("trouble")
        self._saw("grad")
        if report.loss is not None:
            self._saw("loss")
        if "states" in self._points or any(s is not Status.OK for _, s in report._odd()):
            self._saw("states")  # (the state counts are written at every check from then on)
        if report.guarded or report.skipped is not None:
            self._saw("skipped")
        if report.valid_counts:
            self._saw("valid")
        if report.expert_layers:
            self._saw("experts")
            self._saw("expert_norms")

    def saw_update(self, report: Report) -> None:
        if report.update_norm and report.step not in self._update_steps:
            self._update_steps = [*self._update_steps[-3:], report.step]  # (the cadence of the title: the last four)
            self._saw("update")

    def due(self) -> dict | None:
        """The layout to write now, or None when the charts earned are those written last."""
        charts = tuple(k for k, n in self._points.items() if n >= 2)
        steps = self._update_steps  # a cadence once three gaps in a row are the same (the first checks are denser)
        gaps = {b - a for a, b in zip(steps, steps[1:])}
        every = gaps.pop() if len(steps) == 4 and len(gaps) == 1 else None
        if not charts or (charts, every) == self._written:
            return None
        self._written = (charts, every)
        return layout(self.norm, charts, every)

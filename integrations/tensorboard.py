"""TensorBoard adapter: ``TensorBoardSink`` (scalars, dashboards, findings as text).

Tags (public API) are the scheme of :mod:`gradhealth.publish.metrics` (``gradhealth/grad_norm/<name>``,
``gradhealth/status/<STATE>``, ``gradhealth/update_ratio/<name>``, ``gradhealth/valid/<name>``,
``gradhealth/findings/<KIND>``, ...), plus:

* ``gradhealth/findings_text``: the findings of a step, as text (the TEXT tab);
* ``gradhealth/gradient_flow``: an image, modules x steps, log10 gradient norm (NO_GRAD grey,
  FROZEN blue, non-finite red), written every ``heatmap_every`` checks (:mod:`.gradient_flow`);
* ``gradhealth/expert_map``: with stacked experts, an image, MoE layers x experts, each expert's
  gradient norm over the recent checks (idle at all of them black, DEAD_EXPERT red);
* a custom-scalars layout (the CUSTOM SCALARS tab) written for the run (:mod:`.tblayout`): the
  parameters in trouble (0 when healthy) and the findings first, then loss, gradient norm by
  module, the states other than OK, update ratio by module, skipped steps, valid counts and the
  experts' charts, each once its series has two points;
* ``gradhealth/grad_norm_hist``: opt-in histogram of the per-parameter log10 gradient norms.

Names are per parameter for models of up to 100 parameter tensors and per module above that
(``granularity="param"`` or ``"module"`` overrides it). Reading a run back: :func:`read_run`
(from :mod:`.tbreport`, re-exported here).
"""

from __future__ import annotations

import math
import os

import numpy as np
from tensorboard.compat.proto.summary_pb2 import Summary
from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard.summary import custom_scalars

from gradhealth.publish.metrics import PREFIX, clip_metrics, report_metrics, update_metrics
from gradhealth.base.naming import module_of
from gradhealth.base.report import Report, describe_groups, group_by_module
from gradhealth.base.combine import combine_norms
from gradhealth.base.status import Status, hint

from .gradient_flow import CODES, WORST, Window, expert_map_image, flow_picture, labelled_experts, load_font, png
from .tblayout import RunLayout, layout
from .tbevents import scalar_summary
from .tbread import NAMES, read_run

__all__ = ["TensorBoardSink", "read_run", "layout"]

AUTO_PARAM_LIMIT = 100


_STATES = list(Status)  # (a state's code -> the state; iterating the enum itself runs Python)


def _listed(rows, most: int = 256) -> str:
    names = [n for _, ns, _ in rows for n in ns]
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def _they(rows) -> str:
    """The subject of a state's words: ``These 2 parameters`` (the hint's verb agrees with it)."""
    n = sum(len(ns) for _, ns, _ in rows)
    return "This parameter" if n == 1 else f"These {n} parameters"


def _writable(path: str) -> None:
    """Create ``path`` and prove a file can be written there now, in the caller's thread: else
    SummaryWriter fails deep inside its writer thread, after training started."""
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".gradhealth-write-test-{os.getpid()}")
        with open(probe, "wb"):
            pass
        os.remove(probe)
    except OSError as exc:
        raise OSError(exc.errno, f"TensorBoardSink cannot write to the log directory {path!r} "
                                 f"({exc.strerror or type(exc).__name__}{': ' + exc.filename if exc.filename and exc.filename != path else ''}); "
                                 "pass a writable directory") from None


class TensorBoardSink:
    """Writes each report to TensorBoard.

    Args:
        logdir_or_writer: a log directory, or a ``SummaryWriter`` (e.g. a Lightning
            TensorBoardLogger's ``logger.experiment``, so everything lands in one run).
        granularity: "param", "module", or None (per parameter up to 100 parameter tensors).
        histograms: also write a histogram of per-parameter log10 grad norms.
        heatmap_every: write the gradient-flow image every this many checks (0: never).
        heatmap_window: the image covers at most this many recent checks.
        scalars: write the scalar tags (False when a logger writes them already).
        norm: the norm's tag name (``grad_norm``; Lightning uses ``grad_norm_preclip``).
        close_writer: close the writer at ``close()`` (default: only one this sink opened).
        every_n: write every n-th report (like Lightning's ``log_every_n_steps``); a report with a
            problem or a finding above info level is always written, and so is the first.
        on_steps: write at the steps that are multiples of ``every_n`` instead (Trainer's
            ``logging_steps``: the same steps as Trainer's own scalars).
    """

    def __init__(self, logdir_or_writer, *, granularity: str | None = None, histograms: bool = False,
                 heatmap_every: int = 50, heatmap_window: int = 200, scalars: bool = True, norm: str = "grad_norm",
                 close_writer: bool | None = None, every_n: int = 10, on_steps: bool = False):
        if granularity not in (None, "param", "module"):
            raise ValueError(f"granularity must be one of None, 'param', 'module'; got {granularity!r}")
        if not isinstance(heatmap_every, int) or heatmap_every < 0:
            raise ValueError(f"heatmap_every must be an int >= 0; got {heatmap_every!r}")
        if isinstance(every_n, bool) or not isinstance(every_n, int) or every_n < 1:
            raise ValueError(f"every_n must be a positive int; got {every_n!r}")
        if isinstance(logdir_or_writer, (str, os.PathLike)):
            path = os.fspath(logdir_or_writer)
            if not str(path).strip():
                raise ValueError("TensorBoardSink: the log directory is empty (''); pass a directory such as "
                                 "'runs/exp1' (an empty one would make SummaryWriter invent runs/<date_host>)")
            _writable(str(path))
            # a deep queue: the writer thread serialises events while training runs
            self.writer = SummaryWriter(str(path), max_queue=256)
            owned = True
        elif hasattr(logdir_or_writer, "add_scalar"):
            self.writer = logdir_or_writer
            owned = False
        else:
            raise TypeError(f"TensorBoardSink needs a log directory or a SummaryWriter; got {type(logdir_or_writer).__name__}")
        self.every_n = every_n
        self.on_steps = bool(on_steps)
        self._seen = 0
        self._written: list[int] = []  # the steps written lately (their updates follow them)
        self.granularity = granularity
        self.histograms = histograms
        self.heatmap_every = heatmap_every
        self.heatmap_window = heatmap_window
        self.scalars = scalars
        self.norm = norm
        self.close_writer = owned if close_writer is None else close_writer
        self._layout = RunLayout(norm)
        self._window = Window(heatmap_window)  # the recent checks' columns of the picture
        self._modules: dict[str, None] = {}
        self._checks = 0
        self._pictured = -1  # the check count at the last picture
        self._texts: dict[int, set[int]] = {}
        self._states: list[str] = []
        self._text_key = None  # (the errors, the names) the entries of ``_states`` were made of
        self._odd_key: tuple = ((), (), None, None)  # (not-OK names, their states, frozen rows, column): the last
        self._module_of: dict[str, str] = {}
        self._row: dict[str, int] = {}
        self._frozen: tuple[list[str], list[int]] = ([], [])  # (frozen names, the column they make)
        self._expert_columns: list[tuple[dict, set]] = []  # recent checks: (expert norms, dead experts)
        self._expert_layers: dict[str, list[str]] = {}
        self._expert_step = 0
        if heatmap_every:
            load_font()  # (decoding it takes as long as drawing a picture: not in the middle of training)

    def _granularity(self, report: Report) -> str:
        if self.granularity is not None:
            return self.granularity
        return "param" if len(report.status) <= AUTO_PARAM_LIMIT else "module"

    def _wanted(self, report: Report) -> bool:
        self._seen += 1
        if (report.step if self.on_steps else self._seen - 1) % self.every_n == 0:
            return True
        return bool(report.findings) and any(f.level != "info" for f in report.findings) or not report.ok

    def write(self, report: Report) -> None:
        self._remember(report)  # every check is a column of the gradient-flow picture
        if self._wanted(report):
            self._write(report)
        if self.heatmap_every and len(self._window) and self._checks % self.heatmap_every == 0:
            self.write_heatmap(report.step)

    def _write(self, report: Report) -> None:
        self._written = self._written[-15:] + [report.step]
        w = self.writer
        self._layout.saw_report(report)
        self._write_layout(report.step)
        granularity = self._granularity(report)
        metrics = report_metrics(report, granularity, self.norm)
        if self.scalars:
            self._scalars(metrics, report.step)
        if self.histograms and report.grad_norm:
            logs = np.array([math.log10(v) for v in report.grad_norm.values() if v > 0 and math.isfinite(v)])
            if logs.size:
                w.add_histogram(f"{PREFIX}/{self.norm}_hist", logs, report.step)
        self._write_text(report)
        if report.expert_layers:
            self._expert_columns = (self._expert_columns + [(report.expert_grad_norm, {u for f in report.findings
                                    if f.kind == "DEAD_EXPERT" and f.step == report.step for u in f.params})])[-self.heatmap_window:]
            self._expert_layers, self._expert_step = report.expert_layers, report.step
        if not report.ok:
            w.flush()  # a failing step is on disk before any error propagates

    def _write_text(self, report: Report) -> None:
        """The step's own findings not written yet (those of its optimizer step come later), and
        at its first writing, the parameters in each error state, grouped by module."""
        done = self._texts.get(report.step)
        parts = []
        if done is None:
            done = self._texts[report.step] = set()
            errors = report.errors
            key = (errors, list(report.status)) if errors else None  # (what the entries are made of)
            states = self._states if key is not None and key == self._text_key else self._state_texts(report, errors)
            self._text_key = key
            if states != self._states:  # written when they change, not at every step of a long problem
                self._states = states
                parts += [t.format(report.step) for t in states]
        new = [f for f in report.findings if f.level != "info" and f.step == report.step and id(f) not in done]
        done.update(id(f) for f in new)
        parts += [f"**{f.kind}** ({f.level}, step {f.step}): {f.message}" for f in new]
        if parts:
            # exact names: a browser shows them, and ``gradhealth report`` escapes them for terminals
            # and CSV (its JSON gives them back as they are)
            self.writer.add_text(f"{PREFIX}/findings_text", "\n\n".join(parts), report.step)
        while len(self._texts) > 8:
            self._texts.pop(next(iter(self._texts)))

    @staticmethod
    def _state_texts(report: Report, errors) -> list[str]:
        """An entry per error state: its parameters grouped by module, their names, then what the
        state means and what to do, as the console warning says it (``{}``: the step)."""
        by_state: dict[Status, list] = {}
        for row in group_by_module(report.status, errors) if errors else ():  # (no walk of every name)
            by_state.setdefault(row[2], []).append(row)
        return [f"**{state.value}** (error, step {{}}): {describe_groups(rows)}{NAMES}{_listed(rows)}\n\n"
                f"{_they(rows)} {hint(state, sum(len(ns) for _, ns, _ in rows))}" for state, rows in by_state.items()]

    def write_stop(self, step: int | None, message: str) -> None:
        """The error that stops training, as text (``gradhealth/stopped``), flushed to disk."""
        self.writer.add_text(f"{PREFIX}/stopped", message, step if step is not None else 0)
        self.writer.flush()

    def write_update(self, report: Report) -> None:
        if report.step not in self._written and not any(f.level != "info" for f in report.findings):
            return
        self._write_text(report)
        self._layout.saw_update(report)
        self._write_layout(report.step)
        if not self.scalars:
            return
        self._scalars(update_metrics(report, self._granularity(report)), report.step)

    def write_clip(self, report: Report) -> None:
        """The clip's factor at the report's step (a clip that bites: always)."""
        if self.scalars and (report.step in self._written or report.clip_coef < 1.0):
            self._scalars(clip_metrics(report), report.step)

    def _write_layout(self, step: int) -> None:
        """The layout of the charts this run has earned, when they changed (at this step: a
        layout at step 0 after later scalars could be taken for a restarted run)."""
        due = self._layout.due()
        if due is None:
            return
        file_writer = getattr(self.writer, "_get_file_writer", None)
        if file_writer is None:
            self.writer.add_custom_scalars(due)
        else:
            file_writer().add_summary(custom_scalars(due), step)

    def _scalars(self, metrics: dict[str, float], step: int) -> None:
        """All of a step's scalars in ONE event (one protobuf, one record): a SummaryWriter's
        add_scalar writes one event per value, which costs more than the check itself."""
        if not metrics:
            return
        file_writer = getattr(self.writer, "_get_file_writer", None)
        if file_writer is None:  # another writer type: the portable, slower path
            for tag, value in metrics.items():
                self.writer.add_scalar(tag, value, step)
            return
        file_writer().add_summary(scalar_summary(metrics), step)  # (no Python per scalar: .tbevents)

    def _image(self, tag: str, img: np.ndarray, step: int) -> None:
        """An HxWx3 uint8 picture as ``add_image(..., dataformats="HWC")`` writes it (a PNG in an
        image summary), encoded here (:func:`.gradient_flow.png`: the same pixels, a fraction of
        the time of the writer's conversions and its compression; a picture comes every
        ``heatmap_every`` checks)."""
        file_writer = getattr(self.writer, "_get_file_writer", None)
        if file_writer is None or img.dtype != np.uint8 or img.ndim != 3 or img.shape[2] != 3:
            self.writer.add_image(tag, img, step, dataformats="HWC")
            return
        picture = Summary.Image(height=img.shape[0], width=img.shape[1], colorspace=3, encoded_image_string=png(img))
        file_writer().add_summary(Summary(value=[Summary.Value(tag=tag, image=picture)]), step)

    def _remember(self, report: Report) -> None:
        """One heatmap column: each module's gradient norm and its worst parameter state, as lists
        aligned with ``self._modules`` (modules are only ever appended). A parameter first judged at
        a later check (another optimizer's turn under ``toggle_optimizer``, a layer added or
        unfrozen) gets its module's row then: every judged name is looked up below (it has a
        gradient norm, or a state other than OK), and a name not seen before is learnt at its miss."""
        self._checks += 1
        if not self._module_of:
            self._learn(report.status)  # (the rows in the model's order)
        try:
            column = self._column(report)
        except KeyError:
            self._learn(report.status)
            column = self._column(report)
        self._window.add(*column, report.step)

    def _column(self, report: Report) -> tuple[list[float], list[int]]:
        module_norms = report.module_grad_norm or None
        modules = self._module_of
        if module_norms is None:  # per-parameter tags: sum the squares here
            sq: dict[str, list[float]] = {}
            for name, v in report.grad_norm.items():
                sq.setdefault(modules[name], []).append(v)
            module_norms = {m: combine_norms(vs) for m, vs in sq.items()}
        row = self._row
        if len(module_norms) == len(row) and list(module_norms) == list(row):  # every module, in row order:
            values = list(module_norms.values())                                 # no Python loop per module
        else:
            for m in module_norms:  # (a module the checks before did not judge: its row now)
                if m not in row:
                    self._modules.setdefault(m)
                    row[m] = len(row)
            values = [0.0] * len(row)
            for m, v in module_norms.items():
                values[row[m]] = v
        worst, code = WORST, _STATES
        if report.not_ok is not None:  # the frozen rows once per set of frozen names, not a walk at each check
            base = self._frozen_rows(report.frozen_names or [])
            if not report.not_ok:
                return values, base  # (the frozen rows' column itself: the window copies it)
            seen = list(map(report.status.__getitem__, report.not_ok))
            names, was, last_base, column = self._odd_key
            if last_base is base and names == report.not_ok and was == seen:  # (a problem that holds)
                return values, column
            states, odd = base.copy(), zip(report.not_ok, seen)
        else:
            base, states, odd = None, [CODES[Status.OK]] * len(row), report._odd()
        for name, state in odd:  # only the parameters that are neither OK nor FROZEN (or all not OK)
            i = row[modules[name]]
            if worst[state] > worst[code[states[i]]]:
                states[i] = CODES[state]
        if base is not None:
            self._odd_key = (list(report.not_ok), seen, base, states)
        return values, states

    def _learn(self, names) -> None:
        """Each of ``names`` not seen before: its module, and the module's row when it is new."""
        modules = self._module_of
        for name in names:
            if name not in modules:
                modules[name] = module_of(name)
                if modules[name] not in self._row:
                    self._row[modules[name]] = len(self._row)
                    self._modules.setdefault(modules[name])

    def _frozen_rows(self, frozen: list[str]) -> list[int]:
        """A column's states with the rows of ``frozen`` FROZEN and the others OK (the caller copies
        it to change it): worked out again only when the frozen names or the rows change (one C-level
        comparison a check)."""
        key, base = self._frozen
        if len(base) != len(self._row) or key != frozen:
            ok, cold, row, modules = CODES[Status.OK], CODES[Status.FROZEN], self._row, self._module_of
            base = [ok] * len(row)
            for name in frozen:
                base[row[modules[name]]] = cold
            self._frozen = (list(frozen), base)
        return base

    def write_heatmap(self, step: int | None = None) -> None:
        """Write the gradient-flow image of the recent checks now."""
        if not len(self._window):
            return
        self._pictured = self._checks
        rows = list(self._modules)
        value, state = self._window.arrays(len(rows))
        steps = list(self._window.steps)
        img = flow_picture(value, state, rows, steps)
        self._image(f"{PREFIX}/gradient_flow", img, steps[-1] if step is None else step)
        if self._expert_columns:
            self.write_expert_map(step)

    def write_expert_map(self, step: int | None = None) -> None:
        """Write the expert map (MoE layers x experts, recent gradient norms, dead ones marked) now."""
        layers = list(self._expert_layers)
        count = max(len(u) for u in self._expert_layers.values())
        value = np.full((len(layers), count), np.nan)
        dead = np.zeros((len(layers), count), dtype=bool)
        last_dead = self._expert_columns[-1][1]
        for i, layer in enumerate(layers):
            for j, unit in enumerate(self._expert_layers[layer]):
                seen = [norms[unit] for norms, _ in self._expert_columns if unit in norms and math.isfinite(norms[unit])]
                value[i, j] = math.sqrt(sum(v * v for v in seen) / len(seen)) if seen else 0.0
                dead[i, j] = unit in last_dead
        cell = (max(6, min(24, 800 // count)), max(8, min(18, 480 // max(1, len(layers)))))
        img = labelled_experts(expert_map_image(layers, value, dead, cell), layers, count, self._expert_step, cell)
        self._image(f"{PREFIX}/expert_map", img, self._expert_step if step is None else step)

    def flush(self) -> None:
        if len(self._window) and self.heatmap_every and self._pictured != self._checks:  # (not the same picture twice)
            self.write_heatmap()
        self.writer.flush()

    def close(self) -> None:
        if self.close_writer:
            self.writer.close()

"""TensorBoard adapter: ``TensorBoardSink`` (scalars, dashboards, findings) and ``read_run``.

Tags (public API) are the scheme of :mod:`gradhealth.metrics` (``gradhealth/grad_norm/<name>``,
``gradhealth/status/<STATE>``, ``gradhealth/update_ratio/<name>``, ``gradhealth/valid/<name>``,
``gradhealth/findings/<KIND>``, ...), plus:

* ``gradhealth/findings_text``: the findings of a step, as text (the TEXT tab);
* ``gradhealth/gradient_flow``: an image, modules x steps, log10 gradient norm (NO_GRAD grey,
  FROZEN blue, non-finite red), written every ``heatmap_every`` checks;
* a custom-scalars layout (the CUSTOM SCALARS tab), written once per run: gradient norm by module,
  update ratio by module, parameter states over time, valid counts, loss;
* ``gradhealth/grad_norm_hist``: opt-in histogram of the per-parameter log10 gradient norms.

Names are per parameter for models of up to 100 parameter tensors and per module above that
(``granularity="param"`` or ``"module"`` overrides it).
"""

from __future__ import annotations

import json
import math
import os
import re
import sys

import numpy as np
from tensorboard.compat.proto.summary_pb2 import Summary
from torch.utils.tensorboard import SummaryWriter

from gradhealth.history import module_of
from gradhealth.metrics import PREFIX, report_metrics, update_metrics
from gradhealth.report import Report
from gradhealth.status import Status

__all__ = ["TensorBoardSink", "read_run", "layout", "gradient_flow_image", "summarize_run", "main"]

AUTO_PARAM_LIMIT = 100


def layout(norm: str = "grad_norm") -> dict:
    """The custom-scalars layout: the charts a person wants side by side."""
    return {
        "gradhealth": {
            "gradient norm by module": ["Multiline", [rf"{PREFIX}/{norm}/.*"]],
            "update ratio by module": ["Multiline", [rf"{PREFIX}/update_ratio/.*"]],
            "parameter states over time": ["Multiline", [rf"{PREFIX}/status/.*"]],
            "valid counts": ["Multiline", [rf"{PREFIX}/valid/.*"]],
            "loss and findings": ["Multiline", [rf"{PREFIX}/loss.*", rf"{PREFIX}/findings/.*"]],
        }
    }


# colours of the heatmap: log-norm ramp from dark to bright, and flat colours for the states
_RAMP = np.array([[13, 8, 135], [126, 3, 168], [204, 71, 120], [248, 149, 64], [240, 249, 33]], dtype=np.float64)
_COLOURS = {
    Status.NO_GRAD: (128, 128, 128),
    Status.FROZEN: (60, 110, 200),
    Status.NON_FINITE_GRAD: (230, 20, 20),
}


_CODES = {s: k for k, s in enumerate(Status)}


def gradient_flow_image(rows: list[str], columns: list[dict[str, tuple[float, Status]]], cell: tuple[int, int] = (8, 10)) -> np.ndarray:
    """An HxWx3 uint8 image: one row per module, one column per check, coloured by log10 norm.

    ``columns[j][module] = (norm, state)``; a module's state is the worst of its parameters'.
    """
    index = {m: i for i, m in enumerate(rows)}
    value = np.full((len(rows), len(columns)), np.nan)
    state = np.full((len(rows), len(columns)), -1, dtype=np.int64)  # -1: no entry (white)
    for j, col in enumerate(columns):
        for m, (v, s) in col.items():
            i = index.get(m)
            if i is not None:
                value[i, j] = v
                state[i, j] = _CODES[s]
    return _image(value, state, cell)


def _image(value: np.ndarray, state: np.ndarray, cell: tuple[int, int]) -> np.ndarray:
    rgb = np.full(value.shape + (3,), 255.0)
    plain = (state >= 0) & np.isin(state, [_CODES[s] for s in _COLOURS], invert=True)
    positive = plain & np.isfinite(value) & (value > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        logs = np.where(positive, np.log10(np.where(positive, value, 1.0)), np.nan)
    if positive.any():
        lo, hi = np.nanmin(logs), np.nanmax(logs)
        t = np.nan_to_num((logs - lo) / max(hi - lo, 1e-12) * (len(_RAMP) - 1))
        k = np.clip(np.floor(t), 0, len(_RAMP) - 2).astype(np.int64)
        ramp = _RAMP[k] + (t - k)[..., None] * (_RAMP[k + 1] - _RAMP[k])
        rgb[positive] = ramp[positive]
    rgb[plain & ~positive] = 0.0  # zero gradients: black
    for s, colour in _COLOURS.items():
        rgb[state == _CODES[s]] = colour
    cw, ch = cell
    return np.repeat(np.repeat(rgb.astype(np.uint8), ch, axis=0), cw, axis=1)


def _label(img: np.ndarray, rows: list[str], steps: list[int], cell: tuple[int, int]) -> np.ndarray:
    """Module names on the left and steps underneath, with PIL when it is installed."""
    try:
        from PIL import Image, ImageDraw
    except ImportError:
        return img
    cw, ch = cell
    left = 8 + 6 * max((len(r) for r in rows), default=4)
    canvas = Image.new("RGB", (max(left + img.shape[1] + 8, 560), img.shape[0] + 36), "white")
    canvas.paste(Image.fromarray(img), (left, 4))
    draw = ImageDraw.Draw(canvas)
    for i, r in enumerate(rows):
        if ch >= 10 or i % max(1, 10 // ch) == 0:
            draw.text((4, 4 + i * ch), r, fill=(0, 0, 0))
    if steps:
        draw.text((left, img.shape[0] + 8), f"step {steps[0]}", fill=(0, 0, 0))
        draw.text((left + max(0, img.shape[1] - 60), img.shape[0] + 8), f"step {steps[-1]}", fill=(0, 0, 0))
    draw.text((left, img.shape[0] + 22), "log10 grad norm: dark=low bright=high; grey NO_GRAD, blue FROZEN, red NaN/inf", fill=(0, 0, 0))
    return np.asarray(canvas)


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
    """

    def __init__(self, logdir_or_writer, *, granularity: str | None = None, histograms: bool = False,
                 heatmap_every: int = 50, heatmap_window: int = 200, scalars: bool = True, norm: str = "grad_norm",
                 close_writer: bool | None = None):
        if isinstance(logdir_or_writer, (str, os.PathLike)):
            # a deep queue: the writer thread serialises events while training runs
            self.writer = SummaryWriter(str(logdir_or_writer), max_queue=256)
            owned = True
        elif hasattr(logdir_or_writer, "add_scalar"):
            self.writer = logdir_or_writer
            owned = False
        else:
            raise TypeError(f"TensorBoardSink needs a log directory or a SummaryWriter; got {type(logdir_or_writer).__name__}")
        if granularity not in (None, "param", "module"):
            raise ValueError(f"granularity must be one of None, 'param', 'module'; got {granularity!r}")
        if not isinstance(heatmap_every, int) or heatmap_every < 0:
            raise ValueError(f"heatmap_every must be an int >= 0; got {heatmap_every!r}")
        self.granularity = granularity
        self.histograms = histograms
        self.heatmap_every = heatmap_every
        self.heatmap_window = heatmap_window
        self.scalars = scalars
        self.norm = norm
        self.close_writer = owned if close_writer is None else close_writer
        self._layout_written = False
        self._columns: list[dict[str, tuple[float, Status]]] = []
        self._steps: list[int] = []
        self._modules: dict[str, None] = {}
        self._writes = 0
        self._texts: dict[int, set[int]] = {}
        self._module_of: dict[str, str] = {}
        self._row: dict[str, int] = {}

    def _granularity(self, report: Report) -> str:
        if self.granularity is not None:
            return self.granularity
        return "param" if len(report.status) <= AUTO_PARAM_LIMIT else "module"

    def write(self, report: Report) -> None:
        w = self.writer
        if not self._layout_written:
            w.add_custom_scalars(layout(self.norm))
            self._layout_written = True
        granularity = self._granularity(report)
        metrics = report_metrics(report, granularity, self.norm)
        if self.scalars:
            self._scalars(metrics, report.step)
        if self.histograms and report.grad_norm:
            logs = np.array([math.log10(v) for v in report.grad_norm.values() if v > 0 and math.isfinite(v)])
            if logs.size:
                w.add_histogram(f"{PREFIX}/{self.norm}_hist", logs, report.step)
        self._write_text(report)
        prefix = f"{PREFIX}/{self.norm}/"
        module_norms = ({k[len(prefix):]: v for k, v in metrics.items() if k.startswith(prefix) and not k.startswith(prefix + "total")}
                        if granularity == "module" else None)
        self._remember(report, module_norms)
        self._writes += 1
        if self.heatmap_every and self._writes % self.heatmap_every == 0:
            self.write_heatmap(report.step)
        if not report.ok:
            w.flush()  # a failing step is on disk before any error propagates

    def _write_text(self, report: Report) -> None:
        """The step's own findings not written yet (those of its optimizer step come later)."""
        done = self._texts.setdefault(report.step, set())
        new = [f for f in report.findings if f.level != "info" and f.step == report.step and id(f) not in done]
        if new:
            done.update(id(f) for f in new)
            text = "\n\n".join(f"**{f.kind}** ({f.level}, step {f.step}): {f.message}" for f in new)
            self.writer.add_text(f"{PREFIX}/findings_text", text, report.step)
        while len(self._texts) > 8:
            self._texts.pop(next(iter(self._texts)))

    def write_update(self, report: Report) -> None:
        self._write_text(report)
        if not self.scalars:
            return
        self._scalars(update_metrics(report, self._granularity(report)), report.step)

    def _scalars(self, metrics: dict[str, float], step: int) -> None:
        """All of a step's scalars in ONE event (one protobuf, one record): a SummaryWriter's
        add_scalar writes one event per value, which costs more than the check itself."""
        file_writer = getattr(self.writer, "_get_file_writer", None)
        if file_writer is None:  # another writer type: the portable, slower path
            for tag, value in metrics.items():
                self.writer.add_scalar(tag, value, step)
            return
        summary = Summary(value=[Summary.Value(tag=t, simple_value=float(v)) for t, v in metrics.items()])
        file_writer().add_summary(summary, step)

    _WORST = {s: k for k, s in enumerate([Status.OK, Status.ZERO_GRAD, Status.NOT_IN_OPTIMIZER, Status.FROZEN,
                                           Status.NO_GRAD, Status.NON_FINITE_GRAD])}

    def _remember(self, report: Report, module_norms: dict[str, float] | None) -> None:
        """One heatmap column: each module's gradient norm and its worst parameter state, as lists
        aligned with ``self._modules`` (modules are only ever appended)."""
        modules = self._module_of
        if len(modules) != len(report.status):
            for name in report.status:
                if name not in modules:
                    modules[name] = module_of(name)
                    if modules[name] not in self._row:
                        self._row[modules[name]] = len(self._row)
                        self._modules.setdefault(modules[name])
        if module_norms is None:  # per-parameter tags: sum the squares here
            sq: dict[str, list[float]] = {}
            for name, v in report.grad_norm.items():
                sq.setdefault(modules[name], []).append(v)
            module_norms = {m: math.hypot(*vs) for m, vs in sq.items()}
        row = self._row
        values = [0.0] * len(row)
        states = [_CODES[Status.OK]] * len(row)
        for m, v in module_norms.items():
            i = row.get(m)
            if i is not None:
                values[i] = v
        worst = self._WORST
        for name, state in report._odd():  # only the parameters that are not OK
            i = row[modules[name]]
            if worst[state] > worst[list(Status)[states[i]]]:
                states[i] = _CODES[state]
        self._columns.append((values, states))
        self._steps.append(report.step)
        if len(self._columns) > self.heatmap_window:
            self._columns.pop(0)
            self._steps.pop(0)

    def write_heatmap(self, step: int | None = None) -> None:
        """Write the gradient-flow image of the recent checks now."""
        if not self._columns:
            return
        rows = list(self._modules)
        n = len(rows)
        value = np.array([v + [np.nan] * (n - len(v)) for v, _ in self._columns], dtype=np.float64).T
        state = np.array([s + [-1] * (n - len(s)) for _, s in self._columns], dtype=np.int64).T
        cell = (max(2, min(12, 800 // max(1, len(self._columns)))), max(3, min(24, 480 // max(1, n))))
        img = _label(_image(value, state, cell), rows, self._steps, cell)
        self.writer.add_image(f"{PREFIX}/gradient_flow", img, self._steps[-1] if step is None else step, dataformats="HWC")

    def flush(self) -> None:
        if self._columns and self.heatmap_every:
            self.write_heatmap()
        self.writer.flush()

    def close(self) -> None:
        if self.close_writer:
            self.writer.close()


# --------------------------------------------------------------------------- reading
def _event_dirs(path: str) -> list[str]:
    if os.path.isfile(path):
        return [os.path.dirname(path) or "."]
    dirs = []
    for d, _, files in os.walk(path):
        if any(f.startswith("events.out.tfevents") for f in files):
            dirs.append(d)
    return sorted(dirs)


def read_run(path, *, progress: bool = False, text: bool = False):
    """Every scalar in every event file under ``path``: a DataFrame (step, tag, value, wall_time,
    run). ``text=True`` adds the text events (a ``text`` column, value NaN). Raises
    ``FileNotFoundError`` / ``ValueError`` with the path for a missing, empty or unreadable log."""
    import pandas as pd
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"read_run: {path!r} does not exist; pass the log directory given to the TensorBoard writer or logger")
    dirs = _event_dirs(path)
    if not dirs:
        raise ValueError(f"read_run: no TensorBoard event files (events.out.tfevents.*) under {path!r}; was anything logged there?")
    rows = []
    for n, d in enumerate(dirs, 1):
        if progress:
            print(f"\rreading {n}/{len(dirs)} runs: {os.path.relpath(d, path)}", end="", file=sys.stderr, flush=True)
        acc = EventAccumulator(d, size_guidance={"scalars": 0, "tensors": 0, "images": 1, "histograms": 1})
        try:
            acc.Reload()
        except Exception as exc:
            raise ValueError(f"read_run: the event files in {d!r} cannot be read ({type(exc).__name__}: {exc})") from None
        run = os.path.relpath(d, path) if os.path.isdir(path) else "."
        tags = acc.Tags()
        for tag in tags.get("scalars", []):
            for e in acc.Scalars(tag):
                rows.append((e.step, tag, float(e.value), e.wall_time, run, None))
        if text:
            for tag in tags.get("tensors", []):
                if not tag.endswith("/text_summary"):
                    continue  # e.g. the custom-scalars layout
                for e in acc.Tensors(tag):
                    if e.tensor_proto.string_val:
                        rows.append((e.step, tag[: -len("/text_summary")], math.nan, e.wall_time, run,
                                     e.tensor_proto.string_val[0].decode("utf-8", "replace")))
    if progress:
        print(file=sys.stderr)
    frame = pd.DataFrame(rows, columns=["step", "tag", "value", "wall_time", "run", "text"])
    if not text:
        frame = frame.drop(columns=["text"])
    if frame.empty:
        raise ValueError(f"read_run: the event files under {path!r} hold no scalars (a run that logged nothing, or a corrupt file)")
    return frame.sort_values(["run", "tag", "step"], kind="stable").reset_index(drop=True)


def _finding_text(text: str, kind: str) -> str:
    """The message of ``kind`` in a findings text written by the sink, or ''."""
    m = re.search(rf"\*\*{kind}\*\* \([^)]*\): (.*?)(?:\n\n\*\*|$)", text, flags=re.S)
    return m.group(1).strip() if m else ""


def summarize_run(frame) -> list[dict]:
    """What a person wants to know after a run, one dict per item found, from ``read_run(text=True)``."""
    items: list[dict] = []
    for run, df in frame.groupby("run", sort=True):
        scal = df[df["text"].isna()] if "text" in df else df
        totals = scal[scal["tag"].str.match(rf"{PREFIX}/grad_norm(_preclip)?/total")]
        bad = totals[~np.isfinite(totals["value"].to_numpy())]
        if not bad.empty:
            step = int(bad["step"].min())
            at = scal[(scal["step"] == step) & scal["tag"].str.match(rf"{PREFIX}/grad_norm(_preclip)?/") & ~scal["tag"].str.endswith("/total")]
            where = sorted(t.split("/", 2)[2] for t in at[~np.isfinite(at["value"].to_numpy())]["tag"])
            origin = ""
            if "text" in df:
                texts = df[(df["tag"] == f"{PREFIX}/findings_text") & df["text"].notna() & (df["step"] >= step)]
                for t in texts.sort_values("step")["text"]:
                    origin = _finding_text(t, "NONFINITE_ORIGIN")
                    if origin:
                        origin = origin.split(". Usual repairs")[0]
                        break
            items.append({"run": run, "kind": "NON_FINITE_GRAD", "step": step,
                          "detail": f"first non-finite gradients at step {step} in {', '.join(where) or 'the total norm'}" + (f"; origin: {origin}" if origin else "")})
        for state in ("NO_GRAD", "NOT_IN_OPTIMIZER", "ZERO_GRAD"):
            counts = scal[scal["tag"].str.match(rf"{PREFIX}/status/{state}(_opt\d+)?$") & (scal["value"] > 0)]
            if not counts.empty:
                first = int(counts["step"].min())
                items.append({"run": run, "kind": state, "step": first,
                              "detail": f"up to {int(counts['value'].max())} parameters {state} from step {first} on "
                                        f"({counts['step'].nunique()} checks)"})
        for kind, what in [("UNEXPECTED_FROZEN", "parameters frozen against expect_frozen"),
                           ("UNEXPECTED_TRAINABLE", "parameters trainable against expect_frozen"),
                           ("NOT_UPDATED", "parameters not updated by the optimizer step"),
                           ("STALE_GRAD", "gradients added onto already-applied ones (missing zero_grad)"),
                           ("VANISHING_GRAD", "gradients that vanished"), ("EXPLODING_GRAD", "gradient spikes"),
                           ("EMPTY_VALID_SET", "empty valid sets"), ("GRAD_MODE", "grad-mode mistakes"),
                           ("FROZEN_BUT_CHANGED", "frozen parameters moved by the optimizer")]:
            hits = scal[(scal["tag"] == f"{PREFIX}/findings/{kind}") & (scal["value"] > 0)]
            if not hits.empty:
                steps = sorted(int(s) for s in hits["step"].unique())
                shown = ", ".join(map(str, steps[:8])) + (" ..." if len(steps) > 8 else "")
                detail = f"{what} at {len(steps)} steps ({shown})"
                if "text" in df:
                    texts = df[(df["tag"] == f"{PREFIX}/findings_text") & df["text"].notna() & df["text"].str.contains(kind)]
                    if not texts.empty:
                        detail += ": " + _finding_text(texts.sort_values("step")["text"].iloc[0], kind)[:300]
                items.append({"run": run, "kind": kind, "step": steps[0], "detail": detail})
        never = []
        upd = scal[scal["tag"].str.startswith(f"{PREFIX}/update_norm/") & ~scal["tag"].str.endswith("/total")]
        for tag, g in upd.groupby("tag"):
            if len(g) >= 2 and (g["value"] == 0).all():
                never.append(tag.split("/", 2)[2])
        if never:
            items.append({"run": run, "kind": "NEVER_UPDATED", "step": None, "detail": f"never updated in any measured step: {', '.join(sorted(never))}"})
    return items


def main(argv: list[str] | None = None) -> int:
    """``gradhealth report LOGDIR [--format text|csv|json]``."""
    import argparse

    ap = argparse.ArgumentParser(prog="gradhealth report", description="What gradhealth saw in a run, from its TensorBoard event files.")
    ap.add_argument("logdir")
    ap.add_argument("--format", choices=("text", "csv", "json"), default="text")
    args = ap.parse_args(argv)
    try:
        frame = read_run(args.logdir, progress=args.format == "text" and sys.stderr.isatty(), text=True)
    except (FileNotFoundError, ValueError) as exc:
        print(f"gradhealth report: {exc}", file=sys.stderr)
        return 2
    items = summarize_run(frame)
    if args.format == "json":
        print(json.dumps(items, indent=2))
    elif args.format == "csv":
        import csv

        out = csv.DictWriter(sys.stdout, fieldnames=["run", "kind", "step", "detail"])
        out.writeheader()
        out.writerows(items)
    else:
        runs = sorted(frame["run"].unique())
        print(f"gradhealth report: {len(runs)} run(s) under {args.logdir}")
        for run in runs:
            mine = [i for i in items if i["run"] == run]
            print(f"\n{run}: " + ("nothing to report" if not mine else f"{len(mine)} finding(s)"))
            for i in mine:
                print(f"  {i['kind']}: {i['detail']}")
    return 0

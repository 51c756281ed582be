"""The dashboard images: the gradient flow (one row per module, one column per check, coloured by
log10 gradient norm, with NO_GRAD grey, FROZEN blue and non-finite red) and the expert map (one row
per MoE layer, one column per expert, its gradient norm over recent checks, dead experts red,
experts idle at every recent check black). numpy only; labels with PIL when present."""

from __future__ import annotations

import functools
import struct
from collections import deque
import zlib

import numpy as np

from gradhealth.base.status import Status

__all__ = ["gradient_flow_image", "flow_picture", "png", "Window", "load_font", "rows_of", "expert_map_image", "labelled_experts", "CODES", "WORST"]

# colours of the heatmap: log-norm ramp from dark to bright, and flat colours for the states
_RAMP = np.array([[13, 8, 135], [126, 3, 168], [204, 71, 120], [248, 149, 64], [240, 249, 33]], dtype=np.float64)
_COLOURS = {
    Status.NO_GRAD: (128, 128, 128),
    Status.FROZEN: (60, 110, 200),
    Status.NON_FINITE_GRAD: (230, 20, 20),
}


CODES = {s: k for k, s in enumerate(Status)}


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
                state[i, j] = CODES[s]
    return image(value, state, cell)


def image(value: np.ndarray, state: np.ndarray, cell: tuple[int, int]) -> np.ndarray:
    rgb = np.full(value.shape + (3,), 255.0)
    plain = (state >= 0) & np.isin(state, [CODES[s] for s in _COLOURS], invert=True)
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
        rgb[state == CODES[s]] = colour
    cw, ch = cell
    return np.repeat(np.repeat(rgb.astype(np.uint8), ch, axis=0), cw, axis=1)


def _canvas(img: np.ndarray, rows: list[str], top: int, bottom: int):
    """(canvas, draw, left) with ``img`` pasted right of the row labels, or None without PIL."""
    try:
        from PIL import Image, ImageDraw
    except ImportError:
        return None
    left = 8 + 6 * max((len(r) for r in rows), default=4)
    canvas = Image.new("RGB", (max(left + img.shape[1] + 8, 560), img.shape[0] + top + bottom), "white")
    canvas.paste(Image.fromarray(img), (left, top))
    return canvas, ImageDraw.Draw(canvas), left


#: the picture is drawn for TensorBoard's image card (about 310 px wide unless "show actual image
#: size" is ticked): WIDTH px wide, its text FONT px high, so the card shows it at about 10 px
WIDTH, FONT = 640, 28
#: at most this many rows (modules, or groups of modules for large models) and columns (checks,
#: or runs of consecutive checks once there are more): the same size from the first picture on
ROWS, COLUMNS = 16, 50


@functools.lru_cache(maxsize=4)  # (loading decodes the font's data: once per size, not per picture)
def _font(size: int):
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)  # Pillow >= 10.1 with FreeType: a scalable font
    except (TypeError, OSError, ImportError):
        return None  # older Pillow: the bitmap font, drawn at half size and scaled up


def load_font() -> None:
    """Load the picture's font now (a sink made for pictures: at its start, not at a training step)."""
    try:
        _font(FONT)
    except ImportError:  # (no PIL: pictures without labels)
        pass


def rows_of(modules: list[str], most: int = ROWS) -> tuple[list[str], list[list[int]]]:
    """At most ``most`` rows for the picture: every module, or modules grouped by the deepest name
    prefix that gives no more than ``most`` groups (``h.0.*``), or runs of consecutive modules.
    Returns the row labels and, for each row, the indexes of its modules."""
    if len(modules) <= most:
        return list(modules), [[i] for i in range(len(modules))]
    parts = [m.split(".") for m in modules]
    for depth in range(max(len(p) for p in parts) - 1, 0, -1):
        groups: dict[str, list[int]] = {}
        for i, p in enumerate(parts):
            groups.setdefault(".".join(p[:depth]), []).append(i)
        if len(groups) <= most:
            return [k + (".*" if len(v) > 1 or parts[v[0]][depth:] else "") for k, v in groups.items()], list(groups.values())
    size = -(-len(modules) // most)
    runs = [list(range(i, min(i + size, len(modules)))) for i in range(0, len(modules), size)]
    return [f"{modules[r[0]]} .. {modules[r[-1]]}" if len(r) > 1 else modules[r[0]] for r in runs], runs


def _squeeze(value: np.ndarray, state: np.ndarray, rows: list[list[int]], columns: list[list[int]]):
    """Modules into rows (the norm of their norms, the worst state) and checks into columns (the
    root mean square of the norms, the worst state). ``rows`` partition the modules, ``columns``
    are runs of consecutive checks. NaN / -1 where a cell has no finite norm / no entry."""
    if not rows or not columns:
        return np.full((len(rows), len(columns)), np.nan), np.full((len(rows), len(columns)), -1, dtype=np.int64)
    order = np.concatenate([np.asarray(r, dtype=np.int64) for r in rows])
    row_at = np.cumsum([0] + [len(r) for r in rows[:-1]])
    col_at = np.array([c[0] for c in columns])
    rank = np.array([WORST[s] for s in Status] + [-1])  # state code -> badness; -1 (no entry) lowest
    code_of = np.full(len(Status) + 1, -1, dtype=np.int64)  # badness + 1 -> state code
    code_of[rank[:-1] + 1] = np.arange(len(Status))
    worst = np.maximum.reduceat(np.maximum.reduceat(rank[state[order]], row_at, axis=0), col_at, axis=1)
    finite = np.isfinite(value[order])
    sq = np.where(finite, value[order], 0.0) ** 2
    total = np.add.reduceat(np.add.reduceat(sq, row_at, axis=0), col_at, axis=1)
    seen = np.add.reduceat(np.add.reduceat(finite.astype(np.int64), row_at, axis=0), col_at, axis=1)
    width = np.array([len(c) for c in columns], dtype=np.float64)
    out_v = np.where(seen > 0, np.sqrt(total / width), np.nan)
    out_s = code_of[worst + 1]
    return out_v, out_s


def flow_picture(value: np.ndarray, state: np.ndarray, modules: list[str], steps: list[int]) -> np.ndarray:
    """The gradient-flow picture of ``value`` / ``state`` (modules x checks, as ``image`` takes them):
    WIDTH px wide whatever the model and run length, a title with the step span, a row label per
    row, the checks on the time axis, and a legend of the colours with the norms they stand for.
    Without PIL, the bare image. What only changes with the rows, the rows in red and the legend's
    two norms (the labels, the frame, the legend: most of the text) is drawn once per such set
    (:func:`_base`) and copied: a picture draws its title, its cells and its two step numbers."""
    labels, groups = _rows(tuple(modules))
    n = value.shape[1]
    columns = _columns(n)
    per = max((len(c) for c in columns), default=1)
    v, s = _squeeze(value, state, groups, columns)
    try:
        from PIL import Image, ImageDraw
    except ImportError:
        return image(v, s, (8, 12))
    look = _look(tuple(labels))
    font, u, W, f, row_h, pad, label_w, cw, title_h, _, H = look
    now = s[:, -1] if s.size else np.array([], dtype=np.int64)
    calm = (-1, CODES[Status.OK], CODES[Status.FROZEN])
    red = tuple(i for i in range(len(labels)) if now[i] not in calm)  # rows not OK at the latest check
    lo, hi = _span(v, s)
    canvas = _base(look, red, None if lo is None else (_e(lo), _e(hi))).copy()
    draw = ImageDraw.Draw(canvas)
    width = _width(font)
    text = lambda xy, t, fill=(0, 0, 0): draw.text(xy, t, fill=fill, font=font)  # noqa: E731
    span = f"steps {steps[0]}-{steps[-1]}" if steps and steps[0] != steps[-1] else f"step {steps[0]}" if steps else ""
    fewest = min((len(c) for c in columns), default=1)
    each = f"{fewest}" if fewest == per else f"{fewest}-{per}"
    text((pad, pad // 2), f"gradient flow, {span}" + (f", {each} checks a column" if per > 1 else ""))
    x0 = label_w + pad
    cells = Image.fromarray(image(v, s, (1, 1)))  # (a pixel a cell, scaled up in C: each copied cw x row_h)
    canvas.paste(cells.resize((cw * v.shape[1], row_h * v.shape[0]), Image.NEAREST), (x0, title_h))
    y = title_h + row_h * len(labels) + pad // 2
    if steps:
        text((x0, y), f"{steps[0]}")
        last = f"{steps[-1]}"
        text((max(x0, x0 + cw * len(columns) - width(last)), y), last)
    out = np.asarray(canvas)
    return out if u == 1 else np.repeat(np.repeat(out, u, axis=0), u, axis=1)


@functools.lru_cache(maxsize=8)
def _columns(n: int) -> list[list[int]]:
    """The checks ``0..n-1`` as at most COLUMNS runs, the longer ones first (``np.array_split``)."""
    return [list(c) for c in np.array_split(np.arange(n), min(n, COLUMNS))] if n else []


def _e(x: float) -> str:
    return f"{10 ** x:.0e}".replace("e-0", "e-").replace("e+0", "e")


@functools.lru_cache(maxsize=8)
def _rows(modules: tuple[str, ...]):
    return rows_of(list(modules))


def _width(font):
    if font is None:
        return lambda t: 6 * len(t)
    from PIL import Image, ImageDraw

    probe = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    return lambda t: probe.textlength(t, font=font)


@functools.lru_cache(maxsize=8)
def _look(labels: tuple[str, ...]):
    """The picture's geometry for these row labels: (font, u, W, f, row_h, pad, label_w, cw,
    title_h, the labels as shown (long ones cut), H)."""
    font = _font(FONT)
    u = 1 if font is not None else 2  # without a scalable font: a half-size canvas, scaled up
    W, f = WIDTH // u, FONT // u
    row_h, pad = f + 6 // u, 6 // u
    width = _width(font)
    label_w = int(min(W * 3 // 10, max((width(t) for t in labels), default=0))) + pad
    plot_w = W - label_w - 2 * pad
    cw = max(1, plot_w // COLUMNS)
    title_h, axis_h = row_h + pad, 3 * row_h + pad
    H = title_h + row_h * len(labels) + axis_h + pad
    shown = []
    for t in labels:
        while width(t) > label_w - pad and len(t) > 2:  # the end of a long name says most
            t = "…" + t[2:] if font else ".." + t[3:]
        shown.append(t)
    return font, u, W, f, row_h, pad, label_w, cw, title_h, tuple(shown), H


@functools.lru_cache(maxsize=8)
def _base(look, red: tuple[int, ...], norms: tuple[str, str] | None):
    """The picture without its title, cells and step numbers: white, the frame, the row labels
    (``red`` ones red) and the legend (``norms``: the ramp's two ends as written)."""
    from PIL import Image, ImageDraw

    font, u, W, f, row_h, pad, label_w, cw, title_h, shown, H = look
    canvas = Image.new("RGB", (W, H), "white")
    draw = ImageDraw.Draw(canvas)
    width = _width(font)
    text = lambda xy, t, fill=(0, 0, 0): draw.text(xy, t, fill=fill, font=font)  # noqa: E731
    x0 = label_w + pad
    draw.rectangle([x0 - 1, title_h - 1, x0 + cw * COLUMNS, title_h + row_h * len(shown)], outline=(160, 160, 160))
    for i, t in enumerate(shown):
        text((pad, title_h + i * row_h + 1), t, (200, 0, 0) if i in red else (0, 0, 0))
    y = title_h + row_h * len(shown) + pad // 2 + row_h
    x = pad
    if norms is not None:
        for t, colour in ((norms[0], None), ("", "ramp"), (norms[1], None)):
            if colour == "ramp":
                ramp = _ramp_strip(4 * f, f - 4 // u)
                canvas.paste(Image.fromarray(ramp), (int(x), y + 2 // u))
                x += 4 * f + pad
            else:
                text((x, y), t)
                x += width(t) + pad
    for t, colour in (("0", (0, 0, 0)), ("no grad", _COLOURS[Status.NO_GRAD]), ("frozen", _COLOURS[Status.FROZEN]),
                      ("NaN/inf", _COLOURS[Status.NON_FINITE_GRAD]), ("name: not OK now", None)):
        if x + f + width(t) > W - pad:  # the rest of the legend on a line of its own
            x, y = pad, y + row_h
        if colour is None:
            text((x, y), "red", (200, 0, 0))
            x += width("red ")
        else:
            draw.rectangle([x, y + 3 // u, x + f - 4 // u, y + f - 1], fill=colour)
            x += f
        text((x, y), t)
        x += width(t) + 2 * pad
    return canvas


def _span(value: np.ndarray, state: np.ndarray):
    """The log10 range of the ramp (as ``image`` colours it), or (None, None)."""
    plain = (state >= 0) & np.isin(state, [CODES[s] for s in _COLOURS], invert=True)
    ok = plain & np.isfinite(value) & (value > 0)
    if not ok.any():
        return None, None
    logs = np.log10(value[ok])
    return float(logs.min()), float(logs.max())


def _ramp_strip(w: int, h: int) -> np.ndarray:
    t = np.linspace(0, len(_RAMP) - 1, w)
    k = np.clip(np.floor(t), 0, len(_RAMP) - 2).astype(np.int64)
    row = _RAMP[k] + (t - k)[:, None] * (_RAMP[k + 1] - _RAMP[k])
    return np.repeat(row[None].astype(np.uint8), h, axis=0)


class Window:
    """The columns of the recent checks (at most ``size``) for the gradient-flow picture: each
    row's (module's) norm and state code, kept in two arrays as they come (a ring of ``size``
    slots; a row first seen later widens them), so a picture costs no conversion of lists."""

    def __init__(self, size: int):
        self.size = max(0, size)
        self.value = np.full((self.size, 0), np.nan)
        self.state = np.full((self.size, 0), -1, dtype=np.int64)
        self.steps: deque[int] = deque(maxlen=self.size)  # the steps of the columns held, oldest first
        self._width = 0
        self._next = 0  # the slot of the next column

    def __len__(self) -> int:
        return len(self.steps)

    def add(self, values: list[float], states: list[int], step: int) -> None:
        i = self._next
        if len(values) == self._width and self.size:  # (a column as wide as the ones before: two copies in C)
            self.value[i] = values
            self.state[i] = states
        elif not self.size:
            return
        else:
            n, width = len(values), self._width
            if n > width:  # (a row not seen before: no value, no state in the columns before)
                self.value = np.concatenate([self.value, np.full((self.size, n - width), np.nan)], axis=1)
                self.state = np.concatenate([self.state, np.full((self.size, n - width), -1, dtype=np.int64)], axis=1)
                self._width = width = n
            self.value[i, :n] = values
            self.state[i, :n] = states
            self.value[i, n:] = np.nan
            self.state[i, n:] = -1
        self._next = i + 1 if i + 1 < self.size else 0
        self.steps.append(step)

    def arrays(self, rows: int) -> tuple[np.ndarray, np.ndarray]:
        """(value, state), ``rows`` x the columns held, oldest first (NaN / -1 where none)."""
        k = len(self.steps)
        order = np.arange(k) if k < self.size else (np.arange(k) + self._next) % k
        value = np.full((rows, k), np.nan)
        state = np.full((rows, k), -1, dtype=np.int64)
        width = min(rows, self._width)
        value[:width] = self.value[order, :width].T
        state[:width] = self.state[order, :width].T
        return value, state


def png(img: np.ndarray) -> bytes:
    """An HxWx3 uint8 picture as PNG: rows unfiltered, deflated at the fastest level. Lossless like
    any PNG (the reader gets the same pixels); for these pictures of flat cells and text, as small
    as PIL's adaptive row filters make them, in about a third of the time."""
    h, w, _ = img.shape
    rows = np.zeros((h, 3 * w + 1), dtype=np.uint8)  # (each row: its filter byte, 0: none, then RGB)
    rows[:, 1:] = img.reshape(h, 3 * w)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows.tobytes(), 1)) + chunk(b"IEND", b""))


#: how bad a state looks on the image: a module shows its worst parameter's state
WORST = {s: k for k, s in enumerate([Status.OK, Status.ZERO_GRAD, Status.NOT_IN_OPTIMIZER, Status.FROZEN,
                                      Status.NO_GRAD, Status.NON_FINITE_GRAD])}


def expert_map_image(layers: list[str], value: np.ndarray, dead: np.ndarray, cell: tuple[int, int] = (24, 18)) -> np.ndarray:
    """An HxWx3 uint8 image, layers x experts: ``value`` the RMS gradient norm of each expert over
    the recent checks (0: idle at all of them, black; NaN: no such expert, white), ``dead`` the
    experts named DEAD_EXPERT at the latest check (red, with a white diagonal)."""
    state = np.where(np.isnan(value), -1, CODES[Status.OK]).astype(np.int64)
    state[dead] = CODES[Status.NON_FINITE_GRAD]  # (red)
    img = image(value, state, cell).copy()
    cw, ch = cell
    for i, j in zip(*np.nonzero(dead)):
        for k in range(min(cw, ch)):
            img[i * ch + k * ch // min(cw, ch), j * cw + k * cw // min(cw, ch)] = 255
    return img


def labelled_experts(img: np.ndarray, layers: list[str], count: int, step: int, cell: tuple[int, int]) -> np.ndarray:
    """Layer names on the left, expert indexes on top, the legend underneath (PIL when installed)."""
    made = _canvas(img, layers, 18, 34)
    if made is None:
        return img
    canvas, draw, left = made
    cw, ch = cell
    for j in range(count):
        if cw >= 14 or j % max(1, 14 // cw) == 0:
            draw.text((left + j * cw + 2, 4), str(j), fill=(0, 0, 0))
    for i, r in enumerate(layers):
        draw.text((4, 18 + i * ch + max(0, ch - 10) // 2), r, fill=(0, 0, 0))
    draw.text((left, img.shape[0] + 24), f"experts' gradient norm over recent checks, to step {step}", fill=(0, 0, 0))
    draw.text((left, img.shape[0] + 38), "dark=low bright=high; black: no tokens at any recent check; red: DEAD_EXPERT",
              fill=(0, 0, 0))
    return np.asarray(canvas)

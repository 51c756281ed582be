"""The dashboard images: the gradient flow (one row per module, one column per check, coloured by
log10 gradient norm, with NO_GRAD grey, FROZEN blue and non-finite red) and the expert map (one row
per MoE layer, one column per expert, its gradient norm over recent checks, dead experts red,
experts idle at every recent check black). numpy only; labels with PIL when present."""

from __future__ import annotations

import numpy as np

from gradhealth.status import Status

__all__ = ["gradient_flow_image", "expert_map_image", "labelled_experts", "labelled", "CODES", "WORST"]

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


def labelled(img: np.ndarray, rows: list[str], steps: list[int], cell: tuple[int, int]) -> np.ndarray:
    """Module names on the left and steps underneath, with PIL when it is installed."""
    made = _canvas(img, rows, 4, 32)
    if made is None:
        return img
    canvas, draw, left = made
    cw, ch = cell
    for i, r in enumerate(rows):
        if ch >= 10 or i % max(1, 10 // ch) == 0:
            draw.text((4, 4 + i * ch), r, fill=(0, 0, 0))
    if steps:
        draw.text((left, img.shape[0] + 8), f"step {steps[0]}", fill=(0, 0, 0))
        draw.text((left + max(0, img.shape[1] - 60), img.shape[0] + 8), f"step {steps[-1]}", fill=(0, 0, 0))
    draw.text((left, img.shape[0] + 22), "log10 grad norm: dark=low bright=high; grey NO_GRAD, blue FROZEN, red NaN/inf", fill=(0, 0, 0))
    return np.asarray(canvas)



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

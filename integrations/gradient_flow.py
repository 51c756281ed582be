"""The gradient-flow image: one row per module, one column per check, coloured by log10 gradient
norm, with NO_GRAD grey, FROZEN blue and non-finite red. numpy only; labels with PIL when present."""

from __future__ import annotations

import numpy as np

from gradhealth.status import Status

__all__ = ["gradient_flow_image", "labelled", "CODES", "WORST"]

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


def labelled(img: np.ndarray, rows: list[str], steps: list[int], cell: tuple[int, int]) -> np.ndarray:
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



#: how bad a state looks on the image: a module shows its worst parameter's state
WORST = {s: k for k, s in enumerate([Status.OK, Status.ZERO_GRAD, Status.NOT_IN_OPTIMIZER, Status.FROZEN,
                                      Status.NO_GRAD, Status.NON_FINITE_GRAD])}

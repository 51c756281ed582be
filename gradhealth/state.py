"""Checking a monitor's saved state, all of it, before anything of it is loaded.

``GradHealth.load_state_dict`` refuses a state with a missing key, a value of the wrong type or out
of range (a counter that is not an int in ``[0, 2**53]``, a norm that is not a finite number >= 0),
a history wider than the model's module list, or one from another model (other parameter names,
named in the error). The error is a ``ValueError`` naming the key; the monitor is left as it was.
"""

from __future__ import annotations

import math

__all__ = ["load", "MAX_COUNT", "count", "norm", "require", "check_history", "check_persistence", "check_params"]

#: counters stay exact in float64 and writable as TensorBoard steps
MAX_COUNT = 2**53


def require(state, keys, path: str) -> None:
    if not isinstance(state, dict):
        raise TypeError(f"{path} must be a dict; got {type(state).__name__}")
    missing = [k for k in keys if k not in state]
    if missing:
        raise KeyError(f"{path} lacks {', '.join(map(repr, missing))}")


def count(v, path: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{path} must be an int; got {v!r}")
    if not 0 <= v <= MAX_COUNT:
        raise ValueError(f"{path} must be in [0, 2**53]; got {v!r}")
    return v


def norm(v, path: str, nan: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{path} must be a number; got {v!r}")
    v = float(v)
    if not (math.isfinite(v) and v >= 0) and not (nan and math.isnan(v)):
        raise ValueError(f"{path} must be a finite number >= 0; got {v!r}")
    return v


def check_history(state, path: str, modules: set[str] | None, window: int) -> None:
    require(state, ("seen", "total", "modules", "rows"), path)
    count(state["seen"], f"{path}['seen']")
    for key in ("total", "modules", "rows"):
        if not isinstance(state[key], list):
            raise TypeError(f"{path}[{key!r}] must be a list; got {type(state[key]).__name__}")
    total, names, rows = state["total"], state["modules"], state["rows"]
    if len(total) > window or len(rows) != len(total):
        raise ValueError(f"{path}: {len(total)} totals and {len(rows)} rows for a window of {window}")
    for k, v in enumerate(total):
        norm(v, f"{path}['total'][{k}]")
    if not all(isinstance(m, str) for m in names) or len(set(names)) != len(names):
        raise ValueError(f"{path}['modules'] must be distinct module names")
    if modules is not None and not set(names) <= modules:
        odd = sorted(set(names) - modules)
        raise ValueError(f"{path}['modules'] names modules this model does not have: {', '.join(odd[:5])}")
    for k, r in enumerate(rows):
        if not isinstance(r, list) or len(r) > len(names):
            raise ValueError(f"{path}['rows'][{k}] must be a list of at most {len(names)} norms")
        for j, v in enumerate(r):
            norm(v, f"{path}['rows'][{k}][{j}]", nan=True)


def check_persistence(state, path: str, units: set[str] | None) -> None:
    require(state, ("n", "units", "blank"), path)
    for key in ("n", "units"):  # (None is no mapping: refused, not read as an empty one)
        if not isinstance(state[key], dict):
            raise TypeError(f"{path}[{key!r}] must be a dict; got {type(state[key]).__name__}")
    count(state["blank"], f"{path}['blank']")
    if units is not None:
        for key in ("units", "faint", "frozen", "thawed"):  # (the last three: absent from older states)
            odd = sorted(set(state.get(key) or ()) - units) if isinstance(state.get(key) or (), (dict, list, tuple)) else []
            if odd:
                raise ValueError(f"{path}[{key!r}] names parameters this model does not have: {', '.join(map(str, odd[:5]))}")


def check_params(saved, names: list[str]) -> None:
    """The state's parameter names against this model's: refused, naming the difference."""
    if not isinstance(saved, list) or not all(isinstance(n, str) for n in saved):
        raise TypeError("state['params'] must be the list of parameter names")
    if saved != names:
        gone, new = [n for n in saved if n not in set(names)], [n for n in names if n not in set(saved)]
        what = "; ".join(p for p in (f"not in this model: {', '.join(gone[:5])}" if gone else "",
                                     f"not in the saved state: {', '.join(new[:5])}" if new else "") if p)
        raise ValueError(f"the state is from another model ({what or 'the same names in another order'})")


def load(carry, view, state) -> None:
    """``GradHealth.load_state_dict``: the state checked against this model, then loaded."""
    from .experts import unit_name

    if not isinstance(state, dict):
        raise TypeError(f"load_state_dict: state must be a dict from GradHealth.state_dict(); got {type(state).__name__}")
    try:
        check_params(state.get("params"), view.names)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"load_state_dict: {exc}; the monitor was left unchanged") from None
    units = set(view.names) | {unit_name(s.module, e) for s in view.stacks.values() for e in range(s.count)}
    carry.load_state_dict(state, set(view.modules), units)

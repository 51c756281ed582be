"""The checks on a saved state's values that every story's ``load_state_dict`` uses: each takes a
value and the path of its key, and returns it checked, or raises a ``TypeError`` / ``ValueError``
naming that key (:mod:`gradhealth.check.state` checks a whole state with them before anything is loaded)."""

from __future__ import annotations

import math

__all__ = ["MAX_COUNT", "count", "norm", "require", "exact", "flag", "names", "number", "index", "key_of", "plain",
           "check_history", "check_persistence", "check_params"]

#: counters stay exact in float64 and writable as TensorBoard steps
MAX_COUNT = 2**53


def require(state, keys, path: str) -> None:
    if not isinstance(state, dict):
        raise TypeError(f"{path} must be a dict; got {type(state).__name__}")
    missing = [k for k in keys if k not in state]
    if missing:
        raise KeyError(f"{path} lacks {', '.join(map(repr, missing))}")


def exact(state, keys, path: str) -> None:
    """``state`` is a dict with exactly ``keys``: one missing or one it does not know is refused."""
    require(state, keys, path)
    odd = [k for k in state if k not in keys]
    if odd:
        raise KeyError(f"{path} has keys this version does not write: {', '.join(map(repr, odd[:5]))}")


def flag(v, path: str) -> bool:
    if not isinstance(v, bool):
        raise TypeError(f"{path} must be a bool; got {v!r}")
    return v


def names(v, path: str, known: set[str] | None = None) -> list[str]:
    """A list of distinct names (of this model's, where ``known`` is given)."""
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise TypeError(f"{path} must be a list of names; got {type(v).__name__}")
    if len(set(v)) != len(v):
        raise ValueError(f"{path} names one twice")
    if known is not None and not set(v) <= known:
        odd = sorted(set(v) - known)
        raise ValueError(f"{path} names parameters this model does not have: {', '.join(odd[:5])}")
    return v


def number(v, path: str, nan: bool = False) -> float:
    """A finite number of either sign (NaN too where ``nan``)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{path} must be a number; got {v!r}")
    v = float(v)
    if not math.isfinite(v) and not (nan and math.isnan(v)):
        raise ValueError(f"{path} must be a finite number; got {v!r}")
    return v


def index(v, path: str, n: int) -> int:
    """An index below ``n`` (an int, or its digits: JSON writes a dict's int keys as strings)."""
    k = count(int(v) if isinstance(v, str) and v.isdigit() and len(v) < 20 else v, path)
    if k >= n:
        raise ValueError(f"{path} is {k}; this monitor has {n}")
    return k


def key_of(v, path: str, n: int):
    """A key saved per optimizer: "all" (every parameter, None) or an optimizer's index below ``n``."""
    return None if v == "all" else index(v, path, n)


def plain(v, path: str, depth: int = 0):
    """Plain data (what JSON and ``torch.save`` keep): None, bool, int, str, finite or NaN float,
    lists and dicts with str keys of those."""
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        if math.isinf(v):
            raise ValueError(f"{path} must be a finite number; got {v!r}")
        return v
    if depth < 4 and isinstance(v, list):
        return [plain(x, f"{path}[{k}]", depth + 1) for k, x in enumerate(v)]
    if depth < 4 and isinstance(v, dict) and all(isinstance(k, str) for k in v):
        return {k: plain(x, f"{path}[{k!r}]", depth + 1) for k, x in v.items()}
    raise TypeError(f"{path} must be plain data; got {type(v).__name__}")


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
    exact(state, ("seen", "total", "modules", "rows", "spiked", "medians"), path)
    count(state["seen"], f"{path}['seen']")
    flag(state["spiked"], f"{path}['spiked']")
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
    medians = state["medians"]
    if medians is not None:
        exact(medians, ("at", "values"), f"{path}['medians']")
        if count(medians["at"], f"{path}['medians']['at']") > state["seen"]:
            raise ValueError(f"{path}['medians']['at'] is past {path}['seen']")
        if not isinstance(medians["values"], list) or not isinstance(state["modules"], list) \
                or len(medians["values"]) != len(state["modules"]):
            raise ValueError(f"{path}['medians']['values'] must be a list of one median per module")
        for j, v in enumerate(medians["values"]):
            norm(v, f"{path}['medians']['values'][{j}]", nan=True)


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



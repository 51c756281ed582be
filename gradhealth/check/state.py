"""Checking a monitor's saved state, all of it, before anything of it is loaded.

``GradHealth.load_state_dict`` refuses a state with a missing key, a value of the wrong type or out
of range (a counter that is not an int in ``[0, 2**53]``, a norm that is not a finite number >= 0),
a history wider than the model's module list, or one from another model (other parameter names,
named in the error), and a key it does not know: the state is exactly what ``state_dict()`` of this
version writes. The error is a ``ValueError`` naming the key; the monitor is left as it was.

A state carries its ``version`` (:data:`VERSION`). One from an older version (version 1 had no
``version`` key, and exactly its own keys) loads: what it holds is restored, the stories it did not
keep start fresh, and a warning names them, once per load.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace

from ..base.errors import GradHealthWarning
from ..base.saved import check_params, exact
from ..model.experts import unit_name
from ..measure.deltas import UpdateTracker
from ..measure.lrstory import LrStory
from ..judge.unstepped import Unstepped
from ..publish.once import Once
from .carry import Carry

__all__ = ["save", "load", "VERSION"]

#: the version of the state ``GradHealth.state_dict()`` writes (1: before it carried one)
VERSION = 2

_ANY = 64  # (optimizers a state may name where this monitor has no story for them)

#: what a monitor keeps beside its carry's keys (:attr:`gradhealth.check.carry.Carry.KEYS`)
MONITOR_KEYS = ("version", "params", "lrs", "steps", "once", "unstepped")
#: version 1's keys (it had no ``version``), exactly
V1_KEYS = ("calls", "checks", "amp_skips", "amp_settled", "history", "histories", "streaks", "still", "skips",
           "skips_in_a_row", "params")
#: what each key a version 1 state lacks holds, in the words of the warning
STORIES = {
    "lrs": "each param group's learning-rate story (a hold at 0, a warm-up from 0, a fall)",
    "fit": "the loss-fit baseline (running loss median, nothing-to-learn count)",
    "pileup": "the gradient pile-up streaks",
    "unstepped": "the optimizers' not-stepped streaks",
    "once": "the problems already said (said again once)",
    "steps": "the optimizer step counts that date the change tests",
    "still_seen": "the parameters the not-updated streak decided",
    "last_scale": "the grad scaler's last scale",
    "trace": "the NaN tracer armed for the next step",
    "said": "the normalisation-layer notes already said",
    "reentrant": "a reentrant checkpoint seen",
    "owed": "findings about the last step",
    "streaks": "the persistence rule's {}",
    "history": "the norm history's {}",
}


def save(monitor) -> dict:
    """``GradHealth.state_dict``: plain Python (``torch.save`` and JSON keep it)."""
    m, t = monitor, monitor.tracker
    names, opts = m.view.names, m.optimizers
    if t is not None and t.pending and not m.ranks.active and m._deferred is None:
        m._flush_updates(owe=True)  # (the step already taken: its verdict is made now and owed to the next report)
    return {"version": VERSION, **m.carry.state_dict(names, opts), "params": list(names),
            "lrs": t.lrs.state_dict() if t is not None else None,
            "steps": t.state_dict() if t is not None else None,
            "once": m.publisher.once.state_dict(),
            "unstepped": m.unstepped.state_dict() if m.unstepped is not None else None}


def _fresh(monitor) -> dict:
    """The state of a monitor that has not checked yet (what an older state's missing stories start as)."""
    m, t = monitor, monitor.tracker
    carry = Carry(m.options.history)
    return {**carry.state_dict(m.view.names, m.optimizers),
            "lrs": LrStory(m.optimizers).state_dict() if t is not None else None,
            "steps": {"stepped": {}, "total": 0, "arms": {}, "tests": {}, "turn": {}, "watched": []} if t is not None else None,
            "once": Once().state_dict(), "unstepped": Unstepped().state_dict() if m.unstepped is not None else None}


def upgrade(monitor, state: dict) -> tuple[dict, list[str]]:
    """A state of an older version as this version's, and the words for what it lacked (started
    fresh). A state of this version is returned as it is; one of no known version is refused."""
    version = state.get("version", 1)
    if version == VERSION and not isinstance(version, bool):
        return state, []
    if version != 1 or "version" in state:
        raise ValueError(f"state['version'] is {version!r}; this gradhealth reads versions 1 to {VERSION}")
    exact(state, V1_KEYS, "state (version 1)")
    fresh, lacking = _fresh(monitor), []
    new = {**fresh, **state, "version": VERSION}
    lacking += [words for k, words in STORIES.items() if k in fresh and k not in state and fresh[k] is not None]
    streaks = state["streaks"]
    if isinstance(streaks, dict):
        if "units" not in streaks:  # the first format: {name: consecutive checks without a gradient}
            streaks = {"n": {}, "units": {n: [0, 0, c, 0, None, True] for n, c in streaks.items()}, "blank": 0}
        gone = [k for k in fresh["streaks"] if k not in streaks]
        new["streaks"] = {**fresh["streaks"], **streaks}
        if gone:
            lacking.append(STORIES["streaks"].format(" and ".join(", ".join(gone).rsplit(", ", 1)) + " records"))
    for key in ("history",) if isinstance(state["history"], dict) else ():
        gone = [k for k in ("spiked", "medians") if k not in state["history"]]
        new[key] = {**state[key], "spiked": False, "medians": None}
        if gone:
            lacking.append(STORIES["history"].format("last spike and module medians"))
    if isinstance(state["histories"], dict):
        new["histories"] = {k: {**h, "spiked": False, "medians": None} if isinstance(h, dict) else h
                            for k, h in state["histories"].items()}
    return new, lacking


def load(monitor, state) -> None:
    """``GradHealth.load_state_dict``: the state checked against this monitor, whole, then loaded."""
    m, view, t = monitor, monitor.view, monitor.tracker
    if not isinstance(state, dict):
        raise TypeError(f"load_state_dict: state must be a dict from GradHealth.state_dict(); got {type(state).__name__}")
    try:
        check_params(state.get("params"), view.names)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"load_state_dict: {exc}; the monitor was left unchanged") from None
    lacking: list[str] = []
    try:
        state, lacking = upgrade(m, state)
        exact(state, m.carry.KEYS + MONITOR_KEYS, "state")
        carry = {k: state[k] for k in m.carry.KEYS}
        n = len(m.optimizers)
        for key in ("lrs", "steps", "unstepped"):  # (None: saved by a monitor without an optimizer, or with one)
            if state[key] is not None and not isinstance(state[key], dict):
                raise TypeError(f"state[{key!r}] must be a dict or None; got {type(state[key]).__name__}")
        # (a monitor without those stories checks them all the same, against any optimizer index, and keeps none)
        anyone = SimpleNamespace(lrs=SimpleNamespace(optimizers=[None] * _ANY), entries=view.entries)
        lrs = LrStory(m.optimizers if t is not None else anyone.lrs.optimizers)
        if state["lrs"] is not None:
            lrs.load_state_dict(state["lrs"])
        steps = type(t).load_state_dict(t, state["steps"]) if t is not None and state["steps"] is not None else None
        if t is None and state["steps"] is not None:
            UpdateTracker.load_state_dict(anyone, state["steps"])
        once = Once()
        once.load_state_dict(state["once"], n)
        unstepped = Unstepped()
        if state["unstepped"] is not None:
            unstepped.load_state_dict(state["unstepped"], n if m.unstepped is not None else _ANY)
    except (TypeError, ValueError, KeyError, AttributeError, OverflowError, IndexError) as exc:
        detail = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        raise ValueError(f"load_state_dict: not a valid state from GradHealth.state_dict() ({detail}); "
                         "the monitor was left unchanged") from None
    units = set(view.names) | {unit_name(s.module, e) for s in view.stacks.values() for e in range(s.count)}
    restore = m.carry.load_state_dict(carry, set(view.modules), units, view.names, m.optimizers or anyone.lrs.optimizers)
    # (everything checked: from here on nothing can fail)
    trace_from = restore()
    if t is not None:
        lrs.optimizers = t.lrs.optimizers
        t.lrs = lrs
        if steps is not None:
            t.restore(steps)
    m.publisher.once = once
    if m.unstepped is not None:
        m.unstepped = unstepped
    if trace_from is not None:
        m.rearm_tracer(trace_from)
    if lacking:
        warnings.warn(f"gradhealth: this state is from an older gradhealth (version 1, not "
                      f"{VERSION}): it did not keep {'; '.join(lacking)}. These start fresh; everything else it "
                      "held is restored", GradHealthWarning, stacklevel=3)


def rearm(m, step: int) -> None:
    """Monitor ``m``'s NaN tracer, armed before the checkpoint for the step after ``step``, armed again."""
    if m.options.trace_on_nonfinite and m.scaler is None:
        from ..origin.replay import arm_tracer

        wait = m.carry.trace_wait
        arm_tracer(m.carry, m.model, step)
        m.carry.trace_wait = wait

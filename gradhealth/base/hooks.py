"""Hooks owned by a monitor: every hook it registers goes when it is closed or garbage-collected.

A monitor registers module forward hooks (the forward watch), optimizer step hooks and gradient
hooks (the update tracker and its stale-gradient witnesses), a traced step's hooks, a DDP forward
hook, and a share of torch's global registration hooks (:class:`gradhealth.model.params.ModelChanges`,
removed with the last live monitor). None of them refers to the monitor, so a monitor that is
dropped without ``close()`` (a notebook cell run again) is collected, and a ``weakref.finalize``
then removes its hooks: nothing keeps running at every forward, backward and step.

Every one of those hooks is registered through :func:`guarded`: its own failure is said once as a
``GradHealthInternalWarning`` and it stands down for that call; nothing but a verdict the user
asked to raise (``on_problem="raise"``) leaves a hook into the user's loop.
"""

from __future__ import annotations

import functools
import warnings
import weakref

from .errors import GradHealthError, GradHealthInternalWarning

__all__ = ["Owned", "guarded", "step_hooks"]


def guarded(fn, what: str, said: set | None = None, fallback=None):
    """``fn`` as a hook that never raises into the user's loop: an exception from it (not a
    :class:`GradHealthError` said on purpose, ``on_problem="raise"``) is said once per ``what``
    (``said``: the set an owner shares among its hooks) as a :class:`GradHealthInternalWarning`,
    and the hook returns None (a tensor or forward hook then leaves the value as it was): what it
    would have measured at that call is not measured. ``fallback`` (same arguments) then records
    only that the event happened, so nothing is concluded from its absence (a step not counted
    would read as a step that never ran)."""
    said = set() if said is None else said

    def hook(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except GradHealthError:
            raise
        except Exception as exc:
            if what not in said:
                said.add(what)
                try:  # (under `-W error` the warning itself would raise into the user's backward or step)
                    warnings.warn(f"gradhealth: its {what} failed ({type(exc).__name__}: {exc}); what it measures is "
                                  "not reported at that call, training continues (said once)", GradHealthInternalWarning,
                                  stacklevel=2)
                except Exception:
                    pass
            if fallback is not None:
                try:
                    fallback(*args, **kwargs)
                except Exception:  # (the bookkeeping of a hook that already failed: nothing more to say)
                    pass
            return None

    try:
        return functools.wraps(fn)(hook)
    except (AttributeError, TypeError):  # (a partial without a name)
        return hook


def step_hooks(tracker, optimizers) -> list:
    """The update tracker's step pre- and post-hooks on each optimizer, guarded. A post-hook that
    fails still counts its step (unmeasured): a step not counted would read as one that never ran."""
    said: set = set()

    def failed(opt, args, kwargs) -> None:
        tracker._in_step.pop(id(opt), None)
        tracker._inflight.pop(id(opt), None)
        tracker.steps_since_check += 1
        tracker.stepped[id(opt)] = tracker.stepped.get(id(opt), 0) + 1
        tracker.total_steps += 1
        tracker.ran.stepped(opt, None)

    return ([opt.register_step_post_hook(guarded(tracker._post, "optimizer step post-hook", said, failed))
             for opt in optimizers]
            + [opt.register_step_pre_hook(guarded(tracker._pre, "optimizer step pre-hook", said)) for opt in optimizers])


class Owned:
    """What one monitor registered; ``release()`` removes all of it, once."""

    def __init__(self, owner, watch, changes, tracker, carry, ranks, masters=None):
        self.watch, self.changes, self.tracker, self.carry, self.ranks = watch, changes, tracker, carry, ranks
        self.masters = masters  # (:mod:`gradhealth.model.masters`: each wrapper's own step put back)
        self.deferred = None  # (:mod:`gradhealth.check.deferred`: the guard's step hooks)
        self._finalizer = weakref.finalize(owner, self.release)  # (self holds no reference to the owner)

    def release(self) -> None:
        if self._finalizer.alive:
            self._finalizer.detach()
        parts, self.watch = [self.watch], None
        if parts[0] is not None:
            parts[0].remove()
        if self.changes is not None:
            self.changes.close()
            self.changes = None
        if self.tracker is not None:
            self.tracker.close()
            self.tracker = None
        if self.carry is not None and self.carry.tracer is not None:
            self.carry.tracer.disarm()
        self.carry = None
        if self.deferred is not None:
            self.deferred.close()
            self.deferred = None
        if self.masters is not None:
            self.masters.close()
            self.masters = None
        if self.ranks is not None:
            self.ranks.close()
            self.ranks = None

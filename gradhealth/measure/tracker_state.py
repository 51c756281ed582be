"""What the update tracker (:class:`.deltas.UpdateTracker`) saves and loads: the counts that date the coming
steps' tests and the watched parameters, checked whole with the saved-value checks of
:mod:`gradhealth.base.saved` before anything is assigned."""

from __future__ import annotations

from ..base.saved import count, exact, index, names

__all__ = ["TrackerState"]


class TrackerState:
    """The update tracker's checkpoint (:class:`.deltas.UpdateTracker` is one)."""

    def state_dict(self) -> dict:
        """The counts that date the coming steps' tests (by optimizer index) and the watched
        parameters (by name); the learning-rate story is :meth:`LrStory.state_dict`."""
        opts = self.lrs.optimizers
        per = lambda d: {str(k): d[id(o)] for k, o in enumerate(opts) if id(o) in d}  # noqa: E731
        return {"stepped": per(self.stepped), "total": self.total_steps, "arms": per(self._arms),
                "tests": per(self._tests), "turn": per(self._turn),
                "watched": sorted(self.entries[i][0] for i in self.watched if i < len(self.entries))}

    def load_state_dict(self, state: dict) -> dict:
        """Checked (:mod:`gradhealth.check.state`) into what :meth:`restore` assigns, nothing assigned yet."""
        exact(state, ("stepped", "total", "arms", "tests", "turn", "watched"), "state['steps']")
        opts = self.lrs.optimizers
        out = {"total": count(state["total"], "state['steps']['total']")}
        for key in ("stepped", "arms", "tests", "turn"):
            if not isinstance(state[key], dict):
                raise TypeError(f"state['steps'][{key!r}] must map optimizer indices to counts")
            out[key] = {id(opts[index(k, f"state['steps'][{key!r}] key", len(opts))]):
                        count(v, f"state['steps'][{key!r}][{k!r}]") for k, v in state[key].items()}
        where = {n: i for i, (n, _) in enumerate(self.entries)}
        out["watched"] = {where[n] for n in names(state["watched"], "state['steps']['watched']", set(where))}
        return out

    def restore(self, loaded: dict) -> None:
        self.stepped, self.total_steps, self._arms = loaded["stepped"], loaded["total"], loaded["arms"]
        self._tests, self._turn, self.watched = loaded["tests"], loaded["turn"], loaded["watched"]

"""A gradient that piles up without a step: a parameter whose gradient grows check over check
while no optimizer step changes it, though steps run.

An optimizer in backward that hooked only the parameters requiring grad when it was set up
(torchtune's ``register_optim_in_bwd_hooks`` and ``OptimizerInBackward``; a layer unfrozen later
has no hook), an optimizer that holds a parameter but never steps: the parameter's ``.grad`` is
never applied and never cleared, so each backward adds onto it, while the weight stays where it
was and every check reads it as OK. The rule, from what the checks see:

* its gradient norm grew at ``PILE`` checks in a row (each backward added onto the last);
* optimizer steps ran meanwhile (not accumulation over micro-batches before a step);
* no step changed the parameter: its version counter did not move under optimizers that hold it
  and whose steps move it (torch.optim's own, not fused: :func:`gradhealth.measure.compare.versions_tell`), or every
  optimizer that holds it did not step for ``IDLE`` checks in a row while another one did (a GAN's
  generator, whose gradients from the critic's backwards pile up over ``n_critic`` steps until its
  own ``zero_grad``, is not that: its optimizer steps every few checks). Where neither tells (a
  fused step moves no counter), nothing is said.

Judged for OK parameters whose learning rate is not 0 (a group held at 0 is :mod:`gradhealth.measure.lrstory`'s).
"""

from __future__ import annotations

import math
from collections import deque
from itertools import compress, repeat
from operator import add, attrgetter, eq, gt, is_, le, mul, ne

from ..base import saved as checked
from ..base.findings import Finding, FindingKind
from ..base.naming import agree
from ..base.report import describe_names
from ..base.status import Status
from ..measure.compare import versions_tell

__all__ = ["PileUp", "PILE", "IDLE"]

#: checks in a row with a growing gradient (and no change of the parameter) before it is named
PILE = 3
#: ... when the only evidence is that no optimizer holding it stepped meanwhile (longer than the
#: critic steps between a GAN generator's own steps: WGAN's n_critic is 5)
IDLE = 8
#: checks whose norms and step counts are kept (a longer streak is dated from the oldest)
HISTORY = 64
_VERSION = attrgetter("_version")


class PileUp:
    """The streaks, kept as lists aligned to the names that had gradients and advanced with
    ``map`` over ``operator`` functions: no Python bytecode runs per parameter on the usual check
    (the same parameters with gradients as at the last one); Python runs per parameter only for
    those already ``PILE`` checks into a streak."""

    def __init__(self) -> None:
        self._keys: list = []  # the names that had gradients at the last check
        self._vals: list = []  # their gradient norms then
        self._vers: list = []  # their parameters' version counters then
        self._runs: list = []  # checks in a row each grew with no change of its parameter
        self._params: list = []  # the parameters of _keys
        self._names: list | None = None
        self._src: list | None = None  # the monitor's list of parameters _params were taken from
        self._by_name: dict = {}
        self._hist: deque = deque(maxlen=HISTORY)  # per check: (keys, norms, total steps, steps per optimizer)
        self._long: dict = {}  # name -> (total steps, steps per optimizer, first norm) of a streak older than _hist
        self._since: dict = {}  # ... of a streak that began before a load (:meth:`load_state_dict`)
        self._bridge: dict = {}  # name -> its streak, at a load: held over the first check after it

    def quiet(self, keys: list[str], vals: list[float], params: list, tracker) -> bool:
        """``update`` of a check whose parameters with gradients (``keys``, their norms ``vals``)
        are the last check's, every one OK with a finite norm (the factors of those tests are 1),
        with no streak kept past the history nor bridged over a load, where no streak reaches
        ``PILE`` (nothing to say): True, the streaks advanced as ``update`` advances them; else False,
        nothing changed (``update`` decides)."""
        if keys != self._keys or params is not self._src or self._long or self._since or self._bridge:
            return False
        vers = list(map(_VERSION, self._params))
        runs = list(map(mul, map(add, map(mul, self._runs, map(eq, vers, self._vers)), repeat(1)), map(gt, vals, self._vals)))
        if max(runs) >= PILE:
            return False
        vals = list(vals)
        self._vals, self._vers, self._runs = vals, vers, runs
        self._hist.append((self._keys, vals, tracker.total_steps, dict(tracker.stepped)))
        return True

    def update(self, report, names: list[str], params: list, tracker) -> list[Finding]:
        """GRAD_PILEUP for the parameters piling up now (``tracker``: the monitor's
        :class:`~gradhealth.measure.deltas.UpdateTracker`, its step counts and learning rates)."""
        gn, status = report.grad_norm, report.status
        if not gn:
            self.__init__()
            return []
        keys, vals = list(gn), list(gn.values())
        if keys == self._keys and params is self._src:  # (the usual check: the last check's lists are aligned)
            keys, plist, prev, vers0, runs0 = self._keys, self._params, self._vals, self._vers, self._runs
        else:  # (other parameters had gradients, or were replaced: realign by name; one absent then did not grow)
            if names is not self._names or params is not self._src:
                self._names, self._src, self._by_name = names, params, dict(zip(names, params))
            plist = list(map(self._by_name.__getitem__, keys))
            old = self._keys
            prev = list(map(dict(zip(old, self._vals)).get, keys, repeat(math.inf)))
            vers0 = list(map(dict(zip(old, self._vers)).get, keys, repeat(-1)))
            runs0 = list(map(dict(zip(old, self._runs)).get, keys, repeat(0)))
            if self._bridge:  # (the first check after a load: a checkpoint holds no gradients, so the ones
                # now are not the ones the streak saw grow, and a step may have run since its last check: the
                # streak is held over this check, neither grown nor broken; growth and versions are read from here)
                for i in [i for i, k in enumerate(keys) if k in self._bridge]:
                    prev[i], vers0[i], runs0[i] = 0.0, plist[i]._version, self._bridge[keys[i]] - 1
                self._bridge = {}
        vers = list(map(_VERSION, plist))
        # runs = (runs0 * same version + 1) * grew * OK * finite, all in C (bools are 0 and 1)
        runs = list(map(mul, map(mul, map(mul, map(add, map(mul, runs0, map(eq, vers, vers0)), repeat(1)),
                                          map(gt, vals, prev)),
                                 map(is_, map(status.get, keys), repeat(Status.OK))),
                        map(ne, vals, repeat(math.inf))))
        self._keys, self._vals, self._vers, self._runs, self._params = keys, vals, vers, runs, plist
        hist, long = self._hist, self._long
        hist.append((keys, vals, tracker.total_steps, dict(tracker.stepped)))
        if long or self._since:  # (streaks that ended)
            alive = dict(zip(keys, runs))
            for n in [n for n in long if alive.get(n, 0) < HISTORY - 1]:
                del long[n]
            for n in [n for n in self._since if not alive.get(n, 0)]:
                del self._since[n]
        if max(runs) < PILE:  # (the usual check: no streak to name, none about to outlive _hist)
            return []
        for i in compress(range(len(runs)), map(eq, runs, repeat(HISTORY - 1))):  # (a streak about to outlive _hist)
            start = hist[-(HISTORY - 1)]
            long[keys[i]] = (start[2], start[3], _norm_at(hist[-HISTORY], keys[i]))
        due = list(compress(range(len(runs)), map(le, repeat(PILE), runs)))
        if not due:
            return []
        held = tracker.lrs.zero_ids()
        holders = _holders(tracker.lrs.optimizers, {id(plist[i]) for i in due})
        found, firsts, counts = [], [], []
        for i in due:
            run = runs[i]  # (where the streak began: its check kept, or noted before it left _hist or before a load)
            steps0, then, first = self._origin(keys[i], run)
            if tracker.total_steps <= steps0:  # (no step since: accumulation over micro-batches)
                continue
            p = plist[i]
            mine = holders.get(id(p), [])
            if not mine or id(p) in held:
                continue
            stepped = [tracker.stepped.get(id(o), 0) != then.get(id(o), 0) for o in mine]
            if (run >= IDLE and not any(stepped)) or (any(stepped) and all(versions_tell(o) for o in mine)):
                # (idle holders for long; or holders that stepped, whose steps move the version, did not move it)
                found.append(keys[i])
                counts.append(run)
                firsts.append(first)
        if not found:
            return []
        first, last = min(firsts), max(gn[n] for n in found)
        return [Finding(FindingKind.GRAD_PILEUP, f"{describe_names(status, found)}: {agree(found, 'their gradients have', 'its gradient has')} "
                        f"grown at each of the last {min(counts)} checks (norm {first:.3g} to {last:.3g}) while optimizer steps ran "
                        f"and none of them changed {agree(found, 'these parameters', 'this parameter')}: {agree(found, 'their gradients pile', 'its gradient piles')} up unapplied. No optimizer steps "
                        f"{agree(found, 'them', 'it')} and nothing clears {agree(found, 'their', 'its')} .grad: an optimizer "
                        "in backward that hooked only the parameters requiring grad when it was set up (a layer "
                        "unfrozen later has no hook: register one for it, or rebuild the optimizer), or an optimizer "
                        "that holds them but whose step() never runs", params=tuple(n for n in status if n in found),
                        step=report.step, data={"first": first, "last": last})]

    def _origin(self, name: str, run: int) -> tuple:
        """(total steps, steps per optimizer, first norm) where ``name``'s streak of ``run`` checks began."""
        if name in self._since:
            return self._since[name]
        if run >= HISTORY - 1:
            return self._long[name]
        hist = self._hist
        return (*hist[-run][2:], _norm_at(hist[-run - 1], name))

    # -------------------------------------------------------------- checkpoint
    def state_dict(self, optimizers) -> dict:
        """The streaks (a checkpoint holds no gradients, so no norms to compare with): per name,
        [checks, total steps then, {optimizer index: its steps then}, first norm]."""
        where = {id(o): k for k, o in enumerate(optimizers)}
        out = {}
        for name, run in self._bridge.items():  # (loaded, not checked since)
            steps0, then, first = self._since[name]
            out[name] = [run, steps0, {str(where[o]): n for o, n in then.items() if o in where}, first]
        for name, run in zip(self._keys, self._runs):
            if run:
                steps0, then, first = self._origin(name, run)
                out[name] = [run, steps0, {str(where[o]): n for o, n in then.items() if o in where}, first]
        return {"streaks": out}

    def load_state_dict(self, state: dict, optimizers, names) -> None:
        """Every key checked (:mod:`gradhealth.check.state`), then loaded."""
        checked.exact(state, ("streaks",), "state['pileup']")
        streaks = state["streaks"]
        if not isinstance(streaks, dict):
            raise TypeError("state['pileup']['streaks'] must map names to streaks")
        checked.names(list(streaks), "state['pileup']['streaks']", names)
        bridge, since = {}, {}
        for name, v in streaks.items():
            path = f"state['pileup']['streaks'][{name!r}]"
            if not isinstance(v, list) or len(v) != 4 or not isinstance(v[2], dict):
                raise TypeError(f"{path} must be [checks, total steps, {{optimizer: steps}}, first norm]")
            run = checked.count(v[0], f"{path}[0]")
            if not run:
                raise ValueError(f"{path}[0] must be at least 1")
            then = {id(optimizers[checked.index(k, f"{path}[2] key", len(optimizers))]): checked.count(n, f"{path}[2][{k!r}]")
                    for k, n in v[2].items()}
            bridge[name] = run
            since[name] = (checked.count(v[1], f"{path}[1]"), then, checked.norm(v[3], f"{path}[3]"))
        self.__init__()
        self._bridge, self._since = bridge, since


def _norm_at(entry, name: str) -> float:
    """The gradient norm of ``name`` at a kept check (``entry``: keys, norms, ...)."""
    keys, vals = entry[0], entry[1]
    return vals[keys.index(name)]


def _holders(optimizers, ids: set[int]) -> dict[int, list]:
    """For each parameter id of ``ids``, the optimizers whose param_groups hold it."""
    out: dict[int, list] = {}
    for o in optimizers:
        for g in o.param_groups:
            for p in g["params"]:
                if id(p) in ids:
                    out.setdefault(id(p), []).append(o)
    return out

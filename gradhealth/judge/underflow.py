"""Exactly zero gradients that are underflow: a gradient that shrinks through the layers of a deep
stack (saturated tanh or sigmoid, no normalisation, no residual path) reaches the first layers
below float32's smallest number, and every element there is 0. It reads as ZERO_GRAD, like a cut
path or a dead ReLU. What tells it apart is the edge: the parameter right after the zero ones (in
the model's order) has a *subnormal* gradient, a norm below its dtype's smallest normal number
(float32 and bfloat16: 1.2e-38; float16: 6.1e-5): every element of it is subnormal, on its way to 0.
Such units come and go, zero at one check and 1e-44 at the next, which is not skipping: a unit
whose gradient was subnormal before its first gap, or when it came back, is no proxy for the
persistence rule (:class:`Faint`), unless its gap held a NO_GRAD check (its gradient was None:
skipped). Said as VANISHING_GRAD beside the ZERO_GRAD errors, naming the fading layers (gradients
below ``1e8`` times the smallest normal number, :data:`FAINT` for float32), with what to do.
"""

from __future__ import annotations

import operator
from collections.abc import Collection, Mapping
from functools import lru_cache
from itertools import compress, repeat

import torch

from ..base import saved as checked
from ..base.findings import Finding, FindingKind
from ..base.naming import agree
from ..base.status import Status

__all__ = ["underflow", "Faint", "FAINT", "tiny_of"]

#: a fading gradient: below FADING times its dtype's smallest normal number (float32: :data:`FAINT`)
FADING = 1e8
FAINT = FADING * torch.finfo(torch.float32).tiny
_DTYPE = operator.attrgetter("dtype")
_WIDEST = torch.finfo(torch.float16).tiny  # (the largest smallest-normal number of the float dtypes)


@lru_cache(maxsize=None)
def tiny_of(dtype: torch.dtype) -> float:
    """The smallest normal number of ``dtype``: a norm below it is a tensor of subnormal elements."""
    return torch.finfo(dtype).tiny if dtype.is_floating_point else 0.0


class Faint:
    """This check's gradient norms and the last check's, read against each parameter's floor."""

    def __init__(self) -> None:
        self.norms: Mapping[str, float] = {}
        self.last: Mapping[str, float] = {}
        self._names: list | None = None
        self._index: dict[str, int] = {}
        self._params: list = []
        self._dtypes: tuple = ()
        self._fading: dict[str, float] = {}
        self.lead: list[str] = []  # the model's first parameters with subnormal gradients, at the last check
        self.streak = 0  # ... checks in a row

    def read(self, norms: Mapping[str, float], names: list[str], params: list) -> Faint:
        if names is not self._names:
            self._names, self._index = names, {n: i for i, n in enumerate(names)}
        self.norms, self._params = norms, params
        return self

    def fading(self) -> dict[str, float]:
        """name -> FADING times its dtype's smallest normal number (made again when a dtype changed)."""
        dtypes = tuple(map(_DTYPE, self._params))
        if dtypes != self._dtypes:
            self._dtypes, self._fading = dtypes, {n: FADING * tiny_of(d) for n, d in zip(self._names, dtypes)}
        return self._fading

    def below(self, name: str, norm: float | None, times: float = 1.0) -> bool:
        """0 < ``norm`` < ``times`` x the smallest normal number of ``name``'s dtype."""
        i = self._index.get(name)
        return i is not None and norm is not None and 0.0 < norm < times * tiny_of(self._params[i].dtype)

    def dtype(self, name: str) -> torch.dtype:
        return self._params[self._index[name]].dtype

    def now(self, name: str) -> bool:
        """Is ``name``'s gradient subnormal at this check?"""
        return self.below(name, self.norms.get(name))

    def before(self, name: str) -> bool:
        """... at the last check?"""
        return self.below(name, self.last.get(name))

    def keep(self) -> None:
        self.last = self.norms

    def state_dict(self) -> dict:
        """What a later check reads: the last check's subnormal norms (below every dtype's smallest
        normal number: the others read as normal), and the prefix's streak."""
        return {"last": {n: v for n, v in self.last.items() if 0.0 < v < _WIDEST}, "lead": list(self.lead),
                "streak": self.streak}

    def load_state_dict(self, state: dict, units=None) -> None:
        checked.exact(state, ("last", "lead", "streak"), "state['streaks']['reader']")
        last = state["last"]
        if not isinstance(last, dict):
            raise TypeError("state['streaks']['reader']['last'] must map names to norms")
        checked.names(list(last), "state['streaks']['reader']['last']", units)
        last = {n: checked.norm(v, f"state['streaks']['reader']['last'][{n!r}]") for n, v in last.items()}
        lead = checked.names(state["lead"], "state['streaks']['reader']['lead']", units)
        self.last, self.lead, self.streak = last, list(lead), checked.count(state["streak"], "state['streaks']['reader']['streak']")

    def prefix(self, status: Mapping[str, Status], grad_norm: Mapping[str, float], step: int, patience: int) -> list[Finding]:
        """VANISHING_GRAD (cause ``subnormal``) when the model's first parameters (in its order, the
        frozen ones passed over), at least two, have subnormal gradients at ``patience`` checks in a
        row: a gradient that vanishes through the layers above them before it is exactly zero (a
        deep sigmoid stack). Only a prefix: a parameter whose gradient is subnormal by its nature
        elsewhere in a model (an attention key bias in float16) is not one."""
        if not self.streak:  # (the usual check: the first gradient is normal in any dtype, no streak to count)
            first = next(iter(grad_norm.items()), None)
            if first is None or (first[1] >= _WIDEST and status.get(first[0]) is not Status.FROZEN):
                self.lead = []
                return []
        lead = []
        for n, s in status.items():
            if s is Status.FROZEN:
                continue
            if not self.below(n, grad_norm.get(n)):
                break
            lead.append(n)
        self.streak = self.streak + 1 if len(lead) >= 2 and lead[:1] == self.lead[:1] else int(len(lead) >= 2)
        self.lead = lead
        if self.streak < max(1, patience):
            return []
        from ..base.report import LONG, describe_names

        dtype = self.dtype(lead[0])
        return [Finding(
            FindingKind.VANISHING_GRAD,
            f"{describe_names(status, lead, most=LONG)}, the first parameters of the model, got gradients below "
            f"{str(dtype).replace('torch.', '')}'s smallest normal number ({tiny_of(dtype):.2g}; at most "
            f"{max(map(grad_norm.__getitem__, lead)):.3g}) at each of the last {self.streak} checks: the gradient vanishes "
            "through the layers above them and their steps barely move them (a deeper stack makes it exactly 0). "
            "Saturated tanh or sigmoid units, or a deep stack without normalisation or residual connections: use an "
            "initialisation that keeps the scale (Xavier for tanh, Kaiming for ReLU), normalisation layers or "
            "residual connections",
            params=tuple(lead), level="warning", step=step, data={"cause": "subnormal", "checks": self.streak})]


def underflow(status: Mapping[str, Status], errors: Collection[str], grad_norm: Mapping[str, float],
              gaps: Mapping[str, int], step: int, faint: Faint) -> list[Finding]:
    """VANISHING_GRAD (cause ``underflow``) when parameters the persistence rule counts as errors got
    exactly zero gradients and the first parameter after the last of them (in the model's order)
    with a non-zero gradient has a subnormal one: the edge of an underflow."""
    norms = grad_norm.values()
    if not errors or not norms:
        return []
    judged = list(filter(errors.__contains__, status))  # (in the model's order; then the zero ones, in C)
    zero = list(compress(judged, map(operator.is_, map(status.__getitem__, judged), repeat(Status.ZERO_GRAD))))
    if not zero:
        return []
    order = list(status)
    last = max(map(order.index, zero))
    after = next((n for n in order[last + 1:] if grad_norm.get(n, 0.0) > 0.0), None)
    if after is None or not faint.below(after, grad_norm[after]):
        return []
    values = grad_norm.values()  # (the layers where it fades, picked in C)
    weak = list(compress(grad_norm, map(operator.and_, map(operator.gt, values, repeat(0.0)),
                                        map(operator.lt, values, map(faint.fading().__getitem__, grad_norm)))))
    dtype = faint.dtype(after)
    half = " In float16, scale the loss (torch.amp.GradScaler) or train in bfloat16." if dtype == torch.float16 else ""
    from ..base.report import LONG, describe_names  # (the report module imports the findings' modules)

    return [Finding(
        FindingKind.VANISHING_GRAD,
        f"{describe_names(status, zero, most=LONG)} got exactly zero gradients at step {step} (for {max(map(gaps.get, zero, repeat(1)))} "
        f"checks in a row), and {describe_names(status, weak, most=4)} got {agree(weak, 'gradients', 'a gradient')} of at "
        f"most {max(map(grad_norm.__getitem__, weak)):.3g}: the gradient shrinks through the layers until it underflows "
        f"{str(dtype).replace('torch.', '')} (below {tiny_of(dtype):.2g} its elements are subnormal, then 0): saturated "
        "tanh or sigmoid units, or a deep stack without normalisation or residual connections. Use an initialisation "
        "that keeps the scale (Xavier for tanh, Kaiming for ReLU), add normalisation layers or residual connections; "
        f"one backward in float64 shows the gradients that are there.{half}",
        params=tuple(zero), level="warning", step=step,
        data={"cause": "underflow", "faint": {n: grad_norm[n] for n in weak[:8]}})]

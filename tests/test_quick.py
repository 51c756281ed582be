"""gradhealth.base.quick: the hot path's constructors build what the dataclasses' own __init__ builds."""

from __future__ import annotations

import dataclasses

import pytest

from gradhealth.measure.observe import Observation
from gradhealth.base.quick import quick
from gradhealth.base.findings import Finding, FindingKind
from gradhealth.base.report import Report
from gradhealth.base.status import Status


@pytest.mark.parametrize("cls, given", [
    (Report, dict(step=3, status={"w": Status.OK}, grad_norm={"w": 1.5}, total_grad_norm=1.5, loss=0.25, not_ok=[],
                  frozen_names=[], optimizer_index=None)),
    (Report, dict(step=0, status={}, grad_norm={}, total_grad_norm=0.0,
                  findings=[Finding(FindingKind.GRAD_PILEUP, "x", step=0)])),
    (Observation, dict(idx=[0, 1], norm_of=[1.0, None], loss=None, valid={"v": 2}, with_grad=[0], norms=[1.0])),
])
def test_quick_builds_what_the_class_builds(cls, given):
    a, b = quick(cls)(**given), cls(**given)
    assert type(a) is cls and vars(a) == vars(b) and a == b
    assert [f.name for f in dataclasses.fields(cls)] and set(vars(a)) == {f.name for f in dataclasses.fields(cls)}


def test_quick_containers_are_fresh_at_every_call():
    build = quick(Report)
    a, b = (build(step=k, status={}, grad_norm={}, total_grad_norm=0.0) for k in range(2))
    a.findings.append(1)
    a.update_norm["w"] = 1.0
    assert b.findings == [] and b.update_norm == {} and a.findings is not b.findings
    assert a.tolerated == frozenset()


def test_quick_refuses_what_it_cannot_build_and_a_missing_field():
    @dataclasses.dataclass(frozen=True)
    class Frozen:
        x: int = 0

    @dataclasses.dataclass
    class Post:
        x: int = 0

        def __post_init__(self):
            self.x += 1

    for cls in (Frozen, Post, int):
        with pytest.raises(TypeError, match="not a plain dataclass"):
            quick(cls)
    with pytest.raises(TypeError, match="missing grad_norm, total_grad_norm"):
        quick(Report)(step=0, status={})

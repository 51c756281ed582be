"""Every message template reads as English for one parameter and for several: the verb, the
pronouns and the nouns agree with the subject."""

import re

import pytest

import gradhealth as gh
from gradhealth.judge import judges
from gradhealth.base.naming import agree, plural
from gradhealth.judge.patience import Verdict
from gradhealth.publish.policy import explain
from gradhealth.base.report import Report, describe_names
from gradhealth.base.status import HINTS, HINTS_ONE, Status

S = Status
# 6 parameters in 3 modules: one name is "a.weight", two names from different modules are
# "a.weight, b.weight" (never collapsed to a module or to the whole model)
STATUS = {f"{m}.{p}": S.OK for m in "abc" for p in ("weight", "bias")}
ONE, TWO = ["a.weight"], ["a.weight", "b.weight"]

# (label, builds the findings for the given names, the words right after the subject: one, many)
TEMPLATES = [
    ("stale_grad", lambda n: judges.stale_grad(STATUS, n, 3), ": this backward added", ": this backward added"),
    ("checkpoint_no_grad", lambda n: judges.checkpoint_no_grad(n, True, STATUS, 3), "gets no gradient", "get no gradient"),
    ("expect_frozen frozen", lambda n: judges.expect_frozen(
        {k: (S.FROZEN if k in n or k.startswith("c.") else S.OK) for k in STATUS}, ("c.*",), 3),
     "is frozen but not matched", "are frozen but not matched"),
    ("expect_frozen trainable", lambda n: judges.expect_frozen(
        {k: (S.FROZEN if k.startswith("c.") else S.OK) for k in STATUS}, tuple(n) + ("c.*",), 3),
     "matches expect_frozen", "match expect_frozen"),
    ("not_updated below precision", lambda n: judges.not_updated(STATUS, {k: "" for k in n}, 3, still=1, patience=3),
     "was left exactly unchanged", "were left exactly unchanged"),
    ("not_updated warmup", lambda n: judges.not_updated(STATUS, {k: "new" for k in n}, 3),
     "was not changed by optimizer.step()", "were not changed by optimizer.step()"),
    ("not_updated lr stuck", lambda n: judges.not_updated(STATUS, {k: "again" for k in n}, 3),
     "had a finite, non-zero gradient", "had finite, non-zero gradients"),
    ("not_updated nothing moves", lambda n: judges.not_updated(STATUS, {k: "" for k in n}, 3, still=3, patience=3),
     "had a finite, non-zero gradient", "had finite, non-zero gradients"),
    ("frozen_but_changed", lambda n: judges.frozen_but_changed(STATUS, n, 3), "is frozen but optimizer.step() moved it",
     "are frozen but optimizer.step() moved them"),
    ("skipped_step", lambda n: judges.skipped_step(STATUS, {k: k in n for k in STATUS}, 3),
     "had a gradient at step 3 but no optimizer.step() ran before it was zeroed",
     "had gradients at step 3 but no optimizer.step() ran before they were zeroed"),
    ("transient partner", lambda n: judges.transient_grads(STATUS, Verdict({k: 1 for k in n}, set(), {}), 3, n, 3)[1],
     "got an exactly zero gradient", "got exactly zero gradients"),
    ("transient", lambda n: judges.transient_grads(STATUS, Verdict({k: 1 for k in n}, set(), {}), 3, (), 3)[1],
     "got no usable gradient", "got no usable gradient"),
    ("transient intermittent", lambda n: judges.transient_grads(
        STATUS, Verdict({k: 4 for k in n}, set(), {k: (30, 9) for k in n}), 3, (), 3)[1],
     "got no usable gradient", "got no usable gradient"),
]

WRONG_FOR_ONE = re.compile(r"\b(were|are|have|get|match|differ|they|them|their)\b")


@pytest.mark.parametrize("label, build, one, many", TEMPLATES, ids=[t[0] for t in TEMPLATES])
def test_each_template_agrees_with_one_and_with_several(label, build, one, many):
    single, several = build(ONE), build(TWO)
    assert len(single) == 1 and len(several) == 1, label
    subject_one = "a.weight"
    assert single[0].message.startswith(f"{subject_one} {one}".replace(" :", ":")), single[0].message
    assert several[0].message.startswith(f"a.weight, b.weight {many}".replace(" :", ":")), several[0].message
    # nothing plural is said about the one parameter in the sentence it is the subject of
    first = single[0].message.split(":")[0]
    assert not WRONG_FOR_ONE.search(first[len(subject_one):]), first


@pytest.mark.parametrize("state", [s for s in Status if s is not Status.OK])
def test_state_hints_agree(state):
    one, many = HINTS_ONE[state], HINTS[state]
    assert not re.match(r"(have|get|train)\b", one) and not re.search(r"\b(they are|them)\b", one), one
    assert not re.match(r"(has|gets|trains)\b", many), many
    if state is Status.FROZEN:
        return  # frozen is not a problem: no warning explains it
    status = dict(STATUS, **{"a.weight": state})
    text = explain(Report(step=1, status=status, grad_norm={}, total_grad_norm=1.0))
    assert f"{state.value}: a.weight {one}" in text
    status = dict(STATUS, **{"a.weight": state, "b.weight": state})
    text = explain(Report(step=1, status=status, grad_norm={}, total_grad_norm=1.0))
    assert f"{state.value}: a.weight, b.weight {many}" in text


def test_whole_model_subjects_counts_and_plurals():
    assert describe_names({"w": S.OK}, ["w"]) == "w"
    assert describe_names({"a.w": S.OK, "a.b": S.OK}, ["a.w", "a.b"]) == "all 2 parameters"
    assert describe_names(STATUS, ["a.weight", "a.bias"]) == "a.* (2 params)"
    assert plural(1, "parameter") == "1 parameter" and plural(2, "parameter") == "2 parameters"
    assert agree(1, "were", "was") == "was" and agree(["x", "y"], "were", "was") == "were"
    r = Report(step=0, status={"w": S.OK}, grad_norm={"w": 1.0}, total_grad_norm=1.0)
    assert r.summary_line().startswith("1 parameter:")
    finding = judges.frozen_norms(["bn"], 0)[0].message
    assert finding.startswith("1 normalisation layer (bn)")


def test_no_message_in_a_real_run_says_1_parameters(recwarn):
    """A run where one parameter is left out and one unused: every message it produces."""
    import torch
    from torch import nn

    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1), nn.Linear(3, 1))
    opt = torch.optim.SGD(list(model[0].parameters()) + [model[1].weight, model[2].weight, model[2].bias], lr=0.1)
    mon = gh.GradHealth(model, opt, expect_frozen=[])
    for _ in range(4):
        opt.zero_grad()
        model[1](model[0](torch.randn(2, 3))).sum().backward()
        mon.check()
        opt.step()
    texts = [str(w.message) for w in recwarn if issubclass(w.category, gh.GradHealthWarning)]
    assert texts
    bad = re.compile(r"\b1 (parameters|params|checks|steps|tensors|modules|optimizers)\b|\(1 params\)|every parameter \(")
    for t in texts:
        assert not bad.search(t), t
    assert any("1.bias gets gradients but no optimizer updates it" in t for t in texts), texts[0]


def test_hostile_names_reach_the_terminal_escaped(caplog):
    import logging
    import warnings

    import torch
    from torch import nn

    evil = "\x1b]0;PWNED\x07unused"
    model = nn.Module()
    model.add_module("used", nn.Linear(2, 1))
    model.add_module(evil, nn.Linear(2, 1))
    model.add_module("frozen\x9b", nn.Linear(2, 1))
    getattr(model, "frozen\x9b").requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    mon = gh.GradHealth(model, opt, grad_patience=1, sinks=[gh.LoggingSink("gh-hostile")])
    model.used(torch.randn(3, 2)).sum().backward()
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO):
        warnings.simplefilter("always")
        report = mon.check()
    texts = [str(w.message) for w in caught] + [r.getMessage() for r in caplog.records] + [str(report)]
    assert any("PWNED" in t for t in texts) and any("frozen" in t for t in texts)  # the premise: they are named
    for t in texts:
        assert not any(c in t for c in ("\x1b", "\x07", "\x9b")), repr(t)
    assert any("\\x1b]0;PWNED\\x07unused" in t for t in texts)

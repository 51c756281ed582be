"""load_state_dict checks every key before it loads anything (gradhealth/check/state.py): fuzzed states
are never half-applied, never accepted when wrong; states from another model are refused."""

import copy
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import gradhealth as gh


def trained(steps=25, model=None):
    torch.manual_seed(0)
    model = model or nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2), nn.Linear(2, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = gh.GradHealth(model, opt, on_problem="ignore")
    for step in range(steps):
        opt.zero_grad()
        out = model[:3](torch.randn(3, 4)) if step % 3 else model(torch.randn(3, 4))  # model[3] used now and then
        out.sum().backward()
        mon.check()
        opt.step()
    return mon


GOOD = trained().state_dict()


def paths(obj, prefix=()):
    """Every key path into the state (dict keys and list indexes)."""
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:3]):
            yield from paths(v, prefix + (i,))


PATHS = [p for p in paths(GOOD) if p]
WRONG = st.one_of(st.none(), st.booleans(), st.just(float("inf")), st.just(float("nan")), st.just(-1), st.just(2**64),
                  st.just(2.5), st.text(max_size=3), st.just("123"), st.lists(st.floats(), max_size=3),
                  st.just({}), st.just([math.inf] * 30), st.just([[1.0] * 50]))


def set_path(state, path, value):
    obj = state
    for k in path[:-1]:
        obj = obj[k]
    obj[path[-1]] = value


def invariants_hold(state):
    for k in ("calls", "checks", "amp_skips", "still", "skips", "skips_in_a_row"):
        assert isinstance(state[k], int) and not isinstance(state[k], bool) and 0 <= state[k] <= 2**53
    h = state["history"]
    assert all(math.isfinite(v) and v >= 0 for v in h["total"])
    assert all(len(r) <= len(h["modules"]) for r in h["rows"])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(PATHS), WRONG)
def test_a_fuzzed_state_is_refused_whole_or_is_a_valid_state(path, value):
    mon = trained(steps=3)
    before = mon.state_dict()
    state = copy.deepcopy(GOOD)
    set_path(state, path, value)
    try:
        mon.load_state_dict(state)
    except (ValueError, TypeError) as exc:
        assert "left unchanged" in str(exc) or isinstance(exc, TypeError)
        assert mon.state_dict() == before  # nothing half-applied
        return
    invariants_hold(mon.state_dict())  # accepted: then it is a state the monitor can live with
    mon.model(torch.randn(3, 4)).sum().backward()
    assert mon.check() is not None  # and checks go on


@pytest.mark.parametrize("key, value, words", [
    ("calls", "7", r"state\['calls'\] must be an int"), ("calls", 2.5, "must be an int"), ("calls", 2**64, r"2\*\*53"),
    ("amp_settled", 1, "amp_settled"), ("history", {"seen": 1, "total": [1.0]}, "lacks"),
])
def test_each_bad_key_is_named(key, value, words):
    mon = trained(steps=2)
    bad = dict(copy.deepcopy(GOOD), **{key: value})
    with pytest.raises(ValueError, match=words):
        mon.load_state_dict(bad)


def test_history_values_and_widths_are_checked():
    mon = trained(steps=2)
    for change, words in [(lambda s: s["history"].__setitem__("total", [math.inf] * len(s["history"]["rows"])), "finite number"),
                          (lambda s: s["history"]["rows"][0].extend([1.0] * 40), "at most"),
                          (lambda s: s["history"]["modules"].append("not.a.module"), "does not have"),
                          (lambda s: s.pop("streaks"), "lacks 'streaks'"),
                          (lambda s: s["streaks"]["units"].update({"ghost.weight": [0, 0, 1, 0, None, True]}),
                           "does not have: ghost.weight"),
                          (lambda s: s["streaks"].__setitem__("faint", ["ghost.weight"]), r"\['faint'\] names parameters"),
                          (lambda s: s["streaks"].__setitem__("thawed", {"0.weight": -1}), "a count must be an int"),
                          (lambda s: s["streaks"].__setitem__("frozen", "0.weight"), "must be a list of names")]:
        bad = copy.deepcopy(GOOD)
        change(bad)
        with pytest.raises(ValueError, match=words):
            mon.load_state_dict(bad)
    # a 10^4 spike after a history of infinities could never be EXPLODING_GRAD: refused above


V1_KEYS = ("calls", "checks", "amp_skips", "amp_settled", "history", "histories", "streaks", "still", "skips",
           "skips_in_a_row", "params")


def version_1(state):
    """What gradhealth wrote before its states carried a version: these keys, its streaks without
    the records added later, its histories without the last spike and the medians."""
    old = {k: copy.deepcopy(state[k]) for k in V1_KEYS}
    old["streaks"] = {k: old["streaks"][k] for k in ("n", "units", "blank")}
    old["history"] = {k: old["history"][k] for k in ("seen", "total", "modules", "rows")}
    return old


def test_a_version_1_state_loads_what_it_has_and_says_once_what_starts_fresh():
    mon = trained(steps=2)
    with pytest.warns(gh.GradHealthWarning, match=r"older gradhealth \(version 1, not 2\)") as said:
        mon.load_state_dict(version_1(GOOD))
    [warning] = [w for w in said if issubclass(w.category, gh.GradHealthWarning)]
    for words in ("learning-rate story", "loss-fit baseline", "pile-up streaks", "faint, frozen, thawed",
                  "last spike and module medians"):
        assert words in str(warning.message)
    got = mon.state_dict()
    for key in ("calls", "checks", "still", "params"):
        assert got[key] == GOOD[key]
    assert got["streaks"]["units"] == GOOD["streaks"]["units"] and got["streaks"]["n"] == GOOD["streaks"]["n"]
    assert got["history"]["total"] == GOOD["history"]["total"] and got["history"]["seen"] == GOOD["history"]["seen"]
    assert got["fit"] == trained(steps=0).state_dict()["fit"]  # (a story it did not keep: as a fresh run's)
    assert got["version"] == 2


def test_a_state_of_this_version_missing_a_record_is_refused_not_defaulted():
    mon = trained(steps=2)
    before = mon.state_dict()
    for key in ("faint", "frozen", "thawed"):
        bad = copy.deepcopy(GOOD)
        del bad["streaks"][key]
        with pytest.raises(ValueError, match=rf"state\['streaks'\] lacks '{key}'.*left unchanged"):
            mon.load_state_dict(bad)
    assert mon.state_dict() == before
    for version in (3, 0, "2", True, None):
        with pytest.raises(ValueError, match="reads versions 1 to 2"):
            mon.load_state_dict(dict(GOOD, version=version))


def test_a_state_from_another_model_is_refused_naming_the_parameters():
    other = trained(steps=2, model=nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)))
    with pytest.raises(ValueError, match=r"another model \(not in this model: 3\.weight, 3\.bias") as err:
        other.load_state_dict(GOOD)
    assert "left unchanged" in str(err.value)
    same = trained(steps=2)
    same.load_state_dict(GOOD)
    assert same.state_dict() == GOOD


# ------------------------------------------ every key deleted, renamed, retyped
def rich_state():
    """A real state where every story has something to say: two optimizers (the first with a group
    held at lr 0, the second holds the head and neither steps nor zeroes: its gradients pile up),
    a layer dropped now and then, batches with nothing to learn, problems said."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    body = torch.optim.SGD([{"params": model[0].parameters(), "lr": 0.0}, {"params": model[2].parameters(), "lr": 0.05}])
    head = torch.optim.SGD(model[4].parameters(), lr=0.05)
    mon = gh.GradHealth(model, [body, head], on_problem="ignore")
    for step in range(14):
        body.zero_grad()
        x = torch.randn(3, 4)
        h = model[1](model[0](x))
        h = h if step % 3 == 1 else model[3](model[2](h))  # (model[2] dropped at one step in three)
        loss = ((model[4](h) - 10.0) ** 2).mean() * (0.0 if step == 5 else 1.0)
        loss.backward()
        mon.check(loss=loss)
        body.step()
    mon.carry.fit.notes["frac_reward_zero_std"] = (1.0, 5)  # (what the Trainer adapter writes from TRL's logs)
    return mon, mon.state_dict()


def stopped_state():
    """A real state saved right after a step that changed nothing: its findings are owed, and parameters
    its sample left undecided are watched. (Four checks: checks 0, 1 and 2 measure the update norms, and
    for this optimizer of no known rule that copies, and so decides, every parameter exactly; check 3 is
    the first change test that leaves them to their empty samples, watched.)"""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))

    class Stopped(torch.optim.SGD):
        @torch.no_grad()
        def step(self, closure=None):
            return None

    opt = Stopped(model.parameters(), lr=0.1)
    mon = gh.GradHealth(model, opt, on_problem="ignore")
    for _ in range(4):
        opt.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        mon.check()
        opt.step()
    return mon, mon.state_dict()


#: keys whose children are data (names, optimizer indices, notes), not the state's own keys: a child
#: may be absent (a unit that never missed, an optimizer not stepped yet), so it is renamed and retyped only
DATA = {"units", "thawed", "histories", "n", "stepped", "arms", "tests", "turn", "last", "notes", "open", "steps",
        "streak", "seen", "data", "streaks"}
FREE = {"notes", "data"}  # (any name is a valid key there)


def mutations(state, path=()):
    """(description, path, how) for every key of the state and the first elements of its lists."""
    if isinstance(state, dict):
        data = bool(path) and path[-1] in DATA and not (path[-1] == "streaks" and len(path) == 1)
        for k, v in state.items():
            if path[-1:] == ("data",):  # (a finding's own data: any plain value)
                break
            if not data:
                yield f"delete {path + (k,)}", path + (k,), "delete"
            if not (data and path[-1] in FREE):
                yield f"rename {path + (k,)}", path + (k,), "rename"
            yield f"retype {path + (k,)}", path + (k,), "retype"
            yield from mutations(v, path + (k,))
    elif isinstance(state, list):
        for k, v in enumerate(state[:2]):
            yield f"retype {path + (k,)}", path + (k,), "retype"
            yield from mutations(v, path + (k,))


def other_type(v):
    if isinstance(v, bool):
        return 1
    if isinstance(v, (int, float)) or v is None:
        return "7"
    if isinstance(v, str):
        return 7
    return {} if isinstance(v, list) else []


def mutated(state, path, how):
    state = copy.deepcopy(state)
    obj = state
    for k in path[:-1]:
        obj = obj[k]
    key = path[-1]
    if how == "delete":
        del obj[key]
    elif how == "rename":
        obj[f"{key}_x"] = obj.pop(key)
    else:
        obj[key] = other_type(obj[key])
    return state


@pytest.mark.parametrize("make", [rich_state, stopped_state])
def test_every_key_deleted_renamed_or_retyped_is_refused_whole(make):
    mon, state = make()
    if make is rich_state:  # premise: the stories are in it
        assert state["lrs"]["groups"] and state["pileup"]["streaks"] and state["once"]["open"]["all"]
        assert state["unstepped"]["seen"] and state["fit"]["losses"] and state["streaks"]["units"]
    else:
        assert state["owed"] and state["still_seen"] and state["steps"]["watched"]
    fresh, before = make()[0], None
    before = fresh.state_dict()
    accepted = []
    for what, path, how in mutations(state):
        try:
            fresh.load_state_dict(mutated(state, path, how))
        except ValueError as exc:
            assert "left unchanged" in str(exc), what
            assert fresh.state_dict() == before, f"{what}: half loaded"
            continue
        accepted.append(what)
        fresh = make()[0]
    assert not accepted, accepted
    fresh.load_state_dict(state)  # (the state itself loads)
    assert fresh.state_dict() == state

"""Parameters in no optimizer without gradients (gradhealth/judge/copies.py): target networks and EMA /
momentum copies are tolerated, with what was seen; an optimizer that holds a parameter without a
gradient stays an error."""

from __future__ import annotations

import copy
import logging
import warnings

import pytest
import torch
from torch import nn

import gradhealth as gh

S = gh.Status

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------ Stable-Baselines3, as installed
def attach(model, **options):
    """The manual's recipe (docs/frameworks/rl.md): the monitor on ``model.policy`` with every
    optimizer the algorithm steps, checked by each optimizer's step pre-hook."""
    policy = model.policy
    optimizers = [o for o in (getattr(policy, "optimizer", None), getattr(getattr(policy, "actor", None), "optimizer", None),
                              getattr(getattr(policy, "critic", None), "optimizer", None)) if o is not None]
    monitor = gh.GradHealth(policy, optimizers, **options)
    for opt in optimizers:
        opt.register_step_pre_hook(lambda opt, *_: monitor.check(optimizer=opt) and None)
    return monitor


def sb3(algo: str, **kw):
    from stable_baselines3 import DQN, SAC, TD3

    small = dict(learning_starts=10, seed=0, policy_kwargs=dict(net_arch=[16]), device="cpu")
    if algo == "dqn":
        return DQN("MlpPolicy", "CartPole-v1", **{"train_freq": 1, "target_update_interval": 5, **small, **kw})
    return {"sac": SAC, "td3": TD3}[algo]("MlpPolicy", "Pendulum-v1", **{**small, **kw})


class Kept:
    """A sink that keeps every report."""

    def __init__(self, into: list):
        self.write = into.append


TARGETS = {"dqn": ("q_net_target.",), "sac": ("critic_target.",), "td3": ("actor_target.", "critic_target.")}


@pytest.mark.parametrize("algo", ["dqn", "sac", "td3"])
def test_sb3_target_networks_are_silent_under_raise(algo, caplog):
    """Issue 65, case 4: NO_GRAD at error level at the third update, for every user of DQN, SAC
    and TD3. The targets are in no optimizer and moved by SB3's polyak_update (through ``.data``):
    tolerated, and said once at info, with the step by which they were seen to move."""
    model = sb3(algo)
    policy = model.policy
    targets = {n: p.detach().clone() for n, p in policy.named_parameters() if n.startswith(TARGETS[algo])}
    online = {n: p.detach().clone() for n, p in policy.named_parameters() if not n.startswith(TARGETS[algo])}
    reports = []
    monitor = attach(model, on_problem="raise", sinks=(Kept(reports),))
    with warnings.catch_warnings(), caplog.at_level(logging.INFO, logger="gradhealth"):
        warnings.simplefilter("error", gh.GradHealthWarning)
        model.learn(60)
    monitor.close()
    assert len(reports) >= 20  # the premise: the optimizers stepped, each step checked
    after = dict(policy.named_parameters())
    assert all(not torch.equal(after[n], v) for n, v in targets.items())  # the premise: the targets moved ...
    assert any(not torch.equal(after[n], v) for n, v in online.items())  # ... and so did the trained networks
    for r in reports:
        copies = {n for n in r.status if n.startswith(TARGETS[algo])}
        assert copies and {r.status[n] for n in copies} == {S.NO_GRAD}  # the premise: exact, and by design
        assert not any(r.in_optimizer[n] for n in copies)
        assert r.ok and copies <= r.tolerated and not r.grad_streak.keys() & copies
        [note] = r.findings_of("TARGET_COPY")
        assert note.level == "info" and set(note.params) == copies
    last = reports[-1].findings_of("TARGET_COPY")[0].message
    assert "in no optimizer and get no gradient" in last and "Written outside the optimizer by step" in last
    said = [m.getMessage() for m in caplog.records if "TARGET_COPY" in m.getMessage() or "in no optimizer" in m.getMessage()]
    assert len(said) == 2 and "Not written since step 0" in said[0] and "Written outside" in said[1]  # once per change


def test_sb3_target_network_left_in_the_optimizer_and_never_synced_is_an_error():
    """The counterpart: DQN's target added to the optimizer, never synced: an optimizer holds
    parameters that get no gradient (weight decay or momentum would move them, by nothing the
    loss says): NO_GRAD at grad_patience, named."""
    model = sb3("dqn", target_update_interval=10**6)
    model.policy.optimizer.add_param_group({"params": list(model.q_net_target.parameters())})
    attach(model, on_problem="raise")
    with pytest.raises(gh.GradHealthError, match=r"NO_GRAD: q_net_target\.\* \(4 params\) for 3 checks") as err:
        model.learn(60)
    r = err.value.report
    assert r.step == 2 and set(r.errors) == {n for n in r.status if n.startswith("q_net_target.")}
    assert all(r.in_optimizer[n] for n in r.errors) and not r.findings_of("TARGET_COPY")


# ------------------------------------------------------------ plain loops: how each copy is moved
class WithCopy(nn.Module):
    """An online network, a copy of it kept inside the model (a target / EMA / momentum encoder),
    and ``spare``, a layer the forward never uses (held by the optimizer only when asked)."""

    def __init__(self):
        super().__init__()
        self.online = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        self.copy = copy.deepcopy(self.online)
        self.spare = nn.Linear(8, 1)

    def forward(self, x):
        with torch.no_grad():
            target = self.copy(x)
        return (self.online(x) - (target + x.sum(1, keepdim=True))).pow(2).mean()


def _lerp(model, tau=0.1):
    with torch.no_grad():
        torch._foreach_lerp_(list(model.copy.parameters()), list(model.online.parameters()), tau)


def _data_assign(model, m=0.9):  # MoCo's momentum update
    for k, q in zip(model.copy.parameters(), model.online.parameters()):
        k.data = k.data * m + q.data * (1.0 - m)


def _data_inplace(model, tau=0.1):  # Stable-Baselines3's polyak_update
    with torch.no_grad():
        for k, q in zip(model.copy.parameters(), model.online.parameters()):
            k.data.mul_(1 - tau)
            torch.add(k.data, q.data, alpha=tau, out=k.data)


def _hard_copy_every_4(model, step):
    if step % 4 == 3:
        model.copy.load_state_dict(model.online.state_dict())


UPDATES = {  # how the copy moves -> the step by which the monitor sees it
    "foreach_lerp": (lambda m, s: _lerp(m), 1),  # version counters: at the next check
    "data_assign": (lambda m, s: _data_assign(m), 1),  # a new storage: at the next check
    "data_inplace": (lambda m, s: _data_inplace(m), 1),  # neither: the norms, at the 1st check after
    "hard_copy_every_4": (_hard_copy_every_4, 4),
    "never": (lambda m, s: None, None),
}


def copy_run(update, steps=12, spare_in_optimizer=False, **options):
    torch.manual_seed(0)
    model = WithCopy()
    held = [*model.online.parameters(), *(model.spare.parameters() if spare_in_optimizer else ())]
    opt = torch.optim.Adam(held, lr=1e-2)
    monitor = gh.GradHealth(model, opt, **options)
    reports, losses = [], []
    for step in range(steps):
        x = torch.randn(32, 8)
        opt.zero_grad()
        loss = model(x)
        loss.backward()
        reports.append(monitor.check(loss=loss))
        opt.step()
        update(model, step)
        losses.append(loss.item())
    monitor.flush()
    reports = [r for r in reports if r is not None] + ([monitor.last_report] if options.get("lag") else [])
    monitor.close()
    return model, reports, losses


@pytest.mark.parametrize("how", list(UPDATES))
def test_a_copy_inside_the_model_is_tolerated_with_what_was_seen(how):
    """EMA and momentum copies kept inside the model (timm's and torch's foreach lerp, MoCo's
    ``.data =``, SB3's ``.data.mul_``, a periodic hard copy, none): silent under raise; the
    finding says by which step a write was seen, or that none was."""
    update, seen_at = UPDATES[how]
    with warnings.catch_warnings():
        warnings.simplefilter("error", gh.GradHealthWarning)
        model, reports, losses = copy_run(update, on_problem="raise")
    assert losses[-1] < losses[0]  # the premise: it trains
    copies = {f"copy.{i}.{w}" for i in (0, 2) for w in ("weight", "bias")}
    spare = {"spare.weight", "spare.bias"}  # (in no optimizer either: unused, never written)
    for r in reports:
        assert {n for n, s in r.status.items() if s is S.NO_GRAD} == copies | spare and r.ok
        [note] = r.findings_of("TARGET_COPY")
        assert set(note.params) == copies | spare and note.level == "info"
    words = reports[-1].findings_of("TARGET_COPY")[0].message
    assert words.startswith("copy.* (4 params), spare.* (2 params) are in no optimizer and get no gradient")
    if seen_at is None:
        assert "Not written since step 0" in words
        assert "If it should track another network, check its update" in words
    else:
        assert f"Written outside the optimizer by step {seen_at} (first seen at step 0)" in words
        moved = reports[seen_at - 1].findings_of("TARGET_COPY")[0].message
        assert "Not written since step 0" in moved  # not said before it was seen


def test_deferred_checks_read_nothing_for_the_copies():
    """lag=1 never synchronises: the copies are tolerated, their norms are not read (a write
    through ``.data`` is not seen there), a write that bumps the version counters is."""
    for update, said in ((_data_inplace, "Not written since step 0"), (_lerp, "Written outside the optimizer by step 1")):
        _, reports, _ = copy_run(lambda m, s: update(m), lag=1, on_problem="raise")
        assert all(r.ok for r in reports) and len(reports) >= 10
        assert said in reports[-1].findings_of("TARGET_COPY")[0].message


def test_an_unused_layer_the_optimizer_holds_stays_an_error_beside_a_copy():
    """The counterpart: ``spare`` is in the optimizer and gets no gradient (the unused-layer bug):
    NO_GRAD at grad_patience, named; the copy beside it stays tolerated."""
    _, reports, _ = copy_run(lambda m, s: _lerp(m), steps=4, spare_in_optimizer=True, on_problem="ignore")
    assert [r.ok for r in reports] == [True, True, False, False]
    assert set(reports[2].errors) == {"spare.weight", "spare.bias"}
    assert {n for n in reports[2].tolerated if n.startswith("copy.")} == {f"copy.{i}.{w}" for i in (0, 2) for w in ("weight", "bias")}
    text = gh.GradHealth.explain(reports[2])
    assert "NO_GRAD: spare.* (2 params) for 3 checks in a row" in text and "copy." not in text


def test_a_copy_that_gets_a_gradient_is_not_in_optimizer():
    """A target computed without no_grad: its gradient is real and no optimizer applies it:
    NOT_IN_OPTIMIZER, an error at once, as before."""
    torch.manual_seed(0)
    model = WithCopy()
    opt = torch.optim.Adam(model.online.parameters(), lr=1e-2)
    monitor = gh.GradHealth(model, opt, on_problem="ignore")
    x = torch.randn(32, 8)
    (model.online(x) - model.copy(x)).pow(2).mean().backward()
    r = monitor.check()
    assert not r.ok and {n for n, s in r.errors.items() if s is S.NOT_IN_OPTIMIZER} == {
        f"copy.{i}.{w}" for i in (0, 2) for w in ("weight", "bias")}


def test_without_an_optimizer_nothing_says_what_should_move_them():
    """No optimizer given: a parameter without a gradient cannot be told from a copy; judged by
    the persistence rule as before (an error at grad_patience)."""
    torch.manual_seed(0)
    model = WithCopy()
    monitor = gh.GradHealth(model, on_problem="ignore")
    for _ in range(3):
        model.zero_grad()
        model(torch.randn(32, 8)).backward()
        r = monitor.check()
    assert not r.ok and not r.findings_of("TARGET_COPY") and "copy.0.weight" in r.errors

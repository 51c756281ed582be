"""The step guard: a poisoned optimizer step changes nothing (plain loop, Lightning, Trainer), an
error once it repeats, spikes on request, counts through checkpoints."""

import math
import warnings

import pytest
import torch
from torch import nn

import gradhealth as gh

pytestmark = pytest.mark.usefixtures("one_thread")


def batches(n=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(16, 4, generator=g) for _ in range(n)]


def plain_run(mode, bad=(5,), kind="nan", steps=12, **options):
    """mode: "monitor" (check, then step), or "reference" (the same run with the bad batches'
    steps left out by hand)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), 1e-2)
    mon = gh.GradHealth(model, opt, **options) if mode == "monitor" else None
    reports, losses = [], []
    for step, x in enumerate(batches(steps)):
        x = x.clone()
        if step in bad:
            if kind == "nan":
                x[0, 0] = float("nan")
            else:
                x = x * 1e4  # a spike
        opt.zero_grad()
        loss = (model(x) - x.sum(1, keepdim=True)).square().mean()
        loss.backward()
        if mon is not None:
            reports.append(mon.check(loss=loss))
        elif step in bad:
            continue
        opt.step()
        losses.append(loss.item())
    return model, opt, reports, losses, mon


def same_state(a, b):
    for (pa, pb) in zip(a[0].parameters(), b[0].parameters()):
        assert torch.equal(pa, pb)
        sa, sb = a[1].state[pa], b[1].state[pb]
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    return True


def test_a_nan_batch_changes_nothing_with_the_option_exactly_as_if_it_were_left_out():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        guarded = plain_run("monitor", skip_nonfinite=True, on_problem="raise")
    reference = plain_run("reference")
    assert same_state(guarded, reference)  # weights, moments and step counts, bit for bit
    reports, losses = guarded[2], guarded[3]
    assert not reports[5].grads_finite  # the premise: step 5's gradients are NaN
    [f] = reports[5].findings_of("STEP_SKIPPED")
    assert f.step == 5 and f.level == "warning" and f.data["why"] == "nonfinite" and reports[5].ok
    assert set(f.params) == set(reports[5].status) and reports[5].skipped == "nonfinite"
    assert all(not r.findings_of("STEP_SKIPPED") for r in reports if r.step != 5)
    finite = [v for v in losses if v == v]
    assert sum(finite[-3:]) < sum(finite[:3])  # the loss keeps falling
    assert all(torch.isfinite(p).all() for p in guarded[0].parameters())
    said = [str(w.message) for w in caught if issubclass(w.category, gh.GradHealthWarning)]
    assert len(said) == 2 and "STEP_SKIPPED" in said[0]  # said once, then once as resolved
    assert said[1].startswith("gradhealth step 6: resolved:") and "STEP_SKIPPED (warning, since step 5)" in said[1]
    from gradhealth.publish.metrics import report_metrics

    assert report_metrics(reports[5])["gradhealth/skipped"] == 1.0 and report_metrics(reports[4])["gradhealth/skipped"] == 0.0


def test_without_the_option_the_nan_is_applied_as_before():
    model, _, reports, _, _ = plain_run("monitor", on_problem="ignore")
    assert not reports[5].ok and not reports[5].findings_of("STEP_SKIPPED") and reports[5].skipped is None
    assert not all(torch.isfinite(p).all() for p in model.parameters())  # the NaN was applied


def test_nan_at_every_step_is_an_error_after_skip_alarm_skips():
    _, _, reports, _, _ = plain_run("monitor", bad=range(12), steps=6, skip_nonfinite=True, on_problem="ignore",
                                    skip_alarm=3)
    levels = [r.findings_of("STEP_SKIPPED")[0].level for r in reports]
    assert levels == ["warning", "warning", "error", "error", "error", "error"]
    assert [r.ok for r in reports[:2]] == [True, True] and not reports[2].ok
    # the origin (the batch) is named at step 1, a warning while the skips defuse it, an error with the alarm
    assert [r.findings_of("NONFINITE_ORIGIN")[0].level for r in reports[1:4]] == ["warning", "error", "error"]
    with pytest.raises(gh.GradHealthError, match="3 steps in a row"):
        plain_run("monitor", bad=range(12), steps=6, skip_nonfinite=True, on_problem="raise")


@pytest.mark.parametrize("on", [True, False])
def test_a_spike_is_skipped_with_the_spike_option_and_applied_without(on):
    options = {"skip_spikes": 10.0} if on else {}
    history = gh.NormHistory(warmup=5)
    guarded = plain_run("monitor", bad=(8,), kind="spike", history=history, on_problem="ignore", **options)
    reports = guarded[2]
    assert reports[8].total_grad_norm > 100 * reports[7].total_grad_norm  # the premise: a real spike
    if on:
        [f] = reports[8].findings_of("STEP_SKIPPED")
        assert f.data["why"] == "spike" and f.step == 8
        assert same_state(guarded, plain_run("reference", bad=(8,), kind="spike"))
        assert len(guarded[4].carry.history.total) == 11  # the spike never entered the baseline
    else:
        assert not reports[8].findings_of("STEP_SKIPPED")
        with pytest.raises(AssertionError):
            same_state(guarded, plain_run("reference", bad=(8,), kind="spike"))


def test_skip_counts_survive_a_checkpoint_and_options_are_validated():
    *_, mon = plain_run("monitor", bad=(2, 3), steps=5, skip_nonfinite=True, on_problem="ignore")
    state = mon.state_dict()
    assert state["skips"] == 2 and state["skips_in_a_row"] == 0  # steps 2 and 3 skipped, then a good step 4
    fresh = gh.GradHealth(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)), skip_nonfinite=True)
    fresh.load_state_dict(state)
    assert fresh.carry.skips == 2 and fresh.state_dict()["skips_in_a_row"] == 0
    for bad, err in [({"skip_nonfinite": 1}, TypeError), ({"skip_spikes": 0}, ValueError),
                     ({"skip_spikes": "3"}, TypeError), ({"skip_alarm": 0}, ValueError)]:
        with pytest.raises(err, match=next(iter(bad))):
            gh.GradHealth(nn.Linear(2, 2), **bad)


# ------------------------------------------------------------------------------ Lightning
def lightning_run(tmp_path, skip: bool, guard: bool):
    import lightning.pytorch as pl

    from gradhealth.integrations.lightning import GradHealthCallback

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
            self.losses = []

        def training_step(self, batch, idx):
            (x,) = batch
            if self.global_step == 5:
                if skip:  # the reference: Lightning skips the step of a training_step that returns None
                    return None
                x = x.clone()
                x[0, 0] = float("nan")
            loss = (self.net(x) - x.sum(1, keepdim=True)).square().mean()
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), 1e-2)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.cat(batches())), batch_size=16)
    callbacks = [GradHealthCallback(on_problem="raise", skip_nonfinite=True, log=False, sinks=[Kept()])] if guard else []
    model = Net()
    trainer = pl.Trainer(max_steps=12, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                         default_root_dir=str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gh.GradHealthWarning)
        trainer.fit(model, data)
    return model, trainer.optimizers[0], callbacks


def test_lightning_fit_with_one_nan_batch_equals_the_run_without_it(tmp_path):
    model, opt, [cb] = lightning_run(tmp_path / "a", skip=False, guard=True)
    ref_model, ref_opt, _ = lightning_run(tmp_path / "b", skip=True, guard=False)
    for pa, pb in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(pa, pb)
        sa, sb = opt.state[pa], ref_opt.state[pb]
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(v != v for v in model.losses)  # the premise: a NaN loss at step 5
    assert skips(cb) == 1
    [found] = [f for r in cb.options.sinks[0].reports for f in r.findings_of("STEP_SKIPPED")]
    assert found.step == 5 and found.level == "warning"
    finite = [v for v in model.losses if v == v]
    assert sum(finite[-3:]) < sum(finite[:3])  # the loss keeps falling


class Kept:
    """A sink that keeps every report."""

    def __init__(self):
        self.reports = []

    def write(self, report):
        self.reports.append(report)


def skips(cb) -> int:
    """The callback's skip count (its monitor is closed at the end of fit: the state it kept)."""
    return (cb.monitor.state_dict() if cb.monitor is not None else cb._pending_state)["skips"]


# -------------------------------------------------------------------------------- Trainer
def trainer_run(tmp_path, leave_out: bool):
    from transformers import Trainer, TrainingArguments

    from gradhealth.integrations.transformers import GradHealthCallback

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

        def forward(self, x, labels=None):
            out = self.net(x)
            return {"loss": (out - labels).square().mean(), "logits": out}

    rows = []
    for step, x in enumerate(batches()):
        if step == 5:
            if leave_out:
                continue
            x = x.clone()
            x[0, 0] = float("nan")
        rows += [{"x": r, "labels": r.sum().reshape(1)} for r in x]

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return len(rows)

        def __getitem__(self, i):
            return rows[i]

    class InOrder(Trainer):
        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(rows)

    args = TrainingArguments(str(tmp_path), use_cpu=True, report_to=[], max_steps=11 if leave_out else 12,
                             per_device_train_batch_size=16, learning_rate=1e-2, lr_scheduler_type="constant",
                             warmup_steps=0, weight_decay=0.0, save_strategy="no", disable_tqdm=True, seed=0,
                             data_seed=0, logging_steps=100)
    callbacks = [] if leave_out else [GradHealthCallback(on_problem="raise", skip_nonfinite=True, sinks=[Kept()])]
    model = Tiny()
    trainer = InOrder(model=model, args=args, train_dataset=Rows(), callbacks=callbacks)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gh.GradHealthWarning)
        trainer.train()
    return model, trainer.optimizer, callbacks


def test_trainer_run_with_one_nan_batch_equals_the_run_without_it(tmp_path):
    model, opt, [cb] = trainer_run(tmp_path / "a", leave_out=False)
    ref, ref_opt, _ = trainer_run(tmp_path / "b", leave_out=True)
    assert skips(cb) == 1
    [found] = [f for r in cb.options.sinks[0].reports for f in r.findings_of("STEP_SKIPPED")]
    assert found.step == 6  # Trainer counts from 1: its 6th check, the 6th batch (index 5)
    for pa, pb in zip(model.parameters(), ref.parameters()):
        assert torch.isfinite(pa).all() and torch.equal(pa, pb)
    states = [opt.state[p] for p in model.parameters()]
    ref_states = [ref_opt.state[p] for p in ref.parameters()]
    assert all(all(torch.equal(a[k], b[k]) for k in a) for a, b in zip(states, ref_states))


def test_the_step_guard_on_sb3_dqn_says_only_what_it_dropped():
    """Stable-Baselines3's DQN, the monitor on ``model.policy`` and its optimizer, checked before each
    optimizer step, a NaN reward planted once: the guard drops the step. The target network
    (``q_net_target``, in no optimizer, moved by a hard copy) had no gradient to drop: only q_net's
    gradients are named."""
    gym = pytest.importorskip("gymnasium")
    sb3 = pytest.importorskip("stable_baselines3")

    class NaNReward(gym.Wrapper):
        def __init__(self, env, at):
            super().__init__(env)
            self.n, self.at = 0, at

        def step(self, action):
            obs, reward, terminated, truncated, info = self.env.step(action)
            self.n += 1
            return obs, (math.nan if self.n == self.at else reward), terminated, truncated, info

    model = sb3.DQN("MlpPolicy", NaNReward(gym.make("CartPole-v1"), at=40), learning_starts=32, batch_size=16,
                    train_freq=1, buffer_size=200, seed=0, policy_kwargs=dict(net_arch=[16]))
    mon = gh.GradHealth(model.policy, model.policy.optimizer, on_problem="ignore", skip_nonfinite=True)
    reports = []
    model.policy.optimizer.register_step_pre_hook(lambda opt, args, kwargs: reports.append(mon.check()))
    model.learn(total_timesteps=60)
    mon.close()
    skipped = [r for r in reports if r.findings_of("STEP_SKIPPED")]
    assert skipped  # premise: the NaN reward reached the gradients and the step was dropped
    r = skipped[0]
    target = [n for n in r.status if n.startswith("q_net_target.")]
    assert target and all(r.status[n] is gh.Status.NO_GRAD and not r.in_optimizer[n] for n in target)  # premise
    [f] = r.findings_of("STEP_SKIPPED")
    assert "the gradients of q_net.* (4 params) were dropped" in f.message, f.message
    assert "no optimizer" not in f.message and "every judged parameter" not in f.message

"""The ``models`` section of ``gradhealth bench``: the small models RL and small-model users train,
where the Python a check runs is the whole of its cost. For each model, three ways to watch the
gradients after backward: the synchronous monitor (``lag=0``), the deferred one (``lag=1``) and the
one number a user logs instead (``clip_grad_norm_(params, inf).item()``):

* Python instructions per check: bytecode instructions executed inside ``check()`` (or the clip),
  counted with ``sys.settrace`` opcode events (deterministic; torch's C++ not counted), the median
  over ``checks`` steady-state checks after a warm-up;
* Python instructions per step above the plain step: the whole step (zero_grad, forward, backward,
  check, optimizer.step) counted the same way, minus the plain step's: the monitor's hooks inside
  the user's own calls included; the mean over ``checks`` steps (a multiple of 8: the change test,
  every 8 checks, in proportion);
* whole-step time: interleaved blocks (plain, variant, plain, ...), a variant's cost its block's
  median minus the plain blocks' around it; ``x one``: that cost over the one number's.

Models: the small section's 6-tensor MLP, CNN and 2-block transformer, and Stable-Baselines3's
default DQN and PPO policies (CartPole: two 64-wide layers) trained on a batch as their ``train()``
does, when SB3 is installed; then a ``learn()`` row: SB3's own loop with the monitor attached as
``docs/frameworks/rl.md`` says (a check in each optimizer's step pre-hook), against the one number
logged in the same hook.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

__all__ = ["MODELS", "Case", "instructions", "count_model", "time_model", "bench_models", "sb3_learn"]

VARIANTS = ("synchronous", "deferred (lag=1)", "one number")
INF = float("inf")


@dataclass
class Case:
    """One small model in training: ``loss()`` runs its forward and returns the loss; ``judged``:
    the optimizer to name in ``check(optimizer=...)`` (SB3's recipe), or None."""

    module: nn.Module
    optimizer: torch.optim.Optimizer
    loss: Callable[[], torch.Tensor]
    judged: object = None
    after: Callable[[], None] | None = None  # (after the optimizer step: a target network's update)
    clip: float | None = None  # (the loop's own clip_grad_norm_ after backward, before the check)


def _plain(make, batch) -> Callable[[], Case]:
    def build():
        torch.manual_seed(0)
        model, x = make(), batch()
        with torch.no_grad():
            target = torch.randn_like(model(x))
        opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
        return Case(model, opt, lambda: nn.functional.mse_loss(model(x), target))
    return build


def _sb3_dqn() -> Case:
    """SB3's default DQN policy on CartPole (q_net 4-64-64-2 and its target, Adam) and the loss its
    ``train()`` computes on a replay batch of 32; the target copied every 8 steps (``polyak_update``)."""
    from stable_baselines3 import DQN
    from stable_baselines3.common.utils import polyak_update

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        algo = DQN("MlpPolicy", "CartPole-v1", seed=0, device="cpu")
    policy = algo.policy
    g = torch.Generator().manual_seed(0)
    obs, nxt = torch.randn(32, 4, generator=g), torch.randn(32, 4, generator=g)
    actions, rewards = torch.randint(0, 2, (32, 1), generator=g), torch.rand(32, 1, generator=g)
    q_params, t_params = list(policy.q_net.parameters()), list(policy.q_net_target.parameters())
    steps = [0]

    def loss():
        with torch.no_grad():
            target = rewards + 0.99 * policy.q_net_target(nxt).max(dim=1, keepdim=True)[0]
        q = torch.gather(policy.q_net(obs), dim=1, index=actions)
        return nn.functional.smooth_l1_loss(q, target)

    def after():
        steps[0] += 1
        if steps[0] % 8 == 0:
            polyak_update(q_params, t_params, 1.0)

    return Case(policy, policy.optimizer, loss, policy.optimizer, after)


def _sb3_ppo() -> Case:
    """SB3's default PPO policy on CartPole (separate 64-64 actor and critic, Adam) and its clipped
    surrogate loss on a minibatch of 64, with its ``clip_grad_norm_(0.5)`` before the step."""
    from stable_baselines3 import PPO

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        algo = PPO("MlpPolicy", "CartPole-v1", seed=0, device="cpu")
    policy = algo.policy
    g = torch.Generator().manual_seed(0)
    obs, actions = torch.randn(64, 4, generator=g), torch.randint(0, 2, (64,), generator=g)
    old_logp, adv, ret = -torch.rand(64, generator=g), torch.randn(64, generator=g), torch.randn(64, generator=g)

    def loss():
        values, logp, entropy = policy.evaluate_actions(obs, actions)
        ratio = torch.exp(logp - old_logp)
        surrogate = -torch.min(adv * ratio, adv * torch.clamp(ratio, 0.8, 1.2)).mean()
        total = surrogate + 0.5 * nn.functional.mse_loss(ret, values.flatten()) - 0.0 * entropy.mean()
        return total

    return Case(policy, policy.optimizer, loss, policy.optimizer, None, 0.5)


def _models() -> dict[str, Callable[[], Case]]:
    from gradhealth.benchmarks.small import SMALL

    out = {label: _plain(*SMALL[key]) for label, key in (("6-tensor MLP", "6-tensor MLP"),
                                                       ("small CNN (8x3x32x32)", "small CNN (8x3x32x32)"),
                                                       ("2-block transformer", "2-block transformer (8x16x64)"))}
    try:
        import stable_baselines3  # noqa: F401
    except ImportError:
        return out
    out["SB3 DQN policy (CartPole)"] = _sb3_dqn
    out["SB3 PPO policy (CartPole)"] = _sb3_ppo
    return out


#: label -> factory of a fresh :class:`Case` (SB3's only when it is installed)
MODELS = _models()


from gradhealth.benchmarks.counts import _instructions as instructions  # noqa: E402 (the one counter)


class _Run:
    """One variant of one model: its own copy (same weights), its step split in two (the user's
    calls, then the check or the clip), so the check is counted apart from the whole step."""

    def __init__(self, make: Callable[[], Case], variant: str, sinks=()):
        import gradhealth as gh

        self.case = c = make()
        self.variant = variant
        self.monitor = None
        if variant in ("synchronous", "deferred (lag=1)"):
            opts = [c.optimizer] if c.judged is None else [c.judged]
            self.monitor = gh.GradHealth(c.module, opts, on_problem="ignore", lag=int(variant.startswith("deferred")),
                                         sinks=list(sinks))
        self.params = [p for p in c.module.parameters() if p.requires_grad]
        self.losses: list[torch.Tensor] = []  # (every step's, kept on the device: tests assert they fall)

    def watch(self) -> None:
        if self.monitor is not None:
            self.monitor.check(optimizer=self.case.judged) if self.case.judged is not None else self.monitor.check()
        elif self.variant == "one number":
            torch.nn.utils.clip_grad_norm_(self.params, INF).item()

    def before(self) -> None:
        c = self.case
        c.optimizer.zero_grad(set_to_none=True)
        loss = c.loss()
        loss.backward()
        self.losses.append(loss.detach())
        if c.clip is not None:
            torch.nn.utils.clip_grad_norm_(self.params, c.clip)

    def after(self) -> None:
        c = self.case
        c.optimizer.step()
        if c.after is not None:
            c.after()

    def step(self) -> None:
        self.before()
        self.watch()
        self.after()

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.close()


def count_model(label: str, checks: int = 16, warm: int = 30, runs_out: dict | None = None) -> dict[str, dict[str, float]]:
    """{variant: {"check": median instructions inside check() (or the clip), "check_mean": their mean
    (the periodic checks in proportion when ``checks`` is a multiple of 8), "step": mean instructions
    of the whole step above the plain step's}} over ``checks`` steady-state steps after ``warm``
    (``runs_out``: filled with each variant's run, its monitor and losses, for a test to look at)."""
    make = MODELS[label]
    runs = {v: _Run(make, v) for v in ("plain",) + VARIANTS}
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for r in runs.values():
            for _ in range(warm):
                r.step()
        whole = {}
        # (no garbage collection inside a counted call: one there runs the finalizers of whatever died
        # in a cycle before, an earlier test's monitors or an earlier count's (a WeakSet's removals, ~95
        # instructions), not the check's work; what is garbage now is collected first, the rest after)
        collecting = gc.isenabled()
        gc.collect()
        gc.disable()
        try:
            for v, r in runs.items():
                inside, steps = [], []
                for _ in range(checks):
                    r.before()
                    inside.append(instructions(r.watch))
                    r.after()
                for _ in range(checks):
                    steps.append(instructions(r.step))
                whole[v] = statistics.fmean(steps)
                out[v] = {"check": statistics.median(inside), "check_mean": statistics.fmean(inside)}
        finally:
            if collecting:
                gc.enable()
        for v in VARIANTS:
            out[v]["step"] = whole[v] - whole["plain"]
    if runs_out is not None:
        runs_out.update(runs)
    for r in runs.values():
        r.close()
    return {v: out[v] for v in VARIANTS}


def time_model(label: str, rounds: int = 15, steps: int = 20) -> dict[str, dict[str, float]]:
    """{variant: {"plain": median s of a plain step, "extra": median of a block's median minus the plain
    blocks' around it}}, interleaved, the variants' order rotating from round to round."""
    make = MODELS[label]
    runs = {v: _Run(make, v) for v in ("plain",) + VARIANTS}
    clock = time.perf_counter

    def block(r) -> float:
        ts = []
        for _ in range(steps):
            t0 = clock()
            r.step()
            ts.append(clock() - t0)
        return statistics.median(ts)

    extra: dict[str, list[float]] = {v: [] for v in VARIANTS}
    plains: list[float] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for r in runs.values():
            for _ in range(30):
                r.step()
        for k in range(rounds):
            before = block(runs["plain"])
            plains.append(before)
            order = VARIANTS[k % 3:] + VARIANTS[:k % 3]
            for v in order:
                mine = block(runs[v])
                after = block(runs["plain"])
                extra[v].append(mine - (before + after) / 2)
                before = after
    for r in runs.values():
        r.close()
    return {v: {"plain": statistics.median(plains), "extra": statistics.median(extra[v])} for v in VARIANTS}


def _attach(model, hook: str):
    """docs/frameworks/rl.md's ``attach``: a check (or, ``hook="one"``, the one number) in each
    optimizer's step pre-hook."""
    import gradhealth as gh

    policy = model.policy
    opts = [o for o in (getattr(policy, "optimizer", None),
                        getattr(getattr(policy, "actor", None), "optimizer", None),
                        getattr(getattr(policy, "critic", None), "optimizer", None)) if o is not None]
    if hook == "one":
        params = [p for p in policy.parameters() if p.requires_grad]
        for opt in opts:
            opt.register_step_pre_hook(lambda opt, *_: torch.nn.utils.clip_grad_norm_(params, INF).item() and None)
        return None
    monitor = gh.GradHealth(policy, opts, on_problem="ignore", lag=int(hook == "deferred"))
    for opt in opts:
        opt.register_step_pre_hook(lambda opt, *_: monitor.check(optimizer=opt) and None)
    return monitor


def sb3_learn(algo: str = "PPO", rounds: int = 5, timesteps: int = 2048) -> dict[str, float]:
    """Seconds of ``algo.learn(timesteps)`` (median over ``rounds`` interleaved runs) plain, with
    the one number, and with the monitor attached; and the optimizer steps per run."""
    from stable_baselines3 import DQN, PPO

    def make(hook):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if algo == "DQN":
                m = DQN("MlpPolicy", "CartPole-v1", seed=0, device="cpu", learning_starts=min(100, timesteps // 4), train_freq=1)
            else:
                m = PPO("MlpPolicy", "CartPole-v1", seed=0, device="cpu", n_steps=min(512, timesteps), batch_size=64, n_epochs=4)
        mon = _attach(m, hook) if hook != "plain" else None
        return m, mon

    names = ("plain", "one", "monitor")
    times: dict[str, list[float]] = {n: [] for n in names}
    steps = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for k in range(rounds):
            for n in names[k % 3:] + names[:k % 3]:
                m, mon = make(n)
                counted = [0]
                m.policy.optimizer.register_step_pre_hook(lambda *_: counted.__setitem__(0, counted[0] + 1))
                t0 = time.perf_counter()
                m.learn(timesteps)
                times[n].append(time.perf_counter() - t0)
                steps = counted[0]
                if mon is not None:
                    mon.close()
    return {**{n: statistics.median(t) for n, t in times.items()}, "steps": steps, "timesteps": timesteps}


def _ratio(extra: float, one: float) -> str:
    """``extra / one`` in a 7-wide cell; "n/a" where the one number's cost is lost in the noise (<= 0)."""
    return f"{extra / one:>7.2f}" if one > 0 else f"{'n/a':>7}"


def bench_models(rounds: int = 15, timed: bool = True, learn: bool = True) -> dict:
    print("\nsmall models (RL policies among them): Python instructions per check and per step above the plain "
          "step (sys.settrace opcode events, deterministic), whole-step time interleaved; 'x one': over the one "
          "number a user logs instead (clip_grad_norm_(params, inf).item()); target: at most 1.5x")
    print(f"  {'model':<28}{'variant':<19}{'instr/check':>12}{'x one':>7}{'instr/step':>12}{'x one':>7}"
          + (f"{'plain ms':>10}{'+ms':>9}{'x one':>7}" if timed else ""))
    out = {}
    for label in MODELS:
        counts = count_model(label)
        times = time_model(label, rounds) if timed else None
        one = counts["one number"]
        for v in VARIANTS:
            c = counts[v]
            row = (f"  {label:<28}{v:<19}{c['check']:>12.0f}{c['check'] / one['check']:>7.2f}"
                   f"{c['step']:>12.0f}{c['step'] / one['step']:>7.2f}")
            if times is not None:
                t, o = times[v], times["one number"]["extra"]
                row += f"{t['plain'] * 1e3:>10.3f}{t['extra'] * 1e3:>+9.3f}" + _ratio(t["extra"], o)
            print(row, flush=True)
        out[label] = {"counts": counts, "times": times}
    if learn and "SB3 PPO policy (CartPole)" in MODELS:
        for algo in ("PPO", "DQN"):  # (a short run when few rounds are asked: a smoke test of the row)
            r = sb3_learn(algo, max(1, rounds // 3), 2048 if rounds >= 9 else 256)
            one, mon = r["one"] - r["plain"], r["monitor"] - r["plain"]
            print(f"  SB3 {algo}.learn({r['timesteps']}), {r['steps']} optimizer steps: plain {r['plain']:.3f} s; the one number "
                  f"{one * 1e3:+.0f} ms; the monitor attached (docs/frameworks/rl.md) {mon * 1e3:+.0f} ms "
                  f"({_ratio(mon, one).strip()}x the one number)", flush=True)
            out[f"SB3 {algo}.learn"] = r
    return out


if __name__ == "__main__":
    torch.set_num_threads(1)
    bench_models()

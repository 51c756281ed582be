"""A gradient that piles up without a step (gradhealth/judge/pileup.py): torchtune's optimizer in backward,
as its recipes set it up, with ``tok_embeddings`` frozen at setup and unfrozen later (gradual
unfreezing): its hooks were registered for what required grad at setup, so the embedding's
``.grad`` grows at every backward while the weight never moves."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradhealth as gh
from gradhealth.judge import pileup


# torchtune/training/memory.py, ported
class OptimizerInBackwardWrapper:
    def __init__(self, optim_map):
        self.optim_map = optim_map

    def state_dict(self):
        return {p: opt.state_dict() for p, opt in self.optim_map.items()}


def create_optim_in_bwd_wrapper(model, optim_dict):
    return OptimizerInBackwardWrapper({n: optim_dict[p] for n, p in model.named_parameters()})


def register_optim_in_bwd_hooks(model, optim_dict):
    def optim_step(param) -> None:
        optim_dict[param].step()
        optim_dict[param].zero_grad()

    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(optim_step)


from test_idioms_steps import OptimizerInBackward  # noqa: E402  (torchtune/modules/optim.py's, ported)


class TinyDecoder(nn.Module):
    def __init__(self, vocab=32, dim=16):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layer = nn.Sequential(nn.Linear(dim, 32), nn.GELU(), nn.Linear(32, dim))
        self.output = nn.Linear(dim, vocab)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        return self.output(h + self.layer(h))


def recipe(style: str, unfreeze_at: int | None, steps: int = 12, on_problem: str = "raise"):
    """torchtune's single-device full fine-tune loop with ``optimizer_in_bwd: True``; the embedding
    frozen at setup, unfrozen at ``unfreeze_at`` (None: trainable from the start)."""
    torch.manual_seed(0)
    model = TinyDecoder()
    if unfreeze_at is not None:
        model.tok_embeddings.requires_grad_(False)
    if style == "hooks":  # the older recipes: one optimizer per parameter, hooks, a checkpoint wrapper
        optim_dict = {p: torch.optim.AdamW([p], lr=1e-2, foreach=False) for p in model.parameters()}
        register_optim_in_bwd_hooks(model=model, optim_dict=optim_dict)
        create_optim_in_bwd_wrapper(model=model, optim_dict=optim_dict)
        optimizer, given = None, list(optim_dict.values())
    else:  # the current recipes: OptimizerInBackward, whose step() does nothing
        optimizer = given = OptimizerInBackward(model.parameters(), torch.optim.AdamW, lr=1e-2, foreach=False)
    monitor = gh.GradHealth(model, given, on_problem=on_problem)
    g = torch.Generator().manual_seed(1)
    before = model.tok_embeddings.weight.detach().clone()
    losses, grads = [], []
    try:
        for step in range(steps):
            if step == unfreeze_at:
                model.tok_embeddings.requires_grad_(True)  # gradual unfreezing
            tokens = (torch.randint(0, 32, (8, 1), generator=g) + torch.arange(12)) % 32  # next token: +1
            logits = model(tokens[:, :-1])
            loss = nn.functional.cross_entropy(logits.reshape(-1, 32), tokens[:, 1:].reshape(-1))
            loss.backward()
            monitor.check(loss=loss)
            if optimizer is not None:  # "a no-op for optim in bwd, but prevents a warning w/ LR Scheduler"
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            emb = model.tok_embeddings.weight.grad
            grads.append(emb.norm().item() if emb is not None else None)
    finally:
        monitor.close()
    return losses, grads, torch.equal(before, model.tok_embeddings.weight)


@pytest.mark.parametrize("style", ["hooks", "wrapper"])
def test_a_healthy_optimizer_in_backward_is_silent(style, one_thread):
    losses, grads, still = recipe(style, unfreeze_at=None)
    assert losses[-1] < 0.9 * losses[0] and not still and all(g is None for g in grads)


def test_an_embedding_unfrozen_after_setup_piles_up_its_gradient_and_is_named(one_thread):
    style = "hooks"  # the older recipes: register_optim_in_bwd_hooks, the monitor given the per-parameter optimizers
    with pytest.raises(gh.GradHealthError) as caught:
        recipe(style, unfreeze_at=2)
    report = caught.value.report
    [f] = report.findings_of("GRAD_PILEUP")
    assert f.params == ("tok_embeddings.weight",) and f.level == "error"
    # unfrozen at 2: its gradient grew at 3 to 10; its one optimizer never stepped meanwhile (the only
    # evidence: fused or not, no hook steps it), named once that lasted IDLE checks
    assert report.step == 2 + pileup.IDLE
    assert "grown at each of the last 8 checks" in f.message and "hooked only the parameters requiring grad" in f.message
    assert report.status["tok_embeddings.weight"] is gh.Status.OK  # what the states alone say
    # the premise, from the same loop with the monitor told to ignore: the gradient piles up, the weight never moves
    _, grads, still = recipe(style, unfreeze_at=2, on_problem="ignore")
    assert still and grads[:2] == [None, None] and all(b > a for a, b in zip(grads[2:], grads[3:]))


def test_the_wrapper_names_an_embedding_it_never_hooked_at_once(one_thread):
    """With OptimizerInBackward the monitor sees the optimizers that step inside backward: one that
    never steps the embedding is found at the first check after the unfreeze (NOT_IN_OPTIMIZER)."""
    with pytest.raises(gh.GradHealthError) as caught:
        recipe("wrapper", unfreeze_at=2)
    assert caught.value.report.step == 2
    assert caught.value.report.errors == {"tok_embeddings.weight": gh.Status.NOT_IN_OPTIMIZER}


def test_a_gans_generator_between_its_own_steps_is_not_a_pileup(one_thread):
    """WGAN's loop (n_critic=5) with the generator's output not detached for the critic: the
    generator's .grad grows over the five critic backwards, then its own zero_grad and step. Its
    optimizer steps every few checks: not a gradient nothing steps."""
    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
    D = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 1, bias=False))  # (a critic bias gets 0 exactly)
    oG, oD = torch.optim.Adam(G.parameters(), lr=1e-3), torch.optim.Adam(D.parameters(), lr=1e-3)
    monitor = gh.GradHealth(nn.ModuleDict({"G": G, "D": D}), [oG, oD], on_problem="raise")
    critic_losses, piled = [], []
    for it in range(4):
        for _ in range(5):  # n_critic
            real = torch.randn(32, 2) * 0.5 + 2.0
            oD.zero_grad()
            loss_d = D(G(torch.randn(32, 4))).mean() - D(real).mean()  # (fake not detached: G's .grad piles up)
            loss_d.backward()
            monitor.check(loss=loss_d)
            oD.step()
            critic_losses.append(loss_d.item())
            piled.append(G[0].weight.grad.norm().item())
        oG.zero_grad()
        loss_g = -D(G(torch.randn(32, 4))).mean()
        loss_g.backward()
        monitor.check(loss=loss_g)
        oG.step()
    monitor.close()
    assert all(b > a for a, b in zip(piled[1:5], piled[2:5]))  # premise: G's gradient grows over the critic steps
    assert sum(critic_losses[-5:]) < sum(critic_losses[:5])  # the critic learns


def test_a_check_without_gradients_between_two_checks_breaks_nothing(one_thread):
    """A check that found no gradient at all (zero_grad, then check before any backward) leaves no
    stale comparison behind: the next check is judged, not lost to an internal failure."""
    import warnings

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = gh.GradHealth(model, opt, on_problem="ignore")
    with warnings.catch_warnings():
        warnings.simplefilter("error", gh.GradHealthInternalWarning)
        model(torch.randn(8, 4)).sum().backward()
        monitor.check()
        opt.zero_grad()
        monitor.check()  # nothing has a gradient now
        (10 * model(torch.randn(8, 4)).sum()).backward()
        report = monitor.check()
    monitor.close()
    assert report is not None and report.status["weight"] is gh.Status.OK


def _naive_pileups(log, held_by, versions_tell):
    """The rule over a whole run, parameter by parameter (the reference for :class:`pileup.PileUp`,
    which keeps its streaks as aligned lists): ``log`` per check: (grad norms, states, versions,
    total steps, steps per optimizer); returns per check {name: (streak, first norm)} named."""
    streak, prev, out = {}, {}, []
    for gn, status, ver, total, stepped in log:
        now = {}
        for n, v in gn.items():
            if not v > prev.get(n, float("inf")) or status[n] is not gh.Status.OK or v == float("inf"):
                continue
            r = streak.get(n)
            if r is None or r[1] != ver[n]:
                r = [0, ver[n], (total, dict(stepped)), prev[n]]
            r[0] += 1
            now[n] = r
        streak, prev = now, gn
        named = {}
        for n, r in now.items():
            if r[0] < pileup.PILE or total <= r[2][0]:
                continue
            mine = held_by[n]
            ran = [stepped[o] != r[2][1][o] for o in mine]
            if (r[0] >= pileup.IDLE and not any(ran)) or (any(ran) and all(versions_tell[o] for o in mine)):
                named[n] = (r[0], r[3])
        out.append(named)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_streaks_agree_with_the_naive_rule_on_random_loops(seed):
    """A loop that does at random what makes and breaks streaks: layers left out of a forward (no
    new gradient), gradients dropped (another set of parameters with gradients), an optimizer that
    steps now and then and clears only then (a GAN's), a parameter whose gradient is set aside
    around the other optimizer's step (its step runs, the weight never moves), zeroed gradients
    of layers then left out (ZERO_GRAD).
    Every check's GRAD_PILEUP agrees with the naive rule, names and numbers."""
    import random

    torch.manual_seed(seed)
    rng = random.Random(seed)
    layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(6))
    opt_a = torch.optim.SGD([p for m in layers[:3] for p in m.parameters()], lr=0.01, foreach=False)
    opt_b = torch.optim.SGD([p for m in layers[3:] for p in m.parameters()], lr=0.01, foreach=False)
    names = [n for n, _ in layers.named_parameters()]
    params = dict(layers.named_parameters())
    held_by = {n: ["a" if int(n.split(".")[0]) < 3 else "b"] for n in names}
    monitor = gh.GradHealth(layers, [opt_a, opt_b], on_problem="ignore")
    log, seen, steps, total = [], [], {"a": 0, "b": 0}, 0
    for check in range(90):
        x = torch.randn(8, 4)
        used = [m for m in layers if rng.random() < 0.8] or [layers[0]]
        sum(m(x).pow(2).mean() for m in used).backward()
        for n in names[6:]:  # (opt_b's: dropped now and then)
            if rng.random() < 0.05:
                params[n].grad = None
        report = monitor.check()
        if not report.grad_norm:  # (nothing had a gradient: the check judges nothing)
            continue
        log.append((dict(report.grad_norm), dict(report.status), {n: p._version for n, p in params.items()},
                    total, dict(steps)))
        seen.append({n: (f.data["first"], f.message) for f in report.findings_of("GRAD_PILEUP") for n in f.params})
        aside = params["2.weight"].grad if rng.random() < 0.7 else None
        if aside is not None:
            params["2.weight"].grad = None
        opt_a.step()
        steps["a"], total = steps["a"] + 1, total + 1
        opt_a.zero_grad(set_to_none=False)
        if aside is not None:
            params["2.weight"].grad = aside  # (kept: it piles on)
        if rng.random() < 0.12:
            opt_b.step()
            steps["b"], total = steps["b"] + 1, total + 1
            opt_b.zero_grad(set_to_none=rng.random() < 0.5)
    monitor.close()
    expected = _naive_pileups(log, held_by, {"a": True, "b": True})
    named = [n for e in expected for n in e]
    assert "2.weight" in named and any(n.startswith(("3.", "4.", "5.")) for n in named)  # (both ways are met)
    for check, (want, got) in enumerate(zip(expected, seen)):
        assert set(got) == set(want), check
        if want:
            first, message = next(iter(got.values()))
            assert first == min(f for _, f in want.values())
            assert f"grown at each of the last {min(c for c, _ in want.values())} checks" in message


def _aside_loop(checks: int, replace_at: int | None = None):
    """The first layer's gradient set aside around every step (the step runs, the weight never
    moves, the gradient piles up), a fixed batch; ``replace_at``: that weight replaced by a new
    Parameter (in the model and the optimizer) at that check. Returns (log, findings per check)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.01, foreach=False)
    monitor = gh.GradHealth(net, opt, on_problem="ignore")
    x, log, seen, total = torch.randn(8, 4), [], [], 0
    for check in range(checks):
        if check == replace_at:
            new = nn.Parameter(net[0].weight.detach().clone())
            new.grad = net[0].weight.grad
            opt.param_groups[0]["params"][0] = new
            net[0].weight = new
        net(x).pow(2).mean().backward()
        report = monitor.check()
        params = dict(net.named_parameters())
        log.append((dict(report.grad_norm), dict(report.status), {n: p._version for n, p in params.items()}, total,
                    {"a": total}))
        seen.append({n: (f.data["first"], f.message) for f in report.findings_of("GRAD_PILEUP") for n in f.params})
        aside, net[0].weight.grad = net[0].weight.grad, None
        opt.step()
        total += 1
        opt.zero_grad(set_to_none=False)
        net[0].weight.grad = aside
    monitor.close()
    return log, seen


@pytest.mark.parametrize("checks, replace_at", [(72, None), (16, 6)], ids=["a streak longer than the checks kept", "replaced"])
def test_long_streaks_and_replaced_parameters_agree_with_the_naive_rule(checks, replace_at):
    """A streak older than the checks the rule keeps (64) is dated from its real start, and a
    parameter replaced mid-run is followed (its new tensor's version, its new optimizer slot)."""
    log, seen = _aside_loop(checks, replace_at)
    expected = _naive_pileups(log, {n: ["a"] for n in log[0][0]}, {"a": True})
    assert any("0.weight" in e for e in expected[-4:])  # (named to the end)
    for check, (want, got) in enumerate(zip(expected, seen)):
        assert set(got) == set(want), check
        if want:
            first, message = next(iter(got.values()))
            assert first == min(f for _, f in want.values()), check
            assert f"grown at each of the last {min(c for c, _ in want.values())} checks" in message, check

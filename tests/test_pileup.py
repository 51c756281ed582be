"""A gradient that piles up without a step (gradhealth/pileup.py): torchtune's optimizer in backward,
as its recipes set it up, with ``tok_embeddings`` frozen at setup and unfrozen later (gradual
unfreezing): its hooks were registered for what required grad at setup, so the embedding's
``.grad`` grows at every backward while the weight never moves."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradhealth as gh


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


def recipe(style: str, unfreeze_at: int | None, steps: int = 9, on_problem: str = "raise"):
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
    assert report.step == 2 + gh.pileup.PILE  # unfrozen at 2: its gradient grew at 3, 4, 5
    assert "grown at each of the last 3 checks" in f.message and "hooked only the parameters requiring grad" in f.message
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

"""gh.assert_trains: fails on each planted bug with a readable list, passes on a healthy model,
and leaves model and optimizer as they were."""

import pytest
import torch
from torch import nn

import gradhealth as gh
from conftest import MLP


def loss_fn(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)


def test_healthy_model_passes_and_state_is_restored():
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    loss_fn(model, batch()).backward()
    opt.step()  # optimizer has state
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt_state = {k: {kk: vv.clone() for kk, vv in v.items()} for k, v in opt.state.items()}
    rng = torch.random.get_rng_state()
    status = gh.assert_trains(model, opt, loss_fn, batch())
    assert set(status.values()) == {gh.Status.OK}
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) and torch.equal(p.grad, grads[n])
    for k, v in opt.state.items():
        for kk, vv in v.items():
            assert torch.equal(vv, opt_state[k][kk])
    assert torch.equal(torch.random.get_rng_state(), rng)


@pytest.mark.parametrize(
    "plant, words",
    [
        ("detached", "the loss cannot produce gradients"),
        ("unused_head", "head.weight: NO_GRAD"),
        ("not_in_opt", "head.bias: NOT_IN_OPTIMIZER"),
        ("lr0", "encoder.0.weight: did not change after optimizer.step()"),
        ("nan", "NON_FINITE_GRAD"),
        ("zero", "ZERO_GRAD"),
    ],
)
def test_each_planted_bug_fails_readably(plant, words):
    torch.manual_seed(0)
    model = MLP()
    params = list(model.parameters())
    lr = 0.0 if plant == "lr0" else 0.1
    opt = torch.optim.SGD(model.encoder.parameters() if plant == "not_in_opt" else params, lr=lr)
    fn = loss_fn
    if plant == "detached":
        fn = lambda m, b: nn.functional.mse_loss(m(b[0]).detach(), b[1])
    elif plant == "unused_head":
        fn = lambda m, b: m.encoder(b[0]).square().mean()
    elif plant == "nan":
        fn = lambda m, b: (m(b[0]) / torch.zeros(1)).mean()
    elif plant == "zero":
        fn = lambda m, b: (m(b[0]) * 0).sum()
    with pytest.raises(AssertionError, match=words) as err:
        gh.assert_trains(model, opt, fn, batch())
    assert "gradhealth.assert_trains" in str(err.value)


def test_expect_frozen():
    torch.manual_seed(0)
    model = MLP()
    model.encoder[0].requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gh.assert_trains(model, opt, loss_fn, batch())  # frozen parameters are skipped by default
    gh.assert_trains(model, opt, loss_fn, batch(), expect_frozen="encoder.0.*")
    with pytest.raises(AssertionError, match="encoder.0.weight: FROZEN"):
        gh.assert_trains(model, opt, loss_fn, batch(), expect_frozen=[])
    with pytest.raises(AssertionError, match="head.weight: trainable but matched"):
        gh.assert_trains(model, opt, loss_fn, batch(), expect_frozen=["encoder.0.*", "head.*"])


def test_restore_false_keeps_the_step():
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.head.weight.detach().clone()
    gh.assert_trains(model, opt, loss_fn, batch(), restore=False)
    assert not torch.equal(model.head.weight, before)


def test_assert_trains_takes_the_usual_loss_form_with_an_inputs_targets_batch():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = (torch.randn(6, 4), torch.randint(0, 3, (6,)))
    for loss_fn in (nn.CrossEntropyLoss(), nn.functional.cross_entropy):
        status = gh.assert_trains(model, opt, loss_fn, batch)
        assert set(status.values()) == {gh.Status.OK} and len(status) == 4
    frozen = nn.Sequential(nn.Linear(4, 3))
    frozen[0].bias.requires_grad_(False)
    opt2 = torch.optim.SGD([frozen[0].weight], lr=0.1)
    status = gh.assert_trains(frozen, opt2, nn.CrossEntropyLoss(), batch)  # the frozen bias is skipped
    assert status["0.bias"] is gh.Status.FROZEN
    with pytest.raises(TypeError, match="fits neither form"):
        gh.assert_trains(model, opt, lambda a, b, c: a, batch)


def test_the_cli_prints_its_version_and_the_tracer_reads_well(capsys):
    from gradhealth.cli import main

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("gradhealth 0.1")
    model = nn.Sequential(nn.Linear(2, 2))
    with gh.trace_nonfinite(model) as t:
        (model(torch.randn(3, 2)) * float("inf")).sum().backward()
    assert repr(t).startswith("NonFiniteTracer(armed=False, forward_origin=") and "backward_origin=" in repr(t)

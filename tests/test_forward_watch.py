"""The forward watch reads modes in one pre-hook: no hook on the children of a healthy model, a
child switched to eval() named at that check, its hook gone once it trains again."""

import torch
from torch import nn

import gradhealth as gh


def _forward_hooks(model):
    return {name: len(m._forward_hooks) + len(m._forward_pre_hooks) for name, m in model.named_modules() if
            m._forward_hooks or m._forward_pre_hooks}


def _net():
    torch.manual_seed(0)
    layers = []
    for _ in range(10):
        layers += [nn.Linear(8, 8), nn.LayerNorm(8), nn.Dropout(0.1)]
    return nn.Sequential(*layers, nn.Linear(8, 2))


def test_a_healthy_model_has_hooks_on_the_model_alone(one_thread):
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    x, y = torch.randn(16, 8), torch.randint(0, 2, (16,))
    losses = []
    with gh.GradHealth(model, opt, on_problem="raise"):
        for _ in range(5):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert _forward_hooks(model) == {"": 2}  # one pre-hook and one hook, on the model
    assert losses[-1] < losses[0]


def test_a_child_in_eval_is_named_at_that_check_and_unhooked_after(one_thread):
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    x, y = torch.randn(16, 8), torch.randint(0, 2, (16,))
    with gh.GradHealth(model, opt, on_problem="ignore") as mon:
        found = []
        for step in range(8):
            model[5].train(not 3 <= step < 5)  # a dropout left in eval() at steps 3 and 4
            assert model[5].training is (not 3 <= step < 5)  # the premise
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            report = mon.check()
            opt.step()
            found.append([(f.params, f.message.split(":")[0]) for f in report.findings_of("GRAD_MODE")])
            if step == 3:
                assert _forward_hooks(model) == {"": 2, "5": 1}  # hooked only while in eval()
        said = [(("5",), "submodule 5 was in eval() mode during the training forward")]
        assert found == [[], [], [], said, said, [], [], []], found
        assert _forward_hooks(model) == {"": 2}


def test_validation_forward_in_eval_under_no_grad_says_nothing(one_thread):
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    x, y = torch.randn(16, 8), torch.randint(0, 2, (16,))
    with gh.GradHealth(model, opt, on_problem="raise") as mon:
        for _ in range(4):
            model.eval()
            with torch.no_grad():
                model(x)  # validation
            model.train()
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            assert not mon.check().findings_of("GRAD_MODE")
            opt.step()

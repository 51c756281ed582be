"""fastai: its own ``Optimizer`` (the default Adam) and ``OptimWrapper`` around torch's AdamW, each
inside a real ``Learner.fit_one_cycle`` with a fastai Callback that checks in ``after_backward``
(the README's recipe). Every state is compared with the naive per-parameter loop."""

import warnings
from functools import partial

import pytest
import torch
from torch import nn

import gradhealth as gh
from conftest import naive_classify

fastai = pytest.importorskip("fastai")
import fastai.callback.schedule  # noqa: E402,F401 (fit_one_cycle)
from fastai.callback.core import Callback  # noqa: E402
from fastai.callback.progress import ProgressCallback  # noqa: E402
from fastai.data.core import DataLoaders  # noqa: E402
from fastai.learner import Learner  # noqa: E402
from fastai.losses import MSELossFlat  # noqa: E402
from fastai.optimizer import Adam, OptimWrapper, Optimizer  # noqa: E402

torch.set_num_threads(1)


class GradHealthCheck(Callback):
    """The recipe: the monitor made when the fit starts, a check after every backward."""

    def __init__(self, **options):
        self.options, self.reports, self.naive = options, [], []

    def before_fit(self):
        self.monitor = gh.GradHealth(self.learn.model, self.learn.opt, **self.options)

    def after_backward(self):
        self.naive.append(naive_classify(self.learn.model, self.learn.opt))  # (the oracle, as of now)
        self.reports.append(self.monitor.check(loss=self.learn.loss_grad))

    def after_fit(self):
        self.monitor.close()


def _params(*modules):
    return [p for m in modules for p in m.parameters()]


def _learner(opt_func, splitter=None, **options):
    torch.manual_seed(0)
    X = torch.randn(96, 4)
    Y = X @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1
    ds = list(zip(X, Y))
    dls = DataLoaders.from_dsets(ds[:80], ds[80:], bs=16, device="cpu")
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
    check = GradHealthCheck(**options)
    kw = {"splitter": splitter} if splitter is not None else {}
    learn = Learner(dls, model, loss_func=MSELossFlat(), opt_func=opt_func, cbs=[check], **kw)
    learn.remove_cb(ProgressCallback)
    return learn, check


def _fit(learn, epochs=2, lr=1e-2, one_cycle=True):
    with learn.no_logging(), warnings.catch_warnings():
        warnings.simplefilter("error", gh.GradHealthInternalWarning)
        (learn.fit_one_cycle if one_cycle else learn.fit)(epochs, lr)
    return [v[0] for v in learn.recorder.values]  # train loss per epoch


TWO_GROUPS = lambda m: [_params(m[0], m[1]), _params(m[3])]  # noqa: E731  (body, head)
OPTIMIZERS = {"fastai_Adam": Adam, "OptimWrapper_AdamW": partial(OptimWrapper, opt=torch.optim.AdamW)}


@pytest.mark.parametrize("opt_func", OPTIMIZERS.values(), ids=OPTIMIZERS.keys())
def test_a_healthy_fit_one_cycle_is_silent_and_exact(opt_func):
    learn, check = _learner(opt_func, on_problem="raise", change_every=1)
    losses = _fit(learn, epochs=3)
    assert losses[-1] < losses[0]  # healthy: it trains
    assert len(check.reports) == 15 and all(r.ok and not r.problems and not r.findings_of("NOT_UPDATED")
                                            for r in check.reports)
    assert all(r.status == n for r, n in zip(check.reports, check.naive))


@pytest.mark.parametrize("opt_func", OPTIMIZERS.values(), ids=OPTIMIZERS.keys())
def test_a_layer_left_out_of_the_optimizer_is_not_in_optimizer(opt_func):
    learn, check = _learner(opt_func, splitter=lambda m: [_params(m[0], m[1])], on_problem="ignore")
    _fit(learn, epochs=1)
    head = {id(p) for p in learn.model[3].parameters()}
    assert not head & {id(p) for g in learn.opt.param_groups for p in g["params"]}  # the premise
    for r, n in zip(check.reports, check.naive):
        assert r.status == n
        assert {k for k, s in r.status.items() if s is gh.Status.NOT_IN_OPTIMIZER} == {"3.weight", "3.bias"}


def test_a_fastai_optimizer_whose_step_does_nothing_is_not_updated():
    learn, check = _learner(partial(Optimizer, cbs=[]), on_problem="ignore", change_every=1)  # no step callback
    before = [p.detach().clone() for p in learn.model.parameters()]
    _fit(learn, epochs=1)
    assert all(torch.equal(a, p) for a, p in zip(before, learn.model.parameters()))  # the premise: nothing moved
    late = check.reports[-1]
    found = late.findings_of("NOT_UPDATED")
    assert found and all(f.level == "error" and "learning rate is not 0" in f.message for f in found)


@pytest.mark.parametrize("opt_func", OPTIMIZERS.values(), ids=OPTIMIZERS.keys())
def test_a_learning_rate_of_zero_is_named(opt_func):
    learn, check = _learner(opt_func, on_problem="ignore", change_every=1)
    before = [p.detach().clone() for p in learn.model.parameters()]
    _fit(learn, epochs=1, lr=0.0, one_cycle=False)
    assert all(torch.equal(a, p) for a, p in zip(before, learn.model.parameters()))  # the premise
    found = check.reports[-1].findings_of("NOT_UPDATED")
    assert found and all("learning rate has been 0" in f.message for f in found)


def test_weight_decay_moving_layers_frozen_after_training_is_frozen_but_changed():
    # fastai's zero_grad zeroes gradients instead of dropping them: after learn.freeze(), the frozen
    # body still holds (zero) gradients, so its Adam step applies weight decay to it
    learn, check = _learner(Adam, splitter=TWO_GROUPS, on_problem="ignore", change_every=1)
    _fit(learn, epochs=1)
    learn.freeze()
    body = learn.model[0].weight
    assert not body.requires_grad and body.grad is not None  # the premise: frozen, a gradient kept
    before = body.detach().clone()
    check.reports.clear()
    _fit(learn, epochs=1)
    assert not torch.equal(before, body)  # the premise: it moved while frozen
    found = [f for r in check.reports for f in r.findings_of("FROZEN_BUT_CHANGED")]
    assert found and "0.weight" in found[-1].params


def test_learn_freeze_with_train_bn_is_silent():
    learn, check = _learner(Adam, splitter=TWO_GROUPS, on_problem="raise", change_every=1)
    learn.freeze()  # (before any gradient: the body is frozen, its BatchNorm trains: train_bn=True)
    losses = _fit(learn, epochs=3)
    assert losses[-1] < losses[0]
    r = check.reports[-1]
    assert r.status["0.weight"] is gh.Status.FROZEN and r.status["1.weight"] is gh.Status.OK  # the premise
    assert all(r.ok and not r.findings for r in check.reports)
    assert all(r.status == n for r, n in zip(check.reports, check.naive))


def test_an_object_with_param_groups_but_no_step_is_refused_naming_its_framework():
    learn, _ = _learner(Adam)
    learn.create_opt()

    class Groups:  # param_groups, no step
        param_groups = learn.opt.param_groups

    with pytest.raises(TypeError, match=r"Groups is .*optimizer.*cannot be watched.*gh.GradHealth\(model\).*NOT_IN_OPTIMIZER"):
        gh.GradHealth(learn.model, Groups())

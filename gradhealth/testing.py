"""``assert_trains``: the "does every intended parameter actually train?" test, for users' suites."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from .base.naming import matches
from .base.status import Status, hint
from .model.optimizers import as_optimizers
from .model.params import check_model, named_parameters
from .model.wrappers import respell
from .origin.snapshot import ModuleState, rng_state, set_rng_state
from .judge.classify import classify
from .judge.guards import diagnose_loss
from .options import check_patterns

__all__ = ["assert_trains"]


def assert_trains(
    model: nn.Module,
    optimizer,
    loss_fn: Callable,
    batch,
    *,
    expect_frozen=None,
    restore: bool = True,
) -> dict[str, Status]:
    """Run one training step and fail with a readable list of every parameter that does not train.

    ``loss_fn(model, batch)`` returns the loss; a loss of the usual form ``loss_fn(output, target)``
    (``nn.CrossEntropyLoss()``, ``F.mse_loss``) with an ``(inputs, targets)`` batch works too: the
    model is called on the inputs. A parameter fails when it gets no gradient, a
    non-finite or all-zero gradient, is in no optimizer, or is unchanged by ``optimizer.step()``.
    Frozen parameters are skipped, unless ``expect_frozen`` (name patterns) is given: then a frozen
    parameter outside the patterns, or a trainable one inside them, fails too. The model's
    parameters, buffers and gradients, the optimizer's state and the RNG are restored afterwards
    unless ``restore=False``. Returns the statuses when everything trains.
    """
    check_model(model)
    entries = named_parameters(model)
    optimizers = as_optimizers(optimizer)
    if not optimizers:
        raise TypeError("assert_trains needs an optimizer (or a list of them) to take the step with")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable as loss_fn(model, batch) or loss_fn(output, target); got "
                        f"{type(loss_fn).__name__}")
    pats = check_patterns(expect_frozen)
    spelled = respell(model, pats)  # (written with a wrapper's prefix or without it)

    saved_model = ModuleState(model)
    saved_opt = [copy.deepcopy(o.state_dict()) for o in optimizers]
    saved_rng = rng_state()
    failures: list[str] = []
    status: dict[str, Status] = {}
    try:
        for o in optimizers:
            o.zero_grad(set_to_none=True)
        loss = _loss(loss_fn, model, batch)
        cause = diagnose_loss(loss, model)
        if cause is not None:
            failures.append(f"the loss cannot produce gradients: {cause}")
        else:
            loss.backward()
            status = classify(model, optimizers)
            before = [p.detach().clone() for _, p in entries]
            for o in optimizers:
                o.step()
            for (name, p), b in zip(entries, before):
                state = status[name]
                expected_frozen = matches(name, spelled)
                if state is Status.FROZEN:
                    if pats is not None and not expected_frozen:
                        failures.append(f"{name}: FROZEN (requires_grad=False) but not in expect_frozen")
                    continue
                if expected_frozen:
                    failures.append(f"{name}: trainable but matched by expect_frozen {list(pats)}")
                if state is not Status.OK:
                    failures.append(f"{name}: {state.value}: {hint(state, 1)}")
                elif torch.equal(p.detach(), b):
                    failures.append(
                        f"{name}: did not change after optimizer.step() although its gradient is finite and non-zero "
                        "(learning rate 0? an update rule that does nothing?)"
                    )
    finally:
        if restore:
            saved_model.restore()
            for o, s in zip(optimizers, saved_opt):
                o.load_state_dict(s)
            set_rng_state(saved_rng)
    if failures:
        n = len(entries)
        raise AssertionError(
            f"gradhealth.assert_trains: {len(failures)} problem(s) in a model of {n} parameter tensors:\n  "
            + "\n  ".join(failures)
        )
    return status


def _loss(loss_fn, model: nn.Module, batch):
    """``loss_fn(model, batch)``, or ``loss_fn(model(inputs), targets)`` for a loss of the usual
    form (a torch loss module, or a function that refuses the model) and a pair batch."""
    pair = isinstance(batch, (tuple, list)) and len(batch) == 2

    def usual():
        inputs, target = batch
        return loss_fn(model(*inputs) if isinstance(inputs, (tuple, list)) else model(inputs), target)

    if isinstance(loss_fn, nn.Module) and pair:
        return usual()
    try:
        return loss_fn(model, batch)
    except (TypeError, AttributeError) as first:
        if not pair:
            raise TypeError(f"assert_trains: loss_fn(model, batch) failed ({type(first).__name__}: {first}); pass "
                            "loss_fn(model, batch) -> loss, or a loss_fn(output, target) with an (inputs, targets) "
                            "batch") from first
        try:
            return usual()
        except (TypeError, AttributeError) as second:
            raise TypeError(f"assert_trains: loss_fn fits neither form: loss_fn(model, batch) failed ({first}), and "
                            f"loss_fn(model(inputs), targets) failed ({second})") from second

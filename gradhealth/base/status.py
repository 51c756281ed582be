"""The six parameter states, in the order the decision tree tests them."""

from __future__ import annotations

import enum


class Status(str, enum.Enum):
    """State of one parameter after a backward pass (precedence order)."""

    FROZEN = "FROZEN"
    NO_GRAD = "NO_GRAD"
    NON_FINITE_GRAD = "NON_FINITE_GRAD"
    NOT_IN_OPTIMIZER = "NOT_IN_OPTIMIZER"
    ZERO_GRAD = "ZERO_GRAD"
    OK = "OK"

    def __str__(self) -> str:  # so f-strings and logs show "FROZEN", not "Status.FROZEN"
        return self.value


# What each state means and what to do about it: used by warnings, str(report) and the README.
HINTS = {
    Status.FROZEN: (
        "requires_grad is False, so these parameters never train. Usually intended (a frozen "
        "backbone); if not, call requires_grad_(True) on them, or list the intended ones in "
        "expect_frozen= so any other frozen parameter is reported."
    ),
    Status.NO_GRAD: (
        "got no gradient from this backward: they are not on the path from the loss to the output "
        "(an unused layer or head, a .detach()/.data/torch.tensor(...) that cut the graph, an output "
        "left out of the loss), or check() ran before backward(). If they are unused on purpose, "
        "freeze them with requires_grad_(False)."
    ),
    Status.NON_FINITE_GRAD: (
        "have NaN or inf gradients. Usual causes: a mask applied after a division or log (mask "
        "before the operation: gh.safe_div / gh.safe_log), an unguarded log/sqrt at 0, a "
        "torch.where over an overflowing branch, an fp16 overflow, or weights that already "
        "diverged. Wrap one step in gh.trace_nonfinite(model) to name the module where it began."
    ),
    Status.NOT_IN_OPTIMIZER: (
        "get gradients but no optimizer updates them: they are in none of its param_groups. Build "
        "the optimizer from model.parameters() after every submodule exists, or add them with "
        "optimizer.add_param_group(...) (where a framework builds it, what you give it: DeepSpeed's "
        "model_parameters, a fastai splitter)."
    ),
    Status.ZERO_GRAD: (
        "have gradients that are exactly zero: dead ReLUs, a mask that selected nothing, a "
        "multiplication by a zero tensor, or a branch whose output does not reach the loss."
    ),
    Status.OK: "train normally.",
}

# The same words for a single parameter.
HINTS_ONE = {
    Status.FROZEN: (
        "requires_grad is False, so this parameter never trains. Usually intended (a frozen "
        "backbone); if not, call requires_grad_(True) on it, or list the intended ones in "
        "expect_frozen= so any other frozen parameter is reported."
    ),
    Status.NO_GRAD: HINTS[Status.NO_GRAD].replace("they are not on", "it is not on").replace(
        "If they are unused on purpose, freeze them", "If it is unused on purpose, freeze it"),
    Status.NON_FINITE_GRAD: "has" + HINTS[Status.NON_FINITE_GRAD][len("have"):].replace("inf gradients", "inf gradient", 1),
    Status.NOT_IN_OPTIMIZER: (
        "gets gradients but no optimizer updates it: it is in none of the optimizer's param_groups. Build "
        "the optimizer from model.parameters() after every submodule exists, or add it with "
        "optimizer.add_param_group(...) (where a framework builds it, what you give it: DeepSpeed's "
        "model_parameters, a fastai splitter)."
    ),
    Status.ZERO_GRAD: "has a gradient that is exactly zero" + HINTS[Status.ZERO_GRAD][len("have gradients that are exactly zero"):],
    Status.OK: "trains normally.",
}


#: NO_GRAD's words where no backward ran before the check (``report.backward`` is False)
NO_BACKWARD = ("got no gradient because no backward ran before this check: nothing was backpropagated (a "
               "Lightning training_step that returns None makes Lightning skip backward and the step changes "
               "nothing). Return the loss from training_step, or call backward() before check().")


def hint(state: Status, count: int) -> str:
    """The causes and fix of ``state``, worded for ``count`` parameters."""
    return (HINTS_ONE if count == 1 else HINTS)[state]

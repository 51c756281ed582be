"""``Options``: every setting of a monitor, validated once where it is given, shared by all adapters."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from .model.experts import check_experts
from .judge.history import NormHistory

__all__ = ["Options", "ON_PROBLEM", "DELTA_MODES", "check_choice", "check_positive_int", "check_patterns", "check_tensor",
           "check_scaler", "check_step"]

ON_PROBLEM = ("warn", "raise", "ignore")
DELTA_MODES = ("auto", "exact", "off")


def check_scaler(scaler):
    """The grad scaler to judge with, or None. A disabled scaler (nanoGPT's
    ``GradScaler(enabled=(dtype == 'float16'))`` on an fp32/bf16 run) scales nothing: no scaler.
    Any GradScaler torch hands out qualifies (``torch.amp`` for any device, ``torch.cuda.amp``,
    FSDP's ``ShardedGradScaler``): what is read of it is ``is_enabled()`` and ``get_scale()``."""
    if scaler is None:
        return None
    if not (callable(getattr(scaler, "get_scale", None)) and callable(getattr(scaler, "is_enabled", None))):
        raise TypeError(f"scaler must be a torch.amp.GradScaler (enabled or not) or None; got {type(scaler).__name__}")
    return scaler if scaler.is_enabled() else None


def check_step(step) -> int | None:
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        raise TypeError(f"check(step=...) must be an int >= 0 (e.g. a trainer's global step) or None; got {step!r}")
    if step is not None and step < 0:
        raise ValueError(f"check(step=...) must be an int >= 0 (e.g. a trainer's global step) or None; got {step!r}")
    return step


def check_tensor(name: str, value, optional: bool = False):
    """``value`` is a torch.Tensor (or None when optional), else a TypeError naming ``name``."""
    import torch

    if value is None and optional:
        return value
    if not isinstance(value, torch.Tensor):
        hint = " (pass the tensor itself, not .item())" if isinstance(value, (int, float)) else ""
        raise TypeError(f"{name} must be a torch.Tensor{' or None' if optional else ''}{hint}; got {type(value).__name__}")
    return value


def check_choice(name: str, value, allowed: Sequence) -> Any:
    if value not in allowed:
        opts = ", ".join(repr(a) for a in allowed)
        raise ValueError(f"{name} must be one of {opts}; got {value!r}")
    return value


def check_positive_int(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        what = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(f"{name} must be {what}; got {value!r}")
    return value


def _check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False; got {value!r}")
    return value


def check_patterns(value) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = (value,)
    try:
        value = tuple(value)
    except TypeError:
        value = (value,)
    if not all(isinstance(v, str) for v in value):
        raise TypeError(f"expect_frozen must be a name pattern or a list of them (e.g. ['encoder.*']); got {value!r}")
    return value


def _check_sinks(sinks) -> tuple:
    if sinks is None:
        return ()
    if not isinstance(sinks, (list, tuple)):
        sinks = (sinks,)
    for i, s in enumerate(sinks):
        if isinstance(s, type):
            raise TypeError(f"sinks[{i}] is the class {s.__name__}, not an instance: pass {s.__name__}(...)")
        if not callable(getattr(s, "write", None)):
            raise TypeError(
                f"sinks[{i}] must have a write(report) method (e.g. gh.LoggingSink() or "
                f"gradhealth.integrations.tensorboard.TensorBoardSink(logdir)); got {type(s).__name__}"
            )
    return tuple(sinks)


def _check_history(history) -> NormHistory | None:
    if history is True:
        return NormHistory()
    if history is False or history is None:
        return None
    if not isinstance(history, NormHistory):
        raise TypeError(f"history must be True, False or a gh.NormHistory; got {type(history).__name__}")
    return history


def _check_float(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number >= 0; got {value!r}")
    if not value >= 0:
        raise ValueError(f"{name} must be a number >= 0; got {value!r}")
    return float(value)


@dataclasses.dataclass(frozen=True)
class Options:
    """How a monitor judges and reports; the keywords of ``GradHealth`` and of every callback.

    Args:
        on_problem: "warn" (one [GradHealthWarning][gradhealth.GradHealthWarning] per check with problems), "raise"
            ([GradHealthError][gradhealth.GradHealthError] after every sink got the report), or "ignore".
        every_n_steps: check only every n-th call of ``check()`` (others return None at once,
            and the optimizer step after them is not measured).
        sinks: objects with ``write(report)`` (e.g. [LoggingSink][gradhealth.LoggingSink], ``TensorBoardSink``);
            an optional ``write_update(report)`` receives a report again once its step's update
            norms are known.
        expect_frozen: name patterns (``fnmatch``, e.g. ``"encoder.*"``) of the parameters meant
            to be frozen. With it, a frozen parameter outside them, or a trainable one inside them,
            is an error finding (UNEXPECTED_FROZEN / UNEXPECTED_TRAINABLE). A pattern may be written
            with the prefix of a wrapper or holder of the model (``module.encoder.*``) or without it
            (`gradhealth.model.wrappers.respell`); so may those of ``experts``.
        deltas: "auto" (default): every step, whether each parameter changed (exact, from version
            counters and an exact comparison on the device), and at checks 0, 1, 2, 4, ... up to
            half ``update_every``, then every ``update_every``, the update norms ||Δθ|| from the optimizer's own rule (SGD, Adam, AdamW; others: exact
            copies within 2% of parameter memory, in turns); "exact": a transient 1x copy of the
            parameters across every step, exact norms every step; "off": no step measurement.
        update_every: with ``deltas="auto"``, measure update norms at every this many checks, and
            before that at checks 0, 1, 2, 4, ... up to half of it (a short run's chart has points).
        change_every: with ``deltas="auto"``, test whether each parameter changed (exactly) on the
            step after every this many checks (and at every update measurement); a learning rate
            of 0 is seen at every step. 1: every step.
        history: True (default baseline), False, or a [NormHistory][gradhealth.NormHistory] to tune
            EXPLODING_GRAD / VANISHING_GRAD.
        amp_skip_alarm: with a grad scaler, AMP_SKIPPED is an error after this many skips in a row.
        amp_scale_floor: with a grad scaler, a scale below this is an error.
        trace_on_nonfinite: when a check finds NaN/inf gradients, name where they were born in its
            own report: the batch, from the inputs of the loop's calls into the model (kept by
            reference until the check), or a replay of those calls under the NaN tracer
            (`gradhealth.origin.calls`); where that cannot be (``lag=1``, torch.distributed, a grad scaler,
            a NaN born outside the modules) the tracer watches the next step.
        watch_forward: observe the model's forward (Python state only) to report GRAD_MODE
            mistakes and name the exact cause of a loss that cannot produce gradients.
        desync_every: under ``torch.distributed``, compare parameters across ranks every this
            many checks (and at the first check, and whenever a gradient is non-finite); 0: only then.
        rank_origin: for a DistributedDataParallel model, a communication hook notes each rank's
            gradients before the all-reduce, so NaN/inf is traced to the rank that produced it.
        grad_patience: a NO_GRAD or ZERO_GRAD unit that has never had a usable gradient is an
            error once it has gone this many consecutive checks without one; a unit that had
            gradients before is judged against its own past rate (an error once its gap is below
            1e-8 likely at that rate, and at least this long): see `gradhealth.judge.patience`.
            Tolerated gaps are reported at info level (LoRA's first step, LayerDrop, an expert
            that got no tokens, a branch used every other step).
        grad_sync: under ``torch.distributed``, where the replicated gradients are reduced:
            "auto" (default; a DDP wrapper, else inferred at the first check where every
            replicated gradient differs), "before_check" (DDP, or an all-reduce before check()),
            or "in_optimizer" (inside optimizer.step(), ZeRO-style: the replicas are compared on
            their parameters after each step): see `gradhealth.ranks.replicas`.
        experts: stacked experts (one tensor holding a layer's experts, as transformers 5 MoE layers
            and grouped-GEMM codebases store them) are judged per expert. None (default): found
            from the model (a parameter of a module named ``experts`` whose leading dimension is
            its ``num_experts`` or the config's expert count); a name pattern, a list of them
            (stacked along dimension 0), or ``{pattern: dimension}`` declares others; False: off.
        skip_nonfinite: the step guard: after a check with NaN/inf gradients, the next
            ``optimizer.step()`` changes nothing (parameters, moments and step counts stay exactly
            as they were), on every rank; each dropped step is a STEP_SKIPPED warning. Off by
            default: dropping a step changes the training asked for.
        skip_spikes: with a number k, the step guard also drops a step whose total gradient norm
            is more than k robust deviations (1.4826 MAD) above the median of the run's norm
            history (not with ``lag=1``); None: off.
        skip_alarm: this many dropped steps in a row make STEP_SKIPPED an error.
        lag: 0 (default): ``check()`` reads its numbers at once (one device-to-host transfer) and
            returns its own report. 1: deferred (`gradhealth.check.deferred`): ``check()`` never makes
            the host wait for the device; it returns the previous check's report (None at the
            first), ``flush()``/``close()`` deliver the last, and ``on_problem="raise"`` raises one
            check later.
    """

    on_problem: str = "warn"
    every_n_steps: int = 1
    sinks: Any = None  # None: no sinks (normalised to ()); a dump of the config round-trips
    expect_frozen: Any = None
    deltas: str = "auto"
    update_every: int = 100
    change_every: int = 8
    history: Any = True
    amp_skip_alarm: int = 3
    amp_scale_floor: float = 1.0
    trace_on_nonfinite: bool = True
    watch_forward: bool = True
    desync_every: int = 100
    rank_origin: bool = True
    grad_patience: int = 3
    experts: Any = None
    skip_nonfinite: bool = False
    skip_spikes: Any = None
    skip_alarm: int = 3
    grad_sync: str = "auto"
    lag: int = 0

    def __post_init__(self) -> None:
        fix = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)
        check_choice("on_problem", self.on_problem, ON_PROBLEM)
        check_positive_int("every_n_steps", self.every_n_steps)
        fix("sinks", _check_sinks(self.sinks))
        fix("expect_frozen", check_patterns(self.expect_frozen))
        if self.deltas == "sample":  # the former default's name: its job is done by "auto" now
            fix("deltas", "auto")
        check_choice("deltas", self.deltas, DELTA_MODES)
        check_positive_int("update_every", self.update_every)
        check_positive_int("change_every", self.change_every)
        fix("history", _check_history(self.history))
        check_positive_int("amp_skip_alarm", self.amp_skip_alarm)
        fix("amp_scale_floor", _check_float("amp_scale_floor", self.amp_scale_floor))
        for name in ("trace_on_nonfinite", "watch_forward", "rank_origin"):
            _check_bool(name, getattr(self, name))
        check_positive_int("desync_every", self.desync_every, minimum=0)
        check_positive_int("grad_patience", self.grad_patience)
        fix("experts", check_experts(self.experts))
        _check_bool("skip_nonfinite", self.skip_nonfinite)
        if self.skip_spikes is not None:
            fix("skip_spikes", _check_float("skip_spikes", self.skip_spikes))
            if not self.skip_spikes > 0:
                raise ValueError(f"skip_spikes must be a number > 0 (robust deviations above the median) or None; got {self.skip_spikes!r}")
        check_positive_int("skip_alarm", self.skip_alarm)
        check_choice("grad_sync", self.grad_sync, ("auto", "before_check", "in_optimizer"))
        check_choice("lag", self.lag, (0, 1))
        if self.lag and self.skip_spikes is not None:
            raise ValueError("skip_spikes needs the check's norms on the host before optimizer.step(); it cannot run with "
                             "lag=1 (a deferred check reads them one check later): use lag=0, or skip_nonfinite alone")

    @classmethod
    def check_keywords(cls, changes: dict) -> None:
        """A TypeError naming the unknown keywords and listing the known ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise TypeError(f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
                            f"the options are: {', '.join(sorted(known))}")

    @classmethod
    def build(cls, options: Options | None = None, **changes) -> Options:
        """``options`` (or the defaults) with ``changes``; an unknown keyword names the known ones."""
        cls.check_keywords(changes)
        if options is None:
            return cls(**changes)
        if not isinstance(options, Options):
            raise TypeError(f"options must be a gh.Options; got {type(options).__name__}")
        return dataclasses.replace(options, **changes) if changes else options

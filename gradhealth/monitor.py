"""``GradHealth``: the plain-loop monitor. One ``check()`` after ``loss.backward()``.

What a check does, in order: gather every gradient, reduce them (one fused kernel per device and
dtype), read the norms back together with this check's small extras (the loss, valid counts, the
previous optimizer step's update norms, the grad scaler's scale) in ONE transfer, re-check only
the tensors whose norm came back 0 or inf, classify, then judge: findings from the loss, the
forward's grad mode, stale gradients, the previous step's updates, the norm history, AMP. Then the
report goes to every sink, and last the policy warns or raises.

When the previous step's updates arrive: an optimizer step that follows check N is measured on
the device by the optimizer's own step hooks; its numbers travel in check N+1's transfer (or at
``flush()``/``close()``). They are then written into report N (``update_norm``,
``update_ratio``, and its findings NOT_UPDATED / FROZEN_BUT_CHANGED / AMP_SKIPPED), which sinks
receive through ``write_update(report)``; report N+1 carries the same findings as well, so the
policy acts on them at check N+1 at the latest.
"""

from __future__ import annotations

import copy
import fnmatch
import logging
import math
import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from . import distributed as _dist
from . import stats
from .classify import as_optimizers, decide, named_parameters, optimizer_param_ids, unwrap
from .deltas import DELTA_MODES, UpdateTracker
from .errors import GradHealthError, GradHealthInternalWarning, GradHealthWarning
from .guards import ForwardRecord, diagnose_loss
from .history import NormHistory, module_of
from .report import Finding, ParamMeta, Report, describe_groups, describe_names, group_by_module, is_problem
from .sinks import check_sinks
from .status import HINTS, Status
from .trace import NonFiniteTracer

__all__ = ["GradHealth", "ON_PROBLEM"]

ON_PROBLEM = ("warn", "raise", "ignore")
log = logging.getLogger("gradhealth")

_NORM_LAYERS = (nn.modules.dropout._DropoutNd, nn.modules.batchnorm._BatchNorm, nn.AlphaDropout)


def _check_choice(name: str, value, allowed: Sequence[str]) -> str:
    if value not in allowed:
        opts = ", ".join(repr(a) for a in allowed)
        raise ValueError(f"{name} must be one of {opts}; got {value!r}")
    return value


def _check_positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int; got {value!r}")
    return value


def _check_patterns(value) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = (value,)
    value = tuple(value)
    if not all(isinstance(v, str) for v in value):
        raise TypeError(f"expect_frozen must be a name pattern or a list of them (e.g. ['encoder.*']); got {value!r}")
    return value


def _check_scaler(scaler):
    if scaler is None:
        return None
    if not (hasattr(scaler, "get_scale") and hasattr(scaler, "_per_optimizer_states")):
        raise TypeError(f"scaler must be a torch.amp.GradScaler or None; got {type(scaler).__name__}")
    return scaler


class GradHealth:
    """Classify every parameter after each backward pass and report what is wrong.

    Args:
        model: the module being trained (DDP / torch.compile wrappers are unwrapped for names).
        optimizer: one optimizer, a list of them, or None (then NOT_IN_OPTIMIZER, deltas and
            STALE_GRAD are not available).
        on_problem: "warn" (one :class:`GradHealthWarning` per check with problems), "raise"
            (:class:`GradHealthError` after every sink got the report), or "ignore".
        every_n_steps: check only every n-th call of :meth:`check` (others return None at once,
            and the optimizer step after them is not measured).
        sinks: objects with ``write(report)`` (e.g. :class:`LoggingSink`, ``TensorBoardSink``);
            an optional ``write_update(report)`` receives a report again once its step's update
            norms are known.
        expect_frozen: name patterns (``fnmatch``, e.g. ``"encoder.*"``) of the parameters meant
            to be frozen. With it, a frozen parameter outside them, or a trainable one inside them,
            is an error finding (UNEXPECTED_FROZEN / UNEXPECTED_TRAINABLE).
        deltas: how the optimizer step's update ||Δθ|| is measured: "sample" (default, at most 2%
            extra memory), "exact" (a transient 1x copy of the parameters during the step) or "off".
        history: True (default baseline), False, or a :class:`NormHistory` to tune
            EXPLODING_GRAD / VANISHING_GRAD.
        scaler: a ``torch.amp.GradScaler``: norms are reported unscaled, and a step the scaler
            skips is AMP_SKIPPED, an alarm only after ``amp_skip_alarm`` skips in a row or when the
            scale falls below ``amp_scale_floor``.
        trace_on_nonfinite: when a check finds NaN/inf gradients, arm the NaN tracer for the next
            step, so the next report says where they were born (no hooks otherwise).
        watch_forward: observe the model's forward (Python state only) to report GRAD_MODE
            mistakes and name the exact cause of a loss that cannot produce gradients.
        desync_every: under ``torch.distributed``, compare parameters across ranks every this
            many checks (and at the first check, and whenever a gradient is non-finite); 0: only then.
        rank_origin: for a DistributedDataParallel model, a communication hook notes each rank's
            gradients before the all-reduce, so NaN/inf is traced to the rank that produced it.
        ddp_model: the DistributedDataParallel wrapper, when ``model`` is the module inside it
            (as in Lightning), for the rank-origin hook and ``no_sync`` deferral.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer=None,
        *,
        on_problem: str = "warn",
        every_n_steps: int = 1,
        sinks=(),
        expect_frozen=None,
        deltas: str = "sample",
        history=True,
        scaler=None,
        amp_skip_alarm: int = 3,
        amp_scale_floor: float = 1.0,
        trace_on_nonfinite: bool = True,
        watch_forward: bool = True,
        desync_every: int = 100,
        rank_origin: bool = True,
        ddp_model=None,
    ):
        self.model = model
        self._entries = named_parameters(model)
        self.optimizers = as_optimizers(optimizer)
        self.on_problem = _check_choice("on_problem", on_problem, ON_PROBLEM)
        self.every_n_steps = _check_positive_int("every_n_steps", every_n_steps)
        self.sinks = check_sinks(sinks)
        self.expect_frozen = _check_patterns(expect_frozen)
        self.deltas = _check_choice("deltas", deltas, DELTA_MODES)
        if history is True:
            history = NormHistory()
        elif history is False or history is None:
            history = None
        elif not isinstance(history, NormHistory):
            raise TypeError(f"history must be True, False or a gh.NormHistory; got {type(history).__name__}")
        self.history = history
        self.scaler = _check_scaler(scaler)
        self.amp_skip_alarm = _check_positive_int("amp_skip_alarm", amp_skip_alarm)
        self.amp_scale_floor = float(amp_scale_floor)
        self.trace_on_nonfinite = bool(trace_on_nonfinite)

        self._names = [n for n, _ in self._entries]
        self._params = [p for _, p in self._entries]
        self._pids = [id(p) for p in self._params]
        self._meta = {n: ParamMeta(p.numel(), str(p.dtype).replace("torch.", ""), str(p.device)) for n, p in self._entries}
        everything = list(range(len(self._entries)))
        self._all = _Selection(None, everything, self._names, self._group_modules(everything), None)
        self._selections: dict[int, _Selection] = {}
        self._ids_key: tuple | None = None
        self._ids: set[int] | None = None
        self._histories: dict[int, NormHistory] = {}
        self._history_template = copy.deepcopy(self.history)
        #: False silences this monitor's warnings (not its raises): on ranks other than zero
        self.emit_warnings = True
        self._calls = 0
        self._checks = 0
        self._closed = False
        self._broken_sinks: set[int] = set()
        self.last_report: Report | None = None

        # state carried from one check to the next
        self._armed_report: Report | None = None
        self._grad_refs: list | None = None
        self._last_scale: float | None = None
        self._amp_skips = 0
        self._valid: dict[str, Tensor] = {}
        self._forward: ForwardRecord | None = None
        self._eval_backward: ForwardRecord | None = None
        self._tracer: NonFiniteTracer | None = None
        self._trace_pending_from: int | None = None

        self.desync_every = desync_every if isinstance(desync_every, int) and desync_every >= 0 else _bad_desync(desync_every)
        self._distributed = _dist.active()
        # FSDP1 (FullyShardedDataParallel, use_orig_params=True) hands each rank a flat slice of
        # every gradient, whatever its shape: all of them count as shards
        self._all_sharded = self._distributed and _dist.fsdp1_sharded(model)
        self._world = _dist.world_size()
        self._coll_device = _dist.collective_device() if self._distributed else None
        if ddp_model is not None and not isinstance(ddp_model, nn.parallel.DistributedDataParallel):
            raise TypeError(f"ddp_model must be a torch.nn.parallel.DistributedDataParallel; got {type(ddp_model).__name__}")
        self._ddp = ddp_model if ddp_model is not None else (model if isinstance(model, nn.parallel.DistributedDataParallel) else None)
        self._origin = None
        if self._distributed and rank_origin and self._ddp is not None:
            try:
                self._origin = _dist.RankOrigin(self._ddp)
            except Exception as exc:  # e.g. the model already has a comm hook
                warnings.warn(f"gradhealth: no rank-origin hook on the DDP model ({exc}); NaN is not traced to a rank",
                              GradHealthInternalWarning, stacklevel=2)
        if self._distributed and _dist.rank() != 0:
            self.emit_warnings = False  # the same verdict is on every rank; rank 0 says it
        self._plan = None
        self._tracker = UpdateTracker(self._entries, self.optimizers, mode=self.deltas) if self.optimizers else None
        self._hooks = []
        if watch_forward:
            module = unwrap(model)
            self._dropout_like = [(n, m) for n, m in module.named_modules() if isinstance(m, _NORM_LAYERS)]
            self._hooks.append(model.register_forward_hook(self._on_forward))

    # ------------------------------------------------------------------ public
    def check(self, loss: Tensor | None = None, *, step: int | None = None, optimizer=None) -> Report | None:
        """Classify every parameter now (call after ``loss.backward()``).

        Returns the :class:`Report`, or None on a call that ``every_n_steps`` skips. ``loss``, when
        given, is judged too (can it produce gradients? is it finite?) in the same transfer.
        ``step`` overrides the monitor's own count of calls (e.g. a trainer's global step).
        ``optimizer`` (one of the monitor's) judges only that optimizer's parameters: the check
        before its step when several optimizers take turns (GANs, manual optimization).
        """
        report = self.measure(loss, step=step, optimizer=optimizer)
        if report is not None:
            self.publish(report, stacklevel=3)
        return report

    def measure(self, loss: Tensor | None = None, *, step: int | None = None, optimizer=None) -> Report | None:
        """The first half of :meth:`check`: build the report, send it nowhere yet.

        For integrations that add to a report before it is published (the Lightning callback's
        replay of a failing batch); :meth:`publish` then sends it to the sinks and the policy.
        """
        if self._closed:
            warnings.warn("gradhealth: check() on a closed monitor does nothing", GradHealthInternalWarning, stacklevel=3)
            return None
        if self._ddp is not None and not self._ddp.require_backward_grad_sync:
            return None  # inside no_sync(): gradients are local and partial; the synchronising step is checked
        s = self._calls if step is None else int(step)
        self._calls += 1
        if s % self.every_n_steps:
            if self._tracker is not None:
                self._tracker.disarm()  # the step after a skipped call is not measured
            return None
        try:
            report = self._build(s, loss, optimizer)
        except Exception as exc:  # the monitor never breaks a training run unless asked to raise
            if self.on_problem == "raise":
                raise
            warnings.warn(
                f"gradhealth: check at step {s} failed internally and was skipped ({type(exc).__name__}: {exc}); "
                "training continues",
                GradHealthInternalWarning,
                stacklevel=3,
            )
            return None
        self._checks += 1
        self.last_report = report
        return report

    def publish(self, report: Report, stacklevel: int = 2) -> None:
        """The second half of :meth:`check`: every sink gets the report, then the policy acts."""
        self._emit(report, stacklevel=stacklevel)

    def track_valid(self, mask: Tensor, name: str = "valid") -> None:
        """Record how many elements ``mask`` selects in this step (a device sum, no host sync).

        Read with the next check: its report's ``valid_counts[name]``, and EMPTY_VALID_SET if 0.
        Several calls with one name in a step (micro-batches) add up.
        """
        if not isinstance(mask, Tensor):
            raise TypeError(f"track_valid: mask must be a torch.Tensor; got {type(mask).__name__}")
        count = (mask if mask.dtype == torch.bool else mask != 0).sum()
        prev = self._valid.get(name)
        self._valid[name] = count if prev is None else prev + count.to(prev.device)

    def flush(self) -> None:
        """Fetch the last measured optimizer step now (one transfer) instead of at the next check."""
        if self._tracker is None or not self._tracker.pending:
            return
        pending, self._tracker.pending = self._tracker.pending, []
        values = stats.fetch([p.packed for p in pending])
        k = 0
        for p in pending:
            n = p.packed.numel()
            p.values = values[k : k + n]
            k += n
        self._apply_updates(pending, carry_to=None)

    def close(self) -> None:
        """Remove every hook this monitor installed; flush and close every sink. Idempotent."""
        if self._closed:
            return
        try:
            self.flush()
        except Exception as exc:
            warnings.warn(f"gradhealth: could not fetch the last step's updates: {exc}", GradHealthInternalWarning, stacklevel=2)
        self._closed = True
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self._tracker is not None:
            self._tracker.close()
        if self._tracer is not None:
            self._tracer.disarm()
        if self._origin is not None:
            self._origin.enabled = False  # DDP cannot unregister a comm hook: it only forwards now
        for sink in self.sinks:
            for method in ("flush", "close"):
                fn = getattr(sink, method, None)
                if callable(fn):
                    try:
                        fn()
                    except Exception as exc:
                        warnings.warn(f"gradhealth: {type(sink).__name__}.{method}() failed: {exc}", GradHealthInternalWarning, stacklevel=2)

    def __enter__(self) -> GradHealth:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def state_dict(self) -> dict:
        """The monitor's progress and norm history (plain Python, for checkpoints)."""
        return {
            "calls": self._calls,
            "checks": self._checks,
            "amp_skips": self._amp_skips,
            "history": self.history.state_dict() if self.history is not None else None,
        }

    def load_state_dict(self, state: dict) -> None:
        self._calls = int(state.get("calls", 0))
        self._checks = int(state.get("checks", 0))
        self._amp_skips = int(state.get("amp_skips", 0))
        if self.history is not None and state.get("history") is not None:
            self.history.load_state_dict(state["history"])

    @property
    def parameter_names(self) -> list[str]:
        return [n for n, _ in self._entries]

    @property
    def forward_record(self) -> ForwardRecord | None:
        """What the monitor saw when the model's forward last ran."""
        return self._forward

    def diagnose_loss(self, loss) -> str | None:
        """:func:`gh.guards.diagnose_loss` with what this monitor saw of the forward."""
        return diagnose_loss(loss, self.model, self._forward)

    # --------------------------------------------------------- forward watch
    def _on_forward(self, module, args, output) -> None:
        grad_on = torch.is_grad_enabled()
        inference = torch.is_inference_mode_enabled()
        evals = tuple(n for n, m in self._dropout_like if not m.training)
        record = ForwardRecord(grad_on, inference, module.training, evals)
        self._forward = record
        if grad_on and (not module.training or evals):
            # Flag it only if a backward really goes through this forward: a hook on the output
            # fires then, and never for validation forwards.
            for t in _first_grad_tensor(output):
                t.register_hook(lambda g, record=record: self._note_eval_backward(record))

    def _note_eval_backward(self, record: ForwardRecord) -> None:
        self._eval_backward = record

    # ---------------------------------------------------------------- internal
    def _selection(self, optimizer) -> _Selection:
        """Which parameters a check judges: all of them, or one optimizer's (cached)."""
        if optimizer is None:
            return self._all
        ids = [id(p) for g in optimizer.param_groups for p in g["params"]]
        sel = self._selections.get(id(optimizer))
        if sel is None or sel.ids != ids:
            if not any(optimizer is o for o in self.optimizers):
                raise ValueError("check(optimizer=...) must be one of the optimizers the monitor was given")
            members = set(ids)
            idx = [i for i, p in enumerate(self._params) if id(p) in members]
            sel = _Selection(ids, idx, [self._names[i] for i in idx], self._group_modules(idx), set(ids))
            self._selections[id(optimizer)] = sel
        return sel

    def _optimizer_ids(self) -> set[int] | None:
        """ids of every parameter in the optimizers, recomputed only when their groups change."""
        if not self.optimizers:
            return None
        key = tuple((id(g["params"]), len(g["params"])) for o in self.optimizers for g in o.param_groups)
        if key != self._ids_key:
            self._ids_key, self._ids = key, optimizer_param_ids(self.optimizers)
        return self._ids

    def _group_modules(self, idx: list[int]) -> list[tuple[str, list[int]]]:
        groups: dict[str, list[int]] = {}
        for i in idx:
            groups.setdefault(module_of(self._names[i]), []).append(i)
        return list(groups.items())

    def _history_for(self, optimizer) -> NormHistory | None:
        if self.history is None or optimizer is None:
            return self.history
        h = self._histories.get(id(optimizer))
        if h is None:
            h = self._histories[id(optimizer)] = copy.deepcopy(self._history_template)
        return h

    def _build(self, step: int, loss, optimizer=None) -> Report:
        entries = self._entries
        tracker = self._tracker
        sel = self._selection(optimizer)
        ids = sel.opt_ids if optimizer is not None else self._optimizer_ids()
        grads: list[Tensor] = []
        with_grad: list[int] = []
        params_all = self._params
        for i in sel.idx:
            g = params_all[i].grad
            if g is not None:
                grads.append(g)
                with_grad.append(i)
        sharded: set[int] = set()
        if self._distributed:
            for k, i in enumerate(with_grad):
                if self._all_sharded or _dist.is_sharded(grads[k]):
                    sharded.add(i)
                grads[k] = _dist.to_local(grads[k])

        # the extras that ride along in the one transfer
        extras: list[Tensor] = []
        loss_t = loss.detach().reshape(1) if isinstance(loss, Tensor) and loss.numel() == 1 else None
        if loss_t is not None:
            extras.append(loss_t)
        valid_names = list(self._valid)
        extras += [self._valid[n].reshape(1) for n in valid_names]
        pending = []
        stale: set[int] = set()
        steps_ran = None
        if tracker is not None:
            tracker.clear_grad_hooks()
            stale = tracker.take_stale()
            pending, tracker.pending = tracker.pending, []
            extras += [p.packed for p in pending]
            steps_ran = tracker.steps_since_check
        scale_t = None
        if self.scaler is not None and self.scaler.is_enabled() and getattr(self.scaler, "_scale", None) is not None:
            scale_t = self.scaler._scale
            extras.append(scale_t.reshape(1))

        local_error: BaseException | None = None
        try:
            norms, extra, self._plan = stats.grad_norms(grads, extras, self._plan)

            k = 0
            loss_value = None
            if loss_t is not None:
                loss_value, k = extra[0], 1
            valid_counts = {n: int(extra[k + j]) for j, n in enumerate(valid_names)}
            k += len(valid_names)
            for p in pending:
                n = p.packed.numel()
                p.values = extra[k : k + n]
                k += n
            scale = extra[k] if scale_t is not None else None

            if scale is not None:
                norms = self._unscale(norms, with_grad, scale)

            norm_of: list[float | None] = [None] * len(entries)
            for i, v in zip(with_grad, norms):
                norm_of[i] = v
            local_flags = self._local_flags(loss, stale)
        except Exception as exc:
            if not self._distributed:
                raise
            # Never leave the other ranks waiting in the collective: join it with an empty
            # contribution and a failure flag, so every rank gives up on this check together.
            local_error = exc
            norms, loss_value, scale = [], None, None
            valid_counts = {n: 0 for n in valid_names}
            for p in pending:
                p.values = [0.0] * (3 * len(p.indices))
            norm_of = [None] * len(entries)
            local_flags = {"loss_cause": None, "eval": None, "stale": set()}
        finally:
            self._valid = {}
        across = None
        if self._distributed:
            across = self._reduce(sel, norm_of, sharded, loss_value, valid_counts, pending, local_flags,
                                  failed=local_error is not None)
            if across["failed"]:
                ranks = _dist.ranks_of(across["failed"], self._world)
                here = f": {type(local_error).__name__}: {local_error}" if local_error is not None else ""
                raise RuntimeError(f"the check failed on rank(s) {ranks or 'some'}{here}; every rank skips it")
            norm_of, loss_value, valid_counts = across["norm_of"], across["loss"], across["valid"]
            with_grad = [i for i in sel.idx if norm_of[i] is not None]
            norms = [norm_of[i] for i in with_grad]
        names, params, pids = self._names, self._params, self._pids
        status: dict[str, Status] = dict.fromkeys(sel.names, Status.OK)
        in_opt: dict[str, bool] | None = dict.fromkeys(sel.names, True) if ids is not None else None
        inf = math.inf
        nonfinite = False
        not_ok: list[str] = []
        for i in sel.idx:
            p = params[i]
            v = norm_of[i]
            inside = ids is None or pids[i] in ids
            if inside and v is not None and 0.0 < v < inf and p.requires_grad:
                continue  # OK, the common case, without the full decision tree
            if not inside:
                in_opt[names[i]] = False
            state = decide(p.requires_grad, v, inside)
            if state is not Status.OK:
                status[names[i]] = state
                not_ok.append(names[i])
            nonfinite = nonfinite or state is Status.NON_FINITE_GRAD
        grad_norm = {names[i]: v for i, v in zip(with_grad, norms)}
        total = math.hypot(*norms) if norms else 0.0
        if total == inf and any(math.isnan(v) for v in norms):
            total = math.nan  # hypot says inf when an inf and a NaN meet; the norm is NaN

        report = Report(
            step=step,
            status=status,
            grad_norm=grad_norm,
            total_grad_norm=total,
            meta=self._meta,
            in_optimizer=in_opt,
            loss=loss_value,
            valid_counts=valid_counts,
            not_ok=not_ok,
        )

        # the previous step: its updates, or why it did not run
        if steps_ran:
            self._amp_skips = 0
        if pending:
            self._apply_updates(pending, carry_to=report)
        elif self._armed_report is not None and steps_ran == 0:
            self._judge_missing_step(report, scale)
        self._judge_amp(report, scale, nonfinite)
        if across is not None:
            self._judge_ranks(report, across, local_flags)
        else:
            if local_flags["loss_cause"] is not None:
                self._judge_loss(report, local_flags["loss_cause"])
            self._judge_forward(report, local_flags["eval"])
            self._judge_stale(report, stale)
        self._judge_empty(report, valid_counts, norms)
        self._judge_frozen(report)
        self._judge_trace(report, nonfinite)
        if across is not None and self._desync_due(nonfinite):
            self._judge_desync(report, sel)
        report.module_grad_norm = self._module_norms(norm_of, sel.modules)
        history = self._history_for(optimizer)
        if history is not None:
            report.findings += history.update(step, total, report.module_grad_norm)

        # arm the next optimizer step
        if tracker is not None:
            tracker.arm(step, [optimizer] if optimizer is not None else self.optimizers)
            self._armed_report = report
            # A few witnesses suffice: zero_grad resets every gradient of an optimizer at once.
            self._grad_refs = [(i, weakref.ref(entries[i][1].grad), entries[i][1].grad._version) for i in with_grad[:: max(1, len(with_grad) // 8)]]
        self._last_scale = scale
        return report

    def _unscale(self, norms: list[float], with_grad: list[int], scale: float) -> list[float]:
        """Divide by the scaler's scale, except for optimizers whose gradients were unscaled."""
        from torch.amp.grad_scaler import OptState

        unscaled: set[int] = set()
        states = self.scaler._per_optimizer_states
        for opt in self.optimizers:
            st = states.get(id(opt)) if hasattr(states, "get") else None
            if st is not None and st.get("stage") in (OptState.UNSCALED, OptState.STEPPED):
                unscaled |= {id(p) for g in opt.param_groups for p in g["params"]}
        if not scale:
            return norms
        return [v if id(self._entries[i][1]) in unscaled else v / scale for i, v in zip(with_grad, norms)]

    def _module_norms(self, norm_of: list[float | None], groups) -> dict[str, float]:
        out = {}
        for module, idx in groups:
            vs = [norm_of[i] for i in idx if norm_of[i] is not None]
            if vs:
                h = vs[0] if len(vs) == 1 else math.hypot(*vs)
                if h == math.inf and any(math.isnan(v) for v in vs):
                    h = math.nan  # hypot says inf when an inf and a NaN meet
                out[module] = h
        return out

    def _apply_updates(self, pending, carry_to: Report | None) -> None:
        """Write measured update norms into the report of their step, judge them, tell sinks."""
        target = self._armed_report
        if target is None:
            return
        names = self._entries
        changed_ok_missing: list[str] = []
        frozen_moved: list[str] = []
        for p in pending:
            upd, before, changed = p.unpack(self._tracker.sample_scale(p.indices))
            for i, u, b, c in zip(p.indices, upd, before, changed):
                name = names[i][0]
                target.update_norm[name] = u if c else 0.0
                target.update_ratio[name] = (u / b if b > 0 else math.inf) if c else 0.0
                state = target.status.get(name)
                if state is Status.OK and not c:
                    changed_ok_missing.append(name)
                elif state is Status.FROZEN and c:
                    frozen_moved.append(name)
        new: list[Finding] = []
        if changed_ok_missing:
            chosen = set(changed_ok_missing)
            new.append(
                Finding("NOT_UPDATED", f"{describe_names(target.status, chosen)} had "
                        f"finite, non-zero gradients at step {target.step} yet optimizer.step() left them unchanged: "
                        "a learning rate of 0 (check the scheduler), an update rule that does nothing, or a step "
                        "that was skipped", params=tuple(changed_ok_missing), step=target.step)
            )
        if frozen_moved:
            chosen = set(frozen_moved)
            new.append(
                Finding("FROZEN_BUT_CHANGED", f"{describe_names(target.status, chosen)} "
                        f"are frozen but optimizer.step() moved them at step {target.step}: weight decay or momentum "
                        "still acts on frozen parameters left in the optimizer; build the optimizer from the "
                        "trainable parameters only ([p for p in model.parameters() if p.requires_grad])",
                        params=tuple(frozen_moved), step=target.step)
            )
        self._deliver(target, new, carry_to)

    def _deliver(self, target: Report, new: list[Finding], carry_to: Report | None) -> None:
        target.findings.extend(new)
        if carry_to is not None and carry_to is not target:
            carry_to.findings.extend(new)
        self._armed_report = None
        for i, sink in enumerate(self.sinks):
            fn = getattr(sink, "write_update", None)
            if callable(fn):
                self._safe_sink_call(i, sink, fn, target)

    # ------------------------------------------------------------ across ranks
    def _local_flags(self, loss, stale: set[int]) -> dict:
        """This rank's own observations that are not numbers of the parameters."""
        rec, self._eval_backward = self._eval_backward, None
        cause = diagnose_loss(loss, self.model, self._forward) if loss is not None else None
        return {"loss_cause": cause, "eval": rec, "stale": stale}

    def _reduce(self, sel, norm_of, sharded, loss_value, valid_counts, pending, flags, failed: bool = False) -> dict:
        """Pack this rank's numbers, all_reduce(SUM) once, unpack the same verdict on every rank."""
        world, me = self._world, _dist.rank()
        b = _dist.bit(me)
        inv = 1.0 / world
        idx = sel.idx
        # per parameter, vectorised: squared norms (summed over shards, averaged over replicas),
        # has-a-gradient, non-finite here, non-zero here
        raw = [norm_of[i] for i in idx]
        v = torch.tensor([0.0 if x is None else x for x in raw], dtype=torch.float64)
        has = torch.tensor([0.0 if x is None else 1.0 for x in raw], dtype=torch.float64)
        weight = torch.tensor([1.0 if i in sharded else inv for i in idx], dtype=torch.float64)
        per_param = [v * v * weight, has, (~torch.isfinite(v)).to(torch.float64), (v != 0).to(torch.float64)]
        vals: list[float] = []
        pre = self._origin.take([self._params[i] for i in idx]) if self._origin is not None else None
        has_pre = 1.0 if pre is not None else 0.0
        pre_bad, pre_zero = pre if pre is not None else ([0.0] * len(idx), [0.0] * len(idx))
        per_param += [torch.tensor(pre_bad, dtype=torch.float64) * b, torch.tensor(pre_zero, dtype=torch.float64) * b]
        vals.append(has_pre)
        loss_ok = loss_value is not None
        vals += [loss_value * inv if loss_ok and math.isfinite(loss_value) else 0.0,
                 b if loss_ok and not math.isfinite(loss_value) else 0.0, 1.0 if loss_ok else 0.0]
        names = sorted(valid_counts)
        vals += [float(valid_counts[n]) for n in names] + [b if valid_counts[n] == 0 else 0.0 for n in names]
        vals += [b if flags["loss_cause"] else 0.0, b if flags["eval"] is not None else 0.0, b if flags["stale"] else 0.0]
        for p in pending:  # [update norm, param norm, changed] per parameter of the step
            n = len(p.indices)
            w = [1.0 if i in sharded else inv for i in p.indices]
            v = p.values
            vals += [v[k] * v[k] * w[k] for k in range(n)] + [v[n + k] * v[n + k] * w[k] for k in range(n)] + v[2 * n : 3 * n]
        vals.append(b if failed else 0.0)
        packed = torch.cat(per_param + [torch.tensor(vals, dtype=torch.float64)])
        reduced = _dist.all_reduce_tensor(packed, self._coll_device)
        n = len(idx)
        if float(reduced[-1]) > 0:
            return {"failed": float(reduced[-1])}
        sq, has_r, bad, nz = reduced[:n], reduced[n : 2 * n], reduced[2 * n : 3 * n], reduced[3 * n : 4 * n]
        norm = torch.where(bad > 0, torch.where(torch.isfinite(sq), torch.full_like(sq, math.inf), sq),
                           torch.where(nz == 0, torch.zeros_like(sq), sq.sqrt().clamp(min=5e-324)))
        norm_list, has_list = norm.tolist(), has_r.tolist()
        out = reduced[4 * n :].tolist()
        pre_bad, pre_zero, has_pre = out[:n], out[n : 2 * n], out[2 * n]
        k = 2 * n + 1
        loss_sum, loss_bad, loss_n = out[k : k + 3]
        k += 3
        valid = {name: int(round(out[k + j])) for j, name in enumerate(names)}
        empty_masks = {name: out[k + len(names) + j] for j, name in enumerate(names)}
        k += 2 * len(names)
        cause_mask, eval_mask, stale_mask = out[k : k + 3]
        k += 3
        for p in pending:
            n2 = len(p.indices)
            seg = out[k : k + 3 * n2]
            p.values = [math.sqrt(x) for x in seg[: 2 * n2]] + [1.0 if x > 0 else 0.0 for x in seg[2 * n2 :]]
            k += 3 * n2
        new_norm: list[float | None] = [None] * len(norm_of)
        for j, i in enumerate(idx):
            if has_list[j] > 0:
                new_norm[i] = norm_list[j]
        loss = None
        if loss_n > 0:
            loss = math.nan if loss_bad > 0 else loss_sum * world / loss_n
        return {"failed": 0.0, "norm_of": new_norm, "loss": loss, "valid": valid, "empty_masks": empty_masks, "loss_bad": loss_bad,
                "pre_bad": pre_bad, "pre_zero": pre_zero, "has_pre": has_pre, "masks": (cause_mask, eval_mask, stale_mask),
                "idx": idx, "world": world}

    def _judge_ranks(self, report: Report, across: dict, flags: dict) -> None:
        """Findings from what single ranks saw, the same on every rank."""
        world = across["world"]

        def where(mask: float) -> str:
            ranks = _dist.ranks_of(mask, world)
            return f" (on rank{'s' if len(ranks) != 1 else ''} {', '.join(map(str, ranks))})" if ranks else " (on some ranks)"

        cause_mask, eval_mask, stale_mask = across["masks"]
        if cause_mask:
            self._judge_loss(report, flags["loss_cause"] or "see that rank's warning", where(cause_mask))
        if eval_mask:
            rec = flags["eval"] or ForwardRecord(True, False, False, ())
            self._judge_forward(report, rec, where(eval_mask))
        if stale_mask:
            stale = flags["stale"] or {i for i in across["idx"] if self._names[i] in report.status}
            self._judge_stale(report, stale, where(stale_mask))
        names = self._names
        if across["has_pre"] > 0:
            bad = {names[i]: m for i, m in zip(across["idx"], across["pre_bad"]) if m > 0}
            if bad:
                masks = set(bad.values())
                ranks = sorted({r for m in masks for r in _dist.ranks_of(m, world)})
                report.findings.append(Finding(
                    "NONFINITE_RANK", f"the non-finite gradients were produced on rank{'s' if len(ranks) != 1 else ''} "
                    f"{', '.join(map(str, ranks))} before DDP's all-reduce spread them to every rank "
                    f"({describe_names(report.status, bad)}): look at that rank's batch",
                    params=tuple(bad), step=report.step, data={"ranks": ranks}))
            partly = {names[i]: m for i, m in zip(across["idx"], across["pre_zero"])
                      if 0 < m and report.status.get(names[i]) not in (Status.NO_GRAD, Status.ZERO_GRAD, Status.FROZEN)}
            if partly:
                ranks = sorted({r for m in partly.values() for r in _dist.ranks_of(m, world)})
                report.findings.append(Finding(
                    "PARTIALLY_USED", f"{describe_names(report.status, partly)} got no "
                    f"gradient on rank{'s' if len(ranks) != 1 else ''} {', '.join(map(str, ranks))} (DDP zero-filled "
                    "their part before averaging): used by some ranks' batches only, not a dead layer",
                    params=tuple(partly), level="info", step=report.step, data={"ranks_without": ranks}))
            dead = {names[i] for i, m in zip(across["idx"], across["pre_zero"])
                    if report.status.get(names[i]) is Status.ZERO_GRAD and len(_dist.ranks_of(m, world)) == world}
            if dead:
                report.findings.append(Finding(
                    "PARTIALLY_USED", f"{describe_names(report.status, dead)}: zero on "
                    "every rank before the all-reduce: DDP zero-filled them, no rank used them in this step",
                    params=tuple(sorted(dead)), level="info", step=report.step))
        empties = {n: m for n, m in across["empty_masks"].items() if m > 0 and across["valid"].get(n)}
        for n, m in empties.items():  # empty on some ranks only: the global count hides it
            report.findings.append(Finding(
                "EMPTY_VALID_SET", f"the valid mask {n!r} selected nothing{where(m)} at step {report.step}: that rank's "
                "mean over it is NaN or 0 and DDP averages it into every rank's gradients; skip such batches or use "
                "gh.masked_mean(..., empty='zero')", step=report.step))

    def _desync_due(self, nonfinite: bool) -> bool:
        return self._checks == 0 or nonfinite or (self.desync_every > 0 and self._checks % self.desync_every == 0)

    def _judge_desync(self, report: Report, sel) -> None:
        """Compare a fingerprint of every replicated parameter across ranks (one all_gather)."""
        idx = [i for i in sel.idx if not _dist.is_sharded(self._params[i])]
        if not idx:
            return
        local = [_dist.to_local(self._params[i]).detach() for i in idx]
        with torch.no_grad():
            sums = torch.stack([t.sum(dtype=torch.float32) if t.numel() else torch.zeros((), device=t.device) for t in local])
            norms = torch.stack(torch._foreach_norm(local)).to(sums.dtype)
        fp = torch.cat([sums, norms]).double().tolist()
        rows = _dist.all_gather(fp, self._coll_device)
        n = len(idx)
        differ: dict[str, list[int]] = {}
        for j, i in enumerate(idx):
            ref = (rows[0][j], rows[0][n + j])
            odd = [r for r, row in enumerate(rows) if (row[j], row[n + j]) != ref and not (math.isnan(row[j]) and math.isnan(ref[0]))]
            if odd:
                differ[self._names[i]] = odd
        if differ:
            ranks = sorted({r for rs in differ.values() for r in rs})
            report.findings.append(Finding(
                "DESYNC", f"{describe_names(report.status, differ)} differ between "
                f"rank 0 and rank{'s' if len(ranks) != 1 else ''} {', '.join(map(str, ranks))}: the replicas have drifted "
                "apart (a parameter changed on one rank only, a different initialisation seed, a non-deterministic "
                "update, or a skipped all-reduce); broadcast from rank 0 or fix the code that changes one rank",
                params=tuple(differ), step=report.step, data={"ranks": differ}))

    def _judge_missing_step(self, report: Report, scale: float | None) -> None:
        """No optimizer step ran since the previous check. Fine while accumulating; a skipped
        step if that check's gradients were thrown away (zeroed or set to None) meanwhile."""
        prev = self._armed_report
        refs = self._grad_refs or []
        entries = self._entries
        discarded = False
        for i, ref, version in refs:
            g = entries[i][1].grad
            if g is None or g is not ref() or g._version > version + 1:
                discarded = True
                break
        if not discarded:
            return  # gradient accumulation: several backwards, then one step
        if self.scaler is not None:
            # The scaler skipped it (inf/NaN in the scaled gradients): already said as AMP_SKIPPED
            # in that step's report when the check saw the overflow; count it, and say it now
            # if that check did not see it.
            self._amp_skips += 1
            if not prev.findings_of("AMP_SKIPPED") and scale is not None and self._last_scale is not None and scale < self._last_scale:
                self._deliver(prev, [self._amp_finding(prev.step, scale, self._amp_skips)], report)
            else:
                self._armed_report = None
            return
        ok = [n for n, s in prev.status.items() if s is Status.OK]
        if not prev.grads_finite:
            self._armed_report = None  # skipping a step with NaN/inf gradients is the right reaction
            return
        if ok and any(prev.in_optimizer.get(n) for n in ok):
            chosen = {n for n in ok if prev.in_optimizer.get(n)}
            f = Finding("NOT_UPDATED", f"{describe_names(prev.status, chosen)} had "
                        f"gradients at step {prev.step} but no optimizer.step() ran before they were zeroed: the "
                        "step was skipped (a condition around optimizer.step(), or an exception swallowed)",
                        params=tuple(sorted(chosen, key=list(prev.status).index)), step=prev.step)
            self._deliver(prev, [f], report)
        else:
            self._armed_report = None

    def _amp_finding(self, step: int, scale: float, consecutive: int) -> Finding:
        alarm = consecutive >= self.amp_skip_alarm
        return Finding(
            "AMP_SKIPPED",
            f"the grad scaler skips optimizer.step() at step {step}: inf/NaN in the scaled gradients at scale {scale:g}"
            + (f", {consecutive} steps in a row: the model itself produces non-finite gradients, not an fp16 "
               "overflow the scaler can absorb (trace it with gh.trace_nonfinite)" if alarm
               else "; expected now and then while the scale settles"),
            step=step, level="error" if alarm else "info", data={"scale": scale, "consecutive": consecutive},
        )

    def _judge_amp(self, report: Report, scale: float | None, nonfinite: bool) -> None:
        if self.scaler is None or scale is None:
            return
        if nonfinite:
            report.findings.append(self._amp_finding(report.step, scale, self._amp_skips + 1))
        if scale < self.amp_scale_floor:
            report.findings.append(Finding("AMP_SKIPPED", f"the grad scaler's scale collapsed to {scale:g} (floor "
                                           f"{self.amp_scale_floor:g}): nearly every step overflows; the model produces "
                                           "non-finite gradients at any scale", step=report.step, data={"scale": scale}))

    def _judge_loss(self, report: Report, cause: str, where: str = "") -> None:
        report.findings.append(Finding("GRAD_MODE", f"loss cannot produce gradients{where}: {cause}", step=report.step))

    def _judge_empty(self, report: Report, valid_counts: dict[str, int], norms: list[float]) -> None:
        empty = [n for n, c in valid_counts.items() if c == 0]
        if empty:
            report.findings.append(
                Finding("EMPTY_VALID_SET", f"the valid mask {', '.join(repr(n) for n in empty)} selected nothing at step "
                        f"{report.step}: a mean over it is NaN (or 0 with a guarded mean) and the step still moves the "
                        "weights through weight decay and momentum; skip such batches or use gh.masked_mean(..., "
                        "empty='zero')", step=report.step, data={"counts": valid_counts})
            )
            return
        if report.loss is None or math.isfinite(report.loss):
            return
        if norms and all(v == 0.0 for v in norms):
            report.findings.append(
                Finding("EMPTY_VALID_SET", f"the loss is {report.loss} while every gradient is exactly zero at step "
                        f"{report.step}: the signature of a mean over an empty selection (a mask that selected "
                        "nothing, a cross-entropy whose targets are all ignore_index). The step still moves the "
                        "weights through weight decay; skip such batches or use gh.masked_mean(..., empty='zero'), "
                        "and call monitor.track_valid(mask) to see the counts", step=report.step)
            )
        else:
            report.findings.append(
                Finding("NON_FINITE_LOSS", f"the loss is {report.loss}: check the inputs and targets of this batch, a "
                        "log or division inside the loss, or a mean over an empty mask (gh.masked_mean makes the "
                        "empty case explicit)", step=report.step)
            )

    def _judge_forward(self, report: Report, rec: ForwardRecord | None, where: str = "") -> None:
        if rec is None:
            return
        if not rec.training:
            what = "the model was in eval() mode during the training forward"
        else:
            what = f"submodules {', '.join(rec.eval_modules[:5])}{' ...' if len(rec.eval_modules) > 5 else ''} were in eval() mode during the training forward"
        report.findings.append(
            Finding("GRAD_MODE", f"{what}{where}: dropout is off and batch norm uses (and no longer updates) its running "
                    "statistics. Call model.train() after validation, before training resumes", step=report.step,
                    params=rec.eval_modules)
        )

    def _judge_stale(self, report: Report, stale: set[int], where: str = "") -> None:
        if not stale:
            return
        chosen = {self._entries[i][0] for i in stale if self._entries[i][0] in report.status}
        report.findings.append(
            Finding("STALE_GRAD", f"{describe_names(report.status, chosen)}{where}: this "
                    "backward added onto gradients that optimizer.step() had already used (no zero_grad in between), "
                    "so every step applies the sum of all past gradients. Call optimizer.zero_grad() before each "
                    "backward (or after each step)", params=tuple(n for n in report.status if n in chosen),
                    step=report.step)
        )

    def _judge_trace(self, report: Report, nonfinite: bool) -> None:
        tracer = self._tracer
        if tracer is not None and tracer.armed:
            tracer.resolve()
            origin = tracer.forward_origin or tracer.backward_origin
            report.findings.append(
                Finding("NONFINITE_ORIGIN", f"traced at step {report.step} after NaN/inf gradients at step "
                        f"{self._trace_pending_from}: {tracer.explain()}", level="error" if origin else "info",
                        step=report.step, data={"forward_origin": tracer.forward_origin,
                                                "backward_origin": tracer.backward_origin,
                                                "op": tracer.backward_op, "source": tracer.op_source}),
            )
            self._tracer = None
        elif nonfinite and self.trace_on_nonfinite and self.scaler is None:
            self._tracer = NonFiniteTracer(self.model).arm()
            self._trace_pending_from = report.step

    def _judge_frozen(self, report: Report) -> None:
        frozen = [n for n, s in report._odd() if s is Status.FROZEN]
        if self._checks == 0 and frozen:
            rows = group_by_module(report.status, lambda n, s: s is Status.FROZEN)
            trainable = len(report.status) - len(frozen)
            log.info("%s frozen; %d of %d trainable", describe_groups(rows), trainable, len(report.status))
        if self.expect_frozen is None:
            return
        pats = self.expect_frozen

        def expected(name: str) -> bool:
            return any(fnmatch.fnmatchcase(name, p) for p in pats)

        wrong_frozen = tuple(n for n in frozen if not expected(n))
        wrong_trainable = tuple(n for n, s in report.status.items() if s is not Status.FROZEN and expected(n))
        if wrong_frozen:
            chosen = set(wrong_frozen)
            report.findings.append(
                Finding("UNEXPECTED_FROZEN", f"{describe_names(report.status, chosen)} "
                        f"frozen but not matched by expect_frozen={list(pats)}: unfreeze them (requires_grad_(True)) "
                        "or add them to expect_frozen", params=wrong_frozen, step=report.step)
            )
        if wrong_trainable:
            chosen = set(wrong_trainable)
            report.findings.append(
                Finding("UNEXPECTED_TRAINABLE", f"{describe_names(report.status, chosen)} "
                        f"match expect_frozen={list(pats)} but are trainable: freeze them (requires_grad_(False)) or "
                        "change expect_frozen", params=wrong_trainable, step=report.step)
            )

    # ------------------------------------------------------------------ policy
    def _safe_sink_call(self, i: int, sink, fn, report: Report, stacklevel: int = 4) -> None:
        try:
            fn(report)
        except Exception as exc:
            if self.on_problem == "raise":
                raise
            if i not in self._broken_sinks:
                self._broken_sinks.add(i)
                warnings.warn(
                    f"gradhealth: sink {type(sink).__name__} failed ({type(exc).__name__}: {exc}); its reports are "
                    "lost, training continues",
                    GradHealthInternalWarning,
                    stacklevel=stacklevel,
                )

    def alarm(self, report: Report) -> bool:
        """Whether the policy acts on this report: any problem or error finding, except gradients
        that overflowed under a grad scaler which will skip the step (AMP_SKIPPED, info level)."""
        if report.ok:
            return False
        if any(f.level == "error" for f in report.findings):
            return True
        amp_expected = any(f.kind == "AMP_SKIPPED" and f.level == "info" and f.step == report.step for f in report.findings)
        return not (amp_expected and set(report.problems.values()) == {Status.NON_FINITE_GRAD})

    def _emit(self, report: Report, stacklevel: int) -> None:
        for i, sink in enumerate(self.sinks):
            self._safe_sink_call(i, sink, sink.write, report, stacklevel + 2)
        alarm = self.alarm(report)
        loud = any(f.level == "warning" for f in report.findings)
        if (not alarm and not loud) or self.on_problem == "ignore":
            return
        message = self.explain(report)
        if self.on_problem == "raise" and alarm:
            raise GradHealthError(message, report)
        if self.emit_warnings:
            warnings.warn(message, GradHealthWarning, stacklevel=stacklevel + 1)

    @staticmethod
    def explain(report: Report) -> str:
        """The warning text: problems grouped by module, each with its usual causes and fix."""
        lines = [f"gradhealth step {report.step}: {report.headline()}"]
        by_state: dict[Status, list] = {}
        for row in group_by_module(report.status, is_problem):
            by_state.setdefault(row[2], []).append(row)
        for state, rows in by_state.items():
            lines.append(f"  {state.value}: {describe_groups(rows)} {HINTS[state]}")
        for f in report.findings:
            if f.level != "info":
                lines.append(f"  {f.kind}: {f.message}")
        return "\n".join(lines)


@dataclass
class _Selection:
    ids: list[int] | None  # the optimizer's parameter ids, in order (None: every parameter)
    idx: list[int]  # entry indices judged
    names: list[str]
    modules: list[tuple[str, list[int]]]
    opt_ids: set[int] | None


def _bad_desync(value):
    raise ValueError(f"desync_every must be an int >= 0; got {value!r}")


def _first_grad_tensor(output) -> list[Tensor]:
    if isinstance(output, Tensor):
        return [output] if output.requires_grad else []
    items = output.values() if isinstance(output, dict) else output if isinstance(output, (list, tuple)) else ()
    for o in items:
        found = _first_grad_tensor(o)
        if found:
            return found
    return []

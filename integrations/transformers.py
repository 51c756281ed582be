"""Hugging Face ``Trainer`` adapter: ``GradHealthCallback``, a thin shell over :class:`gradhealth.GradHealth`.

    from gradhealth.integrations.transformers import GradHealthCallback
    trainer = Trainer(model, args, ..., callbacks=[GradHealthCallback()])

Step numbers are Trainer's: the check before the optimizer step that makes ``state.global_step``
N is step N, the step at which Trainer logs it (gradhealth's warnings, the logged metrics and the
dashboards agree).

Where each check runs (once per optimizer step, after gradient accumulation):

* at the end of the backward pass of the last micro-batch of the step (an autograd engine
  callback queued from the loss Trainer backpropagates, whatever ``compute_loss`` built it from:
  ``outputs.loss``, TRL's loss from the logits, a custom one; after DDP's own gradient
  reduction): the loss judged is that one, and the gradients
  are complete and not clipped yet. Every number is **pre-clip**, and under fp16 **unscaled**
  (the scaler Accelerate's optimizer wrapper carries). Clipping first would hide the answer:
  ``clip_grad_norm_`` multiplies every gradient by ``max_norm / total``, so one inf gradient
  makes all the others exactly 0 and one NaN makes them all NaN;
* Trainer's clip (``max_grad_norm``) runs through ``monitor.clip_grad_norm_`` with that check's
  norms (``accelerator.clip_grad_norm_`` routed by :func:`gradhealth.integrations.accelerate.share_clip`
  for the run, undone at its end): the gradients are read once, Trainer's ``grad_norm`` is the
  same number, ``gradhealth/clip_coef`` says whether it bit;
* ``on_pre_optimizer_step`` (after Trainer's clipping, before the step): the report is
  published (sinks, warning, raise). When the model's forward was never seen (a custom loop
  that bypasses the model's ``__call__``), the check runs here instead, on clipped gradients,
  and its report carries a ``POSTCLIP`` info finding saying so;
* the optimizer's own step hooks measure the update, reported with the metrics;
* when a check finds NaN/inf gradients (``replay_on_nonfinite``), the micro-batches of that step
  are replayed one by one from their own inputs and random states, under the NaN tracer and the
  autocast they ran in, until one makes the NaN again; the report gets a NONFINITE_ORIGIN finding
  naming that micro-batch, where the NaN was born, and whether it reproduced. Parameters,
  gradients, buffers and random state are put back: training goes on as without the replay.

Numbers in the logs: Trainer's ``grad_norm`` is the pre-clip total over the parameters it clips
(``model.parameters()``); ``gradhealth/grad_norm_preclip/total`` is the same quantity over the
parameters gradhealth watches (equal for a plain model). Post-clip norms are
``min(1, max_grad_norm / grad_norm)`` times these. Update norms (``gradhealth/update_norm/...``)
are what the optimizer really applied, after clipping.

Metrics reach every ``report_to`` backend (TensorBoard, W&B, MLflow, ...) through Trainer's own
logging: at each logging step the latest check's keys (the scheme of :mod:`gradhealth.publish.metrics`,
the same public keys as the Lightning callback) are merged into the ``logs`` dict of ``on_log``,
on the main process only (and into ``trainer.state.log_history``). Trainer calls the reporting callbacks before user callbacks, so at
``on_train_begin`` this callback moves itself just before them in Trainer's callback list. A
check with a problem or a warning also asks Trainer to log that step (``control.should_log``).

``on_problem``: "warn" (a :class:`gradhealth.GradHealthWarning`, training goes on), "stop" (the
warning, then ``control.should_training_stop``: Trainer finishes that optimizer step and ends
training normally, saving as configured), "raise" (a :class:`gradhealth.GradHealthError` from
``on_pre_optimizer_step``: ``trainer.train()`` raises before the faulty step is applied), or
"ignore".

State: the callback is an ``ExportableState``. Its monitor's whole state rides in every
checkpoint's ``trainer_state.json`` and are restored by ``resume_from_checkpoint`` (whatever
``restore_callback_states_from_checkpoint`` says; with it True, Trainer rebuilds the callback
from its saved options, which cannot include ``sinks``: pass sinks through ``report_to``).
"""

from __future__ import annotations

import dataclasses
import weakref
import warnings
from typing import Any

import torch
from torch.autograd import Variable
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from gradhealth.base.errors import GradHealthInternalWarning, GradModeError
from gradhealth.base.findings import Finding
from gradhealth.base.hooks import guarded
from gradhealth.publish.metrics import PREFIX, clip_metrics, report_metrics, update_metrics
from gradhealth.monitor import GradHealth
from gradhealth.options import ON_PROBLEM, Options, check_choice
from gradhealth.origin.replay import producers, shared_origin
from gradhealth.base.report import Report
from gradhealth.check.skipping import defused

from .hf_replay import MicroBatches
from .hf_wiring import around, callback_list, move_before_reporters, share_trainer_clip, tensorboard_writer, trainer_of

__all__ = ["GradHealthCallback", "NORM"]

NORM = "grad_norm_preclip"
_JSON_OPTIONS = ("on_problem", "every_n_steps", "expect_frozen", "deltas", "update_every", "change_every",
                 "history", "amp_skip_alarm", "amp_scale_floor", "trace_on_nonfinite", "watch_forward",
                 "desync_every", "rank_origin", "grad_patience", "experts", "skip_nonfinite", "skip_spikes",
                 "skip_alarm", "grad_sync", "lag")


def _sync_gradients() -> bool:
    """Whether this micro-batch ends an accumulation window (Accelerate's shared gradient state,
    which Trainer sets before each ``training_step``)."""
    try:
        from accelerate.state import GradientState
    except ImportError:  # pragma: no cover - Trainer requires accelerate
        return True
    return bool(GradientState().sync_gradients)


def _first_tensor(output) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(the loss if the model returned one, a tensor of the output that needs a gradient)."""
    loss = None
    items: list = []
    if isinstance(output, torch.Tensor):
        items = [output]
    elif isinstance(output, dict):  # ModelOutput is a dict too
        loss = output.get("loss")
        items = list(output.values())
    elif isinstance(output, (tuple, list)):
        items = list(output)
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        return loss, loss
    grad = next((t for t in items if isinstance(t, torch.Tensor) and t.requires_grad), None)
    return (loss if isinstance(loss, torch.Tensor) else None), grad



#: what TRL's trainers log that explains a check with nothing to learn (:mod:`gradhealth.judge.fitted`):
#: the share of prompt groups whose rewards tied (GRPO), so their advantages are 0
_TRL_NOTES = ("frac_reward_zero_std",)

class _LogsSink:
    """Holds the metrics of the latest check until Trainer logs (``on_log``)."""

    def __init__(self, granularity: str):
        self.granularity = granularity
        self.pending: dict[str, float] = {}
        self.loud = False

    def write(self, report: Report) -> None:
        metrics = report_metrics(report, granularity="module" if self.granularity == "total" else self.granularity,
                                 norm=NORM)
        self.pending = _headline(metrics) if self.granularity == "total" else metrics
        self.loud = not report.ok or any(f.level != "info" for f in report.findings)

    def write_update(self, report: Report) -> None:
        metrics = update_metrics(report, granularity="module" if self.granularity == "total" else self.granularity)
        self.pending.update(_headline(metrics) if self.granularity == "total" else metrics)

    def write_clip(self, report: Report) -> None:
        self.pending.update(clip_metrics(report))


#: the per-name key families left out of Trainer's logs at granularity="total"
_DETAIL = (f"{PREFIX}/{NORM}/", f"{PREFIX}/update_norm/", f"{PREFIX}/update_ratio/", f"{PREFIX}/experts/",
           f"{PREFIX}/valid/")


def _headline(metrics: dict[str, float]) -> dict[str, float]:
    """The headline numbers (totals, state counts, findings, skips): a logged line stays short
    whatever the model's depth; per-module keys are one option away (granularity="module")."""
    return {k: v for k, v in metrics.items() if not k.startswith(_DETAIL) or k.endswith("/total")}


class GradHealthCallback(TrainerCallback, ExportableState):
    """Runs a [GradHealth][gradhealth.GradHealth] monitor inside ``Trainer.train``.

    Takes the options of [Options][gradhealth.Options] as keywords (``on_problem``,
    ``every_n_steps``, ``sinks``, ``expect_frozen``, ``deltas``, ``history``, ...); ``on_problem``
    also accepts "stop" (warn, then end training cleanly). Plus:

    Args:
        log: merge the ``gradhealth/...`` metrics into Trainer's logs (every ``report_to``).
        granularity: "total" (default): only headline numbers in Trainer's logs (the pre-clip total
            norm, the problem-state counts, the findings, the total update norm and ratio), so a
            logged line stays short whatever the depth of the model; "module" or "param": one
            metric key per module or per parameter too.
        check_loss: when the model returns a loss that cannot produce gradients, raise
            [GradModeError][gradhealth.GradModeError] naming the cause instead of autograd's bare error.
        tensorboard: with ``report_to`` TensorBoard, also write the full detail into Trainer's
            TensorBoard run (a [TensorBoardSink][gradhealth.integrations.tensorboard.TensorBoardSink] on its
            writer: every per-module scalar, the dashboards, the findings as text, which name the
            parameters for ``gradhealth report``), on the main process.
        replay_on_nonfinite: replay the failing step's micro-batches under the NaN tracer (the
            module docstring). The callback keeps references to the inputs of the current step's
            ``gradient_accumulation_steps`` micro-batches (no copies; released at the next step)
            and their random states (a few KiB each). Each is replayed through Trainer's own
            ``compute_loss`` (TRL's and custom ones too: `gradhealth.integrations.hf_replay`).

    Attributes:
        last_report: the [Report][gradhealth.Report] of the latest check (None before the first):
            ``callback.last_report.ok`` after ``trainer.train()``.
        monitor: the [GradHealth][gradhealth.GradHealth] monitor of the current training run, or
            None before it starts.
    """

    def __init__(self, *, log: bool = True, granularity: str = "total", check_loss: bool = True,
                 tensorboard: bool = True, replay_on_nonfinite: bool = True, **options):
        Options.check_keywords(options)
        on_problem = options.get("on_problem", "warn")
        check_choice("on_problem", on_problem, ON_PROBLEM + ("stop",))
        self.stop = on_problem == "stop"
        if self.stop:
            options["on_problem"] = "warn"
        self.options = Options(**options)
        self.granularity = check_choice("granularity", granularity, ("total", "module", "param"))
        self.log = bool(log)
        self.check_loss = bool(check_loss)
        self.tensorboard = bool(tensorboard)
        self.replay_on_nonfinite = bool(replay_on_nonfinite)
        #: this step's micro-batches: [args, kwargs, random state, autocast dtype or None, has a loss]
        self._batches = MicroBatches()  # this step's micro-batches, for the replay
        self._pre_hook, self._said = None, set()  # (each hook's own failure said once: gradhealth.base.hooks.guarded)
        self._callbacks: list | None = None  # Trainer's callback list (found at on_train_begin)
        self._tb_sink = None
        self.monitor: GradHealth | None = None
        self.last_report: Report | None = None
        self._pending_state: dict | None = None
        self._sink = _LogsSink(self.granularity)
        self._hook = None
        self._in_step = False
        self._step = 0
        self._loss: torch.Tensor | None = None
        self._queued = False
        self._report: Report | None = None
        self._launched: dict[int, list] = {}  # (lag=1) the micro-batches of the check in flight, by its step
        self._undo: list = []  # undoes the shared clip and the watches on Trainer's calls
        self._trainer = None  # (a weak reference)

    # ---------------------------------------------------------- checkpoints
    def state(self) -> dict:
        o = self.options
        args: dict[str, Any] = {k: getattr(o, k) for k in _JSON_OPTIONS}
        if args["expect_frozen"] is not None:
            args["expect_frozen"] = list(args["expect_frozen"])
        args["history"] = o.history is not None  # a tuned NormHistory comes back with default settings
        if self.stop:
            args["on_problem"] = "stop"
        args.update(log=self.log, granularity=self.granularity, check_loss=self.check_loss, tensorboard=self.tensorboard,
                    replay_on_nonfinite=self.replay_on_nonfinite)
        monitor = self.monitor.state_dict() if self.monitor is not None else self._pending_state
        return {"args": args, "attributes": {"_pending_state": monitor}}

    # ---------------------------------------------------------------- hooks
    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self.monitor is not None:
            self.monitor.close()
        if model is None:
            raise ValueError("GradHealthCallback: Trainer passed no model to on_train_begin; "
                             "install the callback with Trainer(..., callbacks=[GradHealthCallback()])")
        saved = (state.stateful_callbacks or {}).get(type(self).__name__)
        if isinstance(saved, list):
            saved = saved[0] if saved else None
        if self._pending_state is None and isinstance(saved, dict):
            self._pending_state = (saved.get("attributes") or {}).get("_pending_state")
        sinks = self.options.sinks + ((self._sink,) if self.log else ())
        self.monitor = GradHealth(model, optimizer, options=self.options, sinks=sinks)
        self.monitor.emit_warnings = bool(state.is_world_process_zero)
        if self._pending_state:
            try:
                self.monitor.load_state_dict(self._pending_state)
            except (TypeError, ValueError) as exc:  # a checkpoint from elsewhere: start afresh, say so
                warnings.warn(f"gradhealth: the callback state in this checkpoint was not restored ({exc}); the "
                              "norm history starts afresh", GradHealthInternalWarning, stacklevel=2)
        self._pending_state = None
        self._hook = model.register_forward_hook(guarded(self._on_forward, "Trainer callback's forward hook", self._said))
        if self.replay_on_nonfinite:
            self._batches.device = next(iter(model.parameters()), torch.empty(0)).device.type  # (autocast's device type)
            self._pre_hook = model.register_forward_pre_hook(
                guarded(self._on_forward_pre, "Trainer callback's forward pre-hook", self._said), with_kwargs=True)
        self._callbacks = callback_list(self)
        trainer = trainer_of(self._callbacks)
        self._undo = [u for u in (share_trainer_clip(trainer, self.monitor),
                                  around(getattr(trainer, "accelerator", None), "backward", self._on_loss),
                                  around(trainer, "compute_loss", self._enter_loss, self._leave_loss)) if u is not None]
        self._trainer = weakref.ref(trainer) if trainer is not None else None
        if self.log:
            move_before_reporters(self._callbacks, self)
        self._tb_sink = None

    def on_step_begin(self, args, state, control, **kwargs):
        if self.tensorboard and self._tb_sink is None and state.is_world_process_zero:
            self._add_tensorboard_sink(args)
        self._in_step, self._step = True, state.global_step + 1
        self._report, self._queued, self._loss = None, False, None
        self._batches.window = []

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        mon = self.monitor
        if mon is None:
            return
        report, self._report = self._report, None
        if report is None and not self._queued:  # the model's forward was not seen: measure clipped grads
            report = mon.measure(self._loss, step=state.global_step + 1)
            if report is not None:
                report.findings.append(Finding(
                    "POSTCLIP", level="info", step=report.step, message=
                    "gradhealth measured after Trainer's gradient clipping (the model's forward was not seen): "
                    "norms are post-clip, and a clipped non-finite gradient hides which parameter it came from"))
        window, self._batches.window = self._batches.window, []
        if mon.options.lag:  # (the report is the check before's: so are the micro-batches to replay)
            window, done = self._launched.pop(getattr(report, "step", None), []), window
            if mon._deferred.launched_at(self._step):  # (a check the gate let through: its micro-batches)
                self._launched = {self._step: done}
        if report is None:
            return
        # (under a grad scaler an overflow is the scaler's to skip, not a NaN to trace)
        if self.replay_on_nonfinite and not report.grads_finite and mon.scaler is None:
            r = mon.ranks  # under torch.distributed the producing ranks replay, and every rank says their verdict
            mine = window and all(w[4] for w in window) and producers(report, r.rank)
            trainer = self._trainer() if self._trainer is not None else None
            finding = self._batches.replay(mon.model, trainer, window, report.step) if mine else None
            if r.active:
                finding = shared_origin(finding, r.rank, r.world)
            if finding is not None:  # (a warning when the step guard dropped the step)
                report.findings.append(defused(report, finding))
        self.last_report = report
        mon.publish(report, stacklevel=2)
        if self.stop and mon.alarm(report):
            control.should_training_stop = True

    def on_step_end(self, args, state, control, **kwargs):
        self._in_step = False
        if self.log and self._sink.loud:
            control.should_log = True  # a problem reaches the report_to backends at its own step

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and self.monitor is not None:  # TRL's own statistics, where the trainer logs them
            for key in _TRL_NOTES:
                if isinstance(logs.get(key), (int, float)):
                    self.monitor.carry.fit.notes[key] = (float(logs[key]), state.global_step)
        if self.log and self.monitor is not None and self._sink.pending:  # the update norms of the step just
            self.monitor._flush_updates()  # taken (on every rank: it may reduce); lag=1's check stays in flight
        if self.log and logs is not None and state.is_world_process_zero and self._sink.pending:
            logs.update(self._sink.pending)
            history = state.log_history  # Trainer stored a copy of logs before calling on_log
            if history and history[-1].get("step") == state.global_step:
                history[-1].update(self._sink.pending)
            self._sink.pending, self._sink.loud = {}, False

    def on_train_end(self, args, state, control, **kwargs):
        self._close()

    # ------------------------------------------------------------ internals
    def _on_forward_pre(self, module, args, kwargs) -> None:
        if not self._batches.replaying and self._in_step and module.training and torch.is_grad_enabled():
            self._batches.forward(args, kwargs)

    def _enter_loss(self, model, inputs, *args, **kwargs) -> None:
        """Trainer's ``compute_loss``: the micro-batch, replayable whatever its loss is built from; and
        this rank's count of its label tokens (what Trainer counts for ``num_items_in_batch`` before
        gathering it) as the valid count ``tokens``: 0 for a whole step is EMPTY_VALID_SET."""
        training = self._in_step and model.training and torch.is_grad_enabled()
        self._batches.enter_loss(model, inputs, args, kwargs, training)
        labels = inputs.get("shift_labels", inputs.get("labels")) if isinstance(inputs, dict) else None
        if training and self._batches.in_loss == 1 and isinstance(labels, torch.Tensor) and self.monitor is not None:
            trainer = self._trainer() if self._trainer is not None else None
            if "shift_labels" not in inputs and getattr(trainer, "_loss_shifts_labels", False):
                labels = labels[..., 1:]  # (a causal LM's loss skips each row's first label)
            self.monitor.carry.add_count(labels.ne(-100).sum(), "tokens")

    def _leave_loss(self) -> None:
        self._batches.leave_loss()

    def _on_forward(self, module, inputs, output) -> None:
        if self._batches.replaying or not (self._in_step and module.training and torch.is_grad_enabled()):
            return  # evaluation, generation, or a forward outside an optimizer step
        loss, tensor = _first_tensor(output)
        if loss is not None and loss.dim() == 0:
            self._batches.has_loss()  # the replay can compute this micro-batch's loss from the model alone
            self._loss = loss
            if self.check_loss and self.monitor is not None and not loss.requires_grad:
                cause = self.monitor.diagnose_loss(loss)
                if cause is not None:
                    message = f"gradhealth: the model's loss cannot produce gradients: {cause}"
                    self.monitor.publisher.write_stop(self._step, f"GradModeError: {message}")
                    raise GradModeError(message)
        if tensor is None or not _sync_gradients():
            return
        tensor.register_hook(guarded(self._on_backward, "Trainer callback's backward hook", self._said))

    def _on_loss(self, loss, *_args, **_kwargs) -> None:  # (under DeepSpeed Trainer passes scale_wrt_gas=...)
        """The loss Trainer backpropagates (``accelerator.backward``), whatever ``compute_loss`` made it
        from: the loss the check judges, a clear error when it cannot produce gradients, and the check
        queued at the end of its backward (TRL's trainers build their own loss from the logits: the
        model's ``outputs.loss`` is never backpropagated there)."""
        if self._batches.replaying or not self._in_step or self.monitor is None or not isinstance(loss, torch.Tensor):
            return
        if loss.dim() == 0:
            self._loss = loss
        if not loss.requires_grad:
            if self.check_loss:
                cause = self.monitor.diagnose_loss(loss) or "it does not require grad"
                message = (f"gradhealth: the loss Trainer backpropagates (what compute_loss returned) cannot produce "
                           f"gradients: {cause}. Build it with grad enabled: a custom compute_loss must not run under "
                           "torch.no_grad() or inference_mode() (a no-grad reference forward beside it is fine)")
                self.monitor.publisher.write_stop(self._step, f"GradModeError: {message}")
                raise GradModeError(message)
            return
        if _sync_gradients():
            loss.register_hook(guarded(self._on_backward, "Trainer callback's backward hook", self._said))

    def _on_backward(self, grad):
        if not self._queued:
            self._queued = True
            # Queued twice: the second queue runs after callbacks queued during the backward
            # (DDP's gradient reduction finishes in one), so the gradients are final.
            Variable._execution_engine.queue_callback(
                lambda: Variable._execution_engine.queue_callback(self._measure))
        return grad

    def _measure(self) -> None:
        mon = self.monitor
        if mon is not None and self.replay_on_nonfinite:
            # the failing step itself is replayed when the model returns its loss: then no tracer is
            # armed for the next step; with a custom compute_loss, the monitor traces the next one
            trace = self.options.trace_on_nonfinite and not self._batches.replayable()
            if mon.options.trace_on_nonfinite != trace:
                mon.options = dataclasses.replace(mon.options, trace_on_nonfinite=trace)
        if self.monitor is not None and self._report is None:
            with torch.enable_grad():  # the engine runs callbacks with grad mode off; the training loop has it on
                self._report = self.monitor.measure(self._loss, step=self._step)
            self._loss = None

    def _add_tensorboard_sink(self, args) -> None:
        """The full detail into Trainer's TensorBoard run, on its own writer (created by Trainer's
        TensorBoardCallback in its on_train_begin, so looked for at the first step)."""
        self._tb_sink = False  # looked for once per train()
        writer = tensorboard_writer(self._callbacks)
        if writer is None or self.monitor is None:
            return
        try:
            from .tensorboard import TensorBoardSink
        except ImportError:  # tensorboard not installed: Trainer's own scalars still flow
            return
        self._tb_sink = TensorBoardSink(writer, norm=NORM, granularity="module", close_writer=False, on_steps=True,
                                        every_n=max(1, int(args.logging_steps)) if args.logging_steps >= 1 else 1)
        self.monitor.publisher.sinks = self.monitor.publisher.sinks + (self._tb_sink,)

    def _close(self) -> None:
        self._batches.window = []
        for undo in getattr(self, "_undo", ()):
            undo()
        self._undo = []
        for hook in (self._hook, self._pre_hook):
            if hook is not None:
                hook.remove()
        self._hook = self._pre_hook = None
        if self.monitor is not None:
            mon, self.monitor, self._launched = self.monitor, None, {}
            try:
                mon.close()  # (with lag=1 it delivers the last check's report, and raises its verdict under raise)
            finally:
                self._pending_state = mon.state_dict()
                self.last_report = mon.last_report or self.last_report

    def __del__(self):  # hooks must not outlive a callback dropped without on_train_end
        for hook in (getattr(self, "_hook", None), getattr(self, "_pre_hook", None)):
            if hook is not None:
                hook.remove()


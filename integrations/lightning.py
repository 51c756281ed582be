"""Lightning adapter: ``GradHealthCallback``, a thin shell over :class:`gradhealth.GradHealth`.

Where each check runs:

* ``on_before_backward``: the loss-side check, so a loss that cannot produce gradients fails with
  gradhealth's explanation (:class:`gradhealth.GradModeError`) instead of autograd's bare error;
* ``on_before_optimizer_step`` (automatic optimization): classification and norms, once per
  optimizer step: after gradient accumulation, on unscaled gradients under AMP (Lightning unscales
  before this hook), before gradient clipping ("pre-clip");
* ``on_after_backward`` (manual optimization): the same at the end of every
  ``self.manual_backward``, before the ``self.clip_gradients`` and ``opt.step()`` that follow, so
  the numbers are pre-clip there too; inside a ``toggle_optimizer`` phase the check judges that
  optimizer's parameters. A backward Lightning did not see (``loss.backward()`` called directly)
  is checked inside ``opt.step()`` instead, after any clip: those reports carry a ``POSTCLIP``
  info finding and log under ``grad_norm_postclip``;
* Lightning's clip by norm (``gradient_clip_val``, ``self.clip_gradients``) runs through
  ``monitor.clip_grad_norm_`` with the check's norms, so the gradients are read once (the
  precision plugin's ``clip_grad_by_norm``, undone at the end of training; plugins with their own,
  FSDP's and DeepSpeed's, keep it); ``gradhealth/clip_coef`` is logged;
* the optimizer's own step hooks measure the update, reported with the next check;
* ``on_exception`` / ``teardown``: flush and close the sinks, remove every hook.

Logged metric keys (public API): the scheme of :mod:`gradhealth.publish.metrics`, through every logger of
the Trainer, at the optimizer step, with ``grad_norm_preclip`` as the norm name and one key per
module (``granularity="param"`` for one per parameter):

``gradhealth/grad_norm_preclip/total`` and ``/<module>``, ``gradhealth/status/<STATE>``,
``gradhealth/params_in_trouble``, ``gradhealth/loss``, ``gradhealth/valid/<name>``, ``gradhealth/findings/<KIND>``, and once the
step has run, ``gradhealth/update_norm/total``, ``gradhealth/update_norm/<module>`` and
``gradhealth/update_ratio/<module>``. With several optimizers, totals, loss and counts get the
optimizer's index: ``total_opt1``.

With a ``TensorBoardLogger``, a :class:`gradhealth.integrations.tensorboard.TensorBoardSink` on
its writer adds the dashboards (custom-scalars layout, gradient-flow heatmap, findings as text)
to the same run.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from gradhealth.base.errors import GradHealthError, GradModeError
from gradhealth.base.findings import Finding
from gradhealth.publish.metrics import clip_metrics, report_metrics, suffix, update_metrics
from gradhealth.monitor import GradHealth
from gradhealth.options import Options, check_choice
from gradhealth.origin.replay import producers, replay_nonfinite, shared_origin
from gradhealth.check.skipping import defused
from gradhealth.base.report import Report
from gradhealth.origin.snapshot import rng_state

__all__ = ["GradHealthCallback", "metrics_of", "update_metrics_of"]

NORM = "grad_norm_preclip"
POSTCLIP_NORM = "grad_norm_postclip"


def _norm_of(report: Report) -> str:
    return POSTCLIP_NORM if report.findings_of("POSTCLIP") else NORM


def metrics_of(report: Report, suffix: str = "", granularity: str = "module") -> dict[str, float]:
    """The metric dict logged for a report."""
    return report_metrics(report, granularity=granularity, norm=_norm_of(report), suffix=suffix)


def update_metrics_of(report: Report, suffix: str = "", granularity: str = "module") -> dict[str, float]:
    """Update norms and ratios of a report whose step has run."""
    return update_metrics(report, granularity=granularity, suffix=suffix)


class _LoggerSink:
    """Sends reports to every logger of the Trainer (loggers log on rank zero only), every
    ``trainer.log_every_n_steps`` checks, and always when a report has a problem or a finding."""

    def __init__(self, trainer: pl.Trainer, granularity: str):
        self.trainer = trainer
        self.granularity = granularity
        self._seen = 0
        self._written: list[int] = []

    def _log(self, metrics: dict[str, float], step: int) -> None:
        if metrics:
            for logger in self.trainer.loggers:
                logger.log_metrics(metrics, step=step)

    def write(self, report: Report) -> None:
        self._seen += 1
        loud = not report.ok or any(f.level != "info" for f in report.findings)
        if (self._seen - 1) % max(1, self.trainer.log_every_n_steps) and not loud:
            return
        self._written = self._written[-15:] + [report.step]
        self._log(metrics_of(report, suffix(report, len(self.trainer.optimizers)), self.granularity), report.step)

    def write_update(self, report: Report) -> None:
        if report.step in self._written or any(f.level != "info" for f in report.findings):
            self._log(update_metrics_of(report, suffix(report, len(self.trainer.optimizers)), self.granularity),
                      report.step)

    def write_clip(self, report: Report) -> None:
        if report.step in self._written or report.clip_coef < 1.0:  # a clip that bites is always logged
            self._log(clip_metrics(report, suffix(report, len(self.trainer.optimizers))), report.step)


def _share_clip(trainer: pl.Trainer, monitor: GradHealth):
    """Lightning's clip by norm (``gradient_clip_val``, ``self.clip_gradients``) with the norms of the
    check made just before it: the precision plugin's ``clip_grad_by_norm`` clips the optimizer's
    parameters with ``monitor.clip_grad_norm_`` (one read of the gradients). A plugin with its own
    (FSDP's, DeepSpeed's) keeps it. Returns the undo, or None."""
    from lightning.pytorch.plugins.precision import Precision

    from gradhealth.check.clip import arm

    plugin = trainer.precision_plugin
    if type(plugin).clip_grad_by_norm is not Precision.clip_grad_by_norm:
        return None
    if trainer.gradient_clip_val:  # (self.clip_gradients under manual optimization: from its first call)
        arm(monitor)

    def clip_grad_by_norm(optimizer, clip_val) -> None:
        # (unscale=False: what Lightning clips is its business; still-scaled gradients get torch's clip)
        monitor.clip_grad_norm_(clip_val, parameters=list(plugin.main_params(optimizer)), unscale=False)

    plugin.clip_grad_by_norm = clip_grad_by_norm

    def undo() -> None:
        if plugin.__dict__.get("clip_grad_by_norm") is clip_grad_by_norm:
            del plugin.clip_grad_by_norm

    return undo


class GradHealthCallback(Callback):
    """Runs a [GradHealth][gradhealth.GradHealth] monitor inside ``Trainer.fit``.

    Takes the options of [Options][gradhealth.Options] as keywords (``on_problem``,
    ``every_n_steps``, ``sinks``, ``expect_frozen``, ``deltas``, ``history``, ...), plus:

    Args:
        log: log the metrics in the module docstring through the Trainer's loggers.
        replay_on_nonfinite: when a check finds NaN/inf gradients (automatic optimization), run
            that batch again once with the NaN tracer armed ([replay_nonfinite][gradhealth.replay_nonfinite]),
            so training goes on exactly as without the replay; the report gets a NONFINITE_ORIGIN
            finding saying where the NaN was born and whether it reproduced. Under
            ``accumulate_grad_batches=k`` the k batches of the step are replayed one by one until
            one makes the NaN, and the finding names it: the callback keeps references to those k
            batches and their random states (a few KiB each) until the step. With ``lag=1`` the
            report arrives a step later, and so does the replay of its batches (kept one step
            longer): without ``skip_nonfinite=True`` that step's update has already been applied,
            and the replay finds the weights it poisoned.
        check_loss: run the loss-side check before every backward.
        granularity: "module" (default) or "param": one metric key per module or per parameter.
        tensorboard: with a TensorBoardLogger, also write the dashboards into its run.

    Attributes:
        last_report: the [Report][gradhealth.Report] of the latest check (None before the first):
            ``callback.last_report.ok`` after ``trainer.fit``.
        monitor: the [GradHealth][gradhealth.GradHealth] monitor of the current fit (made at
            ``on_train_start``), or None before.
    """

    def __init__(self, *, log: bool = True, replay_on_nonfinite: bool = True, check_loss: bool = True,
                 granularity: str = "module", tensorboard: bool = True, **options):
        super().__init__()
        Options.check_keywords(options)
        self.options = Options(**options)
        self.granularity = check_choice("granularity", granularity, ("module", "param"))
        self.tensorboard = bool(tensorboard)
        self.log = bool(log)
        self.replay_on_nonfinite = bool(replay_on_nonfinite)
        self.check_loss = bool(check_loss)
        self.monitor: GradHealth | None = None
        self.last_report: Report | None = None
        self._loss: torch.Tensor | None = None
        self._backward = False  # a backward ran since the last check (on_before_backward)
        #: the micro-batches of the current optimizer step: (batch, batch_idx, random state before it)
        self._window: deque[tuple[Any, int, dict | None]] = deque(maxlen=1)
        self._launched: dict[int, list] = {}  # (lag=1) the window of the check in flight, by its step
        self._checked_backward = False  # manual optimization: a backward was checked since the last step
        self._pending_state: dict | None = None

    # ------------------------------------------------------------- identity
    @property
    @override
    def state_key(self) -> str:
        o = self.options
        return self._generate_state_key(on_problem=o.on_problem, every_n_steps=o.every_n_steps, deltas=o.deltas,
                                        expect_frozen=list(o.expect_frozen) if o.expect_frozen is not None else None)

    @override
    def state_dict(self) -> dict[str, Any]:
        state = self.monitor.state_dict() if self.monitor is not None else self._pending_state
        return {"monitor": state} if state is not None else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = state_dict.get("monitor")
        if state is None:
            return
        if self.monitor is not None:
            self.monitor.load_state_dict(state)
        else:
            self._pending_state = state  # the monitor is made at on_train_start

    # ------------------------------------------------------------------ hooks
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.monitor is not None:
            self.monitor.close()
        sinks = self.options.sinks
        if self.log:
            sinks += (_LoggerSink(trainer, self.granularity),)
            if self.tensorboard:
                sinks += self._tensorboard_sinks(trainer)
        wrapper = getattr(trainer.strategy, "model", None)
        self.monitor = GradHealth(
            pl_module, list(trainer.optimizers), scaler=getattr(trainer.precision_plugin, "scaler", None),
            ddp_model=wrapper if isinstance(wrapper, torch.nn.parallel.DistributedDataParallel) else None,
            options=self.options, sinks=sinks, trace_on_nonfinite=not self.replay_on_nonfinite,
        )
        self.monitor.emit_warnings = trainer.is_global_zero
        self._unshare = _share_clip(trainer, self.monitor)
        if self._pending_state is not None:
            self.monitor.load_state_dict(self._pending_state)
            self._pending_state = None

    def _tensorboard_sinks(self, trainer) -> tuple:
        from lightning.pytorch.loggers import TensorBoardLogger

        loggers = [lg for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)]
        if not loggers or not trainer.is_global_zero:
            return ()
        try:
            from .tensorboard import TensorBoardSink
        except ImportError:  # tensorboard not installed: the logger's own scalars still flow
            return ()
        # Scalars reach TensorBoard through the logger already; the sink adds what a logger
        # cannot: the custom-scalars layout, the gradient-flow heatmap, findings as text.
        return tuple(TensorBoardSink(lg.experiment, scalars=False, norm=NORM, granularity=self.granularity,
                                     close_writer=False, every_n=max(1, trainer.log_every_n_steps)) for lg in loggers)

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not (self.replay_on_nonfinite and pl_module.automatic_optimization):
            return
        k = max(1, int(getattr(trainer, "accumulate_grad_batches", 1) or 1))
        if self._window.maxlen != k:
            self._window = deque(self._window, maxlen=k)
        self._window.append((batch, batch_idx, rng_state()))

    @override
    def on_before_backward(self, trainer, pl_module, loss: torch.Tensor) -> None:
        self._loss, self._backward = loss, True
        if self.check_loss and self.monitor is not None:
            cause = self.monitor.diagnose_loss(loss)
            if cause is not None:
                message = f"gradhealth: the training_step's loss cannot produce gradients: {cause}"
                self.monitor.publisher.write_stop(trainer.global_step, f"GradModeError: {message}")
                raise GradModeError(message)

    @override
    def on_after_backward(self, trainer, pl_module) -> None:
        mon = self.monitor
        if mon is None or pl_module.automatic_optimization:
            return
        # manual optimization: checked here, before the clip_gradients and step() that follow
        self._checked_backward = True
        report = mon.measure(self._loss, step=trainer.global_step, optimizer=_toggled(pl_module, mon.optimizers))
        if report is not None:
            self.last_report = report
            mon.publish(report, stacklevel=2)

    @override
    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        mon = self.monitor
        if mon is None:
            return
        manual = not pl_module.automatic_optimization
        if manual and self._checked_backward:
            self._checked_backward = False  # checked at the end of its backward already
            return
        several = len(mon.optimizers) > 1
        backward, self._backward = self._backward, False  # (a training_step that returned None: no backward)
        report = mon.measure(self._loss, step=trainer.global_step, optimizer=optimizer if several else None)
        if report is not None and not backward and not manual and not mon.options.lag:
            report.backward = False
        window, self._window = list(self._window), deque(maxlen=self._window.maxlen)
        if mon.options.lag and not manual:  # (the report is the check before's: so is the batch to replay)
            window, done = self._launched.pop(getattr(report, "step", None), []), window
            if mon._deferred.launched_at(trainer.global_step):  # (a check the gate let through: its batches)
                self._launched = {trainer.global_step: done}
        if report is None:
            return
        if manual:  # a backward Lightning did not see: inside step(), after any clip_gradients
            report.findings.append(Finding(
                "POSTCLIP", level="info", step=report.step, message=
                "gradhealth measured inside optimizer.step() (the backward did not go through self.manual_backward): "
                f"norms are post-clip if training_step clipped (logged as {POSTCLIP_NORM}), and a clipped non-finite "
                "gradient hides which parameter it came from; call self.manual_backward(loss) to get pre-clip numbers"))
        # (under a grad scaler an overflow is the scaler's to skip, not a NaN to trace)
        if self.replay_on_nonfinite and not report.grads_finite and not manual and mon.scaler is None:
            r = mon.ranks  # under torch.distributed the producing ranks replay, and every rank says their verdict
            finding = self._replay(trainer, pl_module, report, window) if window and producers(report, r.rank) else None
            if r.active:
                finding = shared_origin(finding, r.rank, r.world)
            if finding is not None:  # (a warning when the step guard dropped the step)
                report.findings.append(defused(report, finding))
        self.last_report = report
        mon.publish(report, stacklevel=2)

    @override
    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        try:
            self._close()
        except GradHealthError:  # (lag=1's last verdict: the exception already on its way is the one to see)
            pass

    @override
    def on_fit_end(self, trainer, pl_module) -> None:
        self._close()

    @override
    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._close()

    def _close(self) -> None:
        if getattr(self, "_unshare", None) is not None:
            self._unshare()
            self._unshare = None
        if self.monitor is not None:
            mon, self.monitor, self._launched = self.monitor, None, {}
            self._pending_state = mon.state_dict()
            try:
                mon.close()  # (with lag=1 it delivers the last check's report, and raises its verdict under raise)
            finally:
                self.last_report = mon.last_report or self.last_report

    def _replay(self, trainer, pl_module, report: Report, window: list):
        """The step's batches once more under the tracer (each alone, until one makes the NaN),
        without logging twice."""
        log, log_dict = pl_module.log, pl_module.log_dict

        def runner(batch, batch_idx):
            def run() -> None:
                with trainer.precision_plugin.train_step_context():
                    out = pl_module.training_step(batch, batch_idx)
                    loss = out["loss"] if isinstance(out, dict) else out
                    if isinstance(loss, torch.Tensor) and loss.requires_grad:
                        loss.backward()
            return run

        pl_module.log = lambda *a, **k: None
        pl_module.log_dict = lambda *a, **k: None
        try:
            if len(window) == 1:
                batch, idx, rng = window[0]
                return replay_nonfinite(pl_module, runner(batch, idx), rng=rng, step=report.step, label=f"batch {idx}",
                                        batch_idx=idx)
            finding = replay_nonfinite(pl_module, [runner(b, i) for b, i, _ in window], rng=[r for _, _, r in window],
                                       labels=[f"batch {i}" for _, i, _ in window], step=report.step, step_batches=[
                                           i for _, i, _ in window])
            if finding is not None and finding.data.get("micro_batch") is not None:
                finding.data["batch_idx"] = window[finding.data["micro_batch"]][1]
            return finding
        finally:
            pl_module.log, pl_module.log_dict = log, log_dict


def _toggled(pl_module, optimizers) -> Any:
    """The optimizer of the current ``toggle_optimizer`` phase (the only one whose parameters
    may train now), or None: not toggled, or one optimizer."""
    if len(optimizers) < 2 or not getattr(pl_module, "_param_requires_grad_state", None):
        return None
    live = [o for o in optimizers if any(p.requires_grad for g in o.param_groups for p in g["params"])]
    return live[0] if len(live) == 1 else None

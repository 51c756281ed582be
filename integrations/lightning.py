"""Lightning adapter: ``GradHealthCallback``, a thin shell over :class:`gradhealth.GradHealth`.

Where each check runs:

* ``on_before_backward``: the loss-side check, so a loss that cannot produce gradients fails with
  gradhealth's explanation (:class:`gradhealth.GradModeError`) instead of autograd's bare error;
* ``on_before_optimizer_step``: classification and norms, once per optimizer step: after gradient
  accumulation, on unscaled gradients under AMP (Lightning unscales before this hook), before
  gradient clipping ("pre-clip"); with several optimizers, each check judges the parameters of
  the optimizer about to step;
* the optimizer's own step hooks measure the update, reported with the next check;
* ``on_exception`` / ``teardown``: flush and close the sinks, remove every hook.

Logged metric keys (public API): the scheme of :mod:`gradhealth.metrics`, through every logger of
the Trainer, at the optimizer step, with ``grad_norm_preclip`` as the norm name and one key per
module (``granularity="param"`` for one per parameter):

``gradhealth/grad_norm_preclip/total`` and ``/<module>``, ``gradhealth/status/<STATE>``,
``gradhealth/loss``, ``gradhealth/valid/<name>``, ``gradhealth/findings/<KIND>``, and once the
step has run, ``gradhealth/update_norm/total``, ``gradhealth/update_norm/<module>`` and
``gradhealth/update_ratio/<module>``. With several optimizers, totals, loss and counts get the
optimizer's index: ``total_opt1``.

With a ``TensorBoardLogger``, a :class:`gradhealth.integrations.tensorboard.TensorBoardSink` on
its writer adds the dashboards (custom-scalars layout, gradient-flow heatmap, findings as text)
to the same run.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from gradhealth import stats
from gradhealth.errors import GradHealthInternalWarning, GradModeError
from gradhealth.metrics import report_metrics, update_metrics
from gradhealth.monitor import GradHealth
from gradhealth.report import Finding, Report
from gradhealth.snapshot import ModuleState, rng_state, set_rng_state
from gradhealth.trace import NonFiniteTracer

__all__ = ["GradHealthCallback", "metrics_of", "update_metrics_of"]

PREFIX = "gradhealth"


def metrics_of(report: Report, suffix: str = "", granularity: str = "module") -> dict[str, float]:
    """The metric dict logged for a report."""
    return report_metrics(report, granularity=granularity, norm="grad_norm_preclip", suffix=suffix)


def update_metrics_of(report: Report, suffix: str = "", granularity: str = "module") -> dict[str, float]:
    """Update norms and ratios of a report whose step has run."""
    return update_metrics(report, granularity=granularity, suffix=suffix)


class _LoggerSink:
    """Sends reports to every logger of the Trainer (loggers log on rank zero only)."""

    def __init__(self, callback: GradHealthCallback):
        self.callback = callback

    def _log(self, metrics: dict[str, float], step: int) -> None:
        trainer = self.callback._trainer
        if trainer is None or not metrics:
            return
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)

    def write(self, report: Report) -> None:
        self._log(metrics_of(report, self.callback._suffix(report), self.callback.granularity), report.step)

    def write_update(self, report: Report) -> None:
        self._log(update_metrics_of(report, self.callback._suffix(report), self.callback.granularity), report.step)


class GradHealthCallback(Callback):
    """Runs a :class:`gradhealth.GradHealth` monitor inside ``Trainer.fit``.

    Takes the same options as ``GradHealth`` (``on_problem``, ``every_n_steps``, ``sinks``,
    ``expect_frozen``, ``deltas``, ``history``, ``amp_skip_alarm``, ``amp_scale_floor``,
    ``watch_forward``), plus:

    Args:
        log: log the metrics in the module docstring through the Trainer's loggers.
        replay_on_nonfinite: when a check finds NaN/inf gradients (automatic optimization), run
            that batch again once with the NaN tracer armed, then restore RNG, parameters,
            buffers and gradients so training goes on exactly as without the replay; the report
            gets a NONFINITE_ORIGIN finding saying where the NaN was born and whether it
            reproduced (yes: the data or the model; no: a numerical or hardware transient).
        check_loss: run the loss-side check before every backward.
        granularity: "module" (default) or "param": one metric key per module or per parameter.
        tensorboard: with a TensorBoardLogger, also write the dashboards into its run.
    """

    def __init__(
        self,
        *,
        on_problem: str = "warn",
        every_n_steps: int = 1,
        sinks=(),
        expect_frozen=None,
        deltas: str = "sample",
        history=True,
        amp_skip_alarm: int = 3,
        amp_scale_floor: float = 1.0,
        watch_forward: bool = True,
        log: bool = True,
        replay_on_nonfinite: bool = True,
        check_loss: bool = True,
        granularity: str = "module",
        tensorboard: bool = True,
    ):
        super().__init__()
        self._options = dict(
            on_problem=on_problem, every_n_steps=every_n_steps, sinks=tuple(sinks) if sinks else (),
            expect_frozen=expect_frozen, deltas=deltas, history=history, amp_skip_alarm=amp_skip_alarm,
            amp_scale_floor=amp_scale_floor, watch_forward=watch_forward,
        )
        # validate now, where the options are given, with the core's own messages
        GradHealth(torch.nn.Linear(1, 1), **{**self._options, "sinks": self._options["sinks"]}).close()
        if granularity not in ("module", "param"):
            raise ValueError(f"granularity must be one of 'module', 'param'; got {granularity!r}")
        self.granularity = granularity
        self.tensorboard = bool(tensorboard)
        self.log = bool(log)
        self.replay_on_nonfinite = bool(replay_on_nonfinite)
        self.check_loss = bool(check_loss)
        self.monitor: GradHealth | None = None
        self.last_report: Report | None = None
        self._trainer: pl.Trainer | None = None
        self._loss: torch.Tensor | None = None
        self._batch: Any = None
        self._batch_idx = 0
        self._rng: dict | None = None
        self._pending_state: dict | None = None

    # ------------------------------------------------------------- identity
    @property
    def state_key(self) -> str:
        return self._generate_state_key(
            on_problem=self._options["on_problem"], every_n_steps=self._options["every_n_steps"],
            deltas=self._options["deltas"], expect_frozen=self._options["expect_frozen"],
        )

    def state_dict(self) -> dict[str, Any]:
        if self.monitor is not None:
            return {"monitor": self.monitor.state_dict()}
        return {"monitor": self._pending_state} if self._pending_state is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = state_dict.get("monitor")
        if state is None:
            return
        if self.monitor is not None:
            self.monitor.load_state_dict(state)
        else:
            self._pending_state = state  # the monitor is made at on_train_start

    # ------------------------------------------------------------------ setup
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._trainer = trainer
        if self.monitor is not None:
            self.monitor.close()
        sinks = tuple(self._options["sinks"]) + ((_LoggerSink(self),) if self.log else ())
        if self.tensorboard and self.log:
            sinks += self._tensorboard_sinks(trainer)
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        wrapper = getattr(trainer.strategy, "model", None)
        ddp = wrapper if isinstance(wrapper, torch.nn.parallel.DistributedDataParallel) else None
        self.monitor = GradHealth(
            pl_module, [o for o in trainer.optimizers], **{**self._options, "sinks": sinks},
            scaler=scaler, trace_on_nonfinite=not self.replay_on_nonfinite, ddp_model=ddp,
        )
        self.monitor.emit_warnings = trainer.is_global_zero
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
        return tuple(TensorBoardSink(lg.experiment, scalars=False, norm="grad_norm_preclip",
                                     granularity=self.granularity, close_writer=False) for lg in loggers)

    def _suffix(self, report: Report) -> str:
        opts = self.monitor.optimizers if self.monitor else []
        if len(opts) <= 1:
            return ""
        idx = getattr(report, "_optimizer_index", 0)
        return f"_opt{idx}"

    # ------------------------------------------------------------------ hooks
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._batch, self._batch_idx = batch, batch_idx
        if self.replay_on_nonfinite:
            self._rng = rng_state()

    def on_before_backward(self, trainer, pl_module, loss: torch.Tensor) -> None:
        self._loss = loss
        if self.check_loss and self.monitor is not None:
            cause = self.monitor.diagnose_loss(loss)
            if cause is not None:
                raise GradModeError(f"gradhealth: the training_step's loss cannot produce gradients: {cause}")

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        mon = self.monitor
        if mon is None:
            return
        several = len(mon.optimizers) > 1
        report = mon.measure(self._loss, step=trainer.global_step, optimizer=optimizer if several else None)
        if report is None:
            return
        if several:
            report._optimizer_index = next(i for i, o in enumerate(mon.optimizers) if o is optimizer)
        if self.replay_on_nonfinite and not report.grads_finite and pl_module.automatic_optimization:
            finding = self._replay(trainer, pl_module, report)
            if finding is not None:
                report.findings.append(finding)
        self.last_report = report
        mon.publish(report, stacklevel=2)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._close()

    def on_fit_end(self, trainer, pl_module) -> None:
        self._close()

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._close()

    def _close(self) -> None:
        if self.monitor is not None:
            self._pending_state = self.monitor.state_dict()
            self.monitor.close()
            self.monitor = None

    # ----------------------------------------------------------------- replay
    def _replay(self, trainer, pl_module, report: Report) -> Finding | None:
        """Run the failing batch again with the tracer armed; leave training exactly as it was."""
        if self._batch is None or self._rng is None:
            return None
        params = list(pl_module.parameters())
        saved = ModuleState(pl_module)
        now = rng_state()
        log, log_dict = pl_module.log, pl_module.log_dict
        tracer = NonFiniteTracer(pl_module)
        reproduced = None
        try:
            set_rng_state(self._rng)  # the same dropout masks and random draws as the failing step
            for p in params:
                p.grad = None
            pl_module.log = lambda *a, **k: None  # the replay must not log twice
            pl_module.log_dict = lambda *a, **k: None
            tracer.arm()
            with torch.enable_grad(), trainer.precision_plugin.train_step_context():
                out = pl_module.training_step(self._batch, self._batch_idx)
                loss = out["loss"] if isinstance(out, dict) else out
                if isinstance(loss, torch.Tensor) and loss.requires_grad:
                    loss.backward()
            tracer.resolve()
            grads = [p.grad for p in params if p.grad is not None]
            norms, _, _ = stats.grad_norms(grads)
            reproduced = any(not math.isfinite(v) for v in norms)
        except Exception as exc:
            warnings.warn(f"gradhealth: the replay of batch {self._batch_idx} failed ({type(exc).__name__}: {exc}); "
                          "training continues unchanged", GradHealthInternalWarning, stacklevel=2)
            return None
        finally:
            tracer.disarm()
            pl_module.log, pl_module.log_dict = log, log_dict
            saved.restore()
            set_rng_state(now)
        if reproduced:
            verdict = ("it reproduced on a replay of the same batch with the same random state: the cause is "
                       "deterministic, in this batch's data or in the model")
        else:
            verdict = ("it did NOT reproduce on a replay of the same batch with the same random state: a "
                       "numerical or hardware transient (non-deterministic kernels, a flaky device)")
        return Finding(
            "NONFINITE_ORIGIN", f"batch {self._batch_idx} at step {report.step}: {verdict}. {tracer.explain()}",
            step=report.step, level="error",
            data={"forward_origin": tracer.forward_origin, "backward_origin": tracer.backward_origin,
                  "op": tracer.backward_op, "source": tracer.op_source, "reproduced": reproduced,
                  "batch_idx": self._batch_idx},
        )

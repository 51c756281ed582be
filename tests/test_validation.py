"""Every public entry point refuses bad arguments with an error that names the argument (and what
is allowed); ``load_state_dict`` is all or nothing."""

import logging
import math
import os

import pytest
import torch
from torch import nn

import gradhealth as gh


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))


def monitor(**kw):
    m = model()
    return gh.GradHealth(m, torch.optim.SGD(m.parameters(), lr=0.1), **kw)


def checked():
    mon = monitor()
    mon.model(torch.randn(3, 4)).sum().backward()
    return mon


def tb_sink(*a, **k):
    from gradhealth.integrations.tensorboard import TensorBoardSink

    return TensorBoardSink(*a, **k)


def read_run(*a):
    from gradhealth.integrations.tensorboard import read_run

    return read_run(*a)


M = model
T = torch.ones(3)
MASK = torch.ones(3, dtype=torch.bool)
_REPORT = gh.Report(step=0, status={}, grad_norm={}, total_grad_norm=0.0)

# (label, call, exception, words the message must contain)
TABLE = [
    ("GradHealth model", lambda: gh.GradHealth("x"), TypeError, "model must be a torch.nn.Module"),
    ("GradHealth optimizer", lambda: gh.GradHealth(M(), 5), TypeError, "optimizer must be a torch.optim.Optimizer"),
    ("GradHealth scaler", lambda: monitor(scaler="x"), TypeError, "scaler must be a torch.amp.GradScaler"),
    ("GradHealth ddp_model", lambda: monitor(ddp_model=5), TypeError, "ddp_model must be"),
    ("GradHealth options", lambda: monitor(options="x"), TypeError, "options must be a gh.Options"),
    ("on_problem", lambda: monitor(on_problem="panic"), ValueError, "on_problem must be one of 'warn', 'raise', 'ignore'"),
    ("every_n_steps type", lambda: monitor(every_n_steps="2"), ValueError, "every_n_steps must be a positive int"),
    ("every_n_steps zero", lambda: monitor(every_n_steps=0), ValueError, "every_n_steps must be a positive int"),
    ("sink class", lambda: monitor(sinks=[gh.LoggingSink]), TypeError, "is the class LoggingSink, not an instance"),
    ("sink object", lambda: monitor(sinks=[5]), TypeError, "sinks[0] must have a write(report) method"),
    ("expect_frozen", lambda: monitor(expect_frozen=5), TypeError, "expect_frozen must be a name pattern"),
    ("deltas", lambda: monitor(deltas="fast"), ValueError, "deltas must be one of 'auto', 'exact', 'off'"),
    ("update_every", lambda: monitor(update_every=0), ValueError, "update_every must be a positive int"),
    ("change_every", lambda: monitor(change_every=0), ValueError, "change_every must be a positive int"),
    ("history", lambda: monitor(history="x"), TypeError, "history must be True, False or a gh.NormHistory"),
    ("amp_skip_alarm", lambda: monitor(amp_skip_alarm=0), ValueError, "amp_skip_alarm must be a positive int"),
    ("amp_scale_floor type", lambda: monitor(amp_scale_floor="x"), TypeError, "amp_scale_floor must be a number >= 0"),
    ("amp_scale_floor negative", lambda: monitor(amp_scale_floor=-1), ValueError, "amp_scale_floor must be a number >= 0"),
    ("trace_on_nonfinite", lambda: monitor(trace_on_nonfinite="yes"), TypeError, "trace_on_nonfinite must be True or False"),
    ("watch_forward", lambda: monitor(watch_forward=2), TypeError, "watch_forward must be True or False"),
    ("desync_every", lambda: monitor(desync_every=-1), ValueError, "desync_every must be an int >= 0"),
    ("rank_origin", lambda: monitor(rank_origin="x"), TypeError, "rank_origin must be True or False"),
    ("grad_patience", lambda: monitor(grad_patience=0), ValueError, "grad_patience must be a positive int"),
    ("unknown option", lambda: monitor(bogus=1), TypeError, "unknown option 'bogus'; the options are"),
    ("Options direct", lambda: gh.Options(deltas="x"), ValueError, "deltas must be one of"),
    ("check loss", lambda: checked().check(loss="x"), TypeError, "check(loss=...) must be a torch.Tensor or None"),
    ("check loss float", lambda: checked().check(loss=1.5), TypeError, "not .item()"),
    ("check step type", lambda: checked().check(step="x"), TypeError, "check(step=...) must be an int >= 0"),
    ("check step negative", lambda: checked().check(step=-1), ValueError, "check(step=...) must be an int >= 0"),
    ("check unknown optimizer", lambda: checked().check(optimizer=torch.optim.SGD([nn.Parameter(T)], lr=1)), ValueError,
     "is not the monitor's optimizer"),
    ("track_valid mask", lambda: checked().track_valid([1]), TypeError, "track_valid: mask must be a torch.Tensor"),
    ("track_valid name", lambda: checked().track_valid(MASK, name=5), TypeError, "track_valid: name must be a non-empty str"),
    ("load_state_dict None", lambda: checked().load_state_dict(None), TypeError, "state must be a dict"),
    ("load_state_dict bad", lambda: checked().load_state_dict({"checks": "x"}), ValueError, "the monitor was left unchanged"),
    ("brief report", lambda: gh.brief("step 0"), TypeError, "brief: report must be a gradhealth Report"),
    ("brief framework", lambda: gh.brief(_REPORT, "keras"), ValueError,
     "brief: framework must be one of plain, lightning, transformers"),
    ("masked_mean values", lambda: gh.masked_mean("a", MASK), TypeError, "values must be a torch.Tensor"),
    ("masked_mean mask", lambda: gh.masked_mean(T, [1]), TypeError, "mask must be a torch.Tensor of bools"),
    ("masked_mean empty", lambda: gh.masked_mean(T, MASK, empty="x"), ValueError, "empty must be one of 'zero', 'nan', 'raise'"),
    ("safe_div numerator", lambda: gh.safe_div("a", T), TypeError, "safe_div: numerator must be a torch.Tensor or a number"),
    ("safe_div denominator", lambda: gh.safe_div(T, "a"), TypeError, "safe_div: denominator must be"),
    ("safe_log x", lambda: gh.safe_log("a"), TypeError, "safe_log: x must be a torch.Tensor"),
    ("safe_sqrt x", lambda: gh.safe_sqrt([1.0]), TypeError, "safe_sqrt: x must be a torch.Tensor"),
    ("safe_where fn", lambda: gh.safe_where(MASK, "exp", T, 0.0), TypeError, "safe_where: fn must be a callable"),
    ("safe_where input", lambda: gh.safe_where(MASK, torch.exp, "a", 0.0), TypeError, "safe_where: input must be a torch.Tensor"),
    ("trace_nonfinite model", lambda: gh.trace_nonfinite("x").__enter__(), TypeError, "model must be a torch.nn.Module"),
    ("NonFiniteTracer model", lambda: gh.NonFiniteTracer(5), TypeError, "model must be a torch.nn.Module"),
    ("replay_nonfinite run", lambda: gh.replay_nonfinite(M(), "x"), TypeError, "replay_nonfinite: run must be a callable"),
    ("replay_nonfinite model", lambda: gh.replay_nonfinite("x", lambda: None), TypeError, "model must be a torch.nn.Module"),
    ("rng_state argument", lambda: gh.rng_state(0), TypeError, "rng_state() takes 0 positional arguments"),
    ("assert_trains model", lambda: gh.assert_trains("x", None, lambda m, b: 0, None), TypeError, "model must be a torch.nn.Module"),
    ("assert_trains optimizer", lambda: gh.assert_trains(M(), None, lambda m, b: 0, None), TypeError, "assert_trains needs an optimizer"),
    ("assert_trains loss_fn", lambda: gh.assert_trains(M(), torch.optim.SGD(M().parameters(), lr=1), 5, None), TypeError,
     "loss_fn must be callable"),
    ("classify model", lambda: gh.classify("x"), TypeError, "model must be a torch.nn.Module"),
    ("check_loss", lambda: gh.check_loss("x"), gh.GradModeError, "the loss is a str, not a torch.Tensor"),
    ("NormHistory window", lambda: gh.NormHistory(window=0), ValueError, "history needs window >= 3"),
    ("LoggingSink every_n", lambda: gh.LoggingSink(every_n=0), ValueError, "LoggingSink: every_n must be a positive int"),
    ("LoggingSink logger", lambda: gh.LoggingSink(logger=5), TypeError, "LoggingSink: logger must be a logging.Logger"),
    ("LoggingSink level", lambda: gh.LoggingSink(level="x"), TypeError, "LoggingSink: level must be a logging level"),
    ("TensorBoardSink empty", lambda: tb_sink(""), ValueError, "the log directory is empty"),
    ("TensorBoardSink type", lambda: tb_sink(5), TypeError, "TensorBoardSink needs a log directory or a SummaryWriter"),
    ("TensorBoardSink granularity", lambda: tb_sink(_tmp_dir(), granularity="x"), ValueError, "granularity must be one of"),
    ("TensorBoardSink every_n", lambda: tb_sink(_tmp_dir(), every_n=0), ValueError, "every_n must be a positive int"),
    ("read_run path", lambda: read_run(5), TypeError, "read_run: path must be a str or os.PathLike"),
]


def _tmp_dir():
    import tempfile

    return tempfile.mkdtemp(prefix="gh_validation_")


@pytest.mark.parametrize("label, call, exc, words", TABLE, ids=[t[0] for t in TABLE])
def test_bad_argument_is_refused_by_name(label, call, exc, words):
    with pytest.raises(exc) as info:
        call()
    assert words in str(info.value), str(info.value)


def test_the_table_covers_every_public_callable():
    covered = " ".join(label for label, *_ in TABLE)
    public = [n for n in gh.__all__ if callable(getattr(gh, n)) and not isinstance(getattr(gh, n), type)
              or n in ("GradHealth", "Options", "NormHistory", "LoggingSink", "NonFiniteTracer")]
    assert not [n for n in public if n not in covered], [n for n in public if n not in covered]


def test_callbacks_refuse_bad_options_by_name():
    pytest.importorskip("lightning")
    from gradhealth.integrations.lightning import GradHealthCallback as LightningCallback

    for cls in [LightningCallback] + ([_hf()] if _hf() else []):
        with pytest.raises(ValueError, match="granularity must be one of"):
            cls(granularity="layer")
        with pytest.raises(TypeError, match="unknown option 'on_problme'"):
            cls(on_problme="raise")
        with pytest.raises(ValueError, match="every_n_steps must be a positive int"):
            cls(every_n_steps=0)


def _hf():
    try:
        from gradhealth.integrations.transformers import GradHealthCallback
    except ImportError:
        return None
    return GradHealthCallback


def test_load_state_dict_is_all_or_nothing():
    mon = monitor()
    for _ in range(3):
        mon.model(torch.randn(3, 4)).sum().backward()
        mon.check()
    good = mon.state_dict()
    assert good["checks"] == 3 and good["history"]["seen"] == 3
    bad = dict(good, calls=7, history={"seen": 1, "total": [1.0]})  # history lacks its keys
    with pytest.raises(ValueError, match="left unchanged"):
        mon.load_state_dict(bad)
    assert mon.state_dict() == good  # nothing was half-applied
    bad = dict(good, streaks={"w": "x"})
    with pytest.raises(ValueError, match="left unchanged"):
        mon.load_state_dict(bad)
    assert mon.state_dict() == good
    other = monitor()
    other.load_state_dict(good)
    assert other.state_dict() == good


def test_tensorboard_sink_log_dir_errors_are_one_clear_error(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(OSError, match=r"TensorBoardSink cannot write to the log directory .*a_file/run"):
        tb_sink(str(blocker / "run"))
    locked = tmp_path / "locked"
    locked.mkdir()
    os.chmod(locked, 0o500)
    try:
        if not os.access(locked, os.W_OK):  # (root writes anyway: the file case above stands for it)
            with pytest.raises(OSError, match="TensorBoardSink cannot write to the log directory"):
                tb_sink(str(locked))
    finally:
        os.chmod(locked, 0o755)
    sink = tb_sink(str(tmp_path / "ok"))
    sink.close()
    assert not [p for p in os.listdir(tmp_path / "ok") if p.startswith(".gradhealth-write-test")]


def test_sinks_and_logging_sink_still_work_after_validation(caplog):
    mon = monitor(sinks=[gh.LoggingSink(logging.getLogger("gh-test"), level=logging.WARNING)])
    mon.model(torch.randn(3, 4)).sum().backward()
    with caplog.at_level(logging.WARNING, logger="gh-test"):
        report = mon.check()
    assert report.ok and math.isfinite(report.total_grad_norm)
    assert any("healthy" in r.getMessage() for r in caplog.records)

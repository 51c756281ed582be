"""The LightningCLI configs in configs/, each loaded and run through a real LightningCLI."""

import os
import warnings

import pytest

import gradhealth as gh
from gradhealth.integrations.cli import main as cli_main
from gradhealth.integrations.lightning import GradHealthCallback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(config, tmp_path, *extra):
    args = ["fit", "--config", os.path.join(ROOT, "configs", config), "--trainer.max_steps=4",
            f"--trainer.default_root_dir={tmp_path}", "--trainer.enable_progress_bar=false", *extra]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cli = cli_main(args)
    return cli, [str(w.message) for w in caught if issubclass(w.category, gh.GradHealthWarning)]


def callback(cli):
    return next(c for c in cli.trainer.callbacks if isinstance(c, GradHealthCallback))


def test_default_config_with_tensorboard(tmp_path):
    cli, said = run("default.yaml", tmp_path, f"--trainer.logger.init_args.save_dir={tmp_path}")
    cb = callback(cli)
    assert said == [] and cb.last_report.ok and cb.last_report.step == 3
    events = [f for _, _, fs in os.walk(tmp_path) for f in fs if f.startswith("events.out.tfevents")]
    assert events


def test_default_config_reports_a_planted_bug(tmp_path):
    cli, said = run("default.yaml", tmp_path, f"--trainer.logger.init_args.save_dir={tmp_path}", "--model.bug=not_in_optimizer")
    assert said and "NOT_IN_OPTIMIZER" in said[0]


def test_strict_config_raises(tmp_path):
    with pytest.raises(gh.GradHealthError, match="UNEXPECTED_FROZEN"):
        run("strict.yaml", tmp_path, "--model.bug=frozen")
    cli, said = run("strict.yaml", tmp_path)  # a healthy run passes under the strict config
    assert callback(cli).last_report.ok


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_multiprocess_config(tmp_path):
    from conftest import run_spawned

    logs = tmp_path / "logs"
    cli, _ = run_spawned(lambda: run("multiprocess.yaml", tmp_path, f"--trainer.logger.init_args.save_dir={logs}"),
                         fresh=[logs])
    assert cli.trainer.world_size == 2
    metrics = [os.path.join(d, f) for d, _, fs in os.walk(logs) for f in fs if f == "metrics.csv"]
    assert len(metrics) == 1 and "gradhealth/grad_norm_preclip/total" in open(metrics[0]).read()
    import csv

    rows = [r for r in csv.DictReader(open(metrics[0])) if r.get("gradhealth/grad_norm_preclip/total")]
    assert sorted({int(r["step"]) for r in rows}) == list(range(cli.trainer.max_steps))  # every step logged


def test_a_lightningcli_run_warns_nothing_about_its_own_config(tmp_path):
    args = ["fit", "--config", os.path.join(ROOT, "configs", "default.yaml"), "--trainer.max_steps=2",
            f"--trainer.default_root_dir={tmp_path}", "--trainer.enable_progress_bar=false"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cli_main(args)
    said = [f"{w.category.__name__}: {w.message}" for w in caught if w.category.__name__ == "JsonargparseWarning"]  # (its deprecation warnings are Lightning's)
    assert not said, said

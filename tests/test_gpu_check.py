"""``scripts/gpu_check.py`` from a plain checkout (no install: the subpackages that setuptools maps
from folders outside ``gradhealth/`` registered by the script), on the CPU with tiny sizes: every
section but the CUDA sync count runs (the sync debug mode played by the script's CPU stand-in, which
fails a check that reads the device), the whole-step table's rows, each section on its own (a
failure reported with its traceback, the next section run, the exit status 1)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import warnings

import pytest
import torch

from gradhealth.check import deferred
from gradhealth.base.errors import GradHealthInternalWarning
import procs

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _checkout(tmp_path):
    root = tmp_path / "checkout"
    for folder in ("gradhealth", "integrations", "demos", "benchmarks", "scripts", "configs"):
        shutil.copytree(os.path.join(HERE, folder), root / folder, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(os.path.join(HERE, "pyproject.toml"), root / "pyproject.toml")
    return root


def _run(root, *args, env=None):
    return procs.run([sys.executable, str(root / "scripts" / "gpu_check.py"), "--cpu", "--tiny", *args],
                     capture_output=True, text=True, timeout=280, cwd=str(root.parent),
                     env={**os.environ, "PYTHONPATH": "", **(env or {})})


@pytest.mark.slow  # (over 10 s: make test runs it, make test-fast does not)
def test_gpu_check_runs_from_a_plain_checkout_on_the_cpu(tmp_path):
    root = _checkout(tmp_path)
    res = _run(root)  # every section
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    # the checkout's own package and its mapped integrations, not an installed copy
    assert f"gradhealth from {root / 'gradhealth'}" in out and f"integrations from {root / 'integrations'}" in out, out
    for done in ("1. hot path: no host sync outside the one transfer", "2. core benchmark, absolute times",
                 "3. fp16 AMP: unscaled norms, one skip = info, three in a row = alarm",
                 "4. Lightning bf16-mixed: the planted bug found, the healthy run clean",
                 "5. skip_nonfinite with fused AdamW: the NaN step changed nothing",
                 "6. 30 deferred checks from the first", "7. the fused guard under set_sync_debug_mode('error')",
                 "8. synchronisations per step: skipped (no CUDA"):
        assert done in out, (done, out)
    for shape in ("6-tensor MLP, batch 64", "GPT", "8x Linear(256), batch 64", "8x Linear(2048), batch 256",
                  "200x (Linear(64, 64), Tanh): vanishing", "that GPT, all but its last block frozen"):
        row = next(line for line in out.splitlines() if shape in line)
        assert row.count("%") == 3, row  # the one number, the default monitor, lag=1
    assert "gpu_check passed" in out


@pytest.mark.slow  # (over 10 s: make test runs it, make test-fast does not)
def test_a_failed_section_is_reported_and_the_next_one_runs(tmp_path):
    root = _checkout(tmp_path)
    res = _run(root, "--sections", "8,9", "--shapes", "4", env={"GPU_CHECK_FAIL": "8"})
    assert res.returncode == 1
    assert "8. syncs per step: FAILED" in res.stdout and "RuntimeError: a failure planted" in res.stderr
    assert "200x (Linear(64, 64), Tanh): vanishing" in res.stdout  # section 9 still ran
    assert "gpu_check FAILED: 8. syncs per step" in res.stdout


def _script():
    spec = importlib.util.spec_from_file_location("gpu_check_under_test", os.path.join(HERE, "scripts", "gpu_check.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.DEV = torch.device("cpu")
    return module


@pytest.mark.parametrize("read", ["item", "tolist"])
def test_the_cpu_stand_in_for_the_sync_debug_mode_fails_a_check_that_reads_the_device(monkeypatch, read):
    """With ``--cpu``, section 6 runs under :class:`CpuSyncs`: a host read planted inside the
    deferred check (a scalar read, or ``tolist()``, which dispatches nothing on the CPU) makes the
    check fail internally, and the section fails (it passes without it)."""
    gc = _script()
    with warnings.catch_warnings():
        warnings.simplefilter("error", GradHealthInternalWarning)
        gc.no_sync_checks(steps=4)  # the premise: clean as it is
        with gc.sync_watch():
            gc.sync_debug("error")
            with pytest.raises(RuntimeError, match="synchronizing"):
                torch.ones(2).sum().item()
            gc.sync_debug("warn")
            with pytest.warns(UserWarning, match="synchronizing"):
                torch.ones(2).nonzero()
        launch = deferred.Deferred.check

        def reads_the_device(self, *args):
            getattr(torch.ones(1).sum(), read)()  # (what .item() or .tolist() on the hot path is on a GPU: a sync)
            return launch(self, *args)

        monkeypatch.setattr(deferred.Deferred, "check", reads_the_device)
        with pytest.raises(GradHealthInternalWarning, match="synchronizing CUDA operation"):
            gc.no_sync_checks(steps=4)
    torch.ones(1).sum().item()  # (the stand-in is gone after the section)

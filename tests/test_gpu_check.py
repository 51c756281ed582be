"""``scripts/gpu_check.py`` from a plain checkout (no install: the subpackages that setuptools maps
from folders outside ``gradhealth/`` registered by the script), on the CPU with tiny sizes: the
whole-step table's rows, each section on its own (a failure reported with its traceback, the next
section run, the exit status 1), the CUDA-only sections saying they are skipped."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _checkout(tmp_path):
    root = tmp_path / "checkout"
    for folder in ("gradhealth", "integrations", "demos", "benchmarks", "scripts"):
        shutil.copytree(os.path.join(HERE, folder), root / folder, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(os.path.join(HERE, "pyproject.toml"), root / "pyproject.toml")
    return root


def _run(root, *args, env=None):
    return subprocess.run([sys.executable, str(root / "scripts" / "gpu_check.py"), "--cpu", "--tiny", *args],
                          capture_output=True, text=True, timeout=280, cwd=str(root.parent),
                          env={**os.environ, "PYTHONPATH": "", **(env or {})})


def test_gpu_check_runs_from_a_plain_checkout_on_the_cpu(tmp_path):
    root = _checkout(tmp_path)
    res = _run(root, "--sections", "4,8,9")
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    # the checkout's own package and its mapped integrations, not an installed copy
    assert f"gradhealth from {root / 'gradhealth'}" in out and f"integrations from {root / 'integrations'}" in out, out
    assert "4. Lightning 16-mixed: skipped (needs CUDA)" in out and "8. synchronisations per step: skipped" in out
    for shape in ("6-tensor MLP, batch 64", "GPT", "8x Linear(256), batch 64", "8x Linear(2048), batch 256",
                  "200x (Linear(64, 64), Tanh): vanishing"):
        row = next(line for line in out.splitlines() if shape in line)
        assert row.count("%") == 3, row  # the one number, the default monitor, lag=1
    assert "gpu_check passed" in out


def test_a_failed_section_is_reported_and_the_next_one_runs(tmp_path):
    root = _checkout(tmp_path)
    res = _run(root, "--sections", "8,9", "--shapes", "4", env={"GPU_CHECK_FAIL": "8"})
    assert res.returncode == 1
    assert "8. syncs per step: FAILED" in res.stdout and "RuntimeError: a failure planted" in res.stderr
    assert "200x (Linear(64, 64), Tanh): vanishing" in res.stdout  # section 9 still ran
    assert "gpu_check FAILED: 8. syncs per step" in res.stdout

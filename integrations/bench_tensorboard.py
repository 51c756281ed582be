"""The TensorBoard sink's cost per check, default tags and per-parameter tags, next to check()."""

from __future__ import annotations

import shutil
import tempfile

import torch

from gradhealth.bench import build_model, interleaved
from gradhealth.monitor import GradHealth

from .tensorboard import TensorBoardSink


def main(rounds: int = 5) -> None:
    torch.manual_seed(0)
    model = build_model(100, 64)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    model(torch.randn(32, 64)).square().mean().backward()
    tmp = tempfile.mkdtemp()
    try:
        plain = GradHealth(model, opt, on_problem="ignore", deltas="off")
        default = GradHealth(model, opt, on_problem="ignore", deltas="off", sinks=[TensorBoardSink(f"{tmp}/a")])
        per_param = GradHealth(model, opt, on_problem="ignore", deltas="off",
                               sinks=[TensorBoardSink(f"{tmp}/b", granularity="param")])
        t = interleaved({"check()": plain.check, "default": default.check, "per-parameter": per_param.check}, rounds, 10)
        base = t["check()"]
        print("\nTensorBoardSink on the 400-tensor model (event files on local disk, heatmap every 50 checks):")
        print(f"  check() alone {base * 1e3:.3f} ms; with the default tags (per module: 201 scalars) "
              f"{t['default'] * 1e3:.3f} ms (+{(t['default'] - base) * 1e3:.3f} ms); with per-parameter tags (401 scalars) "
              f"{t['per-parameter'] * 1e3:.3f} ms (+{(t['per-parameter'] - base) * 1e3:.3f} ms)")
        for m in (plain, default, per_param):
            m.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

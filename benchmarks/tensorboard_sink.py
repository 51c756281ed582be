"""The TensorBoard sink's cost per check, default tags and per-parameter tags, next to check()."""

from __future__ import annotations

import shutil
import tempfile

import torch

from gradhealth.benchmarks.core import build_model, interleaved
from gradhealth.monitor import GradHealth

from gradhealth.integrations.tensorboard import TensorBoardSink


def main(rounds: int = 5) -> None:
    for width in (64, 512):  # the bench's two 400-tensor shapes: 0.4M and 26M parameters
        _one(rounds, width)


def _one(rounds: int, width: int) -> None:
    from gradhealth.benchmarks.core import floor_pass

    torch.manual_seed(0)
    model = build_model(100, width)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    model(torch.randn(32, width)).square().mean().backward()
    tmp = tempfile.mkdtemp()
    try:
        plain = GradHealth(model, opt, on_problem="ignore", deltas="off")
        default = GradHealth(model, opt, on_problem="ignore", deltas="off", sinks=[TensorBoardSink(f"{tmp}/a", every_n=1)])
        per_param = GradHealth(model, opt, on_problem="ignore", deltas="off",
                               sinks=[TensorBoardSink(f"{tmp}/b", granularity="param", every_n=1)])
        inner = 10 if width <= 64 else 2
        t = interleaved({"floor": lambda: floor_pass(model), "check()": plain.check, "default": default.check,
                         "per-parameter": per_param.check}, rounds, inner)
        base, floor = t["check()"], t["floor"]
        n = sum(p.numel() for p in model.parameters()) / 1e6
        print(f"\nTensorBoardSink, 400 tensors, {n:.1f}M parameters (event files on local disk, heatmap every 50 checks, every report written):")
        print(f"  check() alone {base * 1e3:.3f} ms ({base / floor:.2f}x floor); with the default tags (per module: 201 "
              f"scalars) {t['default'] * 1e3:.3f} ms ({t['default'] / floor:.2f}x floor); with per-parameter tags (401 "
              f"scalars) {t['per-parameter'] * 1e3:.3f} ms ({t['per-parameter'] / floor:.2f}x floor)")
        for m in (plain, default, per_param):
            m.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

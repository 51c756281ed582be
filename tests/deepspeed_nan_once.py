"""DeepSpeed skips two steps in a row on inf gradients (the second is traced, names no module, so
the third is traced operation by operation); the checks after them are clean. Run by
tests/test_trace_clean.py in a process of its own (DeepSpeed initialises torch.distributed):
``python tests/deepspeed_nan_once.py OUT.json STAGE PRECISION``."""

from __future__ import annotations

import json
import math
import sys
import warnings

from deepspeed_cases import batch, engine_for  # (sets DeepSpeed's CPU accelerator and a one-process world)

import gradhealth as gh

BAD = (2, 3)  # the steps whose gradients are infinite


def main(path: str, stage: int, precision: str) -> None:
    warnings.simplefilter("ignore")
    model, engine = engine_for(stage, precision)
    monitor = gh.GradHealth(engine.module, engine.optimizer, on_problem="ignore")
    out = {"losses": [], "finite": [], "findings": [], "skipped_steps": None}
    for step in range(7):
        x, y = batch(step, precision)
        pred = engine(x).float()
        loss = ((pred - y) ** 2).mean()
        if step in BAD:  # zero in value, an infinite gradient (d sqrt(t)/dt at t = 0)
            loss = loss + (pred - pred.detach()).pow(0.5).sum()
        engine.backward(loss)
        report = monitor.check(loss=loss)
        engine.step()
        out["losses"].append(float(loss))
        out["finite"].append(report.grads_finite)
        out["findings"].append([(str(f.kind), f.level, f.message) for f in report.findings])
    monitor.close()
    out["skipped_steps"] = engine.skipped_steps
    out["finite_loss"] = all(math.isfinite(v) for v in out["losses"])
    with open(path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])

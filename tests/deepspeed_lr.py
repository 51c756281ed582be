"""DeepSpeed's own loop with the learning rates its users configure: a constant lr of 0 in every
group, and DeepSpeed's ``WarmupLR`` as DeepSpeedExamples' cifar config sets it (``warmup_min_lr: 0``,
the default log warm-up: exactly 0 at its first steps), or with a peak of 0 (a schedule stuck at 0).
The monitor as the README's DeepSpeed recipe sets it up, with the default change test cadence.
``python tests/deepspeed_lr.py OUT.json CASE ...``, CASE = ``<stage>-<precision>-<kind>``, kind in
lr0, warmup, stuck.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

os.environ.setdefault("DS_ACCELERATOR", "cpu")
for key, value in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
    os.environ.setdefault(key, value)

import torch  # noqa: E402

import gradhealth as gh  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from deepspeed_cases import Keep, Net, batch, eval_loss, masters_of  # noqa: E402

STEPS = 10


def run(stage: int, precision: str, kind: str) -> dict:
    import deepspeed

    torch.manual_seed(0)
    model = Net()
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    lr = 0.0 if kind == "lr0" else 1e-2
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 1e-4}, {"params": rest, "weight_decay": 0.0}], lr=lr)
    config = {"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": stage}, "steps_per_print": 10**9}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    if kind in ("warmup", "stuck"):  # DeepSpeedExamples' cifar config: WarmupLR from 0 (log warm-up)
        config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.0 if kind == "stuck"
                                                              else 2e-2, "warmup_num_steps": 4}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    keep = Keep()
    monitor = gh.GradHealth(engine.module, engine.optimizer, on_problem="raise", sinks=[keep])
    out = {"lrs": [], "losses": [], "error": None, "error_step": None, "eval_before": eval_loss(engine, precision)}
    first = masters_of(engine)
    try:
        for step in range(STEPS):
            x, y = batch(step, precision)
            loss = ((engine(x).float() - y) ** 2).mean()
            engine.backward(loss)
            out["lrs"].append([g["lr"] for g in engine.optimizer.param_groups])
            monitor.check(loss=loss)
            engine.step()
            out["losses"].append(float(loss))
        monitor.flush()
    except gh.GradHealthError as exc:
        out["error"], out["error_step"] = str(exc), exc.report.step
    finally:
        monitor.close()
    out["findings"] = sorted({(f.kind, f.level, f.step, f.message) for r in keep.reports for f in r.findings},
                             key=lambda f: f[2])
    out["moved"] = any(not torch.equal(a, b) for a, b in zip(first, masters_of(engine)))
    out["eval_after"] = eval_loss(engine, precision)
    return out


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    results = {}
    for case in argv[1:]:
        s, p, k = case.split("-")
        results[case] = run(int(s), p, k)
    with open(argv[0], "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    import gc

    import deepspeed.runtime.engine  # noqa: F401  (what the run imports, before the freeze)

    gc.freeze()  # (the imports' objects: never collected again, so no collection walks them)
    main(sys.argv[1:])

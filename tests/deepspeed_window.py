"""DeepSpeed ZeRO-3 with its own accumulation (``"gradient_accumulation_steps": 2``) on two gloo ranks, the
loop as its docs write it (``engine.backward(loss)``, ``monitor.check(loss=loss)``, ``engine.step()`` on
every micro-batch), what goes wrong inside a window: rank 1's first micro-batch of window 1 has a NaN loss.
Run by tests/test_deepspeed.py on two ranks (forked by tests/deepspeed_ranks.py, as under ``python -m
torch.distributed.run --nproc_per_node 2 tests/deepspeed_window.py OUT.json CASE ...``); a case is
``healthy`` (four windows under raise), ``nan`` (a NaN in that batch's input), ``empty`` (a token mean over
a mask that selects nothing there: 0/0), ``empty-tracked`` (the same, the mask counted with
``monitor.track_valid``) or ``nan-boundary`` (the NaN in rank 1's last micro-batch of the window instead:
the loss of the check that ends it).
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import deepspeed_cases as dc  # (sets the distributed environment's defaults first)
import torch  # noqa: E402

import gradhealth as gh  # noqa: E402

GAS = 2
AT = (1, 0, 1)  # (window, micro-batch in it, rank): where the planted batch is
AT_BOUNDARY = (1, 1, 1)  # ``nan-boundary``: the window's last micro-batch (its own check's loss)


def engine_for():
    import deepspeed

    torch.manual_seed(0)
    model = dc.Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = {"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": GAS, "steps_per_print": 10**9,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def run(kind: str) -> dict:
    engine = engine_for()
    rank = int(os.environ.get("RANK", "0"))
    keep = dc.Keep()
    monitor = gh.GradHealth(engine.module, engine.optimizer, on_problem="raise" if kind == "healthy" else "ignore",
                            sinks=[keep])
    windows = 4 if kind == "healthy" else AT[0] + 1  # (the planted window's step makes the weights NaN: it ends there)
    out = {"kind": kind, "returned": [], "boundaries": [], "losses": [], "error": None, "rank": rank,
           "eval_before": dc.eval_loss(engine, "fp32")}
    try:
        for micro in range(GAS * windows):
            x, y = dc.batch(micro, "fp32")
            mask = torch.ones(16, dtype=torch.bool)  # every sample a "token" that counts
            planted = (micro // GAS, micro % GAS, rank) == (AT_BOUNDARY if kind == "nan-boundary" else AT)
            planted = planted and kind != "healthy"
            if planted and kind.startswith("nan"):
                x = x.clone()
                x[3, 2] = float("nan")
            if planted and kind.startswith("empty"):
                mask[:] = False
            if kind == "empty-tracked":
                monitor.track_valid(mask, "tokens")
            per_token = ((engine(x).float() - y) ** 2).squeeze(1)
            loss = (per_token * mask).sum() / mask.sum()  # a token mean: 0/0 over no token
            out["losses"].append(float(loss))  # (the premise: NaN there only)
            engine.backward(loss)
            boundary = engine.is_gradient_accumulation_boundary()
            report = monitor.check(loss=loss)
            out["returned"].append(report is not None)
            if boundary:
                out["boundaries"].append(micro)
            engine.step()
        monitor.flush()
    except gh.GradHealthError as exc:
        out["error"] = str(exc)
    finally:
        monitor.close()
    out["reports"] = [{"step": r.step, "problems": sorted({s.value for s in r.problems.values()}),
                       "n_problems": len(r.problems), "valid": dict(r.valid_counts),
                       "findings": [(f.kind, f.level, f.message, f.data.get("ranks"), f.data.get("micro_batches"))
                                    for f in r.findings]} for r in keep.reports]
    out["eval_after"] = dc.eval_loss(engine, "fp32") if kind == "healthy" else None
    return out


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    path, results = argv[0], {}
    for case in argv[1:]:
        results[case] = run(case)
    rank = int(os.environ.get("RANK", "0"))
    with open(path if rank == 0 else f"{path}.rank{rank}", "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1:])

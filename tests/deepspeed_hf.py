"""DeepSpeed through the Hugging Face stack on the CPU: the HF ``Trainer`` under
``TrainingArguments(deepspeed=...)`` with gradhealth's callback, and Accelerate's DeepSpeed plugin in
Accelerate's own loop (``accelerator.backward(loss)`` runs ``engine.backward`` *and* ``engine.step``;
the check comes after it). Run by tests/test_deepspeed.py in a process of its own:
``python tests/deepspeed_hf.py OUT.json CASE``, one case a process (Accelerate allows one
DeepSpeed ``Accelerator`` a process). Cases: ``trainer-<stage>``, ``accelerate-<stage>``,
``accelerate-<stage>-bug`` (the head left out of the optimizer).
"""

from __future__ import annotations

import json
import os
import sys
import warnings

os.environ.setdefault("DS_ACCELERATOR", "cpu")
for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29565"), ("RANK", "0"), ("WORLD_SIZE", "1"),
                   ("LOCAL_RANK", "0")):
    os.environ.setdefault(key, value)

import torch  # noqa: E402

import gradhealth as gh  # noqa: E402

NAMES = ["body.0.weight", "body.0.bias", "body.2.weight", "body.2.bias"]


class Regressor(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    def forward(self, x, labels=None):
        out = self.body(x.to(self.body[0].weight.dtype)).float().squeeze(-1)
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


class Rows(torch.utils.data.Dataset):
    def __init__(self, n=256):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 4, generator=g)
        self.y = self.x @ torch.tensor([1.0, -2.0, 0.5, 1.5])

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


def held_out(model) -> float:
    rows = Rows(512)
    with torch.no_grad():
        return float(model(rows.x[256:], rows.y[256:])["loss"])


class Keep:
    def __init__(self):
        self.reports = []

    def write(self, report):
        self.reports.append(report)


def summary(keep: Keep, losses_before: float, losses_after: float, engine_norms: list, error: str | None) -> dict:
    return {"error": error, "eval_before": losses_before, "eval_after": losses_after,
            "norms": [r.total_grad_norm for r in keep.reports], "steps": [r.step for r in keep.reports],
            "problems": [{k: v.value for k, v in r.problems.items()} for r in keep.reports],
            "names": list(keep.reports[-1].status) if keep.reports else None,
            "findings": [(f.kind, f.level, f.step, f.message) for r in keep.reports for f in r.findings],
            "engine_norms": engine_norms}


def trainer(out_dir: str, stage: int) -> dict:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from gradhealth.integrations.transformers import GradHealthCallback

    torch.manual_seed(0)
    model = Regressor()
    before = held_out(model)
    keep = Keep()
    norms: list = []

    class EngineNorm(TrainerCallback):  # what DeepSpeed itself computed for its clip, at each step
        def on_step_end(self, args, state, control, **kwargs):
            norms.append(float(trainer.model_wrapped.get_global_grad_norm()))

    config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
              "zero_optimization": {"stage": stage}, "bf16": {"enabled": "auto"}}
    args = TrainingArguments(out_dir, deepspeed=config, max_steps=12, per_device_train_batch_size=16,
                             learning_rate=2e-2, max_grad_norm=1.0, report_to=[], save_strategy="no", disable_tqdm=True,
                             logging_steps=4, seed=0, data_seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=Rows(),
                      callbacks=[GradHealthCallback(on_problem="raise", sinks=[keep]), EngineNorm()])
    error = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", gh.GradHealthWarning)
            trainer.train()
    except gh.GradHealthError as exc:
        error = str(exc)
    return summary(keep, before, held_out(trainer.model), norms, error)


def accelerate(stage: int, bug: bool, gas: int = 1) -> dict:
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    torch.manual_seed(0)
    model = Regressor()
    before = held_out(model)
    params = model.body[0].parameters() if bug else model.parameters()  # the bug: the head left out
    optimizer = torch.optim.AdamW(params, lr=2e-2)
    plugin = DeepSpeedPlugin(zero_stage=stage, gradient_clipping=1.0, gradient_accumulation_steps=gas)
    accelerator = Accelerator(deepspeed_plugin=plugin, mixed_precision="bf16")
    data = torch.utils.data.DataLoader(Rows(16 * gas * 12), batch_size=16)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    keep = Keep()
    monitor = gh.GradHealth(model, optimizer, on_problem="raise", sinks=[keep])
    norms, error = [], None
    try:
        for step, batch in enumerate(data):
            with accelerator.accumulate(model):  # (gas > 1: Accelerate tells the engine where its boundary is)
                loss = model(**batch)["loss"]
                accelerator.backward(loss)
                report = monitor.check(loss=loss)
                optimizer.step()
                optimizer.zero_grad()
            if gas > 1 and report is None:
                continue
            norm = model.get_global_grad_norm()  # (None before the engine's first step)
            norms.append(float(norm) if norm is not None else None)
            if len(norms) == 12:
                break
    except gh.GradHealthError as exc:
        error = str(exc)
    finally:
        monitor.close()
    return summary(keep, before, held_out(model.module), norms, error)


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    path, results = argv[0], {}
    for case in argv[1:]:
        how, stage, *rest = case.split("-")
        if how == "trainer":
            results[case] = trainer(os.path.dirname(path) or ".", int(stage))
        else:
            results[case] = accelerate(int(stage), rest == ["bug"], 4 if rest == ["gas"] else 1)
    with open(path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1:])

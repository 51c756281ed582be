"""One rank of Hugging Face Trainer runs under torchrun (gloo on CPU), with GradHealthCallback:
``hf_ddp_worker.py OUT MODE...`` runs one Trainer per mode (``ok``: a healthy run; ``bug``: the head
left out of the optimizer), each its own Trainer, model and callback, one after the other in the
launch's processes, and writes what each saw to OUT/<mode>-rank<r>.json. Used by
test_transformers_ddp.py."""
import json
import os
import sys
import warnings

import torch

torch.set_num_threads(1)
from transformers import Trainer, TrainingArguments  # noqa: E402
from transformers.trainer_callback import PrinterCallback  # noqa: E402

import gradhealth as gh  # noqa: E402
from gradhealth.integrations.transformers import GradHealthCallback  # noqa: E402
from gradhealth.demos.hf_trainer import HeadOutOfOptimizer, Tokens, tiny_bert  # noqa: E402


def run(out: str, mode: str) -> None:
    bug = mode == "bug"
    cb = GradHealthCallback(on_problem="warn")
    args = TrainingArguments(os.path.join(out, mode), use_cpu=True, report_to=[], max_steps=6,
                             per_device_train_batch_size=4, logging_steps=1, save_strategy="no", disable_tqdm=True,
                             seed=0, data_seed=0, max_grad_norm=0.1, gradient_accumulation_steps=2)
    cls = HeadOutOfOptimizer if bug else Trainer
    tr = cls(model=tiny_bert(), args=args, train_dataset=Tokens(), callbacks=[cb])  # (tiny_bert seeds itself)
    tr.remove_callback(PrinterCallback)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always", gh.GradHealthWarning)
        tr.train()
    rank = int(os.environ.get("RANK", 0))
    rows = [(h["step"], h.get("grad_norm"), h.get("gradhealth/grad_norm_preclip/total"),
             h.get("gradhealth/status/NOT_IN_OPTIMIZER")) for h in tr.state.log_history if "grad_norm" in h]
    with open(os.path.join(out, f"{mode}-rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "world": int(os.environ.get("WORLD_SIZE", 1)), "ddp": type(tr.model_wrapped).__name__,
                   "rows": rows, "warnings": [str(x.message).split("\n")[0] for x in w], "last": str(cb.last_report)}, f)


out = sys.argv[1]
for mode in sys.argv[2:]:
    run(out, mode)
# a clean teardown: without it gloo's threads can abort the process at exit (exit code -6)
if torch.distributed.is_initialized():
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()

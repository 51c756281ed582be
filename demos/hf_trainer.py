"""``gradhealth demo --transformers``: a tiny BERT (random weights, no download) through Hugging
Face ``Trainer`` with ``GradHealthCallback``: two planted bugs and a healthy run.

The parts (model, data, the two faulty Trainers) are used by the tests too.
"""

from __future__ import annotations

import argparse
import logging
import os
import warnings

import torch

# The demo trains on the CPU: say so to DeepSpeed, which transformers imports when it is installed
# (else it logs a warning line about the accelerator it could not find, in the middle of the output)
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from transformers import BertConfig, BertForMaskedLM, Trainer, TrainingArguments
from transformers.trainer_callback import PrinterCallback, ProgressCallback

from gradhealth.demos.console import Capture, logs, show, table, verdict
from gradhealth.demos.plain import choose

from gradhealth.integrations.transformers import GradHealthCallback

__all__ = ["tiny_bert", "Tokens", "HeadOutOfOptimizer", "NaNLossOnce", "run_scenario", "main"]


def tiny_bert(seed: int = 0) -> BertForMaskedLM:
    """A 2-layer BERT for masked LM, 32 wide, random weights (42 parameter tensors)."""
    torch.manual_seed(seed)
    return BertForMaskedLM(BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                      intermediate_size=64, max_position_embeddings=32, pad_token_id=0))


class Tokens(torch.utils.data.Dataset):
    """Random token ids (fixed seed); the labels are the inputs."""

    def __init__(self, n: int = 96, length: int = 16):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(2, 100, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.x[i], "labels": self.x[i]}


class HeadOutOfOptimizer(Trainer):
    """Planted bug: a custom optimizer that leaves the prediction head's transform out."""

    def create_optimizer(self, model=None):
        params = [p for n, p in self.model.named_parameters() if "cls.predictions.transform" not in n]
        self.optimizer = torch.optim.AdamW(params, lr=1e-3)
        return self.optimizer


class NaNLossOnce(Trainer):
    """Planted bug: a token-mean loss whose mask selects nothing on one optimizer step (0/0: the
    loss and every gradient are NaN). Trainer's ``logging_nan_inf_filter`` replaces that loss with
    the running average in its logs, so the run looks fine."""

    bad_step = 7

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs["labels"]
        out = model(input_ids=inputs["input_ids"])
        per_token = torch.nn.functional.cross_entropy(out.logits.transpose(1, 2), labels, reduction="none")
        mask = (labels >= 0) & (self.state.global_step != self.bad_step)
        loss = (per_token * mask).sum() / mask.sum()
        return (loss, out) if return_outputs else loss


SCENARIOS = [
    ("not_in_optimizer", HeadOutOfOptimizer, "a custom create_optimizer leaves cls.predictions.transform out"),
    ("nan_batch", NaNLossOnce, f"a token mean over an empty mask at step {NaNLossOnce.bad_step + 1} (0/0), hidden "
                               "by Trainer's NaN filter"),
    ("healthy", Trainer, "the same tiny BERT, nothing planted"),
]


def run_scenario(name: str, cls, root: str, steps: int = 12) -> tuple[list, list[dict]]:
    """One Trainer run; (every report gradhealth made, Trainer's log history)."""
    os.environ["TENSORBOARD_LOGGING_DIR"] = os.path.join(root, name)
    args = TrainingArguments(os.path.join(root, name, "trainer"), use_cpu=True, max_steps=steps,
                             per_device_train_batch_size=4, logging_steps=1, warmup_steps=2, save_strategy="no",
                             report_to=["tensorboard"], disable_tqdm=True, seed=0, data_seed=0)
    capture = Capture()
    trainer = cls(model=tiny_bert(), args=args, train_dataset=Tokens(), callbacks=[GradHealthCallback(sinks=[capture])])
    trainer.remove_callback(PrinterCallback)  # one line per scenario, not one per logged step
    trainer.remove_callback(ProgressCallback)
    with warnings.catch_warnings(record=True):  # the demo prints the short form instead
        warnings.simplefilter("always")
        trainer.train()
    os.environ.pop("TENSORBOARD_LOGGING_DIR", None)
    return capture.reports, trainer.state.log_history


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gradhealth demo --transformers", description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12, help="optimizer steps per scenario")
    ap.add_argument("--logdir", default="gradhealth_runs/transformers", help="where the TensorBoard logs go")
    ap.add_argument("--only", default=None, help="comma-separated scenario names (default: all): "
                    + ", ".join(s[0] for s in SCENARIOS))
    args = ap.parse_args(argv)
    picked = choose(args.only, [s[0] for s in SCENARIOS], ap.prog)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.set_num_threads(min(4, torch.get_num_threads()))
    chosen = [s for s in SCENARIOS if s[0] in picked]
    print(f"gradhealth demo --transformers: Hugging Face Trainer on a tiny BERT (random weights), {len(chosen)} "
          f"scenario{'' if len(chosen) == 1 else 's'}\n(what gradhealth said, in short: gh.brief(report); its warnings "
          "carry the full words)\n")
    rows = []
    for i, (name, cls, what) in enumerate(chosen, 1):
        print(f"[{i}/{len(chosen)}] {name}: {what}", flush=True)
        reports, history = run_scenario(name, cls, args.logdir, args.steps)
        show(reports, None, "transformers", [h["loss"] for h in history if "loss" in h])
        if name == "nan_batch":
            step = NaNLossOnce.bad_step + 1  # the step Trainer logs it at, and gradhealth's number for it
            row = next((h for h in history if h.get("step") == step and "loss" in h), None)
            if row is not None:
                print(f"    (Trainer's own log at step {step}: loss {row['loss']:.4g}, grad_norm {row.get('grad_norm')}: "
                      "its NaN filter hid the 0/0)")
        rows.append((name, verdict(reports, None)))
        print(flush=True)
    table(rows)
    logs(args.logdir, "Trainer's and gradhealth's logs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

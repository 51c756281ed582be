"""The Trainer callback's overhead: interleaved ``Trainer.train`` runs of a small BERT with and
without ``GradHealthCallback``, and the time spent inside gradhealth's code, as a share of a step."""

from __future__ import annotations

import logging
import statistics
import time

import torch
from transformers import BertConfig, BertForMaskedLM, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_callback import PrinterCallback, ProgressCallback

from gradhealth.benchmarks.lightning_fit import _Clock, measure_overhead, print_overhead
from gradhealth.integrations.transformers import GradHealthCallback


class _StepTimer(TrainerCallback):
    def __init__(self):
        self.times: list[float] = []
        self._t = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._t = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self._t)


class _Instrument(TrainerCallback):
    """Puts the gradhealth callback's hooks, its monitor's and the step hooks behind a clock."""

    def __init__(self, target: GradHealthCallback, clock: _Clock):
        self.target, self.clock = target, clock

    def on_train_begin(self, args, state, control, **kwargs):
        for name in ("_measure", "on_pre_optimizer_step", "on_step_end", "on_log", "_on_forward", "_on_backward"):
            self.clock.wrap(self.target, name)
        tracker = self.target.monitor.tracker
        if tracker is not None:
            for h in tracker._handles:
                h.remove()
            self.clock.wrap(tracker, "_post")
            tracker._handles = [o.register_step_post_hook(tracker._post) for o in self.target.monitor.optimizers]


class _Data(torch.utils.data.Dataset):
    def __init__(self, n: int, length: int, vocab: int):
        self.x = torch.randint(2, vocab, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def _train(steps: int, callback: GradHealthCallback | None, clock: _Clock | None, hidden: int, layers: int,
           batch: int, length: int) -> float:
    torch.manual_seed(0)
    model = BertForMaskedLM(BertConfig(vocab_size=1000, hidden_size=hidden, num_hidden_layers=layers,
                                       num_attention_heads=4, intermediate_size=4 * hidden, max_position_embeddings=length))
    timer = _StepTimer()
    extra = [] if callback is None else [callback] + ([_Instrument(callback, clock)] if clock else [])
    args = TrainingArguments("/tmp/gradhealth_bench_trainer", use_cpu=True, report_to=[], max_steps=steps,
                             per_device_train_batch_size=batch, logging_steps=10, save_strategy="no",
                             disable_tqdm=True, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=_Data(batch * steps, length, 1000),
                      callbacks=[timer] + extra)
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    trainer.train()
    return statistics.median(timer.times[3:])


def main(rounds: int = 5, steps: int = 15, hidden: int = 256, layers: int = 4, batch: int = 16, length: int = 64) -> None:
    logging.getLogger("transformers").setLevel(logging.ERROR)
    times, inside = measure_overhead(lambda cb, clock: _train(steps, cb, clock, hidden, layers, batch, length),
                                     lambda every: GradHealthCallback(every_n_steps=every), rounds, steps)
    n = layers * 12 * hidden * hidden / 1e6
    print_overhead(f"GradHealthCallback on Hugging Face Trainer.train: BERT {layers} layers x {hidden} (~{n:.1f}M in the "
                   f"layers), batch {batch} x {length} tokens, fused AdamW, CPU, median step over {rounds} interleaved runs:",
                   times, inside)

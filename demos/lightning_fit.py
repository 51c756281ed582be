"""``gradhealth demo``: the planted-bug scenarios as real ``Trainer.fit`` runs on synthetic data.

Each scenario trains the demo module with one classic mistake, with ``GradHealthCallback`` and a
TensorBoard logger, and prints what gradhealth said, in short; the last one is healthy and says
nothing. ``gradhealth demo --plain`` runs the same scenarios in a plain PyTorch loop.
"""

from __future__ import annotations

import argparse
import logging
import warnings

from gradhealth.demos.console import Capture, logs, show, table, verdict
from gradhealth.demos.plain import choose
from gradhealth.base.errors import GradModeError


SCENARIOS = [
    ("detached", "detached output", "out = model(x).detach() before the loss"),
    ("frozen", "frozen layer", "encoder.0 left frozen; expect_frozen=[] says nothing should be"),
    ("not_in_optimizer", "layer missing from the optimizer", "SGD(self.encoder.parameters()) leaves out the head"),
    ("division_by_zero", "division by zero", "a per-sample weight of 0 divided by"),
    ("missing_zero_grad", "missing zero_grad", "optimizer_zero_grad overridden to do nothing"),
    ("lr_zero", "learning rate 0", "a scheduler stuck at lr=0"),
    ("all_masked", "all-masked batch", "a padding mask that selects nothing: mean over the empty set"),
    ("eval_mode", "model left in eval()", "a validation helper that forgot model.train()"),
    ("mask_after_divide", "mask after divide", "standardize by std, then mask the std=0 feature (forward is clean)"),
    ("where_overflow", "torch.where over an overflow", "log(1+exp(x)) with the infs replaced by torch.where"),
    ("nan_batch", "NaN on one batch", "a zero weight divided by on batch 2 only: replayed to find the origin"),
    ("none", "healthy run", "the same module with no bug"),
]


def run_scenario(bug: str, root: str, steps: int, progress: bool = False) -> tuple[list, str | None, list]:
    """One ``Trainer.fit``: (every report, the GradModeError that stopped it or None, the losses)."""
    # (Lightning imported here, not with the module: ``demo --help`` and a bad ``--only`` answer in a second)
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import TensorBoardLogger

    from gradhealth.demos.lightning_parts import DemoModule, SyntheticData
    from gradhealth.integrations.lightning import GradHealthCallback

    pl.seed_everything(0, verbose=False)
    options = {"expect_frozen": []} if bug == "frozen" else {}
    capture = Capture()
    callback = GradHealthCallback(sinks=[capture], **options)
    trainer = pl.Trainer(
        max_steps=steps, accelerator="cpu", devices=1, logger=TensorBoardLogger(root, name=bug, version=0),
        callbacks=[callback], enable_checkpointing=False, enable_model_summary=False, log_every_n_steps=1,
        num_sanity_val_steps=0, limit_val_batches=0, enable_progress_bar=progress,
    )
    error = None
    with warnings.catch_warnings(record=True):  # the demo prints the short form instead (and no framework noise)
        warnings.simplefilter("always")
        try:
            trainer.fit(DemoModule(bug=bug), SyntheticData(n_batches=steps))
        except GradModeError as exc:
            error = str(exc)
    losses = [r.loss for r in capture.reports if r.loss is not None]
    return capture.reports, error, losses


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gradhealth demo", description=__doc__.splitlines()[0],
                                 epilog="gradhealth demo --plain: the same scenarios in a plain PyTorch loop; "
                                        "gradhealth demo --transformers: Hugging Face Trainer on a tiny BERT")
    ap.add_argument("--steps", type=int, default=6, help="optimizer steps per scenario")
    ap.add_argument("--logdir", default="gradhealth_runs/demo", help="where the TensorBoard logs go")
    ap.add_argument("--only", default=None, help="comma-separated scenario names (default: all): "
                    + ", ".join(s[0] for s in SCENARIOS))
    ap.add_argument("--progress", action="store_true", help="show Lightning's progress bar (off: one line per scenario)")
    ap.add_argument("--no-progress", action="store_true", help=argparse.SUPPRESS)  # the default now
    args = ap.parse_args(argv)
    picked = choose(args.only, [s[0] for s in SCENARIOS], ap.prog)
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)  # drop the banners
    chosen = [s for s in SCENARIOS if s[0] in picked]
    print(f"gradhealth demo: Trainer.fit on synthetic data, {len(chosen)} scenario{'' if len(chosen) == 1 else 's'}"
          "\n(what gradhealth said, in short: gh.brief(report); its warnings carry the full words)\n")
    rows = []
    for i, (bug, title, what) in enumerate(chosen, 1):
        print(f"[{i}/{len(chosen)}] {title}: {what}", flush=True)
        reports, error, losses = run_scenario(bug, args.logdir, args.steps, progress=args.progress and not args.no_progress)
        show(reports, error, "lightning", losses)
        rows.append((bug, verdict(reports, error)))
        print(flush=True)
    table(rows)
    logs(args.logdir, "TensorBoard logs of every scenario")
    return 0

"""Reading gradhealth's TensorBoard logs back: ``read_run`` and ``gradhealth report LOGDIR``."""

from __future__ import annotations

import json
import math
import os
import re
import sys

import numpy as np

from gradhealth.metrics import PREFIX

__all__ = ["read_run", "summarize_run", "main"]


def _event_dirs(path: str) -> list[str]:
    if os.path.isfile(path):
        return [os.path.dirname(path) or "."]
    dirs = []
    for d, _, files in os.walk(path):
        if any(f.startswith("events.out.tfevents") for f in files):
            dirs.append(d)
    return sorted(dirs)


_TRAINER = "train/"  # Hugging Face Trainer's reporters write every training key as train/<key>


def read_run(path, *, progress: bool = False, text: bool = False):
    """Every scalar in every event file under ``path``: a DataFrame (step, tag, value, wall_time,
    run). ``text=True`` adds the text events (a ``text`` column, value NaN). Raises
    ``FileNotFoundError`` / ``ValueError`` with the path for a missing, empty or unreadable log."""
    import pandas as pd
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"read_run: {path!r} does not exist; pass the log directory given to the TensorBoard writer or logger")
    dirs = _event_dirs(path)
    if not dirs:
        raise ValueError(f"read_run: no TensorBoard event files (events.out.tfevents.*) under {path!r}; was anything logged there?")
    rows = []
    for n, d in enumerate(dirs, 1):
        if progress:
            print(f"\rreading {n}/{len(dirs)} runs: {os.path.relpath(d, path)}", end="", file=sys.stderr, flush=True)
        acc = EventAccumulator(d, size_guidance={"scalars": 0, "tensors": 0, "images": 1, "histograms": 1})
        try:
            acc.Reload()
        except Exception as exc:
            raise ValueError(f"read_run: the event files in {d!r} cannot be read ({type(exc).__name__}: {exc})") from None
        run = os.path.relpath(d, path) if os.path.isdir(path) else "."
        tags = acc.Tags()
        for tag in tags.get("scalars", []):
            name = tag[len(_TRAINER):] if tag.startswith(_TRAINER + PREFIX + "/") else tag
            for e in acc.Scalars(tag):
                rows.append((e.step, name, float(e.value), e.wall_time, run, None))
        if text:
            for tag in tags.get("tensors", []):
                if not tag.endswith("/text_summary"):
                    continue  # e.g. the custom-scalars layout
                for e in acc.Tensors(tag):
                    if e.tensor_proto.string_val:
                        rows.append((e.step, tag[: -len("/text_summary")], math.nan, e.wall_time, run,
                                     e.tensor_proto.string_val[0].decode("utf-8", "replace")))
    if progress:
        print(file=sys.stderr)
    frame = pd.DataFrame(rows, columns=["step", "tag", "value", "wall_time", "run", "text"])
    if not text:
        frame = frame.drop(columns=["text"])
    if frame.empty:
        raise ValueError(f"read_run: the event files under {path!r} hold no scalars (a run that logged nothing, or a corrupt file)")
    return frame.sort_values(["run", "tag", "step"], kind="stable").reset_index(drop=True)


def _finding_text(text: str, kind: str) -> str:
    """The message of ``kind`` in a findings text written by the sink, or ''."""
    m = re.search(rf"\*\*{kind}\*\* \([^)]*\): (.*?)(?:\n\n\*\*|$)", text, flags=re.S)
    return m.group(1).strip() if m else ""


def summarize_run(frame) -> list[dict]:
    """What a person wants to know after a run, one dict per item found, from ``read_run(text=True)``."""
    items: list[dict] = []
    for run, df in frame.groupby("run", sort=True):
        scal = df[df["text"].isna()] if "text" in df else df
        totals = scal[scal["tag"].str.match(rf"{PREFIX}/grad_norm(_preclip)?/total")]
        # steps whose problems the policy tolerated (a grad scaler's skip, a transient zero gradient)
        tol = scal[scal["tag"].str.match(rf"{PREFIX}/tolerated(_opt\d+)?$")]
        tolerated = dict(zip(tol["step"].astype(int), tol["value"]))
        bad = totals[~np.isfinite(totals["value"].to_numpy())]
        bad = bad[np.array([tolerated.get(int(s), 0) == 0 for s in bad["step"]], dtype=bool)]
        if not bad.empty:
            step = int(bad["step"].min())
            at = scal[(scal["step"] == step) & scal["tag"].str.match(rf"{PREFIX}/grad_norm(_preclip)?/") & ~scal["tag"].str.endswith("/total")]
            where = sorted(t.split("/", 2)[2] for t in at[~np.isfinite(at["value"].to_numpy())]["tag"])
            origin = ""
            if "text" in df:
                texts = df[(df["tag"] == f"{PREFIX}/findings_text") & df["text"].notna() & (df["step"] >= step)]
                for t in texts.sort_values("step")["text"]:
                    origin = _finding_text(t, "NONFINITE_ORIGIN")
                    if origin:
                        origin = origin.split(". Usual repairs")[0]
                        break
            items.append({"run": run, "kind": "NON_FINITE_GRAD", "step": step,
                          "detail": f"first non-finite gradients at step {step} in {', '.join(where) or 'the total norm'}" + (f"; origin: {origin}" if origin else "")})
        for state in ("NO_GRAD", "NOT_IN_OPTIMIZER", "ZERO_GRAD"):
            counts = scal[scal["tag"].str.match(rf"{PREFIX}/status/{state}(_opt\d+)?$") & (scal["value"] > 0)]
            if state != "NOT_IN_OPTIMIZER":  # only what the policy counted as an error
                counts = counts[np.array([v > tolerated.get(int(s), 0) for s, v in zip(counts["step"], counts["value"])],
                                         dtype=bool)]
            if not counts.empty:
                first = int(counts["step"].min())
                items.append({"run": run, "kind": state, "step": first,
                              "detail": f"up to {int(counts['value'].max())} parameters {state} from step {first} on "
                                        f"({counts['step'].nunique()} checks)"})
        for kind, what in [("UNEXPECTED_FROZEN", "parameters frozen against expect_frozen"),
                           ("UNEXPECTED_TRAINABLE", "parameters trainable against expect_frozen"),
                           ("NOT_UPDATED", "parameters not updated by the optimizer step"),
                           ("STALE_GRAD", "gradients added onto already-applied ones (missing zero_grad)"),
                           ("VANISHING_GRAD", "gradients that vanished"), ("EXPLODING_GRAD", "gradient spikes"),
                           ("EMPTY_VALID_SET", "empty valid sets"), ("GRAD_MODE", "grad-mode mistakes"),
                           ("FROZEN_BUT_CHANGED", "frozen parameters moved by the optimizer")]:
            hits = scal[(scal["tag"] == f"{PREFIX}/findings/{kind}") & (scal["value"] > 0)]
            if not hits.empty:
                steps = sorted(int(s) for s in hits["step"].unique())
                shown = ", ".join(map(str, steps[:8])) + (" ..." if len(steps) > 8 else "")
                detail = f"{what} at {len(steps)} steps ({shown})"
                if "text" in df:
                    texts = df[(df["tag"] == f"{PREFIX}/findings_text") & df["text"].notna() & df["text"].str.contains(kind)]
                    if not texts.empty:
                        detail += ": " + _finding_text(texts.sort_values("step")["text"].iloc[0], kind)[:300]
                items.append({"run": run, "kind": kind, "step": steps[0], "detail": detail})
        never = []
        upd = scal[scal["tag"].str.startswith(f"{PREFIX}/update_norm/") & ~scal["tag"].str.endswith("/total")]
        for tag, g in upd.groupby("tag"):
            if len(g) >= 2 and (g["value"] == 0).all():
                never.append(tag.split("/", 2)[2])
        if never:
            items.append({"run": run, "kind": "NEVER_UPDATED", "step": None, "detail": f"never updated in any measured step: {', '.join(sorted(never))}"})
    return items


def main(argv: list[str] | None = None) -> int:
    """``gradhealth report LOGDIR [--format text|csv|json]``."""
    import argparse

    ap = argparse.ArgumentParser(prog="gradhealth report", description="What gradhealth saw in a run, from its TensorBoard event files.")
    ap.add_argument("logdir")
    ap.add_argument("--format", choices=("text", "csv", "json"), default="text")
    args = ap.parse_args(argv)
    try:
        frame = read_run(args.logdir, progress=args.format == "text" and sys.stderr.isatty(), text=True)
    except (FileNotFoundError, ValueError) as exc:
        print(f"gradhealth report: {exc}", file=sys.stderr)
        return 2
    items = summarize_run(frame)
    if args.format == "json":
        print(json.dumps(items, indent=2))
    elif args.format == "csv":
        import csv

        out = csv.DictWriter(sys.stdout, fieldnames=["run", "kind", "step", "detail"])
        out.writeheader()
        out.writerows(items)
    else:
        runs = sorted(frame["run"].unique())
        print(f"gradhealth report: {len(runs)} run(s) under {args.logdir}")
        for run in runs:
            mine = [i for i in items if i["run"] == run]
            print(f"\n{run}: " + ("nothing to report" if not mine else f"{len(mine)} finding(s)"))
            for i in mine:
                print(f"  {i['kind']}: {i['detail']}")
    return 0

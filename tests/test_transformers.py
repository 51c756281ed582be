"""The Hugging Face Trainer callback, on real ``Trainer`` runs (CPU, tiny BERT, random weights),
and the core's handling of Accelerate's optimizer wrapper in a plain ``accelerate`` loop."""

import json
import math
import os
import warnings

import pytest
import torch

import gradhealth as gh

pytestmark = pytest.mark.usefixtures("one_thread", "frozen_heap")  # (frozen_heap: tests/heap.py)
transformers = pytest.importorskip("transformers")

from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from gradhealth.integrations.transformers import GradHealthCallback  # noqa: E402
from gradhealth.demos.hf_trainer import HeadOutOfOptimizer, NaNLossOnce, Tokens, tiny_bert  # noqa: E402
from gradhealth.base.report import frozen_summary  # noqa: E402
from conftest import CountClips  # noqa: E402
from heap import frozen_heap  # noqa: E402,F401  (a fixture)


def arguments(out, **kw):
    base = dict(use_cpu=True, report_to=[], max_steps=20, per_device_train_batch_size=4, logging_steps=5,
                warmup_steps=5, save_strategy="no", disable_tqdm=True, seed=0, data_seed=0)
    base.update(kw)
    return TrainingArguments(str(out), **base)


def names(report, status):
    return [n for n, s in report.status.items() if s is status]


def train_strict(trainer):
    with warnings.catch_warnings():
        warnings.simplefilter("error", gh.GradHealthWarning)
        trainer.train()


class FixedScaler(Trainer):
    """fp16 with a real grad scaler on CPU: Accelerate makes one (and unscales before clipping)
    only on accelerators, so the test turns that path on before ``prepare``; the rest is Trainer's
    and Accelerate's own code. The scale starts at 2**24 so that the first steps overflow and
    are skipped while it settles (with Trainer's default fused AdamW, which runs its step hooks
    and skips inside the kernel)."""

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        self.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
        self.accelerator.native_amp = True


@pytest.mark.parametrize("case", ["warmup_clip", "accumulate4", "bf16", "checkpointing", "lora", "fp16_scaler"])
def test_healthy_trainer_runs_are_silent_under_raise(tmp_path, case):
    model = tiny_bert()
    kw: dict = {"max_grad_norm": 0.5}
    options: dict = {}
    cls = Trainer
    if case == "accumulate4":
        kw["gradient_accumulation_steps"] = 4
    elif case == "bf16":
        kw["bf16"] = True
    elif case == "checkpointing":
        kw["activation_checkpointing"] = True
    elif case == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["query", "value"]))
        # every HF name but the adapters'
        options["expect_frozen"] = ["*.base_layer.*", "*embeddings*", "*.self.key.*", "*.output.*", "*.intermediate.*",
                                    "*predictions*"]
    elif case == "fp16_scaler":
        kw["fp16"] = True
        cls = FixedScaler
    kept = Kept()
    cb = GradHealthCallback(on_problem="raise", sinks=[kept], **options)
    trainer = cls(model=model, args=arguments(tmp_path, **kw), train_dataset=Tokens(), callbacks=[cb])
    train_strict(trainer)
    report = cb.last_report
    assert report is not None and report.ok and report.step == 20, str(report)
    if case == "lora":
        frozen = names(report, gh.Status.FROZEN)
        assert frozen and all("lora_" not in n for n in frozen)
        assert {n for n, s in report.status.items() if s is gh.Status.OK} == {
            n for n, p in model.named_parameters() if p.requires_grad}
        # the frozen part is one summary line in the words a user reads
        line = frozen_summary(report.status)
        assert len(line.splitlines()) == 1 and "42 frozen" not in line and "(adapters are training)" in line
    if case == "fp16_scaler":
        assert trainer.accelerator.scaler is not None
        # unscaled pre-clip norms: Trainer's own grad_norm (unscaled before clipping) once the
        # scale has settled; the first steps overflowed, were skipped and tolerated (info)
        rows = [h for h in trainer.state.log_history if "gradhealth/grad_norm_preclip/total" in h]
        assert rows and all(h["gradhealth/status/OK"] == 42 for h in rows[1:])
        for h in rows[1:]:
            assert h["gradhealth/grad_norm_preclip/total"] == pytest.approx(h["grad_norm"], rel=1e-4)
        assert trainer.accelerator.scaler.get_scale() < 2.0**24  # it did skip steps
        skipped = [r.step for r in kept.reports if r.findings_of("AMP_SKIPPED")]
        assert skipped and skipped == list(range(1, len(skipped) + 1))  # labelled, as info, while settling
        assert all(f.level == "info" for r in kept.reports for f in r.findings_of("AMP_SKIPPED"))


class PreClipReference(TrainerCallback):
    """The oracle: every parameter's gradient norm, read after each accumulation into ``.grad``
    (the last reading of a step is the complete, unclipped gradient), per optimizer step."""

    def __init__(self, model):
        self.latest: dict[str, float] = {}
        self.steps: list[dict[str, float]] = []
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(
                    lambda p, name=name: self.latest.__setitem__(name, float(p.grad.double().norm())))

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.steps.append(dict(self.latest))


@pytest.mark.parametrize("accumulation", [1, 3])
def test_norms_are_pre_clip_and_equal_a_hand_computed_reference(tmp_path, accumulation):
    model = tiny_bert()
    ref = PreClipReference(model)
    seen = []

    class Keep(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            seen.append(cb.last_report)

    cb = GradHealthCallback(granularity="param")
    # max_grad_norm far below the gradient norm: every step is clipped hard
    args = arguments(tmp_path, max_steps=6, max_grad_norm=1e-3, logging_steps=1,
                     gradient_accumulation_steps=accumulation)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[cb, ref, Keep()])
    train_strict(trainer)
    assert len(ref.steps) == len(seen) == 6
    for expected, report in zip(ref.steps, seen):
        assert set(report.grad_norm) == set(expected)
        for name, v in expected.items():
            assert report.grad_norm[name] == pytest.approx(v, rel=1e-5), name
        total = math.sqrt(sum(v * v for v in expected.values()))
        assert report.total_grad_norm == pytest.approx(total, rel=1e-5)
        assert report.total_grad_norm > 100 * 1e-3  # far above what clipping left
    # the logged key equals Trainer's own pre-clip grad_norm at every logging step
    logged = [h for h in trainer.state.log_history if "grad_norm" in h]
    assert len(logged) == 6
    for h in logged:
        assert h["gradhealth/grad_norm_preclip/total"] == pytest.approx(h["grad_norm"], rel=1e-5)


def test_head_left_out_of_the_optimizer_raises_at_step_0_before_the_step(tmp_path):
    model = tiny_bert()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    cb = GradHealthCallback(on_problem="raise")
    trainer = HeadOutOfOptimizer(model=model, args=arguments(tmp_path), train_dataset=Tokens(), callbacks=[cb])
    with pytest.raises(gh.GradHealthError) as info:
        trainer.train()
    report = info.value.report
    assert report.step == 1  # Trainer's numbering: the check before the step that makes global_step 1
    assert set(names(report, gh.Status.NOT_IN_OPTIMIZER)) == {
        n for n in before if "cls.predictions.transform" in n}
    assert "cls.predictions.transform" in str(info.value)
    # raised from on_pre_optimizer_step: the faulty step was never applied
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_stop_warns_once_and_ends_training_cleanly(tmp_path):
    cb = GradHealthCallback(on_problem="stop")
    trainer = HeadOutOfOptimizer(model=tiny_bert(), args=arguments(tmp_path), train_dataset=Tokens(), callbacks=[cb])
    with pytest.warns(gh.GradHealthWarning, match="NOT_IN_OPTIMIZER") as got:
        out = trainer.train()
    assert trainer.state.global_step == 1 and out.global_step == 1
    assert len([w for w in got if issubclass(w.category, gh.GradHealthWarning)]) == 1
    # a problem is logged at its own step even between logging steps (logging_steps=5)
    [row] = [h for h in trainer.state.log_history if "gradhealth/status/NOT_IN_OPTIMIZER" in h]
    assert row["step"] == 1 and row["gradhealth/status/NOT_IN_OPTIMIZER"] == 4.0


def test_nan_loss_hidden_by_trainer_filter_is_named_at_its_step(tmp_path):
    # (8 steps: the 0/0 is at step 8. Every step after it is NaN too, from NaN weights, and each of
    # them the callback would replay with the NaN tracer: 12 replays more, asserted on by nothing)
    cb = GradHealthCallback(on_problem="warn")
    trainer = NaNLossOnce(model=tiny_bert(), args=arguments(tmp_path, logging_steps=1, max_steps=8), train_dataset=Tokens(),
                          callbacks=[cb])
    with pytest.warns(gh.GradHealthWarning) as got:
        trainer.train()
    texts = [str(w.message) for w in got if issubclass(w.category, gh.GradHealthWarning)]
    assert texts and texts[0].startswith("gradhealth step 8:") and "NON_FINITE_GRAD" in texts[0]
    # Trainer's own loss log stays finite; gradhealth's status says what happened
    row = next(h for h in trainer.state.log_history if h.get("step") == 8)
    assert math.isfinite(row["loss"])
    assert row["gradhealth/status/NON_FINITE_GRAD"] == 42


def test_one_nan_gradient_is_named_alone_although_clipping_spreads_it(tmp_path):
    """Clipping multiplies every gradient by max_norm/NaN: measured after it, every parameter
    would be NON_FINITE. Pre-clip, the report names the one parameter that really had it."""
    model = tiny_bert()
    target = "bert.encoder.layer.1.output.dense.weight"
    state = {"step": -1}

    class Poison(TrainerCallback):
        def on_step_begin(self, args, st, control, **kwargs):
            state["step"] = st.global_step

    dict(model.named_parameters())[target].register_hook(
        lambda g: torch.full_like(g, float("nan")) if state["step"] == 3 else g)
    kept = Kept()
    cb = GradHealthCallback(on_problem="warn", trace_on_nonfinite=False, sinks=[kept])
    trainer = Trainer(model=model, args=arguments(tmp_path, max_steps=5, max_grad_norm=1.0), train_dataset=Tokens(),
                      callbacks=[Poison(), cb])
    with pytest.warns(gh.GradHealthWarning) as got:
        trainer.train()
    assert [str(w.message).split(":")[0] for w in got][:2] == ["gradhealth step 4", "gradhealth step 5"]
    [bad] = [r for r in kept.reports if r.step == 4]
    assert names(bad, gh.Status.NON_FINITE_GRAD) == [target]
    assert all(r.ok for r in kept.reports if r.step < 4)
    # (Trainer's clipping then spread it: the step wrote NaN into every weight, and step 4 says so)
    [after] = [r for r in kept.reports if r.step == 5]
    assert len(names(after, gh.Status.NON_FINITE_GRAD)) == 42


class Kept:
    """A sink that keeps every report."""

    def __init__(self):
        self.reports = []

    def write(self, report):
        self.reports.append(report)


def test_metrics_reach_tensorboard_through_report_to(tmp_path, monkeypatch):
    from gradhealth.integrations.tbreport import read_run

    logdir = tmp_path / "tb"
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(logdir))
    cb = GradHealthCallback(granularity="module")  # per-module keys too (the default logs headlines only)
    trainer = Trainer(model=tiny_bert(), args=arguments(tmp_path / "out", report_to=["tensorboard"]),
                      train_dataset=Tokens(), callbacks=[cb])
    train_strict(trainer)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    # Trainer's reporters prefix training keys with train/; gradhealth report reads them back
    assert "train/gradhealth/grad_norm_preclip/total" in acc.Tags()["scalars"]
    frame = read_run(str(logdir))
    scalars = {tag: dict(zip(rows.step, rows.value)) for tag, rows in frame.groupby("tag")}
    for key in ("gradhealth/grad_norm_preclip/total", "gradhealth/status/OK", "gradhealth/loss",
                "gradhealth/grad_norm_preclip/cls.predictions.transform.dense"):
        assert key in scalars, sorted(scalars)[:20]
    assert sorted(scalars["gradhealth/grad_norm_preclip/total"]) == [5, 10, 15, 20]
    logged = {h["step"]: h["gradhealth/grad_norm_preclip/total"] for h in trainer.state.log_history
              if "gradhealth/grad_norm_preclip/total" in h}
    assert scalars["gradhealth/grad_norm_preclip/total"] == pytest.approx(logged, rel=1e-6)
    assert scalars["gradhealth/status/OK"] == {5: 42.0, 10: 42.0, 15: 42.0, 20: 42.0}


def test_state_rides_in_checkpoints_and_resume_continues_the_history(tmp_path):
    kw = dict(max_steps=20, save_strategy="steps", save_steps=10)
    # the uninterrupted run (its end: the reference) leaves the checkpoint at step 10 to resume from
    first = GradHealthCallback()
    Trainer(model=tiny_bert(), args=arguments(tmp_path / "b", **kw), train_dataset=Tokens(), callbacks=[first]).train()
    expected = first.state()["attributes"]["_pending_state"]
    saved = json.load(open(tmp_path / "b" / "checkpoint-10" / "trainer_state.json"))["stateful_callbacks"]
    assert saved["GradHealthCallback"]["attributes"]["_pending_state"]["checks"] == 10

    resumed = GradHealthCallback()  # a fresh process would build a fresh callback
    Trainer(model=tiny_bert(seed=1), args=arguments(tmp_path / "b", **kw), train_dataset=Tokens(),
            callbacks=[resumed]).train(resume_from_checkpoint=str(tmp_path / "b" / "checkpoint-10"))
    got = resumed.state()["attributes"]["_pending_state"]
    assert got["checks"] == expected["checks"] == 20
    assert got["history"]["seen"] == expected["history"]["seen"]
    assert got["history"]["total"] == pytest.approx(expected["history"]["total"], rel=1e-4)


def test_restore_callback_states_rebuilds_the_same_options(tmp_path):
    kw = dict(max_steps=12, save_strategy="steps", save_steps=6)
    cb = GradHealthCallback(on_problem="stop", expect_frozen=["nothing.*"], every_n_steps=2)
    Trainer(model=tiny_bert(), args=arguments(tmp_path, **kw), train_dataset=Tokens(), callbacks=[cb]).train()
    trainer = Trainer(model=tiny_bert(), args=arguments(tmp_path, restore_callback_states_from_checkpoint=True, **kw),
                      train_dataset=Tokens(), callbacks=[GradHealthCallback()])
    trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-6"))
    [rebuilt] = [c for c in trainer.callback_handler.callbacks if isinstance(c, GradHealthCallback)]
    assert rebuilt.stop and rebuilt.options.every_n_steps == 2 and rebuilt.options.expect_frozen == ("nothing.*",)
    assert rebuilt.state()["attributes"]["_pending_state"]["checks"] == 6  # 3 before, 3 after (every 2nd step)


def test_on_problem_lists_stop_among_the_choices():
    # (the options both callbacks share are in test_validation.py)
    with pytest.raises(ValueError, match="on_problem must be one of 'warn', 'raise', 'ignore', 'stop'; got 'panic'"):
        GradHealthCallback(on_problem="panic")


def test_core_accepts_accelerates_optimizer_wrapper():
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
    model, wrapped = acc.prepare(model, opt)
    assert type(wrapped).__name__ == "AcceleratedOptimizer"
    mon = gh.GradHealth(acc.unwrap_model(model), wrapped)
    assert mon.optimizers == [opt]
    model(torch.randn(8, 4)).pow(2).mean().backward()
    report = mon.measure(optimizer=wrapped)
    assert names(report, gh.Status.NOT_IN_OPTIMIZER) == ["1.weight", "1.bias"]
    with pytest.raises(ValueError, match="not the monitor's optimizer"):
        mon.measure(optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    mon.close()


def accelerate_loop(bug: bool, steps=12, accumulation=2, shared=None):
    """The README recipe: the plain-loop monitor inside an ``accelerate`` loop (``shared``: its clip
    with the check's norms, :func:`gradhealth.integrations.accelerate.share_clip`)."""
    from accelerate import Accelerator
    from transformers import get_linear_schedule_with_warmup

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
    model = tiny_bert()
    params = [p for n, p in model.named_parameters() if not (bug and "cls.predictions.transform" in n)]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    scheduler = get_linear_schedule_with_warmup(optimizer, 3, steps)
    data = torch.utils.data.DataLoader(Tokens(n=4 * steps * accumulation), batch_size=4)
    model, optimizer, data, scheduler = accelerator.prepare(model, optimizer, data, scheduler)
    monitor = gh.GradHealth(accelerator.unwrap_model(model), optimizer, scaler=accelerator.scaler,
                            on_problem="raise")
    if shared:  # (False: the same loop, torch's clip; both return the model too)
        from gradhealth.integrations.accelerate import share_clip

        share_clip(accelerator, monitor)
    reports = []
    for step, batch in enumerate(data):
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                reports.append(monitor.check(loss))
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    monitor.close()
    return reports if shared is None else (reports, accelerator.unwrap_model(model))


def test_accelerate_recipe_is_silent_when_healthy_and_names_the_bug():
    with warnings.catch_warnings():
        warnings.simplefilter("error", gh.GradHealthWarning)
        reports = accelerate_loop(bug=False)
    assert len(reports) == 12 and all(r.ok for r in reports)
    assert [r.step for r in reports] == list(range(12))
    with pytest.raises(gh.GradHealthError, match="cls.predictions.transform") as info:
        accelerate_loop(bug=True)
    assert info.value.report.step == 0


def test_import_gradhealth_loads_no_transformers():
    import procs
    import sys

    code = "import sys, gradhealth; print([m for m in sys.modules if m.split('.')[0] in ('transformers', 'accelerate', 'peft')])"
    out = procs.run([sys.executable, "-c", code], capture_output=True, text=True,
                    env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


@pytest.mark.slow  # (over 10 s: make test runs it, make test-fast does not)
def test_demo_transformers_names_both_bugs_and_is_silent_when_healthy(tmp_path):
    import procs
    import sys

    res = procs.run([sys.executable, "-m", "gradhealth", "demo", "--transformers", "--steps", "9", "--logdir",
                     str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    blocks = out.split("\n[")
    assert "NOT_IN_OPTIMIZER in cls.predictions.transform.* (4 params)" in blocks[1]
    assert "create_optimizer" in blocks[1]
    # the 0/0 at step 8 named at that step: the replay runs the custom compute_loss itself, so the
    # tracer names the division in it, outside the model
    assert "step 8: NON_FINITE_GRAD in all 42 parameters" in blocks[2]
    assert "origin: outside the modules, div at hf_trainer.py:" in blocks[2] and "0/0" in blocks[2]
    assert "gh.safe_div" in blocks[2]
    assert "Trainer's own log at step 8: loss 0" in blocks[2]
    assert "silent: every parameter trains" in blocks[3]
    assert f"gradhealth report {tmp_path}" in out and f"tensorboard --logdir {tmp_path}" in out
    assert max(len(line) for line in out.splitlines() if str(tmp_path) not in line) <= 100
    assert "{'loss'" not in out  # Trainer's per-step log lines are off


def test_a_state_that_cannot_be_restored_warns_and_training_goes_on(tmp_path):
    cb = GradHealthCallback()
    cb._pending_state = {"checks": "not a number"}  # as from a checkpoint of something else
    trainer = Trainer(model=tiny_bert(), args=arguments(tmp_path, max_steps=3), train_dataset=Tokens(), callbacks=[cb])
    with pytest.warns(gh.GradHealthInternalWarning, match="not restored"):
        trainer.train()
    assert cb.state()["attributes"]["_pending_state"]["checks"] == 3


def test_every_option_but_sinks_rides_in_the_callbacks_json_state():
    """Trainer rebuilds a callback from ``state()["args"]`` on resume: an option left out of it
    would silently fall back to its default."""
    import dataclasses

    from gradhealth.integrations.transformers import _JSON_OPTIONS

    assert set(_JSON_OPTIONS) == {f.name for f in dataclasses.fields(gh.Options)} - {"sinks"}
    cb = GradHealthCallback(change_every=2, update_every=7)
    args = cb.state()["args"]
    assert args["change_every"] == 2 and args["update_every"] == 7
    json.dumps(args)


def test_trainer_logs_stay_short_on_a_deep_model_and_detail_is_one_option_away(tmp_path):
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=100, hidden_size=16, num_hidden_layers=12, num_attention_heads=2, intermediate_size=32,
                     max_position_embeddings=32)
    lengths, keys = {}, {}
    for granularity in ("total", "module"):
        cb = GradHealthCallback(granularity=granularity)
        trainer = Trainer(model=BertForMaskedLM(cfg), args=arguments(tmp_path / granularity, max_steps=10),
                          train_dataset=Tokens(), callbacks=[cb])
        train_strict(trainer)
        rows = [h for h in trainer.state.log_history if "gradhealth/grad_norm_preclip/total" in h]
        assert rows
        lengths[granularity] = max(len(str(h)) for h in trainer.state.log_history)
        keys[granularity] = set().union(*rows)
    assert lengths["total"] <= 2000  # the bound: one logged line of at most 2,000 characters, 12 layers or not
    assert "gradhealth/status/NO_GRAD" in keys["total"] and "gradhealth/findings/STALE_GRAD" not in keys["total"]
    assert not any(k.startswith("gradhealth/update_norm/bert.") for k in keys["total"])
    per_module = {k for k in keys["module"] if k.startswith("gradhealth/grad_norm_preclip/bert.encoder.layer.")}
    assert len({k.split(".layer.")[1].split(".")[0] for k in per_module}) == 12  # every layer with the option
    assert lengths["module"] > 5 * lengths["total"]


@pytest.mark.slow  # (over 10 s: make test runs it, make test-fast does not)
def test_report_names_the_parameters_of_a_trainer_run(tmp_path, monkeypatch):
    """With report_to TensorBoard the callback also writes the full detail into Trainer's run, so
    `gradhealth report` names the parameters in every format, as for Lightning runs."""
    import csv
    import io
    import procs
    import sys

    from gradhealth.demos.hf_trainer import HeadOutOfOptimizer

    logdir = tmp_path / "tb"
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(logdir))
    trainer = HeadOutOfOptimizer(model=tiny_bert(), args=arguments(tmp_path / "out", report_to=["tensorboard"], max_steps=6),
                                 train_dataset=Tokens(), callbacks=[GradHealthCallback(on_problem="ignore")])
    trainer.train()
    head = [f"cls.predictions.transform.{m}" for m in ("dense.weight", "dense.bias", "LayerNorm.weight", "LayerNorm.bias")]
    cb = next(c for c in trainer.callback_handler.callbacks if isinstance(c, GradHealthCallback))
    assert names(cb.last_report, gh.Status.NOT_IN_OPTIMIZER) == head  # the premise

    def report(*args):
        res = procs.run([sys.executable, "-m", "gradhealth", "report", str(logdir), *args], capture_output=True,
                        text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        return res.stdout

    [row] = [r for r in json.loads(report("--format", "json")) if r["kind"] == "NOT_IN_OPTIMIZER"]
    assert row["names"] == head and row["step"] == 1
    assert "cls.predictions.transform.* (4 params)" in report()
    assert " ".join(head) in " ".join(c for r in csv.reader(io.StringIO(report("--format", "csv"))) for c in r)
    assert "cls.predictions.transform.dense.weight" in " ".join(report("--verbose").split())


class _Regressor(torch.nn.Module):
    """A model Trainer can train (returns its loss); records at which micro-batch of the step an
    input held an inf."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        self.calls = 0
        self.poisoned_at: list[int] = []

    def forward(self, x, labels=None):
        if torch.is_grad_enabled() and self.training:
            if not torch.isfinite(x).all():
                self.poisoned_at.append(self.calls)
            self.calls += 1
        out = self.body(x)
        return {"loss": torch.nn.functional.mse_loss(out.squeeze(-1), labels), "logits": out}


class _Rows(torch.utils.data.Dataset):
    def __init__(self, n=64, poison=None):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 4, generator=g)
        self.y = self.x @ torch.tensor([1.0, -2.0, 0.5, 1.5])  # learnable
        if poison is not None:
            self.x[poison, 1] = math.inf

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


@pytest.mark.parametrize("lag, logging", [(0, 5), (1, 5), (1, 1)])
def test_accumulation_replay_names_the_micro_batch_that_made_the_nan(tmp_path, lag, logging):
    """(With ``lag=1`` the report arrives a step later, and the replay runs that step's own
    micro-batches, not the current step's; the last report is the last step's. Trainer's logging at
    every step fetches the update numbers only: the check in flight stays in flight.)"""
    model = _Regressor()
    kept = Kept()
    cb = GradHealthCallback(on_problem="ignore", skip_nonfinite=True, sinks=[kept], lag=lag)
    steps = 4 + lag  # (lag=1: a step after the NaN's, to complete its check)
    trainer = Trainer(model=model, args=arguments(tmp_path, max_steps=steps, gradient_accumulation_steps=4,
                                                  max_grad_norm=1.0, warmup_steps=0, logging_steps=logging),
                      train_dataset=_Rows(poison=37), callbacks=[cb])
    trainer.train()
    at = model.poisoned_at[0]  # the premise: one training micro-batch held the inf (the others: its replays)
    step, micro = at // 4 + 1, at % 4
    bad = [r for r in kept.reports if not r.grads_finite]
    assert [r.step for r in bad][:1] == [step] and len(bad) <= 1 + lag  # (step 5 starts the next epoch: it may too)
    [f] = [f for f in bad[0].findings_of("NONFINITE_ORIGIN") if "reproduced" in f.data]
    assert f.data["reproduced"] is True and f.data["micro_batch"] == micro, f.message
    assert f"micro-batch {micro + 1} of the 4 accumulated into step {step}" in f.message
    assert f.data["input_nonfinite"] is True and f.data["forward_origin"] == "body.0"
    assert model.calls == 4 * steps + micro + 1  # the replays stopped at the micro-batch that made it
    assert cb.last_report.step == steps and sorted(r.step for r in kept.reports) == list(range(1, steps + 1))


def test_healthy_accumulation_with_the_replay_on_is_silent_and_learns(tmp_path):
    model = _Regressor()
    kept = Kept()
    cb = GradHealthCallback(on_problem="raise", sinks=[kept])
    trainer = Trainer(model=model, args=arguments(tmp_path, max_steps=16, gradient_accumulation_steps=4,
                                                  learning_rate=3e-2, logging_steps=1, warmup_steps=0),
                      train_dataset=_Rows(), callbacks=[cb])
    train_strict(trainer)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(kept.reports) == 16 and all(r.ok for r in kept.reports)
    assert sum(losses[-4:]) < sum(losses[:4])
    assert cb._batches.window == []  # nothing kept once training ended


def test_accelerates_clip_shares_the_checks_norms(monkeypatch):
    counter = CountClips(monkeypatch)
    reports, model = accelerate_loop(bug=False, shared=True)
    assert counter.calls == 0 and len(reports) == 12 and all(r.ok for r in reports)
    assert all(r.clip_coef is not None for r in reports) and any(r.clip_coef < 1.0 for r in reports)  # it bit
    _, twin = accelerate_loop(bug=False, shared=False)  # accelerate's own clip: torch's
    assert counter.calls == 12
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-7), name  # the same training


def test_trainers_max_grad_norm_clips_with_the_checks_norms(tmp_path, monkeypatch):
    counter = CountClips(monkeypatch)
    runs = {}
    for with_callback in (True, False):
        model = tiny_bert()
        cb = GradHealthCallback(on_problem="raise")
        trainer = Trainer(model=model, args=arguments(tmp_path / str(with_callback), max_steps=6, max_grad_norm=0.5,
                                                      logging_steps=1), train_dataset=Tokens(),
                          callbacks=[cb] if with_callback else [])
        before = counter.calls
        train_strict(trainer)
        runs[with_callback] = (model, counter.calls - before, trainer.state.log_history)
    (ours, calls, logs), (twin, twin_calls, twin_logs) = runs[True], runs[False]
    assert calls == 0 and twin_calls == 6  # Trainer's clip read the gradients again at every step, without us
    assert "clip_grad_norm_" not in vars(trainer.accelerator)  # (undone at the end of train())
    for (name, p), q in zip(ours.named_parameters(), twin.parameters()):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-7), name
    steps = [h for h in logs if "grad_norm" in h]
    assert [h["grad_norm"] for h in steps] == pytest.approx([h["grad_norm"] for h in twin_logs if "grad_norm" in h], rel=1e-5)
    for h in steps:
        assert h["gradhealth/grad_norm_preclip/total"] == pytest.approx(h["grad_norm"], rel=1e-5)
        assert h["gradhealth/clip_coef"] == pytest.approx(min(1.0, 0.5 / (h["grad_norm"] + 1e-6)), rel=1e-5)


class OwnLoss(Trainer):
    """A custom ``compute_loss`` that backpropagates its own loss from the logits (what TRL's
    trainers do), never the model's ``outputs.loss``; ``no_grad``: the whole of it under
    ``torch.no_grad()`` (the mistake); ``reference``: a no-grad reference forward beside the loss
    (a DPO-style reference model, legitimate)."""

    def __init__(self, *a, mode="own", **kw):
        super().__init__(*a, **kw)
        self.mode = mode

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.mode == "no_grad":
            with torch.no_grad():
                out = model(x=inputs["x"])
                return torch.nn.functional.l1_loss(out["logits"].squeeze(-1), inputs["labels"])
        if self.mode == "reference":
            with torch.no_grad():
                model(x=inputs["x"])  # (the reference forward: no gradient, on purpose)
        out = model(x=inputs["x"])  # no labels: the model's own loss is not made, this one is
        return torch.nn.functional.l1_loss(out["logits"].squeeze(-1), inputs["labels"])


class _NoLabelRegressor(_Regressor):
    def forward(self, x, labels=None):
        out = self.body(x)
        return {"logits": out} if labels is None else super().forward(x, labels)


@pytest.mark.parametrize("mode", ["own", "reference"])
def test_trainer_judges_the_loss_it_backpropagates_pre_clip(tmp_path, mode):
    """Checked at the end of the backward of the loss compute_loss returned (not outputs.loss):
    pre-clip (no POSTCLIP), its norms equal the pre-clip reference, the loss judged is the one
    backpropagated; silent under raise, learning."""
    torch.manual_seed(0)
    model = _NoLabelRegressor()
    kept, ref = Kept(), PreClipReference(model)
    trainer = OwnLoss(model=model, args=arguments(tmp_path, max_steps=12, max_grad_norm=0.5, learning_rate=3e-2,
                                                  logging_steps=1, warmup_steps=0),
                      train_dataset=_Rows(), callbacks=[GradHealthCallback(on_problem="raise", sinks=[kept]), ref],
                      mode=mode)
    train_strict(trainer)
    assert len(kept.reports) == 12 and all(r.ok and not r.findings_of("POSTCLIP") for r in kept.reports)
    for r, norms in zip(kept.reports, ref.steps):
        assert r.total_grad_norm == pytest.approx(math.sqrt(sum(v * v for v in norms.values())), rel=1e-5)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert kept.reports[0].loss == pytest.approx(losses[0], rel=1e-5)  # the l1 loss, not an MSE the model never made
    assert sum(losses[-3:]) < sum(losses[:3])


def test_compute_loss_under_no_grad_is_a_grad_mode_error_naming_it(tmp_path):
    model = _NoLabelRegressor()
    trainer = OwnLoss(model=model, args=arguments(tmp_path, max_steps=2), train_dataset=_Rows(),
                      callbacks=[GradHealthCallback()], mode="no_grad")
    with pytest.raises(gh.GradModeError, match="compute_loss") as caught:
        trainer.train()
    assert "no_grad" in str(caught.value)


def test_a_nan_through_a_custom_compute_loss_is_replayed_to_its_micro_batch(tmp_path):
    """The replay runs Trainer's own compute_loss again (the loss the step backpropagated, not the
    model's): a custom loss from the logits with an inf input in one micro-batch of four."""
    model = _NoLabelRegressor()
    kept = Kept()
    trainer = OwnLoss(model=model, args=arguments(tmp_path, max_steps=4, gradient_accumulation_steps=4, max_grad_norm=1.0,
                                                  warmup_steps=0),
                      train_dataset=_Rows(poison=37), callbacks=[GradHealthCallback(on_problem="ignore", skip_nonfinite=True,
                                                                                    sinks=[kept])])
    trainer.train()
    bad = [r for r in kept.reports if not r.grads_finite]
    assert len(bad) == 1  # the premise: one step held the inf
    [f] = [f for f in bad[0].findings_of("NONFINITE_ORIGIN") if "reproduced" in f.data]
    assert f.data["reproduced"] is True and f.data["input_nonfinite"] is True
    assert f.data["forward_origin"] == "body.0" and 0 <= f.data["micro_batch"] < 4


class ClampedTokenMean(Trainer):
    """TRL's loss in short: a token sum divided by Trainer's count of label tokens, the count
    clamped to 1, so a batch with no label token gives a loss of exactly 0 (no NaN)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs["labels"]
        logits = model(input_ids=inputs["input_ids"]).logits
        per_token = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="none")
        return per_token.sum() / torch.clamp(torch.as_tensor(num_items_in_batch), min=1)


class MaskedAfter(torch.utils.data.Dataset):
    """Token rows whose labels are all -100 (nothing to learn) from row ``start`` on."""

    def __init__(self, start):
        from gradhealth.demos.hf_trainer import Tokens

        self.rows, self.start = Tokens(n=16), start

    def __len__(self):
        return 16

    def __getitem__(self, i):
        row = dict(self.rows[i])
        row["labels"] = torch.full_like(row["labels"], -100) if i >= self.start else row["labels"]
        return row


def test_a_batch_with_no_label_token_is_empty_valid_set_from_trainers_count(tmp_path):
    """Trainer's num_items_in_batch is the valid count 'tokens': the second step's batch has no label
    token, the clamped loss is exactly 0 and every gradient zero (harmless, no NaN), and it is an
    EMPTY_VALID_SET warning at that step, saying what still moves the weights."""
    model = tiny_bert()
    kept = Kept()
    trainer = ClampedTokenMean(model=model, args=arguments(tmp_path, max_steps=2, per_device_train_batch_size=8,
                                                           warmup_steps=0),
                               train_dataset=MaskedAfter(8), callbacks=[GradHealthCallback(on_problem="ignore", sinks=[kept])])
    trainer._get_train_sampler = lambda *a, **k: torch.utils.data.SequentialSampler(trainer.train_dataset)  # (in order)
    trainer.train()
    first, second = kept.reports
    assert first.valid_counts["tokens"] == 8 * 16 and not first.findings_of("EMPTY_VALID_SET")
    assert second.valid_counts["tokens"] == 0 and second.loss == 0.0  # the premise: nothing to learn, no NaN
    assert set(second.status.values()) <= {gh.Status.ZERO_GRAD, gh.Status.NO_GRAD}
    [f] = second.findings_of("EMPTY_VALID_SET")
    assert f.level == "warning" and "still moves the weights" in f.message

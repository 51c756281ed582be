"""A resumed run continues every story the monitor kept: run N steps, save (model, optimizers,
monitor), build everything anew from the checkpoint, load, run M more; the reports from step N on
(states, tolerated names, findings with their levels and words, the warnings said) equal the
uninterrupted run's. Each case also shows its premise: the story is there after step N in the
uninterrupted run, and a monitor that starts fresh at the checkpoint tells another story (so the
state is what carries it)."""

from __future__ import annotations

import io
import json
import re
import warnings
from dataclasses import dataclass, field

import pytest
import torch
from torch import nn

import gradhealth as gh


# ------------------------------------------------------------------ the harness
class Recorder:
    """A sink: every report a run published (summarised at the end: later deliveries included)."""

    def __init__(self):
        self.reports = []

    def write(self, report):
        self.reports.append(report)


def summary(report, said=(), numbers=True) -> tuple:
    words = (lambda s: s) if numbers else (lambda s: re.sub(r"\d+(\.\d+)?(e[-+]?\d+)?", "#", s))  # noqa: E731
    return (report.step, {n: s.value for n, s in report.status.items()}, sorted(report.tolerated),
            [(str(f.kind), f.level, words(f.message), f.params) for f in report.findings],
            [words(w) for w in said])


class Layers(nn.Module):
    """Four small layers; ``skip`` (a set of layer indices) leaves layers out of a forward."""

    def __init__(self, width=6, depth=4):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x, skip=()):
        for k, layer in enumerate(self.layers):
            if k not in skip:
                x = torch.tanh(layer(x))
        return self.head(x)


def batch(i: int, width=6):
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(8, width, generator=g), torch.randn(8, 1, generator=g)


@dataclass
class Case:
    name: str
    n: int  # steps before the checkpoint
    m: int  # steps after it
    story: str  # a finding kind (or "warning") the uninterrupted run shows from step n on
    optimizers: object = None  # model -> list of optimizers (default: one SGD)
    step: object = None  # (i, model, optimizers, monitor) -> None: one training step with its check
    options: dict = field(default_factory=dict)
    numbers: bool = True  # the words compared with their numbers (False: the gradients themselves differ)
    model: object = Layers

    def build(self, seed: int):
        torch.manual_seed(seed)
        model = self.model()
        opts = (self.optimizers or (lambda mdl: [torch.optim.SGD(mdl.parameters(), lr=0.05)]))(model)
        return model, opts

    def monitor(self, model, opts):
        rec = Recorder()
        mon = gh.GradHealth(model, opts if len(opts) > 1 else opts[0], sinks=(rec,),
                            **{"on_problem": "warn", **self.options})
        return mon, rec

    def run(self, steps, model, opts, mon) -> dict[int, list[str]]:
        said = {}
        for i in steps:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                (self.step or plain_step)(i, model, opts, mon)
            said[i] = [str(w.message) for w in caught if issubclass(w.category, gh.GradHealthWarning)]
        return said

    def reports(self, rec, said, since):
        return [summary(r, said.get(r.step, ()), self.numbers) for r in rec.reports if r.step >= since]


def plain_step(i, model, opts, mon, skip=(), loss_scale=1.0):
    x, y = batch(i)
    for o in opts:
        o.zero_grad()
    loss = ((model(x, skip) - y) ** 2).mean() * loss_scale
    loss.backward()
    mon.check(loss=loss)
    for o in opts:
        o.step()


def through_a_checkpoint(obj):
    """What a checkpoint file gives back: ``torch.save`` (weights only), and JSON (the HF Trainer's)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=True)
    assert json.loads(json.dumps(back["monitor"])) == json.loads(json.dumps(obj["monitor"]))  # (JSON keeps it)
    back["monitor"] = json.loads(json.dumps(back["monitor"]))
    return back


def resume_plain(case: Case, load=True):
    """The reports from step n on of a run that stopped at step n and was resumed from its checkpoint."""
    model, opts = case.build(0)
    mon, _ = case.monitor(model, opts)
    case.run(range(case.n), model, opts, mon)
    ckpt = through_a_checkpoint({"model": model.state_dict(), "opts": [o.state_dict() for o in opts],
                                 "monitor": mon.state_dict()})
    mon.close()
    model, opts = case.build(1)  # (other weights: the checkpoint's are loaded)
    model.load_state_dict(ckpt["model"])
    for o, s in zip(opts, ckpt["opts"]):
        o.load_state_dict(s)
    mon, rec = case.monitor(model, opts)
    if load:
        mon.load_state_dict(ckpt["monitor"])
    else:  # (the control: a monitor that knows the step count only)
        mon.carry.calls = mon.carry.checks = case.n
    said = case.run(range(case.n, case.n + case.m), model, opts, mon)
    return case.reports(rec, said, case.n)


def uninterrupted(case: Case):
    model, opts = case.build(0)
    mon, rec = case.monitor(model, opts)
    said = case.run(range(case.n + case.m), model, opts, mon)
    return case.reports(rec, said, case.n)


def shows(reports, story: str) -> bool:
    return any(story in r[1].values() or any(f[0] == story for f in r[3]) for r in reports)


# --------------------------------------------------------------------- stories
def two_groups(lr_second):
    def make(model):
        rest = [p for n, p in model.named_parameters() if not n.startswith("layers.0.")]
        return [torch.optim.SGD([{"params": rest, "lr": 0.05}, {"params": model.layers[0].parameters(), "lr": lr_second}])]
    return make


def scheduled(lr_at):
    def step(i, model, opts, mon):
        for g in opts[0].param_groups:
            g["lr"] = lr_at(i)
        plain_step(i, model, opts, mon)
    return step


def layer_drop(i, model, opts, mon):  # layer 2 skipped at one step in three, as LayerDrop does
    plain_step(i, model, opts, mon, skip={2} if i % 3 == 1 else ())


def drop_then_stop(i, model, opts, mon):  # ... then never used again from step 14 on: an error, dated by its past
    plain_step(i, model, opts, mon, skip={2} if i % 3 == 1 or i >= 14 else ())


def thawed_then_cut(i, model, opts, mon):  # layer 1 frozen for 6 steps, thawed, then cut from the graph
    for p in model.layers[1].parameters():
        p.requires_grad_(not 3 <= i < 9)
    plain_step(i, model, opts, mon, skip={1} if i >= 12 else ())


def nothing_to_learn(i, model, opts, mon):  # batches whose loss is exactly 0 now and then (tied rewards)
    plain_step(i, model, opts, mon, loss_scale=0.0 if i % 4 == 3 else 1.0)


def spikes(i, model, opts, mon):  # two spikes in a row across the checkpoint: an error at the second
    plain_step(i, model, opts, mon, loss_scale=1e4 if i in (23, 24) else 1.0)


class Stopped(torch.optim.SGD):
    """An update rule that stopped working: its step runs and changes nothing."""

    @torch.no_grad()
    def step(self, closure=None):
        return None


def out_of_optimizer(model):
    return [torch.optim.SGD([p for n, p in model.named_parameters() if not n.startswith("head.")], lr=0.05)]


def gan_pair(model):
    return [torch.optim.SGD(model.layers.parameters(), lr=0.05), torch.optim.SGD(model.head.parameters(), lr=0.05)]


def only_first_steps(i, model, opts, mon):  # both zeroed, only the first steps: the head's gradients thrown away
    x, y = batch(i)
    for o in opts:
        o.zero_grad()
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    mon.check(loss=loss)
    opts[0].step()


def pile_up(i, model, opts, mon):  # the head's optimizer never steps nor zeroes: its gradients pile up
    x, y = batch(i)
    opts[0].zero_grad()
    loss = ((model(x) - 10.0) ** 2).mean()  # (far from the target: each backward adds a gradient of one sign)
    loss.backward()
    mon.check(loss=loss)
    opts[0].step()


def nan_in_loss_at(steps):
    """A NaN made in the loss, outside every module: a replay of the model's calls names none, so the
    check arms the tracer (operation by operation) for the step after it."""
    def step(i, model, opts, mon):
        plain_step(i, model, opts, mon, loss_scale=torch.tensor(float("nan")) if i in steps else 1.0)
    return step


def accumulate(i, model, opts, mon):  # a healthy loop checking each of two micro-batches, stepping after the second
    x, y = batch(i)
    if i % 2 == 0:
        for o in opts:
            o.zero_grad()
    loss = ((model(x) - 10.0) ** 2).mean()  # (far from the target: the second micro-batch's gradient adds up)
    loss.backward()
    mon.check(loss=loss)
    if i % 2 == 1:
        for o in opts:
            o.step()


CASES = [
    Case("lr held at 0 on purpose", 4, 4, "NOT_UPDATED", two_groups(0.0)),
    Case("warm-up from 0 that never rises", 2, 4, "NOT_UPDATED", step=scheduled(lambda i: 0.0)),
    Case("lr fell to 0 and stays", 5, 3, "NOT_UPDATED", step=scheduled(lambda i: 0.05 if i < 4 else 0.0)),
    Case("LayerDrop's transient gaps", 12, 8, "TRANSIENT_GRAD", step=layer_drop),
    Case("a LayerDrop layer that stops", 13, 5, "NO_GRAD", step=drop_then_stop, options={"on_problem": "ignore"}),
    Case("frozen, thawed, then cut", 10, 5, "NO_GRAD", step=thawed_then_cut, options={"on_problem": "ignore"}),
    Case("nothing to learn, said once", 6, 6, "NOTHING_TO_LEARN", step=nothing_to_learn),
    Case("two spikes in a row", 24, 2, "EXPLODING_GRAD", step=spikes),
    Case("an update rule that stopped", 2, 4, "NOT_UPDATED", lambda model: [Stopped(model.parameters(), lr=0.05)],
         options={"on_problem": "ignore"}),
    Case("a problem said once", 3, 3, "NOT_IN_OPTIMIZER", out_of_optimizer),
    Case("an optimizer that never steps", 2, 4, "NOT_STEPPED", gan_pair, step=only_first_steps,
         options={"on_problem": "ignore"}),
    Case("gradients piling up", 9, 3, "GRAD_PILEUP", gan_pair, step=pile_up, options={"on_problem": "ignore"},
         numbers=False),
    Case("a healthy run accumulating two micro-batches", 8, 6, None, step=accumulate,
         options={"on_problem": "raise"}),  # (a streak of growing gradients is no pile-up across a resume)
    Case("the tracer armed after a NaN", 4, 2, "NONFINITE_ORIGIN", step=nan_in_loss_at({3, 4}),
         options={"on_problem": "ignore", "trace_on_nonfinite": True}),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_a_resumed_plain_loop_tells_the_uninterrupted_story(case, one_thread):
    whole = uninterrupted(case)
    if case.story is None:  # a healthy run: silent under raise, resumed or not
        assert not any(r[3] or r[4] for r in whole) and resume_plain(case) == whole
        return
    fresh = resume_plain(case, load=False)
    assert shows(whole, case.story) or shows(fresh, case.story), f"premise: {case.story} from step {case.n} on"
    assert fresh != whole, "premise: a monitor that starts fresh at the checkpoint tells another story"
    assert resume_plain(case) == whole


# ------------------------------------------------- through the frameworks' resume
def story_step(net, i):
    """One step's loss by the batch's index: layer 2 dropped at one step in three, a batch with
    nothing to learn at one in five (the frameworks choose the order; the index decides the story)."""
    x, y = batch(i)
    loss = ((net(x, {2} if i % 3 == 1 else ()) - y) ** 2).mean()
    return loss * 0.0 if i % 5 == 4 else loss


def held_groups(net):  # layers.0 held at lr 0 on purpose, the rest trains
    return [{"params": [p for n, p in net.named_parameters() if not n.startswith("layers.0.")], "lr": 0.05},
            {"params": list(net.layers[0].parameters()), "lr": 0.0}]


STORIES = ("TRANSIENT_GRAD", "NOTHING_TO_LEARN")


def test_lightning_fit_from_ckpt_path_tells_the_uninterrupted_story(tmp_path, one_thread):
    pl = pytest.importorskip("lightning.pytorch")
    from gradhealth.integrations.lightning import GradHealthCallback

    class Story(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = Layers()

        def training_step(self, idx, batch_idx):
            return story_step(self.net, int(idx[0]))

        def configure_optimizers(self):
            return torch.optim.SGD(held_groups(self.net))

        def train_dataloader(self):
            return torch.utils.data.DataLoader(list(range(7)), batch_size=1)

    n, m = 7, 8

    def fit(ckpt_path=None, seed=0, load=True):
        torch.manual_seed(seed)
        rec = Recorder()
        cb = GradHealthCallback(sinks=(rec,), log=False)
        if not load:  # (the control: the checkpoint without the monitor's state)
            cb.load_state_dict = lambda state: None
        saver = pl.callbacks.ModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=n, save_top_k=-1,
                                             filename="{step}")
        trainer = pl.Trainer(max_steps=n + m, accelerator="cpu", logger=False, enable_progress_bar=False,
                             enable_model_summary=False, callbacks=[cb, saver], default_root_dir=str(tmp_path))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(Story(), ckpt_path=ckpt_path)
        said = [str(w.message) for w in caught if issubclass(w.category, gh.GradHealthWarning)]
        return [summary(r) for r in rec.reports if r.step >= n], said

    whole, said_whole = fit()
    assert all(shows(whole, story) for story in STORIES), "premise: the stories go on after the checkpoint"
    ckpt = str(tmp_path / f"step={n}.ckpt")
    fresh, said_fresh = fit(ckpt, seed=1, load=False)
    assert [r[0] for r in fresh] == [r[0] for r in whole] and fresh != whole  # premise: the state carries them
    resumed, said_resumed = fit(ckpt, seed=1)
    assert resumed == whole
    assert [s for s in said_resumed if "step" in s] == [s for s in said_whole if any(f"step {k}:" in s for k in range(n, n + m))]


def test_hf_trainer_resume_from_checkpoint_tells_the_uninterrupted_story(tmp_path, one_thread):
    transformers = pytest.importorskip("transformers")
    from gradhealth.integrations.transformers import GradHealthCallback

    class Story(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = Layers()

        def forward(self, idx, labels=None):
            return {"loss": story_step(self.net, int(idx[0]))}

    class Indices(torch.utils.data.Dataset):
        def __len__(self):
            return 40

        def __getitem__(self, i):
            return {"idx": i}

    n, m = 8, 8

    def train(out, resume=None, seed=0, load=True):
        torch.manual_seed(seed)
        rec = Recorder()
        cb = GradHealthCallback(sinks=(rec,), log=False, tensorboard=False, replay_on_nonfinite=False)
        model = Story()
        args = transformers.TrainingArguments(str(out), use_cpu=True, report_to=[], max_steps=n + m,
                                              per_device_train_batch_size=1, lr_scheduler_type="constant",
                                              save_strategy="steps", save_steps=n, disable_tqdm=True, seed=0,
                                              data_seed=0, logging_steps=5)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=Indices(), callbacks=[cb],
                                       optimizers=(torch.optim.SGD(held_groups(model.net)), None))
        if not load:  # (the control: the checkpoint without the monitor's state)
            trainer.state.stateful_callbacks = {}
            cb.on_train_begin = lambda *a, _f=cb.on_train_begin, **k: _f(
                *a[:1], transformers.TrainerState(), *a[2:], **k)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.train(resume_from_checkpoint=resume)
        said = [str(w.message) for w in caught if issubclass(w.category, gh.GradHealthWarning)]
        return [summary(r) for r in rec.reports if r.step > n], said

    whole, said_whole = train(tmp_path)
    saved = json.load(open(tmp_path / f"checkpoint-{n}" / "trainer_state.json"))["stateful_callbacks"]
    assert saved["GradHealthCallback"]["attributes"]["_pending_state"]["version"] == 2  # (in the JSON it writes)
    assert all(shows(whole, story) for story in STORIES), "premise: the stories go on after the checkpoint"
    fresh, _ = train(tmp_path, str(tmp_path / f"checkpoint-{n}"), seed=1, load=False)
    assert [r[0] for r in fresh] == [r[0] for r in whole] and fresh != whole  # premise: the state carries them
    resumed, said_resumed = train(tmp_path, str(tmp_path / f"checkpoint-{n}"), seed=1)
    assert resumed == whole
    assert [s for s in said_resumed] == [s for s in said_whole if any(f"step {k}:" in s for k in range(n + 1, n + m + 1))]

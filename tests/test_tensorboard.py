"""TensorBoardSink and read_run against real event files, and `gradhealth report` (the server and the
browser: test_dashboards.py)."""

import math
import os
import sys

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn

import gradhealth as gh
from gradhealth.integrations.lightning import GradHealthCallback, metrics_of
from gradhealth.demos.lightning_parts import DemoModule, SyntheticData
from gradhealth.integrations.gradient_flow import gradient_flow_image
from gradhealth.integrations.tensorboard import TensorBoardSink, read_run
import procs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Keep:
    def __init__(self):
        self.reports = []

    def write(self, report):
        self.reports.append(report)


def train(logdir, steps=5, model=None, opt_params=None, heatmap_every=2, lr=0.1, **kw):
    torch.manual_seed(0)
    model = model or nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(opt_params if opt_params is not None else model.parameters(), lr=lr)
    keep = Keep()
    sink = TensorBoardSink(logdir, heatmap_every=heatmap_every, **{"every_n": 1, **kw})
    with gh.GradHealth(model, opt, sinks=[sink, keep], on_problem="ignore", update_every=1) as mon:
        for _ in range(steps):
            opt.zero_grad()
            loss = model(torch.randn(8, 4)).square().mean()
            loss.backward()
            mon.check(loss=loss)
            opt.step()
    return keep.reports, model


def value(frame, tag, step):
    rows = frame[(frame["tag"] == tag) & (frame["step"] == step)]
    assert len(rows) == 1, (tag, step, len(rows))
    return float(rows["value"].iloc[0])


def test_values_read_back_equal_the_reports(tmp_path):
    reports, model = train(tmp_path)
    frame = read_run(tmp_path)
    assert {"step", "tag", "value", "wall_time", "run"} <= set(frame.columns)
    for r in reports:
        assert value(frame, "gradhealth/grad_norm/total", r.step) == pytest.approx(r.total_grad_norm, rel=1e-6)
        for name, v in r.grad_norm.items():  # per parameter: 4 tensors <= 100
            assert value(frame, f"gradhealth/grad_norm/{name}", r.step) == pytest.approx(v, rel=1e-6)
        assert value(frame, "gradhealth/status/OK", r.step) == 4
        assert value(frame, "gradhealth/loss", r.step) == pytest.approx(r.loss, rel=1e-6)
    for r in reports[:-1]:  # every step's updates, the last one at close()
        for name, u in r.update_ratio.items():
            assert value(frame, f"gradhealth/update_ratio/{name}", r.step) == pytest.approx(u, rel=1e-6)
    assert value(frame, "gradhealth/update_ratio/0.weight", reports[-1].step) == pytest.approx(reports[-1].update_ratio["0.weight"], rel=1e-6)


def test_per_module_above_100_tensors(tmp_path):
    big = nn.Sequential(nn.Linear(4, 2), *[nn.Linear(2, 2) for _ in range(59)])  # 120 tensors
    reports, _ = train(tmp_path, steps=2, model=big, heatmap_every=0)
    tags = set(read_run(tmp_path)["tag"])
    assert "gradhealth/grad_norm/0" in tags and "gradhealth/grad_norm/0.weight" not in tags
    assert len([t for t in tags if t.startswith("gradhealth/grad_norm/")]) == 61  # 60 modules + total
    r = reports[0]
    assert value(read_run(tmp_path), "gradhealth/grad_norm/7", 0) == pytest.approx(math.hypot(r.grad_norm["7.weight"], r.grad_norm["7.bias"]), rel=1e-6)


def test_findings_as_text_and_heatmap_colours(tmp_path):
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model[0].requires_grad_(False)
    reports, _ = train(tmp_path, steps=4, model=model, opt_params=list(model[2].parameters()))
    frame = read_run(tmp_path, text=True)
    texts = frame[frame["tag"] == "gradhealth/findings_text"]
    assert texts.empty  # frozen on purpose is not a finding
    train(tmp_path / "lr0", steps=4, lr=0.0)
    frame = read_run(tmp_path / "lr0", text=True)
    texts = frame[frame["tag"] == "gradhealth/findings_text"]
    # lr 0 everywhere at the first two steps may be a warm-up's start (info, no text); from the third on an error
    assert list(texts["step"]) == [2, 3] and texts["text"].str.contains("NOT_UPDATED").all()
    assert value(frame, "gradhealth/findings/NOT_UPDATED", 2) == 1.0
    img = gradient_flow_image(["0", "2"], [{"0": (0.0, gh.Status.FROZEN), "2": (1.0, gh.Status.OK)},
                                          {"0": (0.0, gh.Status.FROZEN), "2": (float("nan"), gh.Status.NON_FINITE_GRAD)}], (4, 4))
    assert tuple(img[0, 0]) == (60, 110, 200) and tuple(img[4, 4]) == (230, 20, 20)


def test_crash_safety_failing_step_is_on_disk(tmp_path):
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD([model.weight], lr=0.1)  # the bias is left out
    mon = gh.GradHealth(model, opt, sinks=[TensorBoardSink(tmp_path)], on_problem="raise")
    model(torch.randn(3, 4)).sum().backward()
    with pytest.raises(gh.GradHealthError):
        mon.check()
    # no close(), no flush by the test: the sink flushed before the error propagated
    frame = read_run(tmp_path, text=True)
    assert value(frame, "gradhealth/status/NOT_IN_OPTIMIZER", 0) == 1
    assert value(frame, "gradhealth/grad_norm/bias", 0) == pytest.approx(model.bias.grad.norm().item(), rel=1e-6)


def test_empty_and_corrupt_logdirs(tmp_path):
    with pytest.raises(ValueError, match="no TensorBoard event files"):
        read_run(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_run(tmp_path / "nope")
    (tmp_path / "events.out.tfevents.123.host").write_bytes(b"\x00garbage that is not a record" * 3)
    with pytest.raises(ValueError, match="hold no scalars|cannot be read"):
        read_run(tmp_path)
    res = procs.run([sys.executable, "-m", "gradhealth", "report", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and res.stderr.startswith("gradhealth report:") and "Traceback" not in res.stderr


def test_lightning_run_lands_in_one_tensorboard_run(tmp_path):
    keep = Keep()
    cb = GradHealthCallback(sinks=[keep])
    trainer = pl.Trainer(max_steps=4, accelerator="cpu", logger=TensorBoardLogger(str(tmp_path), name="run", version=0),
                         callbacks=[cb], enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         log_every_n_steps=1, limit_val_batches=0)
    trainer.fit(DemoModule(), SyntheticData(n_batches=4))
    frame = read_run(tmp_path)
    assert set(frame["run"]) == {os.path.join("run", "version_0")}
    for r in keep.reports:
        for tag, v in metrics_of(r).items():
            assert value(frame, tag, r.step) == pytest.approx(v, rel=1e-6), tag


def test_report_leaves_out_what_the_policy_tolerated(tmp_path):
    """A branch used from the second step on is a transient NO_GRAD at step 0: gradhealth report
    must not list it (it lists the persistent ones)."""
    from gradhealth.integrations.tbreport import summarize_run

    class Late(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 2)
            self.b = nn.Linear(4, 2)
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            return self.a(x) + (self.b(x) if self.calls > 1 else 0)

    model = Late()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gh.GradHealth(model, opt, sinks=[TensorBoardSink(tmp_path, every_n=1)], on_problem="ignore") as mon:
        for _ in range(4):
            opt.zero_grad()
            model(torch.randn(8, 4)).square().mean().backward()
            mon.check()
            opt.step()
    frame = read_run(tmp_path, text=True)
    assert value(frame, "gradhealth/status/NO_GRAD", 0) == 2.0 and value(frame, "gradhealth/tolerated", 0) == 2.0
    assert [i["kind"] for i in summarize_run(frame)] == []


def test_the_layout_is_written_for_the_run(tmp_path):
    from gradhealth.integrations.tbread import read_layout

    train(tmp_path / "plain", steps=5)
    charts = list(read_layout(str(tmp_path / "plain")))
    assert [c.split(" (")[0].split(",")[0] for c in charts] == [
        "parameters in trouble", "loss", "gradient norm by parameter or module", "update ratio |Δθ|/|θ| by parameter or module"]
    assert "at every check" in charts[-1]  # update_every=1: the cadence is in the title

    def guarded(logdir, valid_from):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with gh.GradHealth(model, opt, sinks=[TensorBoardSink(logdir, every_n=1)], on_problem="ignore",
                           skip_nonfinite=True) as mon:
            for step in range(6):
                opt.zero_grad()
                x = torch.randn(8, 4)
                if step >= valid_from:
                    mon.track_valid(torch.ones(8, dtype=torch.bool), "rows")
                model(x).square().mean().backward()
                mon.check()
                opt.step()

    guarded(str(tmp_path / "valid"), valid_from=3)
    charts = read_layout(str(tmp_path / "valid"))
    assert {"steps the step guard skipped (healthy: 0)", "valid counts (healthy: above 0 at every step)"} <= set(charts)
    assert "loss (healthy: falling)" not in charts  # no loss given to check()
    guarded(str(tmp_path / "once"), valid_from=5)  # tracked at the last check only: one point is no chart
    assert not [c for c in read_layout(str(tmp_path / "once")) if c.startswith("valid")]


def test_large_models_get_one_row_per_block_and_the_worst_state_shows():
    import numpy as np

    from gradhealth.integrations.gradient_flow import CODES, ROWS, _squeeze, rows_of

    layer = ["ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj"]
    gpt2 = (["transformer.wte", "transformer.wpe"] + [f"transformer.h.{i}.{m}" for i in range(12) for m in layer]
            + ["transformer.ln_f", "lm_head"])
    labels, groups = rows_of(gpt2)
    assert len(labels) == ROWS and labels[2] == "transformer.h.0.*" and labels[-2:] == ["transformer.ln_f", "lm_head"]
    assert sorted(i for g in groups for i in g) == list(range(len(gpt2)))  # every module in one row
    flat = [str(i) for i in range(40)]
    labels, groups = rows_of(flat)
    assert len(labels) <= ROWS and labels[0] == "0 .. 2" and [len(g) for g in groups][:2] == [3, 3]
    assert rows_of(flat[:5]) == (flat[:5], [[0], [1], [2], [3], [4]])
    # one module of a block NaN at one check: the block's row shows it; norms are the norm of the norms
    value = np.ones((len(gpt2), 4))
    state = np.full((len(gpt2), 4), CODES[gh.Status.OK])
    state[5, 2] = CODES[gh.Status.NON_FINITE_GRAD]
    value[5, 2] = float("nan")
    v, s = _squeeze(value, state, rows_of(gpt2)[1], [[0, 1], [2, 3]])
    assert s[2, 1] == CODES[gh.Status.NON_FINITE_GRAD] and (s[[0, 1, 3], :] == CODES[gh.Status.OK]).all()
    assert v[2, 0] == pytest.approx(math.sqrt(6 * 2 / 2)) and v[0, 0] == pytest.approx(1.0)


def test_the_picture_keeps_its_size_and_counts_every_check(tmp_path):
    import io

    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train(tmp_path, steps=120, heatmap_every=50, every_n=10)  # pictures at checks 50, 100, and the last at close
    ea = EventAccumulator(str(tmp_path), size_guidance={"images": 0})
    ea.Reload()
    shots = ea.Images("gradhealth/gradient_flow")
    assert [s.step for s in shots] == [49, 99, 119]  # every check counts, not only the 12 written ones
    assert len({Image.open(io.BytesIO(s.encoded_image_string)).size for s in shots}) == 1


def test_the_last_picture_is_not_written_twice(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train(tmp_path, steps=100, heatmap_every=50, every_n=10)  # checks 50 and 100; close() adds none
    ea = EventAccumulator(str(tmp_path), size_guidance={"images": 0})
    ea.Reload()
    assert [s.step for s in ea.Images("gradhealth/gradient_flow")] == [49, 99]


def test_a_state_in_the_text_tab_says_what_is_wrong_and_what_to_do(tmp_path):
    """The TEXT entry of a parameter state: the code, the names, and the words the console
    warning says (what it means, what to do), read back from the event file."""
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)  # the readout is left out
    mon = gh.GradHealth(model, opt, sinks=[TensorBoardSink(tmp_path)], on_problem="ignore")
    model(torch.randn(3, 4)).sum().backward()
    r = mon.check()
    mon.close()
    assert r.status["2.weight"] is gh.Status.NOT_IN_OPTIMIZER  # the premise
    [text] = read_run(tmp_path, text=True).query("tag == 'gradhealth/findings_text'")["text"]
    assert text.startswith("**NOT_IN_OPTIMIZER** (error, step 0): ")
    assert "parameters: 2.weight, 2.bias" in text
    assert "These 2 parameters get gradients but no optimizer updates them" in text
    assert "Build the optimizer from model.parameters()" in text
    from gradhealth.integrations.tbreport import summarize_run

    [item] = [i for i in summarize_run(read_run(tmp_path, text=True)) if i["kind"] == "NOT_IN_OPTIMIZER"]
    assert item["names"] == ["2.weight", "2.bias"]  # the report still reads the names apart from the words


class TakingTurns(pl.LightningModule):
    """Lightning's two-optimizer recipe (manual optimization, ``toggle_optimizer``) with a frozen
    feature layer: each check judges the frozen layer and one optimizer's parameters, as many at
    the generator's turn as at the discriminator's, under other names. ``unused``: a layer in the
    generator's optimizer that its forward never calls (NO_GRAD at the generator's checks only)."""

    def __init__(self, unused=False):
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.unused = unused
        self.features = nn.Linear(16, 4).requires_grad_(False)
        self.layer_1 = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))  # the generator
        self.layer_2 = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))  # the discriminator
        self.spare = nn.Linear(4, 4)  # in the generator's optimizer; called unless ``unused``
        self.d_losses = []

    def generate(self, z):
        out = self.layer_1(z)
        return out if self.unused else out + 0.1 * self.spare(z)

    def training_step(self, batch, batch_idx):
        opt_g, opt_d = self.optimizers()
        x = self.features(batch[0])
        z = torch.randn_like(x)
        self.toggle_optimizer(opt_d)
        d_loss = (nn.functional.softplus(-self.layer_2(x)).mean()
                  + nn.functional.softplus(self.layer_2(self.generate(z).detach())).mean())
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        self.untoggle_optimizer(opt_d)
        self.toggle_optimizer(opt_g)
        g_loss = nn.functional.softplus(-self.layer_2(self.generate(z))).mean()
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        self.untoggle_optimizer(opt_g)
        self.d_losses.append(d_loss.item())

    def configure_optimizers(self):
        return (torch.optim.Adam([*self.layer_1.parameters(), *self.spare.parameters()], 1e-3),
                torch.optim.Adam(self.layer_2.parameters(), 1e-3))


def _fit_taking_turns(tmp_path, unused, on_problem):
    import glob
    import warnings

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    keep, module = Keep(), TakingTurns(unused)
    trainer = pl.Trainer(max_steps=12, accelerator="cpu", default_root_dir=str(tmp_path), log_every_n_steps=1,
                         callbacks=[GradHealthCallback(on_problem=on_problem, sinks=[keep])], enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, SyntheticData(n_batches=8))
    internal = [str(w.message) for w in caught if issubclass(w.category, gh.GradHealthInternalWarning)]
    [run] = {os.path.dirname(p) for p in glob.glob(os.path.join(tmp_path, "**", "events.out.*"), recursive=True)}
    ea = EventAccumulator(run, size_guidance={"images": 0})  # (the logger's own run: lightning_logs/version_0)
    ea.Reload()
    return module, keep.reports, internal, read_run(tmp_path, text=True), ea


def test_two_optimizers_taking_turns_under_the_default_logger_lose_no_report(tmp_path):
    """Lightning's default TensorBoard logger, two optimizers taking turns with a frozen layer: the
    checks of one optimizer judge as many parameters as the other's, under other names. No sink
    error (under raise one stopped the fit); the gradient-flow picture is written; a problem seen
    only at the generator's turn reaches the TEXT tab, in the event files read back."""
    module, reports, internal, frame, ea = _fit_taking_turns(tmp_path / "healthy", unused=False, on_problem="raise")
    turns = [set(r.status) for r in reports[:2]]
    # the premise: each optimizer's check judges as many parameters as the other's, other names among them
    assert len(turns[0]) == len(turns[1]) and turns[0] != turns[1]
    assert {r.optimizer_index for r in reports} == {0, 1} and len(reports) == 12
    assert all(r.ok for r in reports) and not internal
    # the picture has a row for each module judged, the generator's too (its height says how many rows)
    import io

    import numpy as np
    from PIL import Image

    from gradhealth.integrations.gradient_flow import flow_picture

    [shot] = ea.Images("gradhealth/gradient_flow")
    rows = ["features", "layer_1.0", "layer_1.2", "spare", "layer_2.0", "layer_2.2", "layer_2.4"]
    expected = flow_picture(np.ones((len(rows), 12)), np.zeros((len(rows), 12), dtype=np.int64), rows, list(range(12)))
    assert Image.open(io.BytesIO(shot.encoded_image_string)).size == (expected.shape[1], expected.shape[0])
    assert {"gradhealth/grad_norm_preclip/layer_1.0", "gradhealth/grad_norm_preclip/layer_2.0"} <= set(frame["tag"])

    module, reports, internal, frame, ea = _fit_taking_turns(tmp_path / "unused", unused=True, on_problem="warn")
    assert all(r.status["spare.weight"] is gh.Status.NO_GRAD for r in reports if r.optimizer_index == 0)  # the premise
    assert not internal, internal
    texts = frame[frame["tag"] == "gradhealth/findings_text"]
    assert any("spare.weight" in t and "NO_GRAD" in t for t in texts["text"]), list(texts["text"])
    assert "gradhealth/gradient_flow" in ea.Tags()["images"]


@pytest.mark.parametrize("granularity", ["param", "module"])
def test_the_report_counts_parameters_or_modules_as_the_tags_hold_them(tmp_path, granularity):
    """6 parameters in 3 modules, every gradient NaN from step 2: per-parameter tags are counted as
    parameters (the report said "in all 6 modules"), per-module tags as modules."""
    from gradhealth.integrations.tbreport import summarize_run

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sink = TensorBoardSink(tmp_path, every_n=1, granularity=granularity)
    with gh.GradHealth(model, opt, sinks=[sink], on_problem="ignore") as mon:
        for step in range(4):
            x = torch.randn(8, 4)
            if step == 2:
                x[0, 0] = math.nan
            opt.zero_grad()
            loss = model(x).square().mean()
            loss.backward()
            mon.check(loss=loss)
            opt.step()
    frame = read_run(tmp_path, text=True)
    norms = {t.rsplit("/", 1)[1] for t in frame.tag if t.startswith("gradhealth/grad_norm/") and not t.endswith("/total")}
    assert norms == ({n for n, _ in model.named_parameters()} if granularity == "param" else {"0", "2", "4"})  # the premise
    [item] = [i for i in summarize_run(frame) if i["kind"] == "NON_FINITE_GRAD"]
    words = "in all 6 parameters" if granularity == "param" else "in all 3 modules"
    assert item["step"] == 2 and f"first non-finite gradients at step 2 {words}" in item["detail"], item["detail"]


def test_a_picture_is_written_as_add_image_writes_it_pixel_for_pixel(tmp_path):
    """The sink encodes its pictures itself (PNG at the fastest level): read back from the event
    file, the same pixels, size and colour space as ``SummaryWriter.add_image(..., "HWC")`` writes."""
    import io

    import numpy as np
    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    img = np.random.default_rng(0).integers(0, 256, (37, 53, 3), dtype=np.uint8)
    sink = TensorBoardSink(str(tmp_path / "ours"))
    sink._image("gradhealth/gradient_flow", img, 7)
    sink.close()
    with SummaryWriter(str(tmp_path / "torch")) as w:
        w.add_image("gradhealth/gradient_flow", img, 7, dataformats="HWC")
    shots = []
    for run in ("ours", "torch"):
        ea = EventAccumulator(str(tmp_path / run), size_guidance={"images": 0})
        ea.Reload()
        [shot] = ea.Images("gradhealth/gradient_flow")
        shots.append(shot)
        assert shot.step == 7 and (shot.width, shot.height) == (53, 37)
        assert np.array_equal(np.asarray(Image.open(io.BytesIO(shot.encoded_image_string)).convert("RGB")), img)


def test_the_module_tags_follow_the_modules(tmp_path):
    """The per-module tags are made once per set of modules (``metrics._tags``): a report with other
    modules gets its own tags, each with its own norm."""
    from gradhealth.publish.metrics import report_metrics

    def report(norms):
        return gh.Report(step=0, status={}, grad_norm={}, total_grad_norm=1.0, module_grad_norm=norms)

    for norms in ({"a": 1.0, "b": 2.0}, {"a": 3.0, "c": 4.0}, {"a": 5.0, "b": 6.0}):
        got = report_metrics(report(norms))
        assert {k.rsplit("/", 1)[1]: v for k, v in got.items() if k.startswith("gradhealth/grad_norm/")
                and not k.endswith("/total")} == norms


def test_the_scalars_summary_is_the_one_protobuf_builds_byte_for_byte():
    """``tbevents.scalar_summary`` lays the bytes out itself: the same message as protobuf's
    ``Summary.Value`` objects make, for long and non-ASCII tags (two-byte lengths), numbers beyond
    float32, NaN, infinities, ints, bools and numpy scalars, and a tag list seen again."""
    import numpy as np
    from tensorboard.compat.proto.summary_pb2 import Summary

    from gradhealth.integrations.tbevents import scalar_summary

    metrics = {"gradhealth/grad_norm/" + "x" * 200: 1.5, "gradhealth/grad_norm/ü.é": math.nan, "a": 1e300, "b": -1e300,
               "c": 3, "d": True, "e": np.float32(2.5), "f": np.int64(4), "g": 1e-50, "h": -0.0, "i": -math.inf,
               "j" * 20000: 0.1}
    for numbers in (list(metrics.values()), [float(k) for k in range(len(metrics))]):
        given = dict(zip(metrics, numbers))
        expected = Summary(value=[Summary.Value(tag=t, simple_value=v) for t, v in given.items()])
        assert scalar_summary(given).SerializeToString() == expected.SerializeToString()
    assert scalar_summary({}).SerializeToString() == b""

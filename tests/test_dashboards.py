"""The dashboards as a person opens them: a real `tensorboard` server on loopback over the Lightning
demo's runs and plain-loop runs (TensorBoardSink at its defaults), read through TensorBoard's own
HTTP API; the screenshots in headless Chromium where Debian's chromium is installed."""

import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import free_port
from gradhealth.demos.dashboard import RUNS, plain_runs
from gradhealth.demos.lightning_fit import run_scenario
from gradhealth.demos.lightning_parts import DemoModule
import procs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CARD = 310  # TensorBoard's image card shows a picture this wide unless "show actual image size" is on
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def not_in_optimizer(model, optimizer):
    """The oracle: parameters that require grad and are in none of the optimizer's groups."""
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    return [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in held]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dashboards")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (tiny models: faster and reproducible on one thread; restored below)
    try:
        demo = {bug: run_scenario(bug, str(root / "demo"), 40) for bug in ("none", "not_in_optimizer")}
        plain = plain_runs(str(root / "plain"))
    finally:
        torch.set_num_threads(threads)
    return root, demo, plain


@pytest.fixture(scope="module")
def server(runs):
    root = runs[0]
    port = free_port()
    with procs.popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(root), "--host", "127.0.0.1",
                      "--port", str(port), "--load_fast=false", "--reload_interval=1"],
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL):  # (killed, with its group, at the end)
        want = {f"demo/{b}/version_0" for b in ("none", "not_in_optimizer")} | {f"plain/{n}" for n in RUNS}
        deadline = time.time() + 90
        while True:
            try:
                images = json.loads(get(port, "/data/plugin/images/tags"))
                tags = json.loads(get(port, "/data/plugin/scalars/tags"))
                if want <= set(images) and want <= set(tags) and get_layout(port):
                    break
            except OSError:
                pass
            assert time.time() < deadline, "tensorboard did not serve the runs within 90 s"
            time.sleep(1)
        yield port, tags


def get(port, path):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
        return resp.read()


def get_layout(port):
    return [c for cat in json.loads(get(port, "/data/plugin/custom_scalars/layout")).get("category", []) for c in cat["chart"]]


def series(port, run, tag):
    q = urllib.parse.urlencode({"run": run, "tag": tag})
    return [(row[1], row[2]) for row in json.loads(get(port, f"/data/plugin/scalars/scalars?{q}"))]


def test_the_premises(runs):
    _, demo, plain = runs
    for losses in (demo["none"][2], plain["plain_healthy"], plain["plain_updates_every_10"]):
        assert np.mean(losses[-5:]) < np.mean(losses[:5])  # the healthy runs learn
    module = DemoModule(bug="not_in_optimizer")
    assert not_in_optimizer(module, module.configure_optimizers()) == ["head.weight", "head.bias"]
    from gradhealth.demos.plain import Net

    net = Net()
    assert not_in_optimizer(net, torch.optim.SGD(net.encoder.parameters(), lr=0.1)) == ["head.weight", "head.bias"]


def test_every_chart_of_the_layout_draws_a_line(server):
    port, tags = server
    charts = get_layout(port)
    assert charts[0]["title"].startswith("parameters in trouble (healthy: 0)")  # at the top
    titles = [c["title"] for c in charts]
    assert len(titles) == len(set(titles))  # each chart once over the runs
    for chart in charts:
        patterns = chart["multiline"]["tag"]
        lines = {(run, t): series(port, run, t) for run, ts in tags.items() for t in ts
                 if any(re.search(p, t) for p in patterns)}
        assert any(len(points) >= 2 for points in lines.values()), (chart["title"], {k: len(v) for k, v in lines.items()})
    # what these runs never log has no chart (MoE experts, valid counts, the step guard)
    assert not [t for t in titles if re.search("expert|valid|skipped", t)]
    # the update charts: the run that measures every 10 checks names its cadence once three gaps between its
    # written updates agree (its sink writes every 10th check: 0, 10, 20, 30); the runs of 100 that write every
    # check (the demo's, and the plain run whose findings are written at every check) saw only the dense first
    # checks 0, 1, 2, 4, 8, 16, 32 of their 40 or 60: a chart with no cadence to name
    updates = sorted(t for t in titles if t.startswith("update ratio"))
    assert len(updates) == 2 and "every 10 steps" in updates[0] and "when measured" in updates[1], updates
    ratio = "gradhealth/update_ratio/total"
    assert [s for s, _ in series(port, "plain/plain_updates_every_10", ratio)] == [0, 10, 20, 30, 40, 50]
    for run in ("plain/plain_head_not_in_optimizer", "demo/none/version_0"):
        assert [s for s, _ in series(port, run, ratio)] == [0, 1, 2, 4, 8, 16, 32], run
    # a run of 100 whose sink writes every 10th check: of its measured checks only 0 is written, so no chart
    assert [s for s, _ in series(port, "plain/plain_healthy", ratio)] == [0]


def test_the_trouble_series_counts_the_planted_problem(server):
    port, _ = server
    want = {f"plain/{name}": n for name, (_, n) in RUNS.items()}
    want.update({"demo/none/version_0": 0, "demo/not_in_optimizer/version_0": 2})
    for run, n in want.items():
        points = series(port, run, "gradhealth/params_in_trouble")
        assert len(points) >= 2 and {v for _, v in points} == {float(n)}, (run, points)
    # the named states, where not all are OK: NOT_IN_OPTIMIZER for the planted runs only
    planted = series(port, "plain/plain_head_not_in_optimizer", "gradhealth/status/NOT_IN_OPTIMIZER")
    assert {v for _, v in planted} == {2.0}


def ink_bands(strip):
    """Heights of the runs of rows that hold dark pixels."""
    rows = (strip < 128).any(axis=1)
    out, start = [], None
    for i, dark in enumerate(list(rows) + [False]):
        if dark and start is None:
            start = i
        elif not dark and start is not None:
            out.append(i - start)
            start = None
    return out


def test_the_gradient_flow_picture_is_legible_in_its_card(server):
    port, _ = server
    for run in ["demo/none/version_0", "demo/not_in_optimizer/version_0"] + [f"plain/{n}" for n in RUNS]:
        q = urllib.parse.urlencode({"run": run, "tag": "gradhealth/gradient_flow", "sample": 0})
        entries = json.loads(get(port, f"/data/plugin/images/images?{q}"))
        sizes = set()
        for entry in entries:
            img = Image.open(io.BytesIO(get(port, f"/data/plugin/images/individualImage?{entry['query']}")))
            sizes.add(img.size)
        width, _ = img.size
        assert len(sizes) == 1, (run, sizes)  # the same picture size from the first one on
        rgb = np.asarray(img.convert("RGB")).astype(int)
        frame = (np.abs(rgb - 160).sum(axis=2) == 0)  # the plot's grey outline: its top and bottom rows
        top, bottom = [int(y) for y in np.nonzero(frame.sum(axis=1) > width // 3)[0][[0, -1]]]
        left = int(np.nonzero(frame[top + 2])[0][0])
        grey = np.asarray(img.convert("L"))
        title, labels = ink_bands(grey[:top - 1]), ink_bands(grey[top + 1:bottom, :left - 1])
        below = ink_bands(grey[bottom + 2:])  # the time axis and the legend
        assert len(title) == 1 and len(labels) >= 3 and len(below) >= 2, (run, title, labels, below)
        shown = min(title + labels + below) * CARD / width
        assert shown >= 9, (run, title, labels, below, width)  # every line of text >= 9 px high as the card shows it
        red = (rgb[..., 0] > 150) & (rgb[..., 1] < 60) & (rgb[..., 2] < 60)
        labels_red = red[top:bottom, :left].any()
        assert labels_red == ("not_in_optimizer" in run), run  # the head's row label is red: not OK now


@pytest.mark.skipif(shutil.which("chromium") is None, reason="Debian's chromium is not installed (apt-get install chromium)")
def test_the_screenshots_in_a_real_browser(tmp_path):
    out = tmp_path / "docs"
    procs.run([os.path.join(ROOT, "scripts", "screenshot-dashboard"), str(out)], check=True, timeout=240,
              env={**os.environ, "PYTHONPATH": ROOT, "TABS": "custom_scalars images"})  # (the two looked at)
    for tab in ("custom_scalars", "images"):
        shot = np.asarray(Image.open(out / f"dashboard-{tab}.png").convert("RGB"))
        assert shot.shape[1] >= 1200 and len(np.unique(shot.reshape(-1, 3), axis=0)) > 50  # a page was drawn, not a blank

"""The manual's recipes for the loops people copy (docs/loops.md), run as written there (the code
blocks are read from the page), each with a tiny model standing in for the user's."""

import contextlib
import io
import math
import os
import re
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import gradhealth as gh

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def recipes() -> list[str]:
    text = open(os.path.join(ROOT, "docs", "loops.md"), encoding="utf-8").read()
    section = text.split("## Recipes for the loops people copy", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


NANOGPT, TWO_OPTIMIZERS, REPLAY, MANUAL, ACCUMULATE = range(5)


def test_the_section_holds_the_five_recipes():
    blocks = recipes()
    assert len(blocks) == 5
    assert "GradScaler(enabled=(dtype" in blocks[NANOGPT] and "optimizer=opt_g" in blocks[TWO_OPTIMIZERS]
    assert "replay_nonfinite" in blocks[REPLAY] and "clip_gradients" in blocks[MANUAL]
    assert "accumulate_grad_batches=4" in blocks[ACCUMULATE]


class TinyGPT(nn.Module):
    """nanoGPT's interface: ``model(idx, targets) -> (logits, loss)``."""

    def __init__(self, vocab=16, d=32, block=8):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.mlp = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx, targets=None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        logits = self.lm_head(x + self.mlp(x))
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


def _get_batch_factory(vocab=16, block=8, batch=8):
    g = torch.Generator().manual_seed(1)
    data = (torch.arange(4096) * 3 % vocab)  # a learnable sequence: each token fixes the next

    def get_batch(split):
        ix = torch.randint(len(data) - block - 1, (batch,), generator=g)
        x = torch.stack([data[i:i + block] for i in ix])
        return x, torch.stack([data[i + 1:i + 1 + block] for i in ix])

    return get_batch


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("scaler_line", ["torch.amp.GradScaler", "torch.cuda.amp.GradScaler"])
def test_nanogpt_style_loop_with_a_disabled_scaler(dtype, scaler_line, one_thread):
    torch.manual_seed(0)
    model = TinyGPT()
    get_batch = _get_batch_factory()
    probe = get_batch("val")
    before = model(*probe)[1].item()
    ns = dict(torch=torch, gh=gh, model=model, get_batch=get_batch, dtype=dtype, max_iters=30,
              gradient_accumulation_steps=2, grad_clip=1.0,
              optimizer=torch.optim.AdamW(model.parameters(), lr=3e-3))
    code = recipes()[NANOGPT].replace("torch.amp.GradScaler", scaler_line)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # (torch.cuda.amp.GradScaler is deprecated)
        exec(code, ns)  # on_problem="raise": a healthy run raises nothing
    assert ns["scaler"].is_enabled() is False and ns["monitor"].scaler is None
    assert ns["monitor"].last_report.ok and ns["monitor"].carry.checks == 30
    assert ns["monitor"].last_report.clip_coef is not None  # the clip used the check's norms (from the second step)
    assert model(*probe)[1].item() < 0.7 * before


def _gan_namespace():
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    disc = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    model = nn.ModuleDict({"gen": gen, "disc": disc})
    loader = [torch.randn(16, 4) + 2 for _ in range(20)]
    return dict(torch=torch, gh=gh, F=F, gen=gen, disc=disc, model=model, loader=loader,
                opt_g=torch.optim.Adam(gen.parameters(), 1e-3), opt_d=torch.optim.Adam(disc.parameters(), 1e-3))


def test_two_optimizers_recipe_is_silent_and_both_train():
    ns = _gan_namespace()
    before = [p.detach().clone() for p in ns["model"].parameters()]
    exec(recipes()[TWO_OPTIMIZERS], ns)
    assert all(not torch.equal(a, b) for a, b in zip(before, ns["model"].parameters()))


def test_two_optimizers_recipe_names_a_forgotten_step():
    code = recipes()[TWO_OPTIMIZERS]
    assert code.count("    opt_g.step()\n") == 1
    with pytest.raises(gh.GradHealthError, match=r"NOT_STEPPED.*optimizer 0 \(Adam\).*gen\.\* \(4 params\)"):
        exec(code.replace("    opt_g.step()\n", ""), _gan_namespace())


def test_replay_recipe_names_the_micro_batch():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    windows = [[(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(4)] for _ in range(3)]
    windows[1][2][0][3, 0] = math.nan  # the second step's third micro-batch
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(recipes()[REPLAY], dict(torch=torch, gh=gh, F=F, model=model, windows=windows,
                                     optimizer=torch.optim.SGD(model.parameters(), lr=0.1)))
    printed = out.getvalue()
    assert printed.count("reproduced") == 1, printed
    assert "batch 2, micro-batch 3 of the 4 accumulated" in printed and "the batch itself holds NaN/inf" in printed
    assert "step 1" in printed  # the recipe passes the step (it once said "step 0" whatever the step)


def _lightning(code, tmp_path, monkeypatch):
    import lightning.pytorch as pl

    from gradhealth.demos.lightning_parts import DemoModule, SyntheticData
    from gradhealth.integrations.lightning import GradHealthCallback

    monkeypatch.chdir(tmp_path)  # (the Trainer's logs and checkpoints)
    ns = dict(torch=torch, nn=nn, F=F, pl=pl, GradHealthCallback=GradHealthCallback, DemoModule=DemoModule,
              SyntheticData=SyntheticData)
    torch.manual_seed(0)
    exec(code, ns)
    return ns


def _loss(module):
    from gradhealth.demos.lightning_parts import SyntheticData

    x, y = next(iter(SyntheticData().train_dataloader()))
    with torch.no_grad():
        out = module.net(x) if hasattr(module, "net") else module(x)
    return F.cross_entropy(out, y).item()


def test_lightning_manual_optimization_recipe(tmp_path, monkeypatch, one_thread):
    ns = _lightning(recipes()[MANUAL], tmp_path, monkeypatch)
    torch.manual_seed(0)
    fresh = ns["Manual"]()  # the same initial weights as the trained one
    trained = ns["trainer"].lightning_module
    cb = next(c for c in ns["trainer"].callbacks if type(c).__name__ == "GradHealthCallback")
    assert cb.last_report is not None and not cb.last_report.findings_of("POSTCLIP")
    assert _loss(trained) < 0.8 * _loss(fresh)


def test_lightning_accumulate_recipe(tmp_path, monkeypatch, one_thread):
    from gradhealth.demos.lightning_parts import DemoModule

    ns = _lightning(recipes()[ACCUMULATE], tmp_path, monkeypatch)
    torch.manual_seed(0)
    fresh = DemoModule()
    assert ns["trainer"].global_step == 12
    assert _loss(ns["trainer"].lightning_module) < _loss(fresh)

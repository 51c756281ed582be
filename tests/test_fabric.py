"""Lightning Fabric as its users write loops (one process; Fabric's DDP is tests/test_fabric_ddp.py):
names under every wrapper, the shared clip, bf16-mixed, fabric.save/load, Fabric's TensorBoardLogger,
and litgpt's pretrain and LoRA loops with their planted bugs."""

import math
import warnings

import lightning as L
import pytest
import torch
from torch import nn

import gradhealth as gh
from conftest import CountClips
from fabric_ddp_script import Net
from gradhealth.integrations.fabric import share_clip
from gradhealth.integrations.tbread import read_layout
from gradhealth.integrations.tensorboard import TensorBoardSink, read_run

NAMES = ["body.0.weight", "body.0.bias", "head.weight", "head.bias"]


def _fabric(**kw):
    return L.Fabric(accelerator="cpu", devices=1, **kw)


def _wrapped(kind, tmp_path):
    """(the object the monitor gets, the module to run forward, the optimizer over body only)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(0)
    net = Net()
    body_only = lambda m: torch.optim.SGD(m.body.parameters(), lr=0.1)  # noqa: E731 (the planted bug: head left out)
    if kind == "compile":
        m = torch.compile(net, backend="eager")
        return m, m, body_only(net)
    if kind == "dataparallel_of_compiled":
        m = nn.DataParallel(torch.compile(net, backend="eager"))
        return m, m, body_only(net)
    if kind == "compiled_block":  # a wrapper inside the model: torch.compile of one block, a checkpointed head
        net.body = torch.compile(net.body, backend="eager")
        net.head = checkpoint_wrapper(net.head)
        return net, net, torch.optim.SGD(net.body.parameters(), lr=0.1)
    if kind.startswith("fabric"):
        fabric = _fabric()
        inner = torch.compile(net, backend="eager") if kind == "fabric_compiled" else net
        opt = body_only(net)
        if kind == "fabric_before_setup":  # a monitor built on the raw model, then fabric.setup
            m, opt2 = fabric.setup(inner, opt)
            return net, m, opt2
        m, opt = fabric.setup(inner, opt)
        return m, m, opt
    if kind == "accelerate":
        from accelerate import Accelerator

        acc = Accelerator(cpu=True)
        m, opt = acc.prepare(net, body_only(net))
        return m, m, opt
    raise AssertionError(kind)


WRAPPERS = ["compile", "dataparallel_of_compiled", "compiled_block", "fabric", "fabric_compiled",
            "fabric_before_setup", "accelerate"]


@pytest.mark.parametrize("kind", WRAPPERS)
def test_names_are_the_users_under_every_wrapper(tmp_path, kind, one_thread):
    """A head left out of the optimizer is named ``head.weight`` in the report, the warning text and
    the TensorBoard tags, under every wrapper and nesting (a rule, not a list of classes)."""
    given, run, opt = _wrapped(kind, tmp_path)
    mon = gh.GradHealth(given, opt, sinks=[TensorBoardSink(tmp_path)])
    assert mon.parameter_names == NAMES
    run(torch.randn(5, 4)).square().mean().backward()
    with pytest.warns(gh.GradHealthWarning) as caught:
        r = mon.check()
    mon.close()
    assert list(r.status) == NAMES
    assert r.problems == {"head.weight": gh.Status.NOT_IN_OPTIMIZER, "head.bias": gh.Status.NOT_IN_OPTIMIZER}
    text = str(caught[0].message)
    assert "NOT_IN_OPTIMIZER: head.* (2 params)" in text and "_forward_module" not in text and "_orig_mod" not in text and "module." not in text
    tags = set(read_run(tmp_path)["tag"])
    assert {f"gradhealth/grad_norm/{n}" for n in NAMES} <= tags
    assert not [t for t in tags if "_forward_module" in t or "_orig_mod" in t or "module." in t or "_checkpoint" in t]


def test_the_rule_keeps_a_users_own_attribute_named_module_inside_the_model():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.module = nn.Linear(2, 2)  # the user's own name, inside the model

    model = nn.Sequential(Block(), nn.Linear(2, 1))
    assert gh.GradHealth(model).parameter_names == ["0.module.weight", "0.module.bias", "1.weight", "1.bias"]


def _loop(fabric, model, opt, mon, steps=12, accum=2, clip=None, seed=0):
    """Fabric's accumulation idiom, the check after every backward; returns (losses, reports, clip totals)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(4, 2, generator=torch.Generator().manual_seed(7))
    losses, reports, totals = [], [], []
    for it in range(steps * accum):
        x = torch.randn(16, 4, generator=g)
        accumulating = (it + 1) % accum != 0
        with fabric.no_backward_sync(model, enabled=accumulating):
            loss = nn.functional.mse_loss(model(x).float(), x @ w)
            fabric.backward(loss / accum)
            reports.append(mon.check(loss))
        if not accumulating:
            if clip is not None:
                totals.append(fabric.clip_gradients(model, opt, max_norm=clip))
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return losses, reports, totals


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true"])
def test_shared_clip_reads_the_gradients_once_and_returns_fabrics_total(monkeypatch, precision, one_thread):
    """``share_clip``: fabric.clip_gradients with the check's norms: the same total as Fabric's own
    clip on a twin run (bit for bit on the gradients after it), no clip_grad_norm_ call against the
    twin's one per step; healthy under raise, its loss falls."""
    runs = {}
    for shared in (False, True):
        torch.manual_seed(0)
        fabric, net = _fabric(precision=precision), Net()
        model, opt = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=5e-2))
        mon = gh.GradHealth(model, opt, on_problem="raise")
        if shared:
            assert share_clip(fabric, mon) is not None
        counter = CountClips(monkeypatch)
        losses, reports, totals = _loop(fabric, model, opt, mon, clip=1.5)
        runs[shared] = (losses, [float(t) for t in totals], counter.calls,
                        [r.total_grad_norm for r in reports if r is not None][1::2], [p.detach().clone() for p in model.parameters()],
                        [r.clip_coef for r in reports][1::2])
        monkeypatch.undo()
        mon.close()
    plain, ours = runs[False], runs[True]
    assert plain[2] == len(plain[1]) == 12 and ours[2] == 0  # the premise: Fabric's clip ran 12 times; ours none
    assert ours[1] == pytest.approx(plain[1], rel=1e-6)
    # the check's total (pre-clip, exact) is what Fabric's clip returns (torch's: in the gradients' dtype)
    tol = 2**-7 if precision == "bf16-true" else 1e-5
    assert ours[3] == pytest.approx(ours[1], rel=tol)
    assert all(torch.equal(a, b) for a, b in zip(plain[4], ours[4]))
    assert min(ours[1]) < 1.5 < max(ours[1])  # the clip bites at some steps, not at others
    # the factor each step was clipped by is in its report (the sinks log it: gradhealth/clip_coef)
    assert ours[5] == pytest.approx([min(1.0, 1.5 / (t + 1e-6)) for t in ours[1]], rel=tol)
    assert plain[5] == [None] * 12
    assert sum(ours[0][-3:]) < 0.5 * sum(ours[0][:3])


def test_fabric_save_and_load_resume_the_monitor(tmp_path, one_thread):
    fabric = _fabric()
    torch.manual_seed(0)
    net = Net()
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.05))
    mon = gh.GradHealth(model, opt, on_problem="raise")
    _loop(fabric, model, opt, mon, steps=5)
    fabric.save(tmp_path / "ckpt", {"model": model, "optimizer": opt, "gradhealth": mon})
    saved = mon.state_dict()
    assert saved["calls"] == 10 and saved["history"]  # the premise: there is progress to resume
    torch.manual_seed(1)
    net2 = Net()
    model2, opt2 = fabric.setup(net2, torch.optim.SGD(net2.parameters(), lr=0.05))
    mon2 = gh.GradHealth(model2, opt2, on_problem="raise")
    fabric.load(tmp_path / "ckpt", {"model": model2, "optimizer": opt2, "gradhealth": mon2})
    assert mon2.state_dict() == saved
    _, reports, _ = _loop(fabric, model2, opt2, mon2, steps=1)
    assert reports[0].step == 10


def test_fabric_tensorboard_logger_writes_the_dashboards(tmp_path, one_thread):
    """Fabric's TensorBoardLogger's writer takes the sink: the same dashboards (layout and tags) as a
    plain writer's run of the same loop."""
    from lightning.fabric.loggers import TensorBoardLogger
    from torch.utils.tensorboard import SummaryWriter

    layouts, tags = [], []
    for which in ("fabric", "plain"):
        logger = TensorBoardLogger(tmp_path / which, name="run")
        fabric = _fabric(loggers=logger)
        torch.manual_seed(0)
        net = Net()
        model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.05))
        writer = logger.experiment if which == "fabric" else SummaryWriter(str(tmp_path / which / "plain"))
        mon = gh.GradHealth(model, opt, sinks=[TensorBoardSink(writer)], on_problem="raise")
        _loop(fabric, model, opt, mon, steps=8)  # (the sink writes every 10th check: 2 points a chart)
        mon.close()
        logger.finalize("success")
        layouts.append(read_layout(str(tmp_path / which)))
        tags.append(set(read_run(tmp_path / which)["tag"]))
    assert layouts[0] and layouts[0] == layouts[1]
    assert "gradhealth/grad_norm/head.weight" in tags[0] and tags[0] == tags[1]


# ------------------------------------------------------------------ litgpt's loops
def _litgpt_config(lora=False, **kw):
    from litgpt.config import Config
    from litgpt.lora import Config as LoRAConfig

    return (LoRAConfig if lora else Config)(block_size=16, vocab_size=64, padded_vocab_size=64, n_layer=2, n_head=2, n_embd=16,
                  rotary_percentage=1.0, parallel_residual=False, bias=False, norm_class_name="RMSNorm",
                  mlp_class_name="LLaMAMLP", intermediate_size=32, **kw)


def _batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randint(0, 64, (4, 17), generator=g)
        yield (x * 0 + (x[:, :1] + torch.arange(17)) % 64)  # a counting language the model can learn


def test_litgpt_pretrain_loop_is_silent_under_raise(one_thread):
    """litgpt's pretrain.py fit(): warmup-cosine lr set per iteration, accumulation under
    no_backward_sync, fabric.clip_gradients, then step and zero_grad; the check after each backward."""
    from litgpt.model import GPT
    from litgpt.pretrain import get_lr
    from litgpt.utils import chunked_cross_entropy

    fabric = _fabric()
    torch.manual_seed(0)
    model = GPT(_litgpt_config())
    model = fabric.setup(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-2, weight_decay=0.1))
    monitor = gh.GradHealth(model, optimizer, on_problem="raise")
    share_clip(fabric, monitor)
    state = {"iter_num": 0, "step_count": 0}
    accum, max_iters, warmup_iters, losses = 2, 60, 6, []
    for train_data in _batches(max_iters):
        lr = get_lr(optimizer.defaults["lr"], state["iter_num"], warmup_iters, max_iters, 3e-3)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        state["iter_num"] += 1
        input_ids = train_data[:, 0:16].contiguous().long()
        targets = train_data[:, 1:17].contiguous().long()
        is_accumulating = state["iter_num"] % accum != 0
        with fabric.no_backward_sync(model, enabled=is_accumulating):
            logits = model(input_ids)
            loss = chunked_cross_entropy(logits, targets)
            fabric.backward(loss / accum)
        report = monitor.check(loss)
        assert report.ok
        if not is_accumulating:
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
            optimizer.step()
            optimizer.zero_grad()
            state["step_count"] += 1
            losses.append(loss.item())
    monitor.close()
    assert monitor.parameter_names[0] == "lm_head.weight" or monitor.parameter_names[0].startswith("transformer.")
    assert not [n for n in monitor.parameter_names if "_forward_module" in n]
    assert sum(losses[-3:]) < 0.5 * sum(losses[:3])


def _lora_run(bug=None, steps=20):
    """litgpt's finetune/lora.py: mark_only_lora_as_trainable, fabric.setup_module, an optimizer over
    model.parameters(), linear-warmup-cosine scheduler, accumulation. ``bug``: ``out``: layer 0's
    LoRA left out of the optimizer; ``frozen_b``: layer 1's lora_B frozen; ``no_zero_grad``."""
    from litgpt.finetune.lora import get_lr_scheduler
    from litgpt.lora import GPT, mark_only_lora_as_trainable
    from litgpt.utils import chunked_cross_entropy

    fabric = _fabric()
    torch.manual_seed(0)
    model = GPT(_litgpt_config(lora=True, lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_query=True, lora_value=True))
    mark_only_lora_as_trainable(model)
    base = [n for n, _ in model.named_parameters() if "lora_" not in n]  # what the recipe freezes, by name
    if bug == "frozen_b":
        model.transformer.h[1].attn.qkv.lora_B.requires_grad_(False)
    model = fabric.setup_module(model)
    params = [p for n, p in model.named_parameters() if not (bug == "out" and ".h.0." in n)]
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(params, lr=2e-2, weight_decay=0.0))
    scheduler = get_lr_scheduler(optimizer, warmup_steps=2, max_steps=steps)
    monitor = gh.GradHealth(model, optimizer, on_problem="ignore" if bug else "raise", expect_frozen=base)
    accum, reports, losses = 2, [], []
    for iter_num, batch in enumerate(_batches(steps * accum), start=1):
        input_ids, targets = batch[:, :16], batch[:, 1:17]
        is_accumulating = iter_num % accum != 0
        with fabric.no_backward_sync(model, enabled=is_accumulating):
            logits = model(input_ids, lm_head_chunk_size=128)
            loss = chunked_cross_entropy(logits, targets)
            fabric.backward(loss / accum)
        reports.append(monitor.check(loss))
        if not is_accumulating:
            optimizer.step()
            if bug != "no_zero_grad":
                optimizer.zero_grad()
            scheduler.step()
            losses.append(loss.item())
    monitor.close()
    return reports, losses, model


def test_litgpt_lora_loop_is_silent_under_raise(one_thread):
    reports, losses, model = _lora_run()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)  # the premise: only the adapters train
    assert all(r.ok for r in reports)
    assert losses[-1] < losses[0]


def test_litgpt_lora_planted_bugs_are_named_with_the_users_names(one_thread):
    reports, _, _ = _lora_run("out")
    last = reports[-1]
    assert last.problems == {n: gh.Status.NOT_IN_OPTIMIZER for n in
                             ("transformer.h.0.attn.qkv.lora_A", "transformer.h.0.attn.qkv.lora_B")}
    reports, _, model = _lora_run("frozen_b")
    assert not model.transformer.h[1].attn.qkv.lora_B.requires_grad  # the premise
    [f] = [f for f in reports[0].findings if f.kind == "UNEXPECTED_FROZEN"]
    assert f.params == ("transformer.h.1.attn.qkv.lora_B",) and f.level == "error"
    reports, _, _ = _lora_run("no_zero_grad", steps=4)
    stale = [r.step for r in reports if r.findings_of("STALE_GRAD")]
    assert stale and stale[0] <= 2  # at the first backward onto gradients an optimizer step already used


def _readme_blocks():
    import os
    import re

    text = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "frameworks",
                             "litgpt.md")).read()
    section = text.split("## `pretrain.py` and `finetune/lora.py`", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def test_the_readme_fabric_recipes_run_as_written(one_thread):
    """Both blocks of the litgpt page's pretrain/LoRA section (docs/frameworks/litgpt.md), executed as they stand with a tiny litgpt model and
    a counting language: silent under raise, the loss falls, the names are the model's own."""
    from litgpt.lora import GPT as LoRAGPT
    from litgpt.model import GPT
    from litgpt.utils import chunked_cross_entropy

    pretrain, lora = _readme_blocks()
    data = list(_batches(40))

    @torch.no_grad()
    def loss_of(model):
        return chunked_cross_entropy(model(data[0][:, :-1]), data[0][:, 1:]).item()

    torch.manual_seed(0)
    model = GPT(_litgpt_config())
    before = loss_of(model)
    ns = {"fabric": _fabric(), "model": model, "optimizer": torch.optim.AdamW(model.parameters(), lr=3e-2),
          "train_dataloader": data, "learning_rate": 3e-2, "warmup_iters": 4, "max_iters": 40, "min_lr": 3e-3,
          "accum": 2}
    exec(pretrain, ns)
    assert ns["monitor"].carry.checks == 40 and ns["monitor"].parameter_names[0] == "lm_head.weight"
    assert loss_of(ns["model"]) < 0.7 * before

    config = _litgpt_config(lora=True, lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_query=True, lora_value=True)
    torch.manual_seed(0)
    before = loss_of(LoRAGPT(config))  # (lora_B starts at zero: the base model's loss)
    torch.manual_seed(0)
    ns = {"fabric": _fabric(), "config": config, "train_dataloader": data, "max_steps": 20, "accum": 2, "torch": torch}
    exec(lora, ns)
    mon = ns["monitor"]
    assert mon.carry.checks == 40 and "transformer.h.0.attn.qkv.lora_A" in mon.parameter_names
    assert ns["frozen"] and not [n for n in ns["frozen"] if "lora_" in n]
    assert loss_of(ns["model"]) < before

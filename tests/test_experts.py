"""Stacked experts (transformers 5 MoE, grouped-GEMM experts): found, judged per expert, exact."""

import logging
import math
import warnings

import pytest
import torch
from torch import nn

import gradhealth as gh
from gradhealth.model.experts import find_stacks

S = gh.Status
pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------- tiny models
def tiny_mixtral(seed=0, **kw):
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    cfg = MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                        num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64, **kw)
    return MixtralForCausalLM(cfg)


def tiny_qwen3_moe(seed=0):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, num_experts=4, num_experts_per_tok=2,
                         max_position_embeddings=64, decoder_sparse_step=1, mlp_only_layers=[])
    return Qwen3MoeForCausalLM(cfg)


def never_pick(model, expert: int):
    """A collapsed router: the logit of ``expert`` forced to -1e4 in every MoE layer's gate."""
    def hook(module, args, out):
        logits = out[0].clone()
        logits[:, expert] = -1e4
        probs = logits.float().softmax(-1)
        top, idx = probs.topk(module.top_k, dim=-1)
        return logits, top / top.sum(-1, keepdim=True), idx

    return [layer.mlp.gate.register_forward_hook(hook) for layer in model.model.layers]


def lm_run(model, steps, on_problem="raise", router_logits=False, sinks=(), **kw):
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    mon = gh.GradHealth(model, opt, on_problem=on_problem, sinks=sinks, **kw)
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 64, (2, 8), generator=g) for _ in range(4)]
    reports, losses = [], []
    for step in range(steps):
        ids = data[step % 4]
        opt.zero_grad()
        out = model(ids, labels=ids, output_router_logits=router_logits)
        out.loss.backward()
        reports.append(mon.check(loss=out.loss))
        opt.step()
        losses.append(out.loss.item())
    mon.close()
    return reports, losses


LAYERS = ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts")


# ----------------------------------------------------------------------------- finding
def test_stacks_are_found_from_the_model_and_said_once(caplog):
    model = tiny_mixtral()
    stacks = find_stacks(model, list(model.named_parameters()))
    assert sorted(s.name for s in stacks.values()) == sorted(f"{m}.{t}" for m in LAYERS for t in ("down_proj", "gate_up_proj"))
    assert {(s.module, s.dim, s.count) for s in stacks.values()} == {(m, 0, 4) for m in LAYERS}
    with caplog.at_level(logging.INFO, logger="gradhealth"):
        lm_run(model, 2)
    said = [r.getMessage() for r in caplog.records if "stacked experts" in r.getMessage()]
    assert len(said) == 1 and "model.layers.0.mlp.experts (4 experts: gate_up_proj, down_proj)" in said[0]


class Conv3(nn.Module):
    """3-D parameters that are not experts: a Conv1d weight, a [4, 8, 8] tensor in a module not
    named experts, beside a config that says 4 experts."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(4, 4, 3)
        self.mix = nn.Module()
        self.mix.w = nn.Parameter(torch.randn(4, 8, 8))
        self.config = type("Config", (), {"num_local_experts": 4})()

    def forward(self, x):
        return self.conv(x).sum() + torch.einsum("eij,j->", self.mix.w, x[0, :, :8].mean(0).repeat(2)[:8])


def test_a_3d_parameter_that_is_not_experts_reports_no_experts():
    model = Conv3()
    assert model.conv.weight.dim() == 3 and model.mix.w.shape[0] == 4  # the premise
    assert find_stacks(model, list(model.named_parameters())) == {}
    mon = gh.GradHealth(model, on_problem="raise")
    model(torch.randn(2, 4, 10)).backward()
    r = mon.check()
    assert r.ok and r.expert_status == {} and r.expert_layers == {}
    declared = gh.GradHealth(model, experts={"mix.w": 0}, on_problem="ignore")  # declared by the option
    r2 = declared.check()
    assert set(r2.expert_status) == {f"mix[{i}]" for i in range(4)}
    with pytest.raises(TypeError, match="experts must be"):
        gh.GradHealth(model, experts=3)
    assert find_stacks(tiny_mixtral(), list(tiny_mixtral().named_parameters()), False) == {}


# ------------------------------------------------------------------------- exactness
class Stacked(nn.Module):
    def __init__(self, e=6, dtype=torch.float32):
        super().__init__()
        self.experts = nn.Module()
        self.experts.num_experts = e
        self.experts.w = nn.Parameter(torch.zeros(e, 5, 7, dtype=dtype))
        self.experts.b = nn.Parameter(torch.zeros(e, 5, dtype=dtype))


def naive_norm(t: torch.Tensor) -> float:
    """float64, scaled by the largest magnitude: exact where squares over- or underflow."""
    x = t.detach().to(torch.float64).reshape(-1)
    m = float(x.abs().max()) if x.numel() else 0.0
    if m == 0 or not math.isfinite(m):
        return m if not torch.isnan(x).any() else math.nan
    return m * math.sqrt(float(((x / m) ** 2).sum()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_expert_norms_equal_a_naive_per_slice_reference_at_the_edges(dtype):
    model = Stacked(dtype=dtype)
    mon = gh.GradHealth(model, on_problem="ignore")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 5, 7, generator=g).to(dtype)
    b = torch.randn(6, 5, generator=g).to(dtype)
    w[0], b[0] = 1e20, 1e20  # finite; their float32 squares overflow
    w[1], b[1] = 1e-30, 1e-30  # not zero; their squares underflow
    w[2], b[2] = 0.0, -0.0  # exactly zero: an idle expert
    w[4, 3, 1] = float("nan")  # one NaN in one expert
    b[5] = 0.0  # a zero bias slice beside a non-zero weight slice: not idle
    model.experts.w.grad, model.experts.b.grad = w, b
    r = mon.check()
    for e in range(6):
        unit = f"experts[{e}]"
        ref = math.hypot(naive_norm(w[e]), naive_norm(b[e]))
        got = r.expert_grad_norm[unit]
        if math.isnan(ref):
            assert math.isnan(got)
        else:
            assert got == pytest.approx(ref, rel=1e-5), unit
    assert r.expert_grad_norm["experts[0]"] == pytest.approx(math.sqrt(35 + 5) * 1e20 if dtype == torch.float32
                                                             else naive_norm(torch.cat([w[0].reshape(-1), b[0]])), rel=1e-5)
    assert r.expert_grad_norm["experts[1]"] > 0
    want = {0: S.OK, 1: S.OK, 2: S.ZERO_GRAD, 3: S.OK, 4: S.NON_FINITE_GRAD, 5: S.OK}
    assert {u: s for u, s in r.expert_status.items()} == {f"experts[{e}]": s for e, s in want.items()}
    # the tensors' own norms are their slices' (exact too)
    assert r.grad_norm["experts.b"] == pytest.approx(naive_norm(b), rel=1e-5)
    [f] = r.findings_of("NONFINITE_EXPERT")
    assert f.params == ("experts[4]",)


# ------------------------------------------------------------------- healthy and planted
@pytest.mark.parametrize("family", [tiny_mixtral, tiny_qwen3_moe])
def test_healthy_stacked_moe_is_silent_under_raise(family):
    with warnings.catch_warnings():
        warnings.simplefilter("error", gh.GradHealthWarning)
        reports, losses = lm_run(family(), 50)
    assert sum(losses[-4:]) < sum(losses[:4])  # healthy: it learns
    assert all(r.ok for r in reports)
    assert all(len(r.expert_status) == 8 for r in reports)  # 2 layers x 4 experts judged
    assert not any(r.findings_of("DEAD_EXPERT") for r in reports)


def _family_limit(siblings: int, patience: int = 3) -> int:
    g = patience
    while math.prod((1 + i) / (siblings * g + 2 + i) for i in range(g)) >= 1e-8:
        g += 1
    return g


def test_a_collapsed_router_names_the_dead_expert_with_layer_and_index():
    model = tiny_mixtral()
    never_pick(model, 3)
    reports, _ = lm_run(model, 12, on_problem="ignore")
    for r in reports:  # the premise: exactly zero slices of expert 3, whole tensors still OK
        for m in LAYERS:
            for t in ("gate_up_proj", "down_proj"):
                assert r.status[f"{m}.{t}"] is S.OK
        assert {u for u, s in r.expert_status.items() if s is not S.OK} == {f"{m}[3]" for m in LAYERS}
    limit = _family_limit(3)  # never routed, beside 3 siblings that get tokens at every check
    assert all(r.ok for r in reports[:limit - 1])
    bad = reports[limit - 1]
    [f] = bad.findings_of("DEAD_EXPERT")
    assert not bad.ok and f.level == "error" and f.params == tuple(f"{m}[3]" for m in LAYERS)
    assert "model.layers.0.mlp.experts[3]" in f.message and "load-balancing" in f.message
    assert "DEAD_EXPERT" in gh.GradHealth.explain(bad)
    with pytest.raises(gh.GradHealthError, match=r"model\.layers\.1\.mlp\.experts\[3\]"):
        lm_run(model, 12)


def test_an_expert_whose_slice_turns_nan_is_named():
    model = tiny_mixtral()
    w = model.model.layers[1].mlp.experts.gate_up_proj
    w.register_hook(lambda g: g.index_fill(0, torch.tensor([2]), float("nan")))
    reports, _ = lm_run(model, 1, on_problem="ignore")
    r = reports[0]
    assert r.status["model.layers.1.mlp.experts.gate_up_proj"] is S.NON_FINITE_GRAD
    [f] = r.findings_of("NONFINITE_EXPERT")
    assert f.params == ("model.layers.1.mlp.experts[2]",) and r.expert_status[f.params[0]] is S.NON_FINITE_GRAD


def test_expert_metrics_and_router_tokens_agree_with_the_slices():
    from gradhealth.publish.metrics import report_metrics

    model = tiny_mixtral()
    never_pick(model, 3)
    reports, _ = lm_run(model, 10, on_problem="ignore", router_logits=True)
    r = reports[-1]
    m = report_metrics(r)
    for layer in LAYERS:
        norms = [r.expert_grad_norm[f"{layer}[{e}]"] for e in range(4)]
        assert m[f"gradhealth/experts/utilization/{layer}"] == 0.75
        assert m[f"gradhealth/experts/grad_norm_min/{layer}"] == min(norms) == 0.0
        assert m[f"gradhealth/experts/grad_norm_max/{layer}"] == max(norms)
        assert m[f"gradhealth/experts/dead/{layer}[3]"] == 1.0
    # the router's own counts: zero tokens exactly where the slice is zero (16 tokens x top-2 each layer)
    for rep in reports:
        assert rep.expert_tokens and sum(rep.expert_tokens[f"{LAYERS[0]}[{e}]"] for e in range(4)) == 32
        for u, s in rep.expert_status.items():
            assert (rep.expert_tokens[u] == 0) == (s is S.ZERO_GRAD), (rep.step, u)
    [f] = r.findings_of("DEAD_EXPERT")
    assert "router logits agree: 0 tokens" in f.message


def test_the_expert_map_and_the_report_name_dead_experts(tmp_path, capsys):
    from gradhealth.cli import main
    from gradhealth.integrations.tensorboard import TensorBoardSink, read_run

    model = tiny_mixtral()
    never_pick(model, 3)
    sink = TensorBoardSink(str(tmp_path), heatmap_every=5)
    lm_run(model, 12, on_problem="ignore", sinks=[sink])
    frame = read_run(str(tmp_path))
    tags = set(frame.tag)
    assert {f"gradhealth/experts/utilization/{m}" for m in LAYERS} <= tags
    dead = frame[frame.tag == f"gradhealth/experts/dead/{LAYERS[1]}[3]"]
    assert sorted(dead.step) == [8, 9, 10, 11]
    from gradhealth.integrations.tbread import read_layout

    assert [c for c in read_layout(str(tmp_path)) if "expert" in c] == [
        "expert utilization by MoE layer (healthy: near 1; 0: collapse)",
        "expert gradient norm, min and max by MoE layer (healthy: min above 0)"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(tmp_path), size_guidance={"images": 0})
    ea.Reload()
    assert "gradhealth/expert_map" in ea.Tags()["images"]
    import io

    from PIL import Image

    img = Image.open(io.BytesIO(ea.Images("gradhealth/expert_map")[-1].encoded_image_string)).convert("RGB")
    assert img.width >= 96 and (230, 20, 20) in set(img.getdata())  # dead experts are red
    main(["report", str(tmp_path)])
    out = capsys.readouterr().out
    assert "DEAD_EXPERT: 2 dead experts from step 8 on: model.layers.0.mlp.experts[3]" in out
    assert "model.layers.1.mlp.experts[3]" in out


def test_the_trainer_callback_names_the_dead_expert(tmp_path):
    from transformers import Trainer, TrainingArguments

    from gradhealth.integrations.transformers import GradHealthCallback

    class Ids(torch.utils.data.Dataset):
        def __init__(self):
            self.x = torch.randint(0, 64, (64, 8), generator=torch.Generator().manual_seed(0))

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            return {"input_ids": self.x[i], "labels": self.x[i]}

    model = tiny_mixtral()
    never_pick(model, 1)
    cb = GradHealthCallback(on_problem="raise")
    args = TrainingArguments(str(tmp_path), use_cpu=True, report_to=[], max_steps=30, per_device_train_batch_size=2,
                             logging_steps=5, save_strategy="no", disable_tqdm=True, seed=0, data_seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=Ids(), callbacks=[cb])
    with pytest.raises(gh.GradHealthError, match=r"DEAD_EXPERT") as info:
        trainer.train()
    report = info.value.report
    [f] = report.findings_of("DEAD_EXPERT")
    assert f.params == tuple(f"{m}[1]" for m in LAYERS)
    assert report.step == _family_limit(3)  # Trainer counts from 1: the 9th check


def test_to_frame_shows_the_experts():
    model = tiny_mixtral()
    never_pick(model, 3)
    reports, _ = lm_run(model, 1, on_problem="ignore", router_logits=True)
    frame = reports[0].to_frame(experts=True)
    assert list(frame.index) == [f"{m}[{e}]" for m in LAYERS for e in range(4)]
    assert list(frame.loc[f"{LAYERS[0]}[3]", ["layer", "expert", "status", "grad_norm", "tokens"]]) == [
        LAYERS[0], 3, "ZERO_GRAD", 0.0, 0]
    assert (frame["grad_norm"] == [reports[0].expert_grad_norm[u] for u in frame.index]).all()
    assert len(reports[0].to_frame()) == len(reports[0].status)  # the parameters' frame is unchanged

"""Healthy runs of public architectures (tiny configs, random weights, no downloads) stay silent
under on_problem="raise": warmup from lr 0, bf16 autocast, fp16 with a grad scaler settling from
2**24."""

import warnings

import pytest
import torch

import gradhealth as gh


pytestmark = pytest.mark.usefixtures("one_thread")


def models():
    from transformers import (BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel, T5Config,
                              T5ForConditionalGeneration)

    ids = dict(bos_token_id=0, eos_token_id=1, pad_token_id=0)
    return {
        "bert": lambda: BertForMaskedLM(BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                                   intermediate_size=64, max_position_embeddings=32, pad_token_id=0)),
        "gpt2": lambda: GPT2LMHeadModel(GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=2, n_positions=32, **ids)),
        "t5": lambda: T5ForConditionalGeneration(T5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                                          num_heads=2, decoder_start_token_id=0, **ids)),
    }


def batches(name, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(2, 100, (4, 16), generator=g)
        labels = torch.randint(2, 100, (4, 8), generator=g) if name == "t5" else ids
        out.append({"input_ids": ids, "labels": labels})
    return out


@pytest.mark.parametrize("name, precision", [("bert", None), ("gpt2", None), ("t5", None), ("gpt2", "bf16"),
                                             ("gpt2", "fp16"), ("bert", "bf16")])
def test_healthy_run_of_a_public_architecture_is_silent(name, precision):
    from transformers import get_linear_schedule_with_warmup

    torch.manual_seed(0)
    model = models()[name]()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sched = get_linear_schedule_with_warmup(opt, 10, 120)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24) if precision == "fp16" else None
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    mon = gh.GradHealth(model, opt, on_problem="raise", scaler=scaler)
    with warnings.catch_warnings():
        warnings.simplefilter("error", gh.GradHealthWarning)
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
        for batch in batches(name, 110):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
                loss = model(**batch).loss
            if scaler is not None:
                scaler.scale(loss).backward()
                report = mon.check(loss=loss)
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                report = mon.check(loss=loss)
                opt.step()
            sched.step()
            assert report.ok, str(report)
        mon.close()
    assert report.loss is not None and report.total_grad_norm > 0


class Checkpointed(torch.nn.Module):
    """An embedding, two blocks under reentrant torch.utils.checkpoint (``first``: only the first one,
    with no ``gradient_checkpointing`` flag: a hand-written checkpoint), a head."""

    def __init__(self, first=False):
        super().__init__()
        nn = torch.nn
        self.embed = nn.Embedding(50, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.head = nn.Linear(16, 2)
        self.first = first
        if not first:
            self.gradient_checkpointing = True  # (the Hugging Face convention)

    def forward(self, ids):
        from torch.utils.checkpoint import checkpoint

        h = self.embed(ids)
        for i, block in enumerate(self.blocks):
            h = checkpoint(block, h, use_reentrant=True) if i == 0 or not self.first else block(h)
        return self.head(h).mean(1)


def test_reentrant_checkpointing_after_frozen_embeddings_names_the_cause():
    """The classic: frozen embeddings, then layers under reentrant torch.utils.checkpoint (the
    Hugging Face convention: a ``gradient_checkpointing`` flag on the model)."""
    torch.manual_seed(0)
    model = Checkpointed()
    model.embed.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    mon = gh.GradHealth(model, opt, on_problem="ignore")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(3):
            opt.zero_grad()
            model(torch.randint(0, 50, (4, 6))).square().mean().backward()
            last = mon.check()
            opt.step()
    assert {n for n, s in last.errors.items()} == {"blocks.0.weight", "blocks.0.bias", "blocks.1.weight", "blocks.1.bias"}
    [hint] = last.findings_of("CHECKPOINT_NO_GRAD")
    assert "enable_input_require_grads" in hint.message and "use_reentrant=False" in hint.message
    assert "blocks.*" in hint.message


def test_lora_under_a_reentrant_checkpoint_of_one_layer_is_named_within_patience():
    """peft#1142 / transformers#26221: LoRA on two layers after a frozen embedding, layer 0 under a
    reentrant checkpoint (no input requires grad: its adapters never get a gradient), layer 1 plain.
    Layer 1's lora_A starts with an exactly zero gradient (its lora_B is zero): LoRA's start, not a
    part of the model that skips, so it does not stretch the patience of layer 0's adapters."""
    import peft

    torch.manual_seed(0)
    model = peft.get_peft_model(Checkpointed(first=True), peft.LoraConfig(r=4, target_modules=["blocks.0", "blocks.1"]))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    mon = gh.GradHealth(model, opt, on_problem="ignore")
    reports = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(5):
            opt.zero_grad()
            model(torch.randint(0, 50, (4, 6))).square().mean().backward()
            reports.append(mon.check())
            opt.step()
    a0, a1 = "base_model.model.blocks.0.lora_A.default.weight", "base_model.model.blocks.1.lora_A.default.weight"
    assert reports[0].status[a1] is gh.Status.ZERO_GRAD and reports[1].status[a1] is gh.Status.OK  # the premises
    assert all(r.status[a0] is gh.Status.NO_GRAD for r in reports)
    first = next(k for k, r in enumerate(reports) if a0 in r.errors)
    assert first == 2  # grad_patience: 3 checks
    [hint] = reports[first].findings_of("CHECKPOINT_NO_GRAD")
    assert "enable_input_require_grads" in hint.message and "use_reentrant=False" in hint.message
    assert a1 not in reports[0].errors  # LoRA's start stays tolerated


class MeanPooledBert(torch.nn.Module):
    """A tiny BERT (random weights) under Hugging Face gradient checkpointing, mean-pooled into a
    regression head: its pooler runs but the loss never uses it (NO_GRAD, rightly)."""

    def __init__(self, reentrant: bool, cut: bool = False):
        super().__init__()
        from transformers import BertConfig, BertModel

        self.bert = BertModel(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                         intermediate_size=32, max_position_embeddings=32))
        self.head = torch.nn.Linear(16, 1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # (transformers 5 renames it; the words)
            self.bert.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        if cut:  # the classic: frozen embeddings, nothing into the checkpointed layers requires grad
            self.bert.embeddings.requires_grad_(False)
            self.bert.disable_input_require_grads()

    def forward(self, ids):
        return self.head(self.bert(input_ids=ids).last_hidden_state.mean(1)).squeeze(-1)


def pooled_bert_run(reentrant, cut=False, steps=4, **kw):
    torch.manual_seed(0)
    model = MeanPooledBert(reentrant, cut).train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    mon = gh.GradHealth(model, opt, **kw)
    g, reports, calls = torch.Generator().manual_seed(0), [], []
    import torch.utils.checkpoint as tuc

    real = tuc.checkpoint

    def counted(*args, **kwargs):  # (the premise: checkpointing really runs, with the setting asked for)
        calls.append(kwargs.get("use_reentrant"))
        return real(*args, **kwargs)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch's "None of the inputs have requires_grad=True" when cut)
        for layer in model.bert.encoder.layer:  # (transformers binds the function at enable time)
            layer._gradient_checkpointing_func.func is real or pytest.fail("checkpointing is not torch's")
            layer._gradient_checkpointing_func = __import__("functools").partial(counted, use_reentrant=reentrant)
        for _ in range(steps):
            loss = (model(torch.randint(0, 64, (4, 8), generator=g)) - 1).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            reports.append(mon.check(loss))
            opt.step()
    mon.close()
    assert calls and set(calls) == {reentrant}
    return reports


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointing_is_not_blamed_for_a_pooler_the_loss_does_not_use(reentrant):
    """Issue 65, case 5: BERT under gradient_checkpointing_enable(gradient_checkpointing_kwargs=
    {"use_reentrant": False}), mean-pooled: NO_GRAD on bert.pooler.* is right, but
    CHECKPOINT_NO_GRAD blamed reentrant checkpointing and advised use_reentrant=False, which the
    user has. The pooler runs outside every checkpoint: reentrant or not, no checkpoint cut it."""
    reports = pooled_bert_run(reentrant)
    pooler = {"bert.pooler.dense.weight", "bert.pooler.dense.bias"}
    assert all(r.status[n] is gh.Status.NO_GRAD for r in reports for n in pooler)  # the premise
    assert [r.ok for r in reports] == [True, True, False, False]
    for r in reports[2:]:
        assert set(r.errors) == pooler
        assert not r.findings_of("CHECKPOINT_NO_GRAD"), r.findings_of("CHECKPOINT_NO_GRAD")[0].message
    text = gh.GradHealth.explain(reports[2])
    assert "an unused layer or head" in text and "use_reentrant" not in text


@pytest.mark.parametrize("patience", [3, 1])
def test_reentrant_checkpointing_that_cuts_the_graph_is_still_blamed(patience):
    """The counterpart: frozen embeddings, use_reentrant=True, no input that requires grad: the
    checkpointed layers get no gradient and CHECKPOINT_NO_GRAD names them (not the pooler, which
    runs outside the checkpoints); with grad_patience=1, before the forwards were looked at, the
    model's setting stands in for them."""
    reports = pooled_bert_run(True, cut=True, grad_patience=patience)
    first = reports[patience - 1]
    assert not first.ok and all(n in first.errors for n in first.status if n.startswith("bert.encoder."))
    [hint] = first.findings_of("CHECKPOINT_NO_GRAD")
    assert "use_reentrant=True" in hint.message and "enable_input_require_grads" in hint.message
    assert {n for n in hint.params if n.startswith("bert.encoder.")} == {
        n for n in first.status if n.startswith("bert.encoder.")}
    [later] = reports[-1].findings_of("CHECKPOINT_NO_GRAD")  # once the forwards were looked at: exactly these
    assert set(later.params) == {n for n in first.status if n.startswith("bert.encoder.")}


def test_non_reentrant_checkpointing_is_not_blamed_before_the_forwards_are_looked_at():
    """grad_patience=1: the pooler's NO_GRAD is an error at check 0, before any probe; the model
    is set to checkpoint with use_reentrant=False, which cannot cut: not blamed."""
    reports = pooled_bert_run(False, grad_patience=1, steps=2)
    assert not reports[0].ok and set(reports[0].errors) == {"bert.pooler.dense.weight", "bert.pooler.dense.bias"}
    assert not any(r.findings_of("CHECKPOINT_NO_GRAD") for r in reports)

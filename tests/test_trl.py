"""TRL's trainers with the Trainer callback (trl 1.x, CPU, a tiny Llama with random weights and a word-level
tokenizer built here: no downloads). TRL backpropagates a loss it builds itself from the model's logits:
the callback judges that loss, before Trainer's clip."""

import warnings

import datasets
import pytest
import torch

import gradhealth as gh
from gradhealth.integrations.transformers import GradHealthCallback

pytestmark = pytest.mark.usefixtures("one_thread")

WORDS = "the a cat dog sat ran on under mat rug and then quickly slowly big small red blue".split()


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<pad>", "<unk>", "<s>", "</s>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")


def tiny_llama(vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=2, eos_token_id=3)
    return LlamaForCausalLM(cfg)


def sentences(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    subjects, verbs, places = ["the cat", "a dog", "the big cat", "a small dog"], ["sat", "ran"], ["on the mat", "under the rug"]
    out = []
    for _ in range(n):
        s, v, p = (x[int(torch.randint(len(x), (1,), generator=g))] for x in (subjects, verbs, places))
        out.append((f"{s} {v}", f" {p}"))  # the completion follows from the verb: learnable
    return out


def train_strict(trainer, kept):
    """Train with gradhealth's warnings as errors; (Trainer's logged losses)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", gh.GradHealthWarning)
        trainer.train()
    assert len(kept.reports) == 12 and all(r.ok for r in kept.reports)
    assert not [r for r in kept.reports if r.findings_of("POSTCLIP")]  # checked before Trainer's clip
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


class Kept:
    def __init__(self):
        self.reports = []

    def write(self, report):
        self.reports.append(report)


def common(tmp_path, **kw):
    return dict(output_dir=str(tmp_path), max_steps=12, per_device_train_batch_size=4, learning_rate=5e-3,
                logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0,
                max_grad_norm=0.5, **kw)


def test_sft_trainer_completion_only_is_silent_under_raise_and_pre_clip(tmp_path):
    from trl import SFTConfig, SFTTrainer

    tok = tokenizer()
    rows = sentences(64)
    ds = datasets.Dataset.from_dict({"prompt": [p for p, _ in rows], "completion": [c for _, c in rows]})
    kept = Kept()
    trainer = SFTTrainer(model=tiny_llama(len(tok)), args=SFTConfig(**common(tmp_path), completion_only_loss=True,
                                                                     max_length=16),
                         train_dataset=ds, processing_class=tok,
                         callbacks=[GradHealthCallback(on_problem="raise", sinks=[kept])])
    losses = train_strict(trainer, kept)
    assert sum(losses[-3:]) < 0.8 * sum(losses[:3])  # the healthy control learns
    norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    assert [r.total_grad_norm for r in kept.reports] == pytest.approx(norms, rel=1e-4)  # Trainer's own pre-clip norm


def test_dpo_trainer_is_silent_under_raise(tmp_path):
    from trl import DPOConfig, DPOTrainer

    tok = tokenizer()
    rows = sentences(64)
    ds = datasets.Dataset.from_dict({"prompt": [p for p, _ in rows], "chosen": [c for _, c in rows],
                                     "rejected": [" on the rug" if "mat" in c else " under the mat" for _, c in rows]})
    kept = Kept()
    trainer = DPOTrainer(model=tiny_llama(len(tok)), ref_model=tiny_llama(len(tok)),  # (the same weights: seeded)
                         args=DPOConfig(**common(tmp_path), max_length=16, beta=0.5),
                         train_dataset=ds, processing_class=tok,
                         callbacks=[GradHealthCallback(on_problem="raise", sinks=[kept])])
    losses = train_strict(trainer, kept)
    assert losses[-1] < losses[0]  # the policy moves away from the reference, towards the chosen


def grpo(tmp_path, reward, kept, on_problem="raise", steps=6):
    from trl import GRPOConfig, GRPOTrainer

    tok = tokenizer()
    rows = sentences(32)
    ds = datasets.Dataset.from_dict({"prompt": [p for p, _ in rows]})
    args = GRPOConfig(**{**common(tmp_path), "max_steps": steps}, beta=0.0, num_generations=4, max_completion_length=4,
                      generation_batch_size=4)
    trainer = GRPOTrainer(model=tiny_llama(len(tok)), reward_funcs=reward, args=args, train_dataset=ds,
                          processing_class=tok, callbacks=[GradHealthCallback(on_problem=on_problem, sinks=[kept])])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    return trainer, [str(w.message) for w in caught if issubclass(w.category, gh.GradHealthWarning)]


def test_grpo_with_tied_rewards_has_nothing_to_learn_and_is_not_stopped(tmp_path):
    """GRPOTrainer(beta=0.0) whose rewards tie in every group: advantages 0, the loss exactly 0,
    every gradient exactly 0. Nothing to learn from those batches, not a fault of the model."""
    def constant(completions, **kw):
        return [1.0] * len(completions)

    kept = Kept()
    trainer, said = grpo(tmp_path, constant, kept)
    logged = [h for h in trainer.state.log_history if "frac_reward_zero_std" in h]
    assert logged and all(h["frac_reward_zero_std"] == 1.0 for h in logged)  # premise: TRL's own statistic
    assert len(kept.reports) == 6 and all(r.loss == 0.0 for r in kept.reports)  # premise: the loss is exactly 0
    assert all(set(r.status.values()) == {gh.Status.ZERO_GRAD} for r in kept.reports)  # and every gradient
    assert all(r.ok for r in kept.reports)
    found = [r.findings_of("NOTHING_TO_LEARN") for r in kept.reports]
    assert all(len(f) == 1 for f in found)
    # one tied batch is routine (info); the run is mostly tied from the 4th such check on: said once
    assert [f[0].level for f in found] == ["info"] * 3 + ["warning"] + ["info"] * 2
    assert "nothing to learn from this batch at step 1" in found[0][0].message
    assert "One such batch now and then is routine (1 of the last 1 checks" in found[0][0].message
    assert "Most batches are tied: 4 of the last 4 checks had nothing to learn" in found[3][0].message
    assert "(6 such checks so far, the first at step 1" in found[-1][0].message
    assert "TRL logged frac_reward_zero_std = 1 at step" in found[-1][0].message
    assert len(said) == 1 and "NOTHING_TO_LEARN" in said[0], said  # one warning for all of them
    assert not [f for r in kept.reports for f in r.findings if f.kind == "TRANSIENT_GRAD" or f.kind == "VANISHING_GRAD"]


def test_grpo_with_a_kl_reference_and_one_tied_batch_is_silent_under_raise(tmp_path):
    """GRPOTrainer(beta=0.04) with its KL reference model (built by TRL from the policy's own path):
    at step 1 the policy is the reference, so the KL term and its gradient are exactly 0, and the
    first group's completions all scored the same: nothing to learn from that one batch, an info
    line. The rewards vary after it and the run trains."""
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    tok = tokenizer()
    tiny_llama(len(tok)).save_pretrained(tmp_path / "policy")
    calls = []

    def tied_once(completions, **kw):
        calls.append(len(completions))
        if len(calls) == 1:
            return [1.0] * len(completions)
        return [float(c.count("mat") + c.count("rug")) - 0.1 * len(c.split()) for c in completions]

    rows = sentences(32)
    kept = Kept()
    args = GRPOConfig(**{**common(tmp_path / "out"), "max_steps": 8}, beta=0.04, num_generations=4,
                      max_completion_length=4, generation_batch_size=4)
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(tmp_path / "policy"), reward_funcs=tied_once,
                          args=args, train_dataset=datasets.Dataset.from_dict({"prompt": [p for p, _ in rows]}),
                          processing_class=tok, callbacks=[GradHealthCallback(on_problem="raise", sinks=[kept])])
    assert trainer.ref_model is not None  # premise: a KL reference model
    with warnings.catch_warnings():
        warnings.simplefilter("error", gh.GradHealthWarning)
        trainer.train()
    tied = [h["frac_reward_zero_std"] for h in trainer.state.log_history if "frac_reward_zero_std" in h]
    assert tied[0] == 1.0 and not any(tied[1:])  # premise: one tied batch, at step 1 (TRL's own statistic)
    assert kept.reports[0].loss == 0.0 and any(r.loss != 0.0 for r in kept.reports[1:])
    assert len(kept.reports) == 8 and all(r.ok for r in kept.reports)
    [f] = kept.reports[0].findings_of("NOTHING_TO_LEARN")
    assert f.level == "info" and "One such batch now and then is routine (1 of the last 1 checks" in f.message
    assert not [f for r in kept.reports for f in r.findings if f.level != "info"]


def test_grpo_with_rewards_that_vary_is_silent_under_raise(tmp_path):
    """The control: rewards that differ within the groups train without a word (the mean reward rises)."""
    def likes_mat(completions, **kw):
        return [float(c.count("mat") + c.count("rug")) - 0.1 * len(c.split()) for c in completions]

    kept = Kept()
    trainer, said = grpo(tmp_path, likes_mat, kept, steps=8)
    assert len(kept.reports) == 8 and not said and all(r.ok for r in kept.reports)
    assert any(r.loss != 0.0 for r in kept.reports)  # premise: there was something to learn
    assert not [f for r in kept.reports for f in r.findings if f.level != "info"]

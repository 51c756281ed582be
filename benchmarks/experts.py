"""The stacked-experts section of ``gradhealth bench``: what judging each expert of a stacked tensor
costs, against the same check with experts judged whole and against the floor, in one run."""

from __future__ import annotations

import torch
from torch import nn

from gradhealth.benchmarks.core import floor_pass, interleaved
from gradhealth.monitor import GradHealth

__all__ = ["MoEStack", "bench_experts"]


class MoEStack(nn.Module):
    """``layers`` blocks of attention-free MoE: a router, and the experts of a layer stacked in two
    tensors ``[E, d, h]`` / ``[E, h, d]`` (the transformers 5 / grouped-GEMM layout)."""

    def __init__(self, layers: int = 8, d: int = 128, h: int = 256, e: int = 16, top_k: int = 2):
        super().__init__()
        self.top_k = top_k
        self.blocks = nn.ModuleList()
        for _ in range(layers):
            block = nn.Module()
            block.norm = nn.LayerNorm(d)
            block.router = nn.Linear(d, e, bias=False)
            block.experts = nn.Module()
            block.experts.num_experts = e
            block.experts.w1 = nn.Parameter(torch.randn(e, d, h) / d**0.5)
            block.experts.w2 = nn.Parameter(torch.randn(e, h, d) / h**0.5)
            self.blocks.append(block)

    def forward(self, x):
        for b in self.blocks:
            y = b.norm(x)
            gates, idx = b.router(y).softmax(-1).topk(self.top_k, dim=-1)
            out = torch.zeros_like(y)
            for k in range(self.top_k):
                w1, w2 = b.experts.w1[idx[:, k]], b.experts.w2[idx[:, k]]  # gathered per token
                out = out + gates[:, k:k + 1] * torch.bmm(torch.relu(torch.bmm(y[:, None], w1)), w2)[:, 0]
            x = x + out
        return x


def bench_experts(rounds: int) -> None:
    torch.manual_seed(0)
    model = MoEStack()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    model(torch.randn(64, 128)).square().mean().backward()
    per_expert = GradHealth(model, opt, on_problem="ignore", deltas="off", history=False, watch_forward=False)
    whole = GradHealth(model, opt, on_problem="ignore", deltas="off", history=False, watch_forward=False, experts=False)
    assert per_expert.view.stacks and not whole.view.stacks
    out = interleaved({"floor": lambda: floor_pass(model), "check(), experts whole": whole.check,
                       "check(), per expert": per_expert.check}, rounds, 5)
    per_expert.close()
    whole.close()
    n = sum(p.numel() for p in model.parameters())
    stacked = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    floor = out["floor"]
    print(f"\nstacked experts: {n / 1e6:.1f}M parameters, {stacked / n:.0%} of them in 16 tensors of 16 stacked experts")
    print(f"  {'method':<26}{'ms/check':>10}{'x floor':>10}")
    for k, v in out.items():
        print(f"  {k:<26}{v * 1e3:>10.3f}{v / floor:>10.2f}")
    extra = (out["check(), per expert"] - out["check(), experts whole"]) / floor
    print(f"  per-expert judging costs {extra:+.2f} floor (target: at most +0.10)")

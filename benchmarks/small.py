"""The small-model section of ``gradhealth bench``: on tiny models a check's fixed Python cost, not
its norm pass, is what the user pays. A 6-tensor MLP, a small CNN and a 2-block transformer, each
trained step by step (zero_grad, forward, backward, [check], optimizer.step) with: nothing, the one
number a user logs instead (``clip_grad_norm_(..., max_norm).item()``: one fused norm and one host
read), the default monitor, the deferred monitor (``lag=1``), and the default monitor with each of
its parts off in turn (what that part's verdicts cost on a tiny model). Blocks interleaved as in the
whole-step section (a variant's cost is its block minus the plain blocks around it); the ratio
columns ("x one") are each variant's cost over the one number's, from block means (they count the
periodic steps: the change test every ``change_every`` checks, the update norms every
``update_every``) and from block medians (the usual step). Then where each variant's cost lands: the
median of each part of its steps (zero_grad, forward, backward, the check or the clip, the optimizer
step) above the plain step's: the monitor's hooks run inside the user's own calls.
"""

from __future__ import annotations

import torch
from torch import nn

from gradhealth.benchmarks.whole_step import PARTS, PHASES, measure

__all__ = ["PARTS", "SMALL", "bench_small"]


class MLP(nn.Module):  # 6 tensors
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, x):
        return self.net(x)


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                 nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                 nn.Linear(32, 10))

    def forward(self, x):
        return self.net(x)


class Transformer(nn.Module):  # 2 blocks
    def __init__(self):
        super().__init__()
        self.blocks = nn.TransformerEncoder(nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True), 2,
                                            enable_nested_tensor=False)
        self.head = nn.Linear(64, 1)

    def forward(self, x):
        return self.head(self.blocks(x))


#: label -> (model factory, batch)
SMALL = {
    "6-tensor MLP": (MLP, lambda: torch.randn(8, 32)),
    "small CNN (8x3x32x32)": (CNN, lambda: torch.randn(8, 3, 32, 32)),
    "2-block transformer (8x16x64)": (Transformer, lambda: torch.randn(8, 16, 64)),
}

VARIANTS = {
    "plain step": None,
    "clip_grad_norm_().item()": None,
    "default monitor": {},
    "deferred monitor (lag=1)": {"lag": 1},
}


def bench_small(rounds: int, steps: int = 30, parts: bool = True) -> dict:
    """``parts``: the default monitor with each part off in turn too (:data:`PARTS`), in the same rounds."""
    print("\nsmall models: a whole step with the one number a user logs instead, the default monitor, the "
          "deferred one" + (" and the default with each part off in turn" if parts else "") +
          "\n(cost = the variant's block minus the plain blocks around it; x one number: that cost over "
          "clip_grad_norm_().item()'s)")
    variants = {**VARIANTS, **PARTS} if parts else VARIANTS
    out = {}
    for label, (make, batch) in SMALL.items():
        torch.manual_seed(0)
        res = measure(make, batch(), rounds, steps, variants, clips={"clip_grad_norm_().item()": "item"}, phases=True)
        plain = res["plain step"]
        print(f"\n{label}: plain step {plain['mean'] * 1e3:.3f} ms mean, {plain['median'] * 1e3:.3f} ms median")
        print(f"  {'':<28}{'mean +ms':>9}{'% step':>8}{'x one':>7}   {'median +ms':>10}{'% step':>8}{'x one':>7}")
        for name in list(variants)[1:]:
            cells = []
            for key in ("mean", "median"):
                extra, one = res[name][f"extra_{key}"], max(res["clip_grad_norm_().item()"][f"extra_{key}"], 1e-9)
                cells.append(f"{extra * 1e3:>+{len(key) + 5}.3f}{extra / plain[key] * 100:>7.0f}%{extra / one:>7.2f}")
            print(f"  {name:<28}" + "   ".join(cells))
        base = plain["phases"]
        print("  where it goes (each part's median, µs: the plain step's, then each variant's above it)")
        print(f"  {'':<28}" + "".join(f"{k:>10}" for k in PHASES))
        print(f"  {'plain step':<28}" + "".join(f"{base[k] * 1e6:>10.0f}" for k in PHASES))
        for name in list(variants)[1:]:
            mine = res[name]["phases"]
            print(f"  {'  ' + name:<28}" + "".join(f"{(mine[k] - base[k]) * 1e6:>+10.0f}" for k in PHASES))
        out[label] = res
    return out

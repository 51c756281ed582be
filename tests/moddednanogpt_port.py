"""A small port of modded-nanogpt's training setup (KellerJordan/modded-nanogpt, train_gpt.py of its
2025 records) as the loop sees it, written for these tests: the GPT with merged QKV weights, QK-norm,
value embeddings on the outer layers, a U-net of skip connections whose weights and the blocks'
lambdas live in one ``scalars`` tensor, the zero-initialised output projections and ``lm_head``
(so at the first step every gradient but ``lm_head``'s is exactly zero), the soft-capped logits;
and the optimizer split: Muon for the blocks' matrices, reducing its gradients inside ``step()``
(reduce-scatter, each rank orthogonalises its share, all-gather of the parameters), Adam for
``lm_head``, the embeddings and the scalars, whose gradients the loop all-reduces by hand before
the step. Rotary embeddings, FP8 and FlexAttention's block masks are left out (no parameter of
their own); gloo has no AVG, so the averages are a SUM over the world size."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HEADS, HEAD_DIM, LAYERS, SEQ = 64, 32, 2, 16, 4, 16


def norm(x):
    return F.rms_norm(x, (x.size(-1),))


class CastedLinear(nn.Linear):
    def __init__(self, d_in, d_out, zero=False):
        super().__init__(d_in, d_out, bias=False)
        if zero:
            with torch.no_grad():
                self.weight.zero_()

    def reset_parameters(self):
        bound = 3**0.5 * 0.5 * self.in_features**-0.5
        with torch.no_grad():
            self.weight.uniform_(-bound, bound)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        bound = 3**0.5 * 0.5 * DIM**-0.5
        self.qkv_w = nn.Parameter(torch.empty(3, HEADS * HEAD_DIM, DIM).uniform_(-bound, bound))
        self.c_proj = CastedLinear(HEADS * HEAD_DIM, DIM, zero=True)

    def forward(self, x, ve, lambdas):
        B, T = x.shape[:2]
        q, k, v = F.linear(x, self.qkv_w.flatten(end_dim=1)).view(B, T, 3 * HEADS, HEAD_DIM).chunk(3, dim=-2)
        q, k = norm(q), norm(k)
        v = lambdas[0] * v + lambdas[1] * ve.view_as(v) if ve is not None else lambdas[0] * v
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                           scale=0.12)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, HEADS * HEAD_DIM))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc = CastedLinear(DIM, 4 * DIM)
        self.c_proj = CastedLinear(4 * DIM, DIM, zero=True)

    def forward(self, x):
        return self.c_proj(F.relu(self.c_fc(x)).square())


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn, self.mlp = Attention(), MLP()

    def forward(self, x, ve, x0, lambdas, sa_lambdas):
        x = lambdas[0] * x + lambdas[1] * x0
        x = x + self.attn(norm(x), ve, sa_lambdas)
        return x + self.mlp(norm(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.value_embeds = nn.ModuleList([nn.Embedding(VOCAB, DIM)])
        self.blocks = nn.ModuleList([Block() for _ in range(LAYERS)])
        self.lm_head = CastedLinear(DIM, VOCAB, zero=True)
        self.scalars = nn.Parameter(torch.cat([torch.ones(LAYERS // 2),  # skip weights
                                               *[torch.tensor([1.0, 0.0]) for _ in range(LAYERS)],  # block lambdas
                                               *[torch.tensor([0.5, 0.5]) for _ in range(LAYERS)]]))  # attention lambdas

    def forward(self, idx, targets):
        ve = self.value_embeds[0](idx)
        ves = [ve] + [None] * (LAYERS - 2) + [ve]  # on the outer layers only
        n = LAYERS // 2
        skip_w, lambdas = self.scalars[:n], self.scalars[n:n + 2 * LAYERS].view(LAYERS, 2)
        sa_lambdas = self.scalars[n + 2 * LAYERS:].view(LAYERS, 2)
        x = x0 = norm(self.embed(idx))
        skips = []
        for i, block in enumerate(self.blocks):
            if i >= n:
                x = x + skip_w[i - n] * skips.pop()
            x = block(x, ves[i], x0, lambdas[i], sa_lambdas[i])
            if i < n:
                skips.append(x)
        logits = 30 * torch.sigmoid(self.lm_head(norm(x)).float() / 7.5)
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def newton_schulz(G, steps=5):
    a, b, c = 3.4445, -4.7750, 2.0315
    X = G.float()
    if G.size(-2) > G.size(-1):
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return X.mT if G.size(-2) > G.size(-1) else X


class Muon(torch.optim.Optimizer):
    """Muon as modded-nanogpt distributes it: the parameters of one shape in a group; per chunk of
    ``world`` of them, a reduce-scatter hands each rank the averaged gradient of its own one, which
    it steps (momentum, orthogonalised update); an all-gather then brings every rank every parameter."""

    def __init__(self, params, lr=0.05, momentum=0.95):
        params = list(params)
        shapes = dict.fromkeys(p.shape for p in params)
        super().__init__([dict(params=[p for p in params if p.shape == s]) for s in shapes], dict(lr=lr, momentum=momentum))

    @torch.no_grad()
    def step(self):
        rank, world = dist.get_rank(), dist.get_world_size()
        for group in self.param_groups:
            params = group["params"]
            pad = params + [torch.empty_like(params[-1])] * world
            grads = [p.grad for p in params] + [torch.zeros_like(params[-1])] * world
            for base in range(0, len(params), world):
                mine = torch.empty_like(params[-1])
                dist.reduce_scatter(mine, grads[base:base + world], op=dist.ReduceOp.SUM)
                mine /= world
                if base + rank < len(params):
                    p = params[base + rank]
                    state = self.state[p]
                    if not state:
                        state["momentum_buffer"] = torch.zeros_like(mine)
                    buf = state["momentum_buffer"]
                    buf.lerp_(mine, 1 - group["momentum"])
                    update = newton_schulz(mine.lerp_(buf, group["momentum"]))
                    p.add_(update, alpha=-group["lr"] * max(1, p.size(-2) / p.size(-1)) ** 0.5)
                dist.all_gather(pad[base:base + world], pad[base + rank].clone())


def optimizers(model):
    """modded-nanogpt's split: Muon for the blocks' matrices, Adam for lm_head, embeddings, scalars."""
    hidden = [p for n, p in model.blocks.named_parameters() if p.ndim >= 2]
    embeds = [p for n, p in model.named_parameters() if "embed" in n]
    scalars = [p for p in model.parameters() if p.ndim < 2]
    adam = torch.optim.Adam([dict(params=[model.lm_head.weight], lr=0.22), dict(params=embeds, lr=0.6),
                             dict(params=scalars, lr=0.04)], betas=(0.8, 0.95), eps=1e-10)
    return adam, Muon(hidden, lr=0.05, momentum=0.95)

"""``gradhealth bench``: the cost of a check, side by side with the naive way, in one run.

Every figure is a median over interleaved rounds (each method timed in turn, round after round), so
a noisy neighbour slows all of them alike; ratios are to the floor, one fused norm pass over every
gradient read back to the host.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
import warnings
from collections.abc import Callable

import torch
from torch import nn

from .monitor import GradHealth

SHAPES = {
    # name: (blocks, width) -> blocks x (Linear(width, width) + LayerNorm(width)) = 4 tensors a block
    "400 small tensors (100x Linear(64)+LayerNorm)": (100, 64),
    "26M params, 400 tensors (width 512)": (100, 512),
    "84M params, 80 tensors (width 2048)": (20, 2048),
}


def build_model(blocks: int, width: int) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(width, width), nn.LayerNorm(width)]
    return nn.Sequential(*layers)


def naive_check(model: nn.Module, optimizer) -> list:
    """The seed-style loop: per parameter, .all()/.max() and a norm, each synced with the host."""
    ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
    rows = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            rows.append((name, "FROZEN", None))
        elif p.grad is None:
            rows.append((name, "NO_GRAD", None))
        elif not torch.isfinite(p.grad).all():
            rows.append((name, "NON_FINITE_GRAD", None))
        elif id(p) not in ids:
            rows.append((name, "NOT_IN_OPTIMIZER", p.grad.norm().item()))
        elif p.grad.abs().max() == 0:
            rows.append((name, "ZERO_GRAD", 0.0))
        else:
            rows.append((name, "OK", p.grad.norm().item()))
    return rows


def floor_pass(model: nn.Module) -> list[float]:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return torch.stack(torch._foreach_norm(grads)).tolist()


def interleaved(fns: dict[str, Callable[[], object]], rounds: int, inner: int) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():  # warm-up
        fn()
    for _ in range(rounds):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            times[k].append((time.perf_counter() - t0) / inner)
    return {k: statistics.median(v) for k, v in times.items()}


def bench_shape(label: str, blocks: int, width: int, rounds: int, device: str) -> dict[str, float]:
    torch.manual_seed(0)
    model = build_model(blocks, width).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(32, width, device=device)

    def train_step():
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()

    train_step()
    step_t = interleaved({"step": train_step}, max(3, rounds // 2), 1)["step"]  # before any hook exists
    model(x).square().mean().backward()  # leave gradients in place for the checks
    monitor = GradHealth(model, opt, on_problem="ignore")
    fns: dict[str, Callable[[], object]] = {
        "floor": lambda: floor_pass(model),
        "naive loop": lambda: naive_check(model, opt),
        "check()": lambda: monitor.check(),
    }
    try:  # Lightning's grad_norm utility, when Lightning is installed (through the adapter package)
        from gradhealth.integrations.bench_lightning import lightning_grad_norm

        fns["lightning grad_norm"] = lambda: lightning_grad_norm(model)
    except ImportError:
        pass
    inner = 20 if width <= 64 else 3
    out = interleaved(fns, rounds, inner)
    monitor.close()
    out["training step"] = step_t
    n_params = sum(p.numel() for p in model.parameters())
    n_tensors = len(list(model.parameters()))
    floor = out["floor"]
    print(f"\n{label}: {n_params / 1e6:.1f}M parameters in {n_tensors} tensors, device {device}")
    print(f"  {'method':<22}{'ms/check':>10}{'x floor':>10}{'% of step':>11}")
    for k in ["floor", "naive loop", "lightning grad_norm", "check()"]:
        if k in out:
            print(f"  {k:<22}{out[k] * 1e3:>10.3f}{out[k] / floor:>10.2f}{100 * out[k] / step_t:>10.1f}%")
    print(f"  {'training step':<22}{step_t * 1e3:>10.3f}  (forward+backward+SGD step, batch 32)")
    return out


def bench_deltas(label: str, blocks: int, width: int, opt_name: str, steps: int = 3) -> None:
    """Extra memory and update-norm error of the sample mode against an exact copy."""
    torch.manual_seed(0)
    model = build_model(blocks, width)
    make = {"SGD": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9), "AdamW": lambda p: torch.optim.AdamW(p, lr=1e-3)}
    opt = make[opt_name](model.parameters())
    x = torch.randn(32, width)
    mon = GradHealth(model, opt, on_problem="ignore", history=False)
    errs: list[float] = []
    total_errs: list[float] = []
    for _ in range(steps):
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        r = mon.check()
        opt.step()
        mon.flush()
        exact = [(p.detach() - b).double().norm().item() for p, b in zip(model.parameters(), before)]
        est = list(r.update_norm.values())
        sampled = [mon.tracker._layout[i] is not None for i in range(len(exact))]
        errs += [abs(e - t) / t for e, t, s in zip(est, exact, sampled) if t > 0 and s]
        tot_t, tot_e = math.hypot(*exact), math.hypot(*est)
        total_errs.append(abs(tot_e - tot_t) / tot_t)
    elems = sum(p.numel() for p in model.parameters())
    extra = mon.tracker.extra_elements()
    errs.sort()
    q = lambda f: 100 * errs[min(len(errs) - 1, int(f * len(errs)))]
    print(f"  {opt_name:<6} sample mode: extra memory {100 * extra / elems:5.2f}% of parameters "
          f"({extra * 4 / 2**20:.2f} MiB; exact mode 100%, {elems * 4 / 2**20:.1f} MiB, error 0); update-norm error of "
          f"the sampled tensors: median {q(0.5):.1f}%, p95 {q(0.95):.1f}%, max {100 * errs[-1]:.1f}%; whole model {100 * max(total_errs):.2f}%")
    mon.close()


def bench_step_overhead(blocks: int, width: int, rounds: int) -> None:
    """A full training step without gradhealth, with check() + sampled deltas, and with exact deltas."""
    torch.manual_seed(0)
    model = build_model(blocks, width)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(32, width)
    monitors = {"sample": GradHealth(model, opt, on_problem="ignore"), "exact": GradHealth(model, opt, on_problem="ignore", deltas="exact")}

    def step(which):
        def run():
            opt.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            mon = monitors.get(which)
            if mon is not None:
                mon.check()
            for other in monitors.values():  # only the timed monitor measures this step
                if other is not mon:
                    other.tracker.disarm()
            opt.step()
        return run

    t = interleaved({"plain": step(None), "sample": step("sample"), "exact": step("exact")}, rounds, 1)
    print(f"  training step: plain {t['plain'] * 1e3:.2f} ms; with check()+sampled deltas {100 * (t['sample'] / t['plain'] - 1):+.1f}%; "
          f"with exact deltas {100 * (t['exact'] / t['plain'] - 1):+.1f}%")
    for m in monitors.values():
        m.close()


def bench_tracer(rounds: int) -> None:
    """One training step plain, with the NaN tracer armed, and under detect_anomaly."""
    from .trace import NonFiniteTracer

    print("\nNaN tracer: one forward+backward of an 8-block MLP (Linear+GELU+LayerNorm), interleaved:")
    for width, batch in [(256, 64), (1024, 256)]:
        torch.manual_seed(0)
        model = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(width, width), nn.GELU(), nn.LayerNorm(width))])
        x = torch.randn(batch, width)

        def plain():
            model.zero_grad(set_to_none=True)
            model(x).square().mean().backward()

        def armed():
            tracer = NonFiniteTracer(model).arm()
            plain()
            tracer.resolve()

        def anomaly():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with torch.autograd.detect_anomaly():
                    plain()

        t = interleaved({"plain": plain, "armed": armed, "anomaly": anomaly}, rounds, 3)
        print(f"  width {width}, batch {batch}: plain {t['plain'] * 1e3:.2f} ms; tracer armed {t['armed'] / t['plain']:.2f}x; "
              f"torch.autograd.detect_anomaly {t['anomaly'] / t['plain']:.2f}x; disarmed: no hooks at all")


def _dist_worker(rank: int, world: int, port: int, out: str, rounds: int) -> None:
    import json
    import os

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = build_model(100, 64)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        model(torch.randn(32, 64)).square().mean().backward()
        mon = GradHealth(model, opt, on_problem="ignore", deltas="off", desync_every=0)
        mon.carry.checks = 1  # past the first check: no DESYNC fingerprint in the timed loop
        res = interleaved({"check()": lambda: mon.check()}, rounds, 20)
        mon.close()
        # the rank-origin comm hook: a DDP training step with and without it
        from torch.nn.parallel import DistributedDataParallel as DDP

        from .distributed import RankOrigin

        torch.manual_seed(0)
        plain, hooked = DDP(build_model(100, 64)), DDP(build_model(100, 64))
        RankOrigin(hooked)
        x = torch.randn(32, 64)

        def step(m):
            m.zero_grad(set_to_none=True)
            m(x).square().mean().backward()

        res.update(interleaved({"ddp step": lambda: step(plain), "ddp step + hook": lambda: step(hooked)}, rounds, 5))
        if rank == 0:
            with open(out, "w") as f:
                json.dump(res, f)
    finally:
        dist.barrier()
        dist.destroy_process_group()
    os._exit(0)  # skip the interpreter's teardown, which can abort while gloo's threads stop


def bench_distributed(rounds: int) -> None:
    """The check's collective at world size 2 (gloo, CPU), next to the same check in one process."""
    import json
    import os
    import socket
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.path.join(tempfile.mkdtemp(), "dist.json")
    mp.spawn(_dist_worker, args=(2, port, out, rounds), nprocs=2, join=True)
    with open(out) as f:
        res = json.load(f)
    dist_t = res["check()"]
    torch.manual_seed(0)
    saved = torch.get_num_threads()
    torch.set_num_threads(1)  # the same thread budget as each rank
    model = build_model(100, 64)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    model(torch.randn(32, 64)).square().mean().backward()
    mon = GradHealth(model, opt, on_problem="ignore", deltas="off")
    local_t = interleaved({"check()": lambda: mon.check()}, rounds, 20)["check()"]
    torch.set_num_threads(saved)
    print("\ntorch.distributed, 400 small tensors, one thread per process:")
    print(f"  check() in one process {local_t * 1e3:.3f} ms; at world size 2 (gloo, one all_reduce per check) "
          f"{dist_t * 1e3:.3f} ms: the collective adds {1e3 * (dist_t - local_t):.3f} ms ({dist_t / local_t:.2f}x)")
    a, b = res["ddp step"], res["ddp step + hook"]
    print(f"  DDP forward+backward {a * 1e3:.2f} ms; with the rank-origin comm hook {b * 1e3:.2f} ms ({100 * (b / a - 1):+.1f}%)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gradhealth bench", description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds per shape (median)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shapes", default="all", help="comma-separated shape indexes (0,1,2) or 'all'")
    ap.add_argument("--sections", default="all",
                    help="comma-separated: checks,deltas,tracer,distributed,lightning,tensorboard (default: all)")
    args = ap.parse_args(argv)
    print(f"gradhealth bench: torch {torch.__version__}, {torch.get_num_threads()} threads, device {args.device}")
    chosen = list(SHAPES.items())
    if args.shapes != "all":
        chosen = [chosen[int(i)] for i in args.shapes.split(",")]
    sections = ({"checks", "deltas", "tracer", "distributed", "lightning", "tensorboard"} if args.sections == "all"
                else set(args.sections.split(",")))
    for label, (blocks, width) in chosen:
        if "checks" in sections:
            bench_shape(label, blocks, width, args.rounds, args.device)
        if "deltas" in sections and args.device == "cpu":
            print(f"\nupdate norms on {label}:")
            bench_step_overhead(blocks, width, max(3, args.rounds // 2))
            for opt_name in ("SGD", "AdamW"):
                bench_deltas(label, blocks, width, opt_name)
    if "tracer" in sections:
        bench_tracer(args.rounds)
    if "distributed" in sections and args.device == "cpu":
        bench_distributed(args.rounds)
    if "tensorboard" in sections:
        try:
            from gradhealth.integrations.bench_tensorboard import main as bench_tensorboard
        except ImportError:
            bench_tensorboard = None
        if bench_tensorboard is not None:
            bench_tensorboard(args.rounds)
    if "lightning" in sections and args.device == "cpu":
        try:  # the integrations' own costs, when their frameworks are installed
            from gradhealth.integrations.bench_lightning import main as bench_lightning
        except ImportError:
            bench_lightning = None
        if bench_lightning is not None:
            bench_lightning(rounds=max(5, args.rounds))
    return 0

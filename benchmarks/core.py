"""``gradhealth bench``: the cost of a check, side by side with the naive way, in one run.

Every figure is a median over interleaved rounds (each method timed in turn, round after round), so
a noisy neighbour slows all of them alike; ratios are to the floor, one fused norm pass over every
gradient read back to the host.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
import warnings
from collections.abc import Callable

import torch
from torch import nn

from gradhealth.monitor import GradHealth

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


def interleaved(fns: dict[str, Callable[[], object]], rounds: int, inner: int,
                against: str | None = None) -> dict[str, float]:
    """Each function's median time per call over ``rounds`` rounds (every round runs each one
    ``inner`` times, in turn). ``against``: also ``"k / against"``, the median over the rounds of
    each round's ratio of the two: a slow drift of the machine (a collective's latency) cancels."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    # (on a GPU a block is timed from an idle device to an idle device: what it queued is in its time)
    sync = torch.cuda.synchronize if torch.cuda.is_available() and torch.cuda.is_initialized() else (lambda: None)
    for fn in fns.values():  # warm-up
        fn()
    for _ in range(rounds):
        for k, fn in fns.items():
            sync()
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            sync()
            times[k].append((time.perf_counter() - t0) / inner)
    out = {k: statistics.median(v) for k, v in times.items()}
    if against is not None:
        out.update({f"{k} / {against}": statistics.median(a / b for a, b in zip(v, times[against]))
                    for k, v in times.items() if k != against})
    return out


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
        from gradhealth.benchmarks.lightning_fit import lightning_grad_norm

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


OPTIMIZERS = {
    "SGD": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9),
    "AdamW": lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01),
}


def _budget_sink():
    """The TensorBoardSink with its default settings, when tensorboard is installed."""
    try:
        from gradhealth.integrations.tensorboard import TensorBoardSink
    except ImportError:
        return None, None
    import tempfile

    tmp = tempfile.mkdtemp()
    return TensorBoardSink(tmp), tmp


class _Timed:
    """Seconds spent inside a monitor's own code: ``check()`` and its optimizer step hook."""

    def __init__(self, mon: GradHealth):
        self.mon, self.spent = mon, 0.0
        tracker = mon.tracker
        for h in tracker._handles:  # the same hook, timed
            h.remove()
        tracker._handles = [o.register_step_post_hook(self._timed(tracker._post)) for o in mon.optimizers]

    def _timed(self, fn):
        def run(*args):
            t0 = time.perf_counter()
            fn(*args)
            self.spent += time.perf_counter() - t0
        return run

    def check(self) -> None:
        t0 = time.perf_counter()
        self.mon.check()
        self.spent += time.perf_counter() - t0


def bench_budget(label: str, blocks: int, width: int, rounds: int) -> None:
    """The whole default monitor per training step, as ratios to the floor, side by side.

    Gradients stay in place and only the optimizer steps, so the rounds are short. Every method
    is timed in the same place, right after an optimizer step (caches as a training loop leaves
    them): the floor pass, ``check()`` of a monitor with no hooks at all, and the time spent
    inside the full default monitor's own code per step (``check()`` and its step hook: the
    classification, the change test, update norms every ``update_every`` checks, stale-gradient
    witnesses, history; the forward watch is one Python call per forward), amortised over
    ``2 x update_every`` steps, and the same with a TensorBoardSink with its default settings.
    """
    import shutil

    for opt_name, make in OPTIMIZERS.items():
        torch.manual_seed(0)
        model = build_model(blocks, width)
        opt = make(model.parameters())
        x = torch.randn(32, width)
        nn.functional.mse_loss(model(x), torch.randn_like(x)).backward()
        bare = GradHealth(model, on_problem="ignore", deltas="off", history=False, watch_forward=False)
        full = _Timed(GradHealth(model, opt, on_problem="ignore"))
        sink, tmp = _budget_sink()
        with_sink = _Timed(GradHealth(model, opt, on_problem="ignore", sinks=[sink])) if sink is not None else None
        n = 2 * full.mon.options.update_every
        timed = [m for m in (full, with_sink) if m is not None]
        per_step: dict[str, list[float]] = {"floor": [], "check()": [], "full": [], "full+sink": []}

        def steps(key, count, fn=None, which=None):
            def run():
                for other in timed:  # only the timed monitor (if any) measures these steps
                    if other is not which:
                        other.mon.tracker.disarm()
                spent = 0.0
                if which is not None:
                    which.spent = 0.0
                for _ in range(count):
                    if which is None:
                        t0 = time.perf_counter()
                        fn()
                        spent += time.perf_counter() - t0
                    else:
                        which.check()
                    opt.step()
                per_step[key].append((spent if which is None else which.spent) / count)
            return run

        fns = {"floor": steps("floor", n // 8, lambda: floor_pass(model)), "check()": steps("check()", n // 8, bare.check),
               "full": steps("full", n, which=full)}
        if with_sink is not None:
            fns["full+sink"] = steps("full+sink", n, which=with_sink)
        interleaved(fns, max(3, rounds // 2), 1)
        floor = statistics.median(per_step["floor"])
        row = {"check() alone": statistics.median(per_step["check()"]) / floor,
               "full default": statistics.median(per_step["full"]) / floor}
        if with_sink is not None:
            row["full default + TensorBoardSink"] = statistics.median(per_step["full+sink"]) / floor
        full.mon.flush()
        copied = len(full.mon.tracker.watched)
        print(f"  {opt_name:<6} " + "; ".join(f"{k} {v:.2f}x" for k, v in row.items()) + f" (floor {floor * 1e3:.3f} ms"
              + (f"; {copied} tensors whose sampled elements did not move are copied in turns" if copied else "") + ")")
        for m in (bare, *[x.mon for x in timed]):
            m.close()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def bench_update_error(blocks: int, width: int, steps: int = 3) -> None:
    """Update norms of the default mode against an exact copy taken here: every tensor."""
    for opt_name, make in OPTIMIZERS.items():
        torch.manual_seed(0)
        model = build_model(blocks, width)
        opt = make(model.parameters())
        x = torch.randn(32, width)
        mon = GradHealth(model, opt, on_problem="ignore", history=False, update_every=1)
        errs: list[float] = []
        for _ in range(steps):
            before = [p.detach().clone() for p in model.parameters()]
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(x), torch.randn_like(x)).backward()
            r = mon.check()
            opt.step()
            mon.flush()
            exact = [(p.detach() - b).double().norm().item() for p, b in zip(model.parameters(), before)]
            errs += [abs(e - t) / t for e, t in zip(r.update_norm.values(), exact) if t > 0]
        elems = sum(p.numel() for p in model.parameters())
        extra = mon.tracker.extra_elements()
        print(f"  {opt_name:<6} update norms from the optimizer's rule vs an exact copy, {len(errs)} tensor-steps: max error "
              f"{100 * max(errs):.4f}%, median {100 * statistics.median(errs):.5f}%; transient memory at most "
              f"{100 * extra / elems:.2f}% of the parameters ({extra * 4 / 2**20:.2f} MiB; deltas='exact': 100%)")
        mon.close()


def bench_tracer(rounds: int) -> None:
    """One training step plain, with the NaN tracer armed, and under detect_anomaly."""
    from gradhealth.origin.trace import NonFiniteTracer

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


@contextlib.contextmanager
def _gloo_rank(rank: int, world: int, port: int, out: str):
    """A benchmark rank: one thread, its gloo group, a dict to fill that rank 0 writes to ``out``,
    and the group torn down; the caller then leaves with ``os._exit(0)`` (the interpreter's
    teardown can abort while gloo's threads stop)."""
    import json

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    res: dict = {}
    try:
        yield res
        if rank == 0:
            with open(out, "w") as f:
                json.dump(res, f)
    finally:
        dist.barrier()
        dist.destroy_process_group()


def _dist_worker(rank: int, world: int, port: int, out: str, rounds: int) -> None:
    import os

    with _gloo_rank(rank, world, port, out) as res:
        torch.manual_seed(0)
        model = build_model(100, 64)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        model(torch.randn(32, 64)).square().mean().backward()
        mon = GradHealth(model, opt, on_problem="ignore", deltas="off", desync_every=0)
        mon.carry.checks = 1  # past the first check: no DESYNC fingerprint in the timed loop
        from gradhealth.ranks import crossrank

        def timed(agreement: bool, counts: bool = True, fingerprint: bool = False):
            # the same order on every rank: one layout per collective
            crossrank.AGREEMENT, crossrank.COUNTS = agreement, counts
            mon.replicas.in_optimizer = fingerprint
            mon.check()

        res.update(interleaved({"check()": lambda: timed(True), "check() without agreement": lambda: timed(False),
                                "check() without lockstep": lambda: timed(True, counts=False),
                                "check() in_optimizer": lambda: timed(True, fingerprint=True),
                                # the same as the third: what two identical runs differ by here (the noise)
                                "again": lambda: timed(True, counts=False)}, rounds, 20, against="check() without lockstep"))
        crossrank.AGREEMENT, crossrank.COUNTS = True, True
        mon.close()
        # the rank-origin comm hook: a DDP training step with and without it
        from torch.nn.parallel import DistributedDataParallel as DDP

        from gradhealth.ranks.ddp import RankOrigin

        torch.manual_seed(0)
        plain, hooked = DDP(build_model(100, 64)), DDP(build_model(100, 64))
        RankOrigin(hooked)
        x = torch.randn(32, 64)

        def step(m):
            m.zero_grad(set_to_none=True)
            m(x).square().mean().backward()

        res.update(interleaved({"ddp step": lambda: step(plain), "ddp step + hook": lambda: step(hooked)}, rounds, 5))
    os._exit(0)


def _mesh_worker(rank: int, world: int, port: int, out: str, rounds: int) -> None:
    """The check of a model sharded on a 1-D mesh (FSDP2, (4,)) and on a 2-D one (HSDP, (2, 2):
    replicated and sharded dimensions, the per-shard agreement), interleaved, 4 gloo ranks."""
    import os

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with _gloo_rank(rank, world, port, out) as res:
        mons = {}
        for name, shape, dims in (("1-D (4,)", (world,), ("shard",)), ("2-D (2, 2)", (2, world // 2), ("replicate", "shard"))):
            torch.manual_seed(0)
            model = build_model(50, 64)
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=dims)
            for layer in model:
                fully_shard(layer, mesh=mesh)
            model(torch.randn(8, 64)).square().mean().backward()
            mons[name] = GradHealth(model, None, on_problem="ignore", deltas="off", desync_every=0)
            mons[name].carry.checks = 1  # past the first check: no DESYNC fingerprint in the timed loop
        res.update(interleaved({k: m.check for k, m in mons.items()}, rounds, 10))
        for m in mons.values():
            m.close()
    os._exit(0)


def _spawned(worker, world: int, rounds: int) -> dict:
    """Run ``worker`` on ``world`` gloo ranks (a free loopback port); rank 0's timings."""
    import json
    import os
    import socket
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.path.join(tempfile.mkdtemp(), "timings.json")
    # (forked from a server that imported this module once, where there is one: not a spawned interpreter
    # importing torch and gradhealth again in every rank; the timings are taken after start-up either way)
    method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    if method == "forkserver":
        mp.set_forkserver_preload([__name__, "torch.distributed.fsdp", "torch.distributed.device_mesh"])
    mp.start_processes(worker, args=(world, port, out, rounds), nprocs=world, join=True, start_method=method)
    with open(out) as f:
        return json.load(f)


def bench_meshes(rounds: int) -> None:
    res = _spawned(_mesh_worker, 4, rounds)
    a, b = res["1-D (4,)"], res["2-D (2, 2)"]
    print("\n2-D meshes, 100 sharded tensors (50 blocks of width 64), 4 gloo ranks on this machine's cores:")
    print(f"  check() on FSDP2's 1-D mesh {a * 1e3:.3f} ms; on HSDP's 2-D mesh (each element once, per-shard "
          f"agreement) {b * 1e3:.3f} ms ({100 * (b / a - 1):+.1f}%)")


def bench_distributed(rounds: int) -> None:
    """The check's collective at world size 2 (gloo, CPU), next to the same check in one process."""
    res = _spawned(_dist_worker, 2, rounds)
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
    base = "check() without lockstep"
    ratio = lambda k: 100 * (res[f"{k} / {base}"] - 1)  # noqa: E731  (paired in each round, median)
    print(f"  the check without lockstep {res[base] * 1e3:.3f} ms; each of these against it, paired in each round "
          f"(median of {rounds} rounds; target +15%):")
    print(f"    the same check again (what this measurement's noise is): {ratio('again'):+.1f}%")
    print(f"    without the replicas' gradient agreement {res['check() without agreement'] * 1e3:.3f} ms "
          f"({ratio('check() without agreement'):+.1f}%): the agreement costs the difference to the full check")
    print(f"    with the lockstep counts (checks, optimizer steps): the full check {dist_t * 1e3:.3f} ms ({ratio('check()'):+.1f}%)")
    print(f"    grad_sync='in_optimizer' (the parameters' fingerprint in place of the gradients' agreement, with the "
          f"counts): {res['check() in_optimizer'] * 1e3:.3f} ms ({ratio('check() in_optimizer'):+.1f}%)")
    a, b = res["ddp step"], res["ddp step + hook"]
    print(f"  DDP forward+backward {a * 1e3:.2f} ms; with the rank-origin comm hook {b * 1e3:.2f} ms ({100 * (b / a - 1):+.1f}%)")


#: the sections of ``gradhealth bench --sections`` (all by default)
SECTIONS = ("step", "small", "models", "counts", "checks", "budget", "deltas", "experts", "many", "tracer", "distributed",
            "lightning", "transformers", "tensorboard")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gradhealth bench", description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds per shape (median)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shapes", default="all", help="comma-separated shape indexes (0,1,2) or 'all'")
    ap.add_argument("--batch", type=int, default=8, help="the whole-step section's batch size (default 8)")
    ap.add_argument("--many", default=None, help="the whole-step section's many-tensors models, comma-separated tensor "
                                                 "counts (default: 1000,10000 with --shapes all, else none)")
    ap.add_argument("--targets", action="store_true", help="the whole-step section times only the plain step, the "
                                                           "default monitor and the clipping pair (more rounds in the time)")
    ap.add_argument("--count-steps", type=int, default=9, help="the counts section: steps per variant (default 9, "
                                                                  "the first apart; 9 and up count the change test)")
    ap.add_argument("--sections", default="all",
                    help="comma-separated, from: " + ", ".join(SECTIONS) + " (default: all)")
    args = ap.parse_args(argv)
    print(f"gradhealth bench: torch {torch.__version__}, {torch.get_num_threads()} threads, device {args.device}")
    chosen = list(SHAPES.items())
    if args.shapes != "all":
        chosen = [chosen[int(i)] for i in args.shapes.split(",")]
    sections = set(SECTIONS) if args.sections == "all" else set(args.sections.split(","))
    if "step" in sections and args.device == "cpu":
        from gradhealth.benchmarks.whole_step import bench_whole_step

        many = (1000, 10000) if args.shapes == "all" else ()
        if args.many is not None:
            many = tuple(int(n) for n in args.many.split(",") if n)
        bench_whole_step(args.rounds, chosen, many=many, batch=args.batch, targets=args.targets)
    if "small" in sections and args.device == "cpu":
        from gradhealth.benchmarks.small import bench_small

        bench_small(args.rounds)
    if "models" in sections and args.device == "cpu":  # (RL policies among them: instructions, time, SB3's learn())
        from gradhealth.benchmarks.models import bench_models

        bench_models(max(3, 2 * args.rounds))
    if "counts" in sections:  # (counted on the CPU: ops and instructions do not depend on the clock)
        from gradhealth.benchmarks.counts import bench_counts

        bench_counts(steps=max(3, args.count_steps))
    for label, (blocks, width) in chosen:
        if "checks" in sections:
            bench_shape(label, blocks, width, args.rounds, args.device)
        if "budget" in sections and args.device == "cpu":
            print(f"\nthe default monitor per training step on {label}, x floor (targets: check() 1.2, full 1.5, "
                  "with the sink 1.7):")
            bench_budget(label, blocks, width, args.rounds)
        if "deltas" in sections and args.device == "cpu":
            print(f"\nupdate norms on {label}:")
            bench_update_error(blocks, width)
    if "experts" in sections:
        from gradhealth.benchmarks.experts import bench_experts

        bench_experts(args.rounds)
    if "many" in sections and args.device == "cpu":
        from gradhealth.benchmarks.many import bench_many

        bench_many(args.rounds)
    if "tracer" in sections:
        bench_tracer(args.rounds)
    if "distributed" in sections and args.device == "cpu":
        bench_distributed(args.rounds)
        bench_meshes(args.rounds)
    if "tensorboard" in sections:
        try:
            from gradhealth.benchmarks.tensorboard_sink import main as bench_tensorboard
        except ImportError:
            bench_tensorboard = None
        if bench_tensorboard is not None:
            bench_tensorboard(args.rounds)
    if "lightning" in sections and args.device == "cpu":
        try:  # the integrations' own costs, when their frameworks are installed
            from gradhealth.benchmarks.lightning_fit import main as bench_lightning
        except ImportError:
            bench_lightning = None
        if bench_lightning is not None:
            bench_lightning(rounds=max(5, args.rounds))
    if "transformers" in sections and args.device == "cpu":
        try:
            from gradhealth.benchmarks.hf_trainer import main as bench_transformers
        except ImportError:
            bench_transformers = None
        if bench_transformers is not None:
            bench_transformers(rounds=max(5, args.rounds))
    return 0

"""The GPU check, for a session lent an accelerator: one command, well under 5 minutes.

    python scripts/gpu_check.py

1. The hot path under torch.cuda.set_sync_debug_mode("error"), allowed to synchronise only in its
   one device-to-host transfer (gradhealth.stats.fetch): a healthy check must not sync elsewhere.
2. The core benchmark's three shapes with absolute times (gradhealth bench --device cuda).
3. fp16 AMP with a GradScaler: unscaled norms, an injected overflow reported as AMP_SKIPPED
   (info, no alarm), and the alarm after repeated skips.
4. Lightning precision="16-mixed" with the callback: a planted bug found, a healthy run silent.
5. skip_nonfinite with torch's fused AdamW on the GPU: a NaN step leaves the parameters and the
   optimizer's state bit for bit as they were, and the guard adds no host sync to the check (the
   decision comes from the check's one transfer; the fused kernel skips parameters without grads).
6. Deferred checks (``lag=1``) under ``set_sync_debug_mode("error")`` with no exception window at
   all: forward, backward, check and step of a whole loop, the guard on (fused AdamW).
7. The deferred guard on the device: fused AdamW takes the check's found_inf flag; a poisoned step
   leaves parameters and optimizer state bit for bit, under the same mode.
8. A whole-step A/B, interleaved (plain, synchronous monitor, deferred monitor) on a small and a
   large shape, absolute milliseconds per step.
Exits non-zero on the first failed check.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import subprocess
import sys
import time
import warnings

import torch
from torch import nn

import gradhealth as gh
from gradhealth import stats


@contextlib.contextmanager
def only_the_transfer_may_sync():
    """Inside: stats.fetch (a check's one transfer) may synchronise; sync_debug_mode "error" is
    switched on around each check by the caller."""
    original = stats.fetch

    def fetch(parts):
        torch.cuda.set_sync_debug_mode(0)
        try:
            return original(parts)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    stats.fetch = fetch
    try:
        yield
    finally:
        stats.fetch = original


def sync_free_hot_path() -> None:
    dev = torch.device("cuda")
    model = nn.Sequential(*[m for _ in range(50) for m in (nn.Linear(256, 256), nn.LayerNorm(256))]).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = gh.GradHealth(model, opt, on_problem="raise")
    with only_the_transfer_may_sync():
        for _ in range(5):
            opt.zero_grad(set_to_none=True)
            loss = model(torch.randn(64, 256, device=dev)).square().mean()
            loss.backward()
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                report = mon.check()
            finally:
                torch.cuda.set_sync_debug_mode(0)
            assert report.ok, str(report)
            opt.step()
    mon.close()
    print("1. hot path: no host sync outside the one transfer (5 checks, 200 tensors, AdamW deltas on)")


def amp_fp16() -> None:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**14)
    mon = gh.GradHealth(model, opt, scaler=scaler, on_problem="ignore", amp_skip_alarm=3)
    said = []
    for step in range(8):
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(torch.randn(32, 64, device=dev)).square().mean()
        scaler.scale(loss).backward()
        if step in (3, 5, 6, 7):
            model[2].weight.grad[0, 0] = math.inf  # what an fp16 overflow leaves behind
        report = mon.check()
        if step == 0:
            ref = math.sqrt(sum((p.grad.float() / scaler.get_scale()).norm().item() ** 2 for p in model.parameters()))
            assert abs(report.total_grad_norm - ref) <= 1e-3 * ref, (report.total_grad_norm, ref)
        said.append([(f.kind, f.level) for f in report.findings if f.kind == "AMP_SKIPPED"])
        scaler.step(opt)
        scaler.update()
    assert said[3] == [("AMP_SKIPPED", "info")], said
    assert ("AMP_SKIPPED", "error") in said[7], said
    print("3. fp16 AMP: unscaled norms, one skip = info, three in a row = alarm")


def lightning_16_mixed() -> None:
    import lightning.pytorch as pl

    from gradhealth.integrations.lightning import GradHealthCallback
    from gradhealth.demos.lightning_parts import DemoModule, SyntheticData

    for bug, expect in [("not_in_optimizer", "NOT_IN_OPTIMIZER"), ("none", None)]:
        cb = GradHealthCallback(on_problem="ignore")
        trainer = pl.Trainer(max_steps=5, accelerator="gpu", devices=1, precision="16-mixed", callbacks=[cb], logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(DemoModule(bug=bug), SyntheticData(n_batches=8))
        r = cb.last_report
        if expect:
            assert expect in r.headline(), str(r)
        else:
            assert r.ok, str(r)
    print("4. Lightning 16-mixed: the planted bug found, the healthy run clean")


def fused_skip() -> None:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    mon = gh.GradHealth(model, opt, on_problem="raise", skip_nonfinite=True)
    with only_the_transfer_may_sync():
        for step in range(4):
            x = torch.randn(32, 64, device=dev)
            if step == 2:
                x[0, 0] = float("nan")
            opt.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            torch.cuda.synchronize()
            before = [p.detach().clone() for p in model.parameters()]
            state = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters() if opt.state[p]}
            torch.cuda.set_sync_debug_mode("error")
            try:
                report = mon.check()
            finally:
                torch.cuda.set_sync_debug_mode(0)
            opt.step()
            if step == 2:
                assert report.skipped == "nonfinite" and report.findings_of("STEP_SKIPPED"), str(report)
                assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
                assert all(torch.equal(v, opt.state[p][k]) for p in model.parameters() for k, v in state.get(id(p), {}).items())
    mon.close()
    print("5. skip_nonfinite with fused AdamW: the NaN step changed nothing, no extra host sync")


def model_of(width: int, depth: int) -> nn.Module:
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, 1)).cuda()


def no_sync_checks(steps: int = 30) -> None:
    torch.manual_seed(0)
    model = model_of(256, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    monitor = gh.GradHealth(model, opt, lag=1, skip_nonfinite=True, on_problem="ignore")
    x, y = torch.randn(64, 256, device="cuda"), torch.randn(64, 1, device="cuda")
    for step in range(3):  # warm-up (allocations, the pinned buffers' first use) outside the mode
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        monitor.check()
        opt.step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(steps):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            monitor.check(loss=loss)
            opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    monitor.close()
    print(f"6. {steps} deferred checks (fused AdamW, the guard on) under set_sync_debug_mode('error'): no synchronisation")


def device_guard() -> None:
    torch.manual_seed(0)
    model = model_of(256, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    monitor = gh.GradHealth(model, opt, lag=1, skip_nonfinite=True, on_problem="ignore")
    x, y = torch.randn(64, 256, device="cuda"), torch.randn(64, 1, device="cuda")
    for step in range(6):
        opt.zero_grad()
        xb = x.clone()
        if step == 4:
            xb[0, 0] = math.inf
        loss = nn.functional.mse_loss(model(xb), y)
        loss.backward()
        if step == 4:
            before = [p.detach().clone() for p in model.parameters()]
            state = [{k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()]
        torch.cuda.set_sync_debug_mode("error")
        try:
            monitor.check(loss=loss)
            opt.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        if step == 4:
            same = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
            same_state = all(torch.equal(s[k], opt.state[p][k]) for s, p in zip(state, model.parameters()) for k in s)
            if not (same and same_state):
                sys.exit("7. FAILED: the poisoned step changed the parameters or the optimizer state")
    monitor.close()
    print("7. the fused guard under set_sync_debug_mode('error'): the poisoned step left parameters and state bit for bit")


def ab(width: int, depth: int, batch: int, rounds: int = 7, steps: int = 20) -> None:
    torch.manual_seed(0)
    runs = {}
    for name, kw in (("plain", None), ("synchronous monitor", {}), ("deferred monitor (lag=1)", {"lag": 1})):
        model = model_of(width, depth)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        mon = gh.GradHealth(model, opt, on_problem="ignore", **kw) if kw is not None else None
        runs[name] = (model, opt, mon, [])
    x, y = torch.randn(batch, width, device="cuda"), torch.randn(batch, 1, device="cuda")

    def block(name: str) -> float:
        model, opt, mon, _ = runs[name]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        start.record()
        for _ in range(steps):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            if mon is not None:
                mon.check(loss=loss)
            opt.step()
        end.record()
        end.synchronize()
        return (time.perf_counter() - t0) / steps

    for name in runs:
        block(name)
    for r in range(rounds):
        names = list(runs)
        for name in names[r % 3:] + names[:r % 3]:
            runs[name][3].append(block(name))
    plain = statistics.median(runs["plain"][3])
    print(f"8. whole step, {depth}x Linear({width}), batch {batch} (median of {rounds} blocks of {steps}):")
    for name, (_, _, mon, times) in runs.items():
        t = statistics.median(times)
        print(f"   {name:<26}{t * 1e3:8.3f} ms  ({(t / plain - 1) * 100:+.1f}%)")
        if mon is not None:
            mon.close()


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here", file=sys.stderr)
        return 2
    t0 = time.time()
    print(f"gpu_check on {torch.cuda.get_device_name()} (torch {torch.__version__})")
    warnings.simplefilter("ignore")
    sync_free_hot_path()
    print("2. core benchmark, absolute times:", flush=True)
    subprocess.run([sys.executable, "-m", "gradhealth", "bench", "--device", "cuda", "--rounds", "5"], check=True)
    amp_fp16()
    lightning_16_mixed()
    fused_skip()
    no_sync_checks()
    device_guard()
    ab(256, 4, 64)
    ab(4096, 8, 512)
    print(f"gpu_check passed in {time.time() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The GPU check, for a session lent an accelerator: one command, a few minutes, from a plain
checkout (no install needed).

    python scripts/gpu_check.py            # on a CUDA device
    python scripts/gpu_check.py --cpu      # the same script on the CPU (CUDA-only sections say so)
    python scripts/gpu_check.py --tiny     # tiny sizes, few rounds: a smoke test (section 2: its smallest shape)

Each section runs on its own: a failure prints its traceback and the next section runs; the exit
status is 1 when any section failed (2 without a CUDA device and without ``--cpu``). With ``--cpu``
every section but 8 runs on the CPU, so that a GPU session's first run finds no mistake a CPU could
have found: ``set_sync_debug_mode`` is played there by :class:`CpuSyncs` (it sees the host reads a
CPU can see: a scalar read, an op whose output size depends on the values; ``tests/test_deferred.py``
counts the copies too), and section 4 runs Lightning's ``bf16-mixed`` (CPU autocast has no
``16-mixed``).

1. The hot path under torch.cuda.set_sync_debug_mode("error") from the first check on (plans
   included), allowed to synchronise only in a check's transfer (gradhealth.measure.stats.fetch).
2. The core benchmark's shapes with absolute times (gradhealth bench --sections checks).
3. fp16 AMP with a GradScaler: unscaled norms, an injected overflow reported as AMP_SKIPPED
   (info, no alarm), and the alarm after repeated skips.
4. Lightning precision="16-mixed" with the callback: a planted bug found, a healthy run silent.
5. skip_nonfinite with torch's fused AdamW: a NaN step leaves the parameters and the optimizer's
   state bit for bit as they were, and the guard adds no host sync to the check.
6. Deferred checks (``lag=1``) under ``set_sync_debug_mode("error")`` from the very first check,
   with no exception window at all: forward, backward, check and step, the guard on (fused AdamW).
7. The deferred guard on the device: a poisoned step leaves parameters and optimizer state bit
   for bit, under the same mode.
8. Synchronisations per step, counted with ``set_sync_debug_mode("warn")``: plain, the one number
   (``clip_grad_norm_(...).item()``), the default monitor, ``lag=1``, on the vanishing shape and
   the 6-tensor MLP.
9. The whole-step table: plain, the one number, the default monitor, ``lag=1`` on a 6-tensor MLP
   (batch 64), a 12-layer GPT (d=768, bf16 autocast, 8x512 tokens), 8x Linear(256) (batch 64),
   8x Linear(2048) (batch 256), 200x (Linear(64, 64), Tanh) (gradients that underflow fp32
   squares) and the GPT with all but its last block frozen (a fine-tune); interleaved blocks, medians, each variant's cost over the plain step and its ratio to
   the one number's.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import math
import os
import statistics
import sys
import time
import traceback
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _plain_checkout() -> None:
    """Import gradhealth from this checkout, and its subpackages that setuptools maps from folders
    outside ``gradhealth/`` (``[tool.setuptools.package-dir]``: integrations/, demos/, benchmarks/),
    registered by hand when nothing installed maps them."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    import gradhealth

    mapping = {"gradhealth.integrations": "integrations", "gradhealth.demos": "demos", "gradhealth.benchmarks": "benchmarks"}
    try:
        import tomllib

        with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
            mapping = tomllib.load(f)["tool"]["setuptools"]["package-dir"] or mapping
    except (ImportError, OSError, KeyError):
        pass
    for name, folder in mapping.items():
        if not name.startswith("gradhealth.") or name in sys.modules:
            continue
        try:  # (mapped already, to this checkout's folder: an install of it, editable or not)
            found = importlib.util.find_spec(name)
            if found is not None and os.path.abspath(found.origin or "").startswith(os.path.join(ROOT, folder)):
                continue
        except ImportError:
            pass
        init = os.path.join(ROOT, folder, "__init__.py")
        spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[os.path.join(ROOT, folder)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        setattr(gradhealth, name.rpartition(".")[2], module)


_plain_checkout()

import torch  # noqa: E402
from torch import nn  # noqa: E402

import gradhealth as gh  # noqa: E402
from gradhealth.measure import stats  # noqa: E402
from gradhealth.benchmarks.counts import TolistWatch, within  # noqa: E402

ARGS = argparse.Namespace(cpu=False, tiny=False, shapes="")
DEV = torch.device("cuda")


def _sync():
    if DEV.type == "cuda":
        torch.cuda.synchronize()


class CpuSyncs(TolistWatch):
    """(``--cpu``) ``torch.cuda.set_sync_debug_mode``'s stand-in: at the level "error" an op that
    would make the host wait for a CUDA device raises, as CUDA's mode does (at "warn" it warns). It
    sees a scalar read (``item``, ``bool()``, ``float()``), an op whose output's size depends on the
    values, and ``Tensor.tolist()`` (on a GPU a blocking copy; on the CPU it reads memory and
    dispatches nothing) outside the reads of host memory: a check's transfer points
    (``stats.fetch``, ``Transfer.values``) and ``rules._host_values`` (fused Adam's step counts are
    taken as a GPU holds them: on the device)."""

    READS = {"_local_scalar_dense", "item", "is_nonzero", "nonzero", "nonzero_static", "masked_select", "unique",
             "_unique", "_unique2", "unique_dim", "unique_consecutive", "argwhere", "masked_scatter"}
    level = 0

    @staticmethod
    def said(what) -> None:
        if CpuSyncs.level == 2:
            raise RuntimeError(f"called a synchronizing CUDA operation (the CPU's stand-in: {what})")
        warnings.warn(f"called a synchronizing CUDA operation (the CPU's stand-in: {what})")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if CpuSyncs.level and func.__name__.split(".")[0] in self.READS:
            self.said(func)
        return func(*args, **(kwargs or {}))

    def tolist_called(self, frame) -> None:
        from gradhealth.check import deferred
        from gradhealth.measure import rules

        if CpuSyncs.level and not within(frame, {stats.fetch.__code__, deferred.Transfer.values.__code__,
                                                 rules._host_values.__code__}):
            self.said("Tensor.tolist")

    def __enter__(self):
        from gradhealth.measure import rules

        self._on_host, rules._on_host = rules._on_host, lambda t: False  # (every tensor is the "device"'s here)
        return super().__enter__()

    def __exit__(self, *exc):
        from gradhealth.measure import rules

        rules._on_host = self._on_host
        return super().__exit__(*exc)


def sync_debug(level) -> None:
    """``torch.cuda.set_sync_debug_mode(level)`` on a GPU; with ``--cpu``, :class:`CpuSyncs`'s."""
    if DEV.type == "cuda":
        torch.cuda.set_sync_debug_mode(level)
    else:
        CpuSyncs.level = {"default": 0, "warn": 1, "error": 2}.get(level, level)


@contextlib.contextmanager
def sync_watch():
    """Around a section that switches the sync debug mode: on the CPU, its stand-in listens."""
    with CpuSyncs() if DEV.type != "cuda" else contextlib.nullcontext():
        try:
            yield
        finally:
            sync_debug(0)


@contextlib.contextmanager
def only_the_transfer_may_sync():
    """Inside: stats.fetch (a check's one transfer) may synchronise; sync_debug_mode "error" is
    switched on around each check by the caller."""
    original = stats.fetch

    def fetch(parts):
        sync_debug(0)
        try:
            return original(parts)
        finally:
            sync_debug("error")

    stats.fetch = fetch
    try:
        yield
    finally:
        stats.fetch = original


def sync_free_hot_path() -> None:
    dev = DEV
    model = nn.Sequential(*[m for _ in range(50) for m in (nn.Linear(256, 256), nn.LayerNorm(256))]).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = gh.GradHealth(model, opt, on_problem="raise")
    with sync_watch(), only_the_transfer_may_sync():
        for _ in range(5):
            opt.zero_grad(set_to_none=True)
            loss = model(torch.randn(64, 256, device=dev)).square().mean()
            loss.backward()
            _sync()
            sync_debug("error")
            try:
                report = mon.check()
            finally:
                sync_debug(0)
            assert report.ok, str(report)
            opt.step()
    mon.close()
    print("1. hot path: no host sync outside the one transfer (5 checks, 200 tensors, AdamW deltas on)")


def amp_fp16() -> None:
    dev = DEV
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler(dev.type, init_scale=2.0**14)
    mon = gh.GradHealth(model, opt, scaler=scaler, on_problem="ignore", amp_skip_alarm=3)
    said = []
    for step in range(8):
        opt.zero_grad()
        with torch.autocast(dev.type, dtype=torch.float16):
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
    try:
        import lightning.pytorch as pl
    except ImportError:
        print("4. Lightning: skipped (lightning is not installed here)")
        return

    from gradhealth.integrations.lightning import GradHealthCallback
    from gradhealth.demos.lightning_parts import DemoModule, SyntheticData

    gpu = DEV.type == "cuda"
    for bug, expect in [("not_in_optimizer", "NOT_IN_OPTIMIZER"), ("none", None)]:
        cb = GradHealthCallback(on_problem="ignore")
        trainer = pl.Trainer(max_steps=5, accelerator="gpu" if gpu else "cpu", devices=1,
                             precision="16-mixed" if gpu else "bf16-mixed", callbacks=[cb], logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(DemoModule(bug=bug), SyntheticData(n_batches=8))
        r = cb.last_report
        if expect:
            assert expect in r.headline(), str(r)
        else:
            assert r.ok, str(r)
    print(f"4. Lightning {'16' if gpu else 'bf16'}-mixed: the planted bug found, the healthy run clean")


def fused_skip() -> None:
    dev = DEV
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    mon = gh.GradHealth(model, opt, on_problem="raise", skip_nonfinite=True)
    with sync_watch(), only_the_transfer_may_sync():
        for step in range(4):
            x = torch.randn(32, 64, device=dev)
            if step == 2:
                x[0, 0] = float("nan")
            opt.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            _sync()
            before = [p.detach().clone() for p in model.parameters()]
            state = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters() if opt.state[p]}
            sync_debug("error")
            try:
                report = mon.check()
            finally:
                sync_debug(0)
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
    return nn.Sequential(*layers, nn.Linear(width, 1)).to(DEV)


def no_sync_checks(steps: int = 30) -> None:
    torch.manual_seed(0)
    model = model_of(256, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    x, y = torch.randn(64, 256, device=DEV), torch.randn(64, 1, device=DEV)
    for step in range(2):  # the plain loop's own first steps (allocator, optimizer state), no monitor yet
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    _sync()
    with sync_watch():  # the monitor made and every check from the first on (plans, pinned buffers) inside the mode
        sync_debug("error")
        monitor = gh.GradHealth(model, opt, lag=1, skip_nonfinite=True, on_problem="ignore")
        for step in range(steps):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            monitor.check(loss=loss)
            opt.step()
        sync_debug("default")
        monitor.flush()  # (the last check's report, delivered: one read, outside the mode)
    last = monitor.last_report
    assert last is not None and last.ok and last.step == steps - 1, str(last)  # (a healthy run: judged, and clean)
    monitor.close()
    print(f"6. {steps} deferred checks from the first (fused AdamW, the guard on) under set_sync_debug_mode('error'): "
          "no synchronisation")


def device_guard() -> None:
    torch.manual_seed(0)
    model = model_of(256, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    monitor = gh.GradHealth(model, opt, lag=1, skip_nonfinite=True, on_problem="ignore")
    x, y = torch.randn(64, 256, device=DEV), torch.randn(64, 1, device=DEV)
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
        with sync_watch():
            sync_debug("error")
            monitor.check(loss=loss)
            opt.step()
        if step == 4:
            same = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
            same_state = all(torch.equal(s[k], opt.state[p][k]) for s, p in zip(state, model.parameters()) for k in s)
            assert same and same_state, "the poisoned step changed the parameters or the optimizer state"
    monitor.close()
    print("7. the fused guard under set_sync_debug_mode('error'): the poisoned step left parameters and state bit for bit")


def core_bench() -> None:
    from gradhealth.benchmarks.core import main as bench

    print("2. core benchmark, absolute times:", flush=True)
    # (--tiny: its smallest shape, 400 small tensors; the 26M- and 84M-parameter ones on a real run)
    tiny = ["--rounds", "1", "--shapes", "0"] if ARGS.tiny else ["--rounds", "5"]
    assert bench(["--device", DEV.type, *tiny, "--sections", "checks"]) == 0


# ----------------------------------------------------------------------------- the whole-step table
class GPT(nn.Module):
    """A GPT-2-style decoder (pre-norm, causal attention, GELU MLP, tied head)."""

    def __init__(self, vocab: int, d: int, layers: int, heads: int, ctx: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, activation="gelu",
                                                               batch_first=True, norm_first=True) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=idx.device)
        for b in self.blocks:
            x = b(x, src_mask=mask, is_causal=True)
        return self.head(self.ln(x))


def _stack(width: int, depth: int, act=nn.GELU) -> nn.Module:
    return nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), act())], nn.Linear(width, 1))


def _frozen_but_last(gpt: nn.Module) -> nn.Module:
    """Every tensor frozen but the last block's and those after it (a fine-tune's few trainable ones)."""
    params, last = list(gpt.parameters()), {id(p) for p in gpt.blocks[-1].parameters()}
    for p in params[: min(i for i, p in enumerate(params) if id(p) in last)]:  # (the tied embedding among them)
        p.requires_grad_(False)
    return gpt


def shapes() -> dict:
    """label -> (model factory, batch factory, loss(model, batch), autocast dtype or None)."""
    tiny = ARGS.tiny
    mse = lambda m, b: nn.functional.mse_loss(m(b[0]).float(), b[1])  # noqa: E731
    vocab, d, layers, heads, (bsz, t) = (256, 64, 2, 4, (2, 32)) if tiny else (50304, 768, 12, 12, (8, 512))

    def lm(m, b):
        logits = m(b[:, :-1])
        return nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), b[:, 1:].reshape(-1))

    xy = lambda n, w: (torch.randn(n, w, device=DEV), torch.randn(n, 1, device=DEV))  # noqa: E731
    return {
        "6-tensor MLP, batch 64": (lambda: _stack(64, 2, nn.ReLU), lambda: xy(64, 64), mse, None),
        f"{layers}-layer GPT, d={d}, bf16 autocast, {bsz}x{t} tokens": (
            lambda: GPT(vocab, d, layers, heads, t + 1), lambda: torch.randint(0, vocab, (bsz, t + 1), device=DEV),
            lm, torch.bfloat16),
        "8x Linear(256), batch 64": (lambda: _stack(256, 8), lambda: xy(64, 256), mse, None),
        "8x Linear(2048), batch 256": (lambda: _stack(256 if tiny else 2048, 8),
                                       lambda: xy(16 if tiny else 256, 256 if tiny else 2048), mse, None),
        "200x (Linear(64, 64), Tanh): vanishing": (
            lambda: nn.Sequential(*[m for _ in range(20 if tiny else 200) for m in (nn.Linear(64, 64), nn.Tanh())]),
            lambda: xy(64, 64), lambda m, b: m(b[0]).float().pow(2).mean(), None),
        "that GPT, all but its last block frozen": (
            lambda: _frozen_but_last(GPT(vocab, d, layers, heads, t + 1)),
            lambda: torch.randint(0, vocab, (bsz, t + 1), device=DEV), lm, torch.bfloat16),
    }


VARIANTS = ("plain", "one number", "default monitor", "lag=1")


def _runner(shape, variant):
    make, batch, loss_of, amp = shape
    torch.manual_seed(0)
    model = make().to(DEV)
    params = [p for p in model.parameters() if p.requires_grad]  # (a fine-tune's optimizer: its trainable ones)
    opt = torch.optim.AdamW(params, lr=1e-4, fused=DEV.type == "cuda")
    mon = (gh.GradHealth(model, opt, on_problem="ignore", lag=int(variant == "lag=1"))
           if variant in ("default monitor", "lag=1") else None)
    data = batch()

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(DEV.type, dtype=amp) if amp else contextlib.nullcontext():
            loss = loss_of(model, data)
        loss.backward()
        if mon is not None:
            mon.check(loss=loss)
        elif variant == "one number":
            torch.nn.utils.clip_grad_norm_(params, 1e9).item()
        opt.step()

    return step, mon


def sync_counts() -> None:
    if DEV.type != "cuda":
        print("8. synchronisations per step: skipped (no CUDA: set_sync_debug_mode counts CUDA syncs)")
        return
    table = shapes()
    print("8. synchronisations per step (set_sync_debug_mode('warn'), 10 steps after 2 of warm-up):")
    for label in (list(table)[0], list(table)[-1]):
        cells = []
        for variant in VARIANTS:
            step, mon = _runner(table[label], variant)
            for _ in range(2):
                step()
            torch.cuda.synchronize()
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    for _ in range(10):
                        step()
                finally:
                    torch.cuda.set_sync_debug_mode(0)
            n = sum("synchroniz" in str(w.message) for w in said)
            cells.append(f"{variant} {n / 10:.1f}")
            if mon is not None:
                mon.close()
        print(f"   {label}: " + ", ".join(cells))


def whole_step() -> None:
    rounds, steps = (2, 2) if ARGS.tiny else (7, 20)
    print(f"9. whole steps, interleaved blocks of {steps} steps, medians of {rounds} ({DEV}):")
    print(f"   {'shape':<48}{'plain ms':>10}" + "".join(f"{v:>32}" for v in VARIANTS[1:]))
    print("   (each variant: its extra over the plain step, in % and ms; its ratio to the one number's extra where "
          "that stands out of the plain blocks' spread by 3x)")
    table = list(shapes().items())
    for label, shape in [table[int(i)] for i in ARGS.shapes.split(",")] if ARGS.shapes else table:
        runs = {v: _runner(shape, v) for v in VARIANTS}
        times = {v: [] for v in VARIANTS}

        def block(v):
            step = runs[v][0]
            _sync()
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            _sync()
            return (time.perf_counter() - t0) / steps

        for v in VARIANTS:  # warm-up (and the plans' first check)
            block(v)
        for r in range(rounds):
            order = VARIANTS[r % 4:] + VARIANTS[:r % 4]
            for v in order:
                times[v].append(block(v))
        med = {v: statistics.median(t) for v, t in times.items()}
        one = med["one number"] - med["plain"]
        noise = max(times["plain"]) - min(times["plain"])  # (a ratio to the one number only where it stands out)
        cells = []
        for v in VARIANTS[1:]:
            extra = med[v] - med["plain"]
            ratio = (" " * 13 if v == "one number" else f" ({extra / one:5.2f}x one)" if one > max(3 * noise, 1e-9)
                     else " (one: noise)")
            cells.append(f"{extra / med['plain'] * 100:+7.1f}% {extra * 1e3:+.3f}ms" + ratio)
        print(f"   {label:<48}{med['plain'] * 1e3:>10.3f}" + "".join(f"{c:>32}" for c in cells), flush=True)
        for _, mon in runs.values():
            if mon is not None:
                mon.close()


SECTIONS = [("1. hot path without a sync", "sync_free_hot_path"), ("2. core benchmark", "core_bench"),
            ("3. fp16 AMP", "amp_fp16"), ("4. Lightning 16-mixed", "lightning_16_mixed"), ("5. fused skip", "fused_skip"),
            ("6. deferred without a sync", "no_sync_checks"), ("7. the deferred guard", "device_guard"),
            ("8. syncs per step", "sync_counts"), ("9. whole steps", "whole_step")]


def main(argv=None) -> int:
    global DEV
    ap = argparse.ArgumentParser(description="gradhealth's GPU check")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU (the CUDA-only sections say they are skipped)")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes and few rounds (a smoke test; "
                                                               "section 2 times only the core benchmark's smallest shape)")
    ap.add_argument("--sections", default="", help="comma-separated section numbers (default: all)")
    ap.add_argument("--shapes", default="", help="the whole-step table's shapes, comma-separated indexes (default: all)")
    ARGS.__dict__.update(vars(ap.parse_args(argv)))
    if not ARGS.cpu and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (--cpu runs what can run on the CPU)", file=sys.stderr)
        return 2
    DEV = torch.device("cpu" if ARGS.cpu else "cuda")
    t0 = time.time()
    name = torch.cuda.get_device_name() if DEV.type == "cuda" else "the CPU"
    import gradhealth.integrations as integrations

    print(f"gpu_check on {name} (torch {torch.__version__}; gradhealth from {os.path.dirname(gh.__file__)}, "
          f"gradhealth.integrations from {os.path.dirname(integrations.__file__)})")
    warnings.simplefilter("ignore")
    chosen = {s for s in ARGS.sections.split(",") if s}
    failed = []
    for title, fn in SECTIONS:
        if chosen and title.split(".")[0] not in chosen:
            continue
        try:
            if os.environ.get("GPU_CHECK_FAIL") == title.split(".")[0]:  # (the harness's own test: a section that fails)
                raise RuntimeError("a failure planted by GPU_CHECK_FAIL")
            with warnings.catch_warnings(record=True) as said:  # (a check or a hook that failed inside: said, caught)
                warnings.simplefilter("ignore")
                warnings.simplefilter("always", gh.GradHealthInternalWarning)
                globals()[fn]()
            inside = [str(w.message) for w in said if issubclass(w.category, gh.GradHealthInternalWarning)]
            if inside:
                raise RuntimeError("gradhealth failed inside: " + " | ".join(dict.fromkeys(inside)))
        except Exception:  # each section on its own: report it, run the next
            failed.append(title)
            print(f"{title}: FAILED", flush=True)
            traceback.print_exc()
    print(f"gpu_check {'FAILED: ' + ', '.join(failed) if failed else 'passed'} in {time.time() - t0:.0f}s")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

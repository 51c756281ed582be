#!/usr/bin/env python3
"""Instructions a training step costs, counted by valgrind (callgrind): the small-model bench's
comparison without the noise of a shared machine's clock.

    python scripts/count_instructions.py [--shapes 6,small,2-] [--steps 48]

For each small shape of ``gradhealth bench --sections small`` (the 6-tensor MLP, the small CNN, the
2-block transformer), one process per variant (the plain step, ``clip_grad_norm_(...).item()``: the
one number a user logs, and the default monitor) trains under callgrind with instrumentation off;
after a warm-up it is switched on, the counters zeroed, ``--steps`` steps run and the counters
dumped: instructions per step, then each variant's cost above the plain step and its ratio to the
one number's. ``--steps`` a multiple of 8 counts the change test (every 8 checks) in proportion.
Instructions are not time (a cache miss costs more than an add), but they are deterministic: run to
run they agree to 0.1%. Needs valgrind (apt-get install valgrind); a few minutes per shape.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

VARIANTS = ("plain", "clip", "monitor")


def child(shape: str, variant: str, steps: int, flag_dir: str) -> None:
    import torch

    torch.set_num_threads(1)
    import gradhealth as gh
    from gradhealth.benchmarks.small import SMALL

    make, batch = SMALL[shape]
    torch.manual_seed(0)
    model, x = make(), batch()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    monitor = gh.GradHealth(model, opt, on_problem="ignore") if variant == "monitor" else None

    def run(n: int) -> None:
        for _ in range(n):
            opt.zero_grad(set_to_none=True)
            loss = model(x).float().pow(2).mean()
            loss.backward()
            if monitor is not None:
                monitor.check(loss=loss)
            elif variant == "clip":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).item()
            opt.step()

    run(30)  # warm-up: every code path once, outside the count
    _touch(flag_dir, "ready")
    _wait(flag_dir, "go")
    run(steps)
    _touch(flag_dir, "done")
    _wait(flag_dir, "dumped")


def _touch(d: str, name: str) -> None:
    open(os.path.join(d, name), "w").close()


def _wait(d: str, name: str, timeout: float = 3600) -> None:
    end = time.monotonic() + timeout
    while not os.path.exists(os.path.join(d, name)):
        if time.monotonic() > end:
            raise TimeoutError(name)
        time.sleep(0.05)


def count(shape: str, variant: str, steps: int) -> float:
    """Instructions per step of ``variant`` on ``shape``."""
    with tempfile.TemporaryDirectory(prefix="gradhealth_ir_") as d:
        out = os.path.join(d, "cg.out")
        cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}", sys.executable,
               os.path.abspath(__file__), "--child", shape, variant, str(steps), d]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            _wait(d, "ready")
            for action in ("-i", "on"), ("-z",):  # instrument from here on, and count from zero
                subprocess.run(["callgrind_control", *action, str(proc.pid)], check=True, capture_output=True)
            _touch(d, "go")
            _wait(d, "done")
            subprocess.run(["callgrind_control", "-d", str(proc.pid)], check=True, capture_output=True)
            _touch(d, "dumped")
            proc.wait(timeout=600)
        finally:
            if proc.poll() is None:
                proc.kill()
        with open(out + ".1") as f:  # the dump (the file without a suffix holds what ran after it)
            total = next(int(m.group(1)) for line in f if (m := re.match(r"(?:summary|totals): (\d+)", line)))
    return total / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="", help="comma-separated prefixes of the small shapes' labels (default: all)")
    ap.add_argument("--steps", type=int, default=48)
    args = ap.parse_args()
    from gradhealth.benchmarks.small import SMALL

    wanted = [p for p in args.shapes.split(",") if p]
    for shape in SMALL:
        if wanted and not any(shape.startswith(p) for p in wanted):
            continue
        ir = {v: count(shape, v, args.steps) for v in VARIANTS}
        one = ir["clip"] - ir["plain"]
        print(f"{shape}: plain step {ir['plain'] / 1e6:.3f} M instructions")
        for v in VARIANTS[1:]:
            extra = ir[v] - ir["plain"]
            print(f"  {v:<10}{extra / 1e3:>+10.0f} k   {extra / one:.2f}x the one number", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
    else:
        main()

"""The ranks of DeepSpeed launches, forked from this process after it has imported torch and
DeepSpeed (its ZeRO stages, MoE, CPU Adam and the Muon module ``deepspeed.initialize`` imports, whose
``torch.compile`` decorators import torch's dynamo) and run nothing else: ``python tests/deepspeed_ranks.py
WORLD PORT ARGS... [+++ WORLD PORT ARGS...]``, the launches one after the other, each its own world, port and
processes (a one-process launch is a world of 1); each rank runs ``tests/deepspeed_many.py ARGS...`` as
``torchrun --nproc_per_node WORLD`` would run it (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT=PORT in its environment), without a launcher importing torch and every rank importing the stack
again (about 6 s of CPU a rank). A launch ``hf ROOT CASE@PORT ...`` is tests/deepspeed_forks.py's (the HF
stack's cases, a process each; Transformers and Accelerate are then imported here too, before any fork).
Each rank is a process of its own: gradhealth and the case scripts are imported there, DeepSpeed's
``init_distributed`` and its gloo group are its own. A rank that fails kills the others of its launch
(they would wait in a collective for it), its output (ROOT/rank<r>.log, ROOT the folder of the first
script's OUT) printed, and the exit status 1 (the other launches still run). The ranks share this
process's session: a test that kills the session (tests/procs.py) kills them too.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import threading
import warnings

import procs  # (tests/procs.py: a fork server's children)

warnings.simplefilter("ignore")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
import torch  # noqa: E402,F401
import deepspeed  # noqa: E402,F401
import deepspeed.runtime.engine  # noqa: E402,F401
import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: E402,F401
import deepspeed.runtime.zero.stage_1_and_2  # noqa: E402,F401
import deepspeed.runtime.zero.stage3  # noqa: E402,F401
import deepspeed.moe.layer  # noqa: E402,F401
import deepspeed.ops.adam  # noqa: E402,F401


def _rank(rank: int, world: int, port: str, log: str, argv: list[str]) -> int:
    def body():
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                          GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        import deepspeed_many

        deepspeed_many.main(argv)

    return procs.forked(log, body)


def main(argv: list[str]) -> int:
    launches = procs.split(argv, "+++")
    hf = any(launch[0] == "hf" for launch in launches)
    if hf:  # (Transformers and Accelerate too, and the one-process defaults every rank overrides)
        import deepspeed_forks
    assert not [m for m in sys.modules if m.split(".")[0] == "gradhealth"], "the fork server imported gradhealth"
    assert threading.active_count() == 1, "an import started a thread: forking would be unsafe"
    gc.freeze()  # (the imports' objects: never collected again, so no rank's collections walk them, e.g. ZeRO-3's)
    failed = [deepspeed_forks.main(launch[1:]) if launch[0] == "hf" else  # (each, whatever came before)
              launch_ranks(int(launch[0]), launch[1], launch[2:]) for launch in launches]
    return 1 if any(failed) else 0


def launch_ranks(world: int, port: str, args: list[str]) -> int:
    root = os.path.dirname(os.path.abspath(args[1]))  # (args: SCRIPT OUT CASE ... -- ...)
    logs = [os.path.join(root, f"rank{r}.log") for r in range(world)]
    pids = {_rank(r, world, port, logs[r], args): r for r in range(world)}
    failed = []
    while pids:
        pid, status = os.wait()
        rank = pids.pop(pid, None)
        if rank is not None and os.waitstatus_to_exitcode(status):
            failed.append(rank)
            for other in pids:  # (the others would wait for it in a collective)
                os.kill(other, signal.SIGKILL)
    for rank in failed:
        with open(logs[rank]) as f:
            print(f"--- rank {rank} failed:\n{f.read()[-6000:]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

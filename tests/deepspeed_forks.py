"""tests/deepspeed_hf.py's cases, each in a process of its own, forked from this one after it has imported
DeepSpeed (its ZeRO optimizers and the Muon module ``deepspeed.initialize`` imports, whose ``torch.compile``
decorators import torch's dynamo: about 3 s of CPU a case), Transformers and Accelerate, and run nothing
else (gradhealth and tests/deepspeed_hf.py are imported in the case's process): ``python
tests/deepspeed_forks.py ROOT CASE@PORT ...``, two cases at a time, each writing ROOT/CASE.json, its output
in ROOT/CASE.log (the logs of the cases that failed printed, and the exit status 1). Each case process is as
fresh as ``python tests/deepspeed_hf.py ROOT/CASE.json CASE`` would be, without importing the stack again
(about 4 s of CPU a case); DeepSpeed's ``init_distributed``, gloo and the engine run in it alone, on its own
MASTER_PORT (PORT). They share this process's session: a test that kills the session (tests/procs.py) kills
them too. tests/test_deepspeed.py runs them as tests/deepspeed_ranks.py's last launch (``hf``), from the process
that forked its DeepSpeed ranks before."""

from __future__ import annotations

import gc
import os
import sys
import warnings

import procs  # (tests/procs.py: a fork server's children)

warnings.simplefilter("ignore")
os.environ.setdefault("DS_ACCELERATOR", "cpu")  # (as tests/deepspeed_hf.py sets them, before DeepSpeed's import)
for _key, _value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29565"), ("RANK", "0"), ("WORLD_SIZE", "1"),
                     ("LOCAL_RANK", "0")):
    os.environ.setdefault(_key, _value)
import deepspeed  # noqa: E402,F401
import deepspeed.runtime.engine  # noqa: E402,F401
import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: E402,F401
import deepspeed.runtime.zero.stage_1_and_2  # noqa: E402,F401
import deepspeed.runtime.zero.stage3  # noqa: E402,F401
import accelerate  # noqa: E402,F401
import transformers  # noqa: E402,F401
import transformers.trainer  # noqa: E402,F401


def _fork(root: str, case: str, port: int) -> int:
    def body():
        os.environ["MASTER_PORT"] = str(port)
        import deepspeed_hf

        deepspeed_hf.main([os.path.join(root, f"{case}.json"), case])

    return procs.forked(os.path.join(root, f"{case}.log"), body)


def main(argv: list[str]) -> int:
    assert not [m for m in sys.modules if m.split(".")[0] == "gradhealth"], "the fork server imported gradhealth"
    gc.freeze()  # (the imports' objects: never collected again, so no case's collections walk them)
    root, cases, failed = argv[0], [a.split("@") for a in argv[1:]], []
    for k in range(0, len(cases), 2):
        pids = {_fork(root, case, int(port)): case for case, port in cases[k:k + 2]}
        for pid, case in pids.items():
            if os.waitpid(pid, 0)[1]:
                failed.append(case)
    for case in failed:
        with open(os.path.join(root, f"{case}.log")) as f:
            print(f"--- {case} failed:\n{f.read()[-6000:]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

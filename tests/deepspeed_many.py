"""Several DeepSpeed case scripts in one process (one launch, one import of DeepSpeed and one load of
its ops for all of them, rather than one a script): ``python tests/deepspeed_many.py SCRIPT OUT CASE ...
-- SCRIPT OUT CASE ...`` (under ``torchrun`` as well), each script's ``main([OUT, CASE, ...])`` run in
turn, as its own command line would run it: every case builds its own engine from its own seed, and
each script writes its own results (OUT, OUT.rank<r>)."""

from __future__ import annotations

import gc
import importlib
import sys

import deepspeed_cases  # noqa: F401  (sets the distributed environment's defaults first)
import procs  # (tests/procs.py: its argv splitting)


def main(argv: list[str]) -> None:
    for name, *args in procs.split(argv, "--"):
        importlib.import_module(name).main(args)


if __name__ == "__main__":
    import deepspeed.runtime.engine  # noqa: F401  (what every case imports, before the freeze)

    gc.freeze()  # (the imports' objects: never collected again, so no case's collections walk them, e.g. ZeRO-3's)
    main(sys.argv[1:])

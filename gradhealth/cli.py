"""The ``gradhealth`` command: ``demo``, ``bench``."""

from __future__ import annotations

import sys

USAGE = """usage: gradhealth COMMAND [options]      (gradhealth COMMAND --help: every option of one)

commands:
  demo    Trainer.fit runs with planted bugs on synthetic data, and what gradhealth says
            --plain          the same scenarios in a plain PyTorch loop, without Lightning
            --transformers   a tiny BERT through Hugging Face Trainer
            --only NAMES     comma-separated scenario names (default: all 12)
            --steps N        optimizer steps per scenario
            --logdir DIR     where the TensorBoard logs go (default: gradhealth_runs/demo)
            --progress       show Lightning's progress bar (default: one line per scenario)
  bench   the cost of a check against the naive per-parameter loop and a single fused norm pass
            --sections NAMES comma-separated (default: all; counts: what a check costs in torch
                             ops and Python instructions)
  report  LOGDIR [--format text|csv|json] [--verbose]: what gradhealth saw in a run, from its
          TensorBoard logs

options:
  --version  print the version
"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if argv[0] in ("--version", "-V", "version"):
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(f"gradhealth {version('gradhealth')}")
        except PackageNotFoundError:  # run from a checkout that is not installed
            print("gradhealth (not installed: version unknown)")
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "demo":
        if "--transformers" in rest:
            rest = [a for a in rest if a != "--transformers"]
            try:
                from gradhealth.demos.hf_trainer import main as run
            except ImportError as exc:
                print(f"gradhealth demo --transformers needs transformers ({exc}); "
                      "pip install 'transformers>=5,<6' accelerate", file=sys.stderr)
                return 2
        elif "--plain" in rest:
            rest = [a for a in rest if a != "--plain"]
            from gradhealth.demos.plain import main as run
        else:  # the Lightning demo when Lightning is installed (imported when a scenario runs); the plain-loop one otherwise
            from importlib.util import find_spec

            if find_spec("lightning") is not None:
                from gradhealth.demos.lightning_fit import main as run
            else:
                from gradhealth.demos.plain import main as run
    elif cmd == "bench":
        from gradhealth.benchmarks.core import main as run
    elif cmd == "report":
        try:
            from gradhealth.integrations.tbreport import main as run
        except ImportError as exc:
            print(f"gradhealth report needs tensorboard ({exc}); pip install 'gradhealth[tensorboard]'", file=sys.stderr)
            return 2
    else:
        print(f"gradhealth: unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return run(rest)


if __name__ == "__main__":
    raise SystemExit(main())

"""The ``gradhealth`` command: ``demo``, ``bench``."""

from __future__ import annotations

import sys

USAGE = """usage: gradhealth COMMAND [options]

commands:
  demo    train a small model on synthetic data with planted bugs and show what gradhealth says
  bench   time a check against the naive per-parameter loop and a single fused norm pass
"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "demo":
        from .demo import main as run
    elif cmd == "bench":
        from .bench import main as run
    else:
        print(f"gradhealth: unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return run(rest)


if __name__ == "__main__":
    raise SystemExit(main())

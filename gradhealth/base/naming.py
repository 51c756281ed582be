"""Names and words shared by every message: modules of parameters, name patterns, plurals, ranks."""

from __future__ import annotations

import fnmatch
import functools
import re
from collections.abc import Iterable, Sequence

__all__ = ["terminal_safe", "ROOT", "module_of", "matches", "plural", "on_ranks"]

_CONTROL = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")


def terminal_safe(text: str) -> str:
    """``text`` with every control character but the newline escaped (C0, DEL, C1, line and
    paragraph separators, and the surrogate escapes of undecodable bytes): a parameter or module
    name reaches a terminal as visible ``\x1b``, never as a terminal command."""
    return _CONTROL.sub(lambda m: m.group(0).encode("unicode_escape", "backslashreplace").decode("ascii")
                        if not 0xD800 <= ord(m.group(0)) <= 0xDFFF else f"\\udc{ord(m.group(0)) & 0xFF:02x}", text)


#: how the top-level module is named where a module name is needed
ROOT = "(root)"


@functools.lru_cache(maxsize=1 << 16)
def module_of(name: str) -> str:
    """The module a parameter belongs to: ``encoder.0`` for ``encoder.0.weight``."""
    return name.rpartition(".")[0] or ROOT


def matches(name: str, patterns: Iterable[str] | None) -> bool:
    """Does ``name`` match any ``fnmatch`` pattern (``"encoder.*"``)? False for no patterns."""
    return patterns is not None and any(fnmatch.fnmatchcase(name, p) for p in patterns)


def agree(count, many: str, one: str) -> str:
    """The verb (or phrase) that agrees with ``count`` things (a number or a collection):
    ``agree(names, "were", "was")``."""
    n = count if isinstance(count, int) else len(count)
    return one if n == 1 else many


def plural(n: int, word: str, many: str | None = None) -> str:
    """``1 parameter``, ``2 parameters``."""
    return f"{n} {word if n == 1 else (many or word + 's')}"


def on_ranks(ranks: Sequence[int]) -> str:
    """``rank 1`` or ``ranks 0, 2``."""
    return f"rank{'s' if len(ranks) != 1 else ''} {', '.join(map(str, ranks))}"

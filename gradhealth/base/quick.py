"""Hot-path constructors of the dataclasses a check builds at every call (``Report``,
``Observation``, ``Launch``): the same object the class's own ``__init__`` makes, built in one dict.

A dataclass's generated ``__init__`` tests every field against its default factory and calls it
(about ten bytecode instructions a field): on a model of a few tensors the report's 25 fields cost
more Python than reading the gradients. :func:`quick` makes ``build(**given)``: every field not
given takes its default, each default factory's container made fresh by a literal (``[]``, ``{}``,
``set()``; an empty ``frozenset`` is shared, it cannot change), all set with one ``__dict__``
update. Only for plain dataclasses (no ``__post_init__``, no slots, not frozen, no ``InitVar``):
anything else is refused when the constructor is made, not silently built wrong.
"""

from __future__ import annotations

import dataclasses

__all__ = ["quick"]

_LITERALS = {list: "[]", dict: "{}", set: "set()"}


def quick(cls):
    """``build(**given)`` -> a ``cls`` whose fields are ``given``, the others their defaults (every
    field without a default must be given: a missing one is a TypeError, as with ``cls(...)``;
    the names given are the caller's to get right: tests compare the two constructors)."""
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or params.frozen or hasattr(cls, "__post_init__") or hasattr(cls, "__slots__"):
        raise TypeError(f"quick(): {cls.__name__} is not a plain dataclass")
    consts, items, required = {}, [], []
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            consts[f.name] = f.default
        elif f.default_factory is frozenset:
            consts[f.name] = frozenset()
        elif f.default_factory in _LITERALS:
            items.append(f"{f.name!r}: {_LITERALS[f.default_factory]}")
        elif f.default_factory is not dataclasses.MISSING:
            items.append(f"{f.name!r}: _factory_{f.name}()")
        else:
            required.append(f.name)
    scope = {"_new": object.__new__, "_cls": cls, "_consts": consts, "_required": frozenset(required),
             **{f"_factory_{f.name}": f.default_factory for f in dataclasses.fields(cls)
                if f.default_factory is not dataclasses.MISSING}}
    src = (f"def build(**given):\n"
           f"    if not _required.issubset(given):\n"
           f"        raise TypeError('{cls.__name__}() missing ' + ', '.join(sorted(_required.difference(given))))\n"
           f"    fresh = {{{', '.join(items)}}}\n"
           f"    fresh.update(_consts)\n"
           f"    fresh.update(given)\n"
           f"    obj = _new(_cls)\n"
           f"    obj.__dict__.update(fresh)\n"
           f"    return obj\n")
    exec(compile(src, f"<quick {cls.__name__}>", "exec"), scope)
    build = scope["build"]
    build.__doc__ = f"A {cls.__name__} (its fields' defaults for those not given), for the hot path."
    return build

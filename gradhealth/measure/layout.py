"""``Layout``: named slots of one flat vector, for the single transfer and the all_reduce.

Everything a check reads back, or reduces across ranks, is packed into one vector; a layout says
where each named value lives, so packing and unpacking are by name and adding a value is one
``add`` call on both sides::

    lay = Layout().add("norms", n).add("loss", 1)
    flat = lay.pack(norms=norms_tensor, loss=loss.reshape(1))   # float64 (the all_reduce), one cat
    got = lay.unpack(flat.tolist())                              # {"norms": [...], "loss": [x]}

or, for the check's own transfer, ``lay.put(name, part)`` per slot and ``stats.joined(lay.parts)``:
the parts as they are, joined in the fewest kernels.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["Layout"]


class Layout:
    def __init__(self) -> None:
        self.slots: dict[str, tuple[int, int]] = {}  # name -> (start, size)
        self.size = 0
        self.parts: list[Tensor] = []  # what :meth:`put` was given, in order

    def add(self, name: str, size: int = 1) -> Layout:
        if name in self.slots:
            raise ValueError(f"layout slot {name!r} is defined twice")
        self.slots[name] = (self.size, int(size))
        self.size += int(size)
        return self

    def __contains__(self, name: str) -> bool:
        return name in self.slots

    def pack(self, device=None, **parts) -> Tensor:
        """One float64 tensor of every slot, in layout order. Each part is a tensor (any device,
        moved without a sync to the first one's) or a list of numbers; every slot must be given."""
        missing = [n for n in self.slots if n not in parts]
        extra = [n for n in parts if n not in self.slots]
        if missing or extra:
            raise ValueError(f"layout pack: missing slots {missing}, unknown slots {extra}")
        flat: list[Tensor] = []
        for name, (_, size) in self.slots.items():
            part = parts[name]
            if not isinstance(part, Tensor):
                part = torch.tensor(part, dtype=torch.float64)
            if device is None:
                device = part.device
            part = part.reshape(-1).to(device=device, dtype=torch.float64, non_blocking=True)
            if part.numel() != size:
                raise ValueError(f"layout slot {name!r} holds {size} values; got {part.numel()}")
            flat.append(part)
        if not flat:
            return torch.zeros(0, dtype=torch.float64, device=device)
        return flat[0] if len(flat) == 1 else torch.cat(flat)

    def put(self, name: str, part, size: int | None = None) -> None:
        """A slot and its device numbers at once: ``part`` is a tensor (0-d for one value is fine)
        or several whose values, in order, fill the slot; they are kept in ``parts`` as they are, for
        :func:`gradhealth.measure.stats.joined`, which reads them back exactly in the fewest kernels (an
        empty part adds nothing to read)."""
        several = isinstance(part, list)
        if size is None:
            size = sum(p.numel() for p in part) if several else part.numel()
        self.add(name, size)
        if several:
            self.parts += part
        elif size:
            self.parts.append(part)

    def unpack(self, values) -> dict[str, list[float]]:
        """Each slot's values (a list, or a slice of a tensor when ``values`` is one), by name."""
        if len(values) != self.size:
            raise ValueError(f"layout unpack: expected {self.size} values; got {len(values)}")
        return {name: values[start : start + size] for name, (start, size) in self.slots.items()}

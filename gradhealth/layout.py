"""``Layout``: named slots of one flat float64 vector, for the single transfer and the all_reduce.

Everything a check reads back, or reduces across ranks, is packed into one vector; a layout says
where each named value lives, so packing and unpacking are by name and adding a value is one
``add`` call on both sides::

    lay = Layout().add("norms", n).add("loss", 1)
    flat = lay.pack(norms=norms_tensor, loss=loss.reshape(1))   # device tensors, one cat
    got = lay.unpack(flat.tolist())                              # {"norms": [...], "loss": [x]}
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["Layout"]


class Layout:
    def __init__(self) -> None:
        self.slots: dict[str, tuple[int, int]] = {}  # name -> (start, size)
        self.size = 0

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

    def pieces(self, **parts) -> list[Tensor]:
        """The slots' device tensors in layout order, as they are (0-d for a one-value slot is fine):
        for :func:`gradhealth.stats.joined`, which reads them back exactly in the fewest kernels."""
        if parts.keys() != self.slots.keys():
            raise ValueError(f"layout pieces: slots {list(self.slots)}; got {list(parts)}")
        out = []
        for name, (_, size) in self.slots.items():
            part = parts[name]
            if isinstance(part, list):  # (a slot given as several tensors, in order)
                got = sum(p.numel() for p in part)
                out += part
            else:
                got = part.numel()
                if got:  # (an empty slot adds nothing to read)
                    out.append(part)
            if got != size:
                raise ValueError(f"layout slot {name!r} holds {size} values; got {got}")
        return out

    def unpack(self, values) -> dict[str, list[float]]:
        """Each slot's values (a list, or a slice of a tensor when ``values`` is one), by name."""
        if len(values) != self.size:
            raise ValueError(f"layout unpack: expected {self.size} values; got {len(values)}")
        return {name: values[start : start + size] for name, (start, size) in self.slots.items()}

import pytest
import torch

from gradhealth.measure.layout import Layout


def test_pack_and_unpack_by_name():
    lay = Layout().add("norms", 3).add("loss").add("valid", 2)
    flat = lay.pack(norms=torch.tensor([1.0, 2.0, 3.0]), loss=torch.tensor(0.5), valid=[4, 0])
    assert flat.dtype == torch.float64 and flat.tolist() == [1.0, 2.0, 3.0, 0.5, 4.0, 0.0]
    assert lay.unpack(flat.tolist()) == {"norms": [1.0, 2.0, 3.0], "loss": [0.5], "valid": [4.0, 0.0]}


def test_empty_slots_and_errors():
    lay = Layout().add("a", 0).add("b", 1)
    assert lay.unpack(lay.pack(a=[], b=[7.0]).tolist()) == {"a": [], "b": [7.0]}
    with pytest.raises(ValueError, match="missing slots"):
        lay.pack(b=[1.0])
    with pytest.raises(ValueError, match="holds 1 values; got 2"):
        lay.pack(a=[], b=[1.0, 2.0])
    with pytest.raises(ValueError, match="defined twice"):
        lay.add("a")
    with pytest.raises(ValueError, match="expected 1 values"):
        lay.unpack([1.0, 2.0])


def test_put_keeps_the_parts_and_joined_reads_them_back_exactly():
    """``put`` names a slot and keeps its device numbers as they are; ``stats.joined`` reads them in
    one stack (float32 parts: the very same numbers) or one cat (a count or float64: float64, exact)."""
    from gradhealth.measure.stats import joined

    norms = list(torch._foreach_norm([torch.randn(5), torch.randn(3, 3)], 2))
    lay = Layout()
    lay.put("norms", norms)
    lay.put("loss", torch.tensor(0.1, dtype=torch.bfloat16), 1)
    lay.put("empty", torch.zeros(0, dtype=torch.float64))
    flat = joined(lay.parts)
    assert flat.dtype == torch.float32 and len(lay.parts) == 3  # (the empty part adds nothing)
    got = lay.unpack(flat.tolist())
    assert got["norms"] == [n.item() for n in norms] and got["loss"] == [torch.tensor(0.1, dtype=torch.bfloat16).item()]
    assert got["empty"] == []
    big = torch.tensor(2**24 + 1)  # not a float32
    lay2 = Layout()
    lay2.put("norms", norms)
    lay2.put("count", big, 1)
    lay2.put("vec", torch.tensor([1e-300, 3.0], dtype=torch.float64))
    flat2 = joined(lay2.parts)
    assert flat2.dtype == torch.float64
    assert lay2.unpack(flat2.tolist()) == {"norms": [n.item() for n in norms], "count": [2.0**24 + 1], "vec": [1e-300, 3.0]}

import pytest
import torch

from gradhealth.layout import Layout


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

"""torch.save of spyre tensors, torch.load back to the CPU, and views that reinterpret a
storage's elements (what torch.save reads: a storage's bytes)."""

import io

import pytest
import torch

import spyre_rt


def test_a_saved_state_dict_loads_on_the_cpu_bit_for_bit():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(300, 128), torch.nn.Linear(128, 70)).to(torch.float16)
    on_card = torch.nn.Sequential(torch.nn.Embedding(300, 128), torch.nn.Linear(128, 70)).to(torch.float16)
    on_card.load_state_dict(model.state_dict())
    on_card.to("spyre")
    buf = io.BytesIO()
    torch.save(on_card.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf, map_location="cpu")
    for name, want in model.state_dict().items():
        assert loaded[name].device.type == "cpu" and torch.equal(loaded[name], want), name


@pytest.mark.parametrize("location", [None, "spyre", "spyre:0"])
def test_loading_onto_the_card_is_a_clear_error(location):
    buf = io.BytesIO()
    torch.save({"w": torch.randn(3, 40).to("spyre")}, buf)
    buf.seek(0)
    with pytest.raises(spyre_rt.SpyreError, match="map_location='cpu'"):
        torch.load(buf, map_location=location)


@pytest.mark.parametrize("dtype,as_dtype", [(torch.float32, torch.uint8), (torch.float32, torch.float16),
                                            (torch.float16, torch.uint8), (torch.int64, torch.int32)])
def test_views_of_other_sized_elements_read_and_write_the_storages_bits(dtype, as_dtype):
    x = (torch.randn(7, 70) * 100).to(dtype)
    d = x.to("spyre")
    assert bytes(d.view(as_dtype).cpu().untyped_storage()) == bytes(x.untyped_storage())
    v, w = d.view(as_dtype), x.view(as_dtype)
    v[2, 3:9] = 5
    w[2, 3:9] = 5
    v[:, -1] = 0
    w[:, -1] = 0
    assert bytes(d.untyped_storage().cpu()) == bytes(x.untyped_storage())

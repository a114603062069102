"""The spyre device as PyTorch sees it: registration, the device module, tensors, views."""

import subprocess
import sys

import pytest
import torch

import spyre_rt
from spyre_rt.errors import SpyreError


def test_import_torch_alone_registers_the_device():
    """The torch.backends entry point registers spyre during `import torch`."""
    code = "import torch; t = torch.ones(2, device='spyre'); print(t.device, t.cpu().tolist())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "spyre:0 [1.0, 1.0]"


def test_device_module_is_shaped_like_cuda():
    assert torch.spyre.is_available()
    assert torch.spyre.device_count() == 1
    assert torch.spyre.current_device() == 0
    props = torch.spyre.get_device_properties(0)
    assert props.num_cores == 32
    assert props.scratchpad_bytes == 2 << 20
    assert props.total_memory == 128 << 30
    assert props.name == "spyre-sim"
    torch.spyre.synchronize()
    with torch.spyre.device(0):
        assert torch.spyre.current_device() == 0
    stats = torch.spyre.memory_stats()
    assert "memory.allocated" in stats and "runtime.native_calls" in stats


def test_a_card_that_does_not_exist_is_a_clear_error():
    with pytest.raises(SpyreError, match="spyre:3 does not exist.*1 card"):
        torch.empty(2, device="spyre:3")


def test_tensors_are_plain_torch_tensors_on_spyre():
    t = torch.zeros(4, 5, device="spyre")
    assert type(t) is torch.Tensor and t.device == torch.device("spyre:0") and t.is_spyre
    assert t.untyped_storage().nbytes() == 4 * 5 * 4
    assert (t.cpu() == 0).all()
    assert torch.ones(3, device="spyre", dtype=torch.float16).cpu().tolist() == [1, 1, 1]
    assert torch.full((2, 2), 3.5, device="spyre").cpu().tolist() == [[3.5, 3.5], [3.5, 3.5]]
    assert torch.arange(6, device="spyre").cpu().tolist() == list(range(6))
    assert torch.empty(0, device="spyre").numel() == 0


def test_views_share_storage_and_offsets():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    t = base.to("spyre")
    views = {
        "slice": lambda x: x[1:3, 2:5],
        "transpose": lambda x: x.t(),
        "select": lambda x: x[2],
        "expand": lambda x: x[:, :1].expand(4, 3),
        "view": lambda x: x.view(6, 4),
        "permute": lambda x: x.reshape(2, 2, 6).permute(2, 0, 1),
        "narrow": lambda x: x.narrow(1, 1, 3),
        "unsqueeze": lambda x: x.unsqueeze(0),
        "as_strided": lambda x: x.as_strided((3, 2), (5, 2), 1),
    }
    for name, f in views.items():
        v = f(t)
        assert v.untyped_storage().data_ptr() == t.untyped_storage().data_ptr(), name
        assert torch.equal(v.cpu(), f(base)), name
    parts = t.split(2)
    assert all(p.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() for p in parts)
    assert [p.cpu().tolist() for p in t.chunk(2, dim=1)] == [p.tolist() for p in base.chunk(2, dim=1)]
    assert [u.cpu().tolist() for u in t.unbind(0)] == [u.tolist() for u in base.unbind(0)]


def test_copy_in_every_direction():
    a = torch.randn(5, 7)
    d = torch.empty(5, 7, device="spyre")
    d.copy_(a)                                   # host -> device
    e = torch.empty(7, 5, device="spyre").t()
    e.copy_(d)                                   # device -> device, into a transposed view
    h = torch.empty(5, 7)
    h.copy_(e)                                   # device -> host
    assert torch.equal(h, a)
    d[1:3].copy_(torch.zeros(2, 7))              # into a slice
    assert torch.equal(d.cpu()[1:3], torch.zeros(2, 7)) and torch.equal(d.cpu()[3:], a[3:])
    d.copy_(torch.arange(7))                     # broadcasting and dtype conversion
    assert torch.equal(d.cpu(), torch.arange(7, dtype=torch.float32).expand(5, 7))


def test_model_to_spyre_and_to_empty():
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16))
    m.register_buffer("scale", torch.tensor(2.0))
    x = torch.randn(3, 8)
    ref = m(x)
    ms = m.to("spyre")
    assert all(p.device.type == "spyre" for p in ms.parameters())
    assert ms.scale.device.type == "spyre"
    with pytest.warns(spyre_rt.SpyreFallbackWarning):
        out = ms(x.to("spyre"))
    assert torch.allclose(out.cpu(), ref, atol=1e-6)
    with torch.device("meta"):
        meta = torch.nn.Linear(4, 4)
    empty = meta.to_empty(device="spyre")
    assert empty.weight.device.type == "spyre" and empty.weight.shape == (4, 4)


def test_a_device_context_still_places_the_tensors_made_from_data():
    """torch.tensor, torch.as_tensor and torch.asarray (which the card wraps to give
    "spyre" the current card's index) still take the device of a device context: Hugging
    Face builds a checkpoint's model on the meta device and tells it so by asking
    torch.tensor([]).device; a wrong answer left its rotary buffers uninitialised."""
    with torch.device("meta"):
        made = (torch.tensor([]), torch.as_tensor([1.0]), torch.asarray([1.0]), torch.tensor(2.0, device="cpu"))
    assert [t.device.type for t in made] == ["meta", "meta", "meta", "cpu"]
    assert torch.tensor([1.0]).device.type == "cpu"  # and none outside it


def test_a_checkpoint_loaded_with_the_card_registered_has_its_rotary_buffers(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    want = transformers.LlamaForCausalLM(cfg).model.rotary_emb.inv_freq
    assert torch.equal(loaded.model.rotary_emb.inv_freq, want)


def test_item_and_printing():
    t = torch.tensor([[1.5, 2.5]]).to("spyre")
    assert t[0, 1].item() == 2.5
    assert repr(t) == "tensor([[1.5000, 2.5000]], device='spyre:0')"


def test_unsupported_dtype_is_a_clear_error():
    with pytest.raises(TypeError, match="spyre tensors cannot hold torch.complex64"):
        torch.zeros(2, dtype=torch.complex64, device="spyre")


def test_float64_tensors_are_stored_exactly_and_computed_on_the_cpu():
    """The card stores float64 (the bytes round-trip) but has no fp64 arithmetic: eager ops
    on it run on the CPU, as any op without a card kernel does."""
    x = torch.randn(3, 70, dtype=torch.float64)
    d = x.to("spyre")
    assert d.dtype == torch.float64 and torch.equal(d.cpu(), x)
    spyre_rt.fallback.forget_warnings("aten::mul")  # each op warns once per process
    with pytest.warns(spyre_rt.SpyreFallbackWarning):
        torch.testing.assert_close((d * 2).cpu(), x * 2, rtol=0, atol=0)


def test_a_scripted_function_calling_torch_tensor_scripts_and_runs():
    """TorchScript finds torch.tensor (wrapped for the current card) as the aten op: Hugging
    Face's DeBERTa-v2 scripts such a function when its module is imported."""

    def sign_times(x: torch.Tensor) -> torch.Tensor:
        return x * torch.tensor(-1.0) + torch.as_tensor(2.0)

    scripted = torch.jit.script(sign_times)
    assert torch.equal(scripted(torch.ones(3)), torch.full((3,), 1.0))

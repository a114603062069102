"""The native layout records, batched allocation and batched DLPack wraps, through the
Python binding: what a compiled step needs to allocate and wrap all its outputs in one
native call (spy_malloc_layout, spy_layout_of, spy_malloc_many, spy_dlpack_wrap_many,
spy_dlpack_new_many)."""

import ctypes
import random

import pytest
import torch

import spyre_rt  # noqa: F401 - registers the spyre device for the DLPack imports
from spyre_rt import device_profile
from spyre_rt.layout import StickLayout
from spyre_rt.native import ffi, lib

STICK = 128
KDL_EXT_DEV = 12  # DLPack's device type of the spyre tensors

_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


@pytest.fixture
def device():
    native = ffi.new("spy_profile *")
    for field, value in device_profile.load("spyre").native_fields().items():
        setattr(native, field, value)
    native.dram_bytes = 1 << 20
    out = ffi.new("spy_device **")
    assert lib.spy_device_open(native, lib.SPY_MODE_FUNCTIONAL, 0, out) == lib.SPY_OK
    yield out[0]
    lib.spy_device_close(out[0])


def _layout(rows, row_len, itemsize, stick=STICK):
    return ffi.new("spy_layout *", {"rows": rows, "row_len": row_len, "itemsize": itemsize, "stick_bytes": stick})


def _stats(dev):
    st = ffi.new("spy_mem_stats *")
    assert lib.spy_mem_stats_get(dev, st) == lib.SPY_OK
    return st


def _error() -> str:
    return ffi.string(lib.spy_last_error()).decode()


def test_layout_size_is_the_python_layouts_size():
    rng = random.Random(7)
    nbytes = ffi.new("uint64_t *")
    for _ in range(500):
        py = StickLayout(rng.choice([0, 1, 3, 64, 1000]), rng.randint(1, 700), rng.choice([1, 2, 4, 8]))
        assert lib.spy_layout_bytes(_layout(*py), nbytes) == lib.SPY_OK
        assert nbytes[0] == py.nbytes, py


def test_layout_is_recorded_with_the_allocation_and_goes_with_it(device):
    layout, addr, got = _layout(1024, 256, 2), ffi.new("uint64_t *"), ffi.new("spy_layout *")
    assert lib.spy_malloc_layout(device, 4 * 1024 * 128, lib.SPY_MEM_DATA, layout, addr) == lib.SPY_OK
    assert lib.spy_layout_of(device, addr[0], got) == lib.SPY_OK
    assert (got.rows, got.row_len, got.itemsize, got.stick_bytes) == (1024, 256, 2, STICK)
    assert lib.spy_free(device, addr[0]) == lib.SPY_OK
    assert lib.spy_layout_of(device, addr[0], got) == lib.SPY_E_BAD_ADDRESS
    assert lib.spy_malloc_layout(device, 100, lib.SPY_MEM_DATA, layout, addr) == lib.SPY_E_INVALID_ARG
    assert "does not fit" in _error()


def test_malloc_many_is_all_or_nothing(device):
    addrs = ffi.new("uint64_t[3]")
    layouts = ffi.new("spy_layout[3]", [(3, 65, 2, STICK), (0, 1, 4, STICK), (2, 64, 4, STICK)])
    assert lib.spy_malloc_many(device, 3, ffi.NULL, layouts, addrs) == lib.SPY_OK
    assert len(set(addrs)) == 3 and _stats(device).num_allocs == 3
    for a in addrs:
        assert lib.spy_free(device, a) == lib.SPY_OK
    before = _stats(device)
    sizes = ffi.new("uint64_t[3]", [256 << 10, 256 << 10, 2 << 20])
    assert lib.spy_malloc_many(device, 3, sizes, ffi.NULL, addrs) == lib.SPY_E_OOM
    assert "allocation 2 of 3" in _error()
    after = _stats(device)
    assert (after.num_allocs, after.allocated, after.total_allocs) == (before.num_allocs, before.allocated,
                                                                       before.total_allocs)


def _tensor_descs(shapes):
    keep, descs = [], ffi.new("spy_dlpack_tensor[]", len(shapes))
    for d, (shape, code, bits) in zip(descs, shapes, strict=True):
        strides = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            strides[i] = strides[i + 1] * shape[i + 1]
        s, t = ffi.new("int64_t[]", shape or [0]), ffi.new("int64_t[]", strides or [0])
        keep += [s, t]
        d.shape, d.strides, d.ndim, d.code, d.bits = s, t, len(shape), code, bits
    return descs, keep


def _to_torch(managed):
    capsule = _capsule_new(int(ffi.cast("uintptr_t", managed)), b"dltensor", None)
    return torch._C._from_dlpack(capsule)


def test_step_outputs_in_one_call_become_tensors_whose_deleter_frees_allocation_and_layout(device):
    descs, _keep = _tensor_descs([((3, 65), 2, 16), ((4,), 2, 32)])
    layouts = ffi.new("spy_layout[2]", [(3, 65, 2, STICK), (1, 4, 4, STICK)])
    addrs, out = ffi.new("uint64_t[2]"), ffi.new("void *[2]")
    calls = ffi.new("spy_counters *")
    lib.spy_counters_reset(device)
    assert lib.spy_dlpack_new_many(device, 2, layouts, descs, KDL_EXT_DEV, addrs, out) == lib.SPY_OK
    lib.spy_counters_get(device, calls)
    assert calls.native_calls == 1
    tensors = [_to_torch(m) for m in out]
    assert tensors[0].shape == (3, 65) and tensors[0].dtype == torch.float16 and tensors[0].device.type == "spyre"
    assert tensors[1].shape == (4,) and tensors[1].dtype == torch.float32
    assert [t.untyped_storage().data_ptr() for t in tensors] == list(addrs)
    assert lib.spy_dlpack_live(device) == 2
    got = ffi.new("spy_layout *")
    assert lib.spy_layout_of(device, addrs[0], got) == lib.SPY_OK and got.row_len == 65
    del tensors
    assert lib.spy_dlpack_live(device) == 0 and _stats(device).num_allocs == 0
    assert lib.spy_layout_of(device, addrs[0], got) == lib.SPY_E_BAD_ADDRESS


def test_wrap_many_is_all_or_nothing(device):
    descs, _keep = _tensor_descs([((8,), 2, 16), ((8,), 2, 16)])
    sizes, addrs, out = ffi.new("uint64_t[2]", [128, 128]), ffi.new("uint64_t[2]"), ffi.new("void *[2]")
    assert lib.spy_malloc_many(device, 2, sizes, ffi.NULL, addrs) == lib.SPY_OK
    wrong = ffi.new("uint64_t[2]", [addrs[0], addrs[1] + 128])
    assert lib.spy_dlpack_wrap_many(device, 2, wrong, descs, KDL_EXT_DEV, out) == lib.SPY_E_BAD_ADDRESS
    assert lib.spy_dlpack_live(device) == 0 and _stats(device).num_allocs == 2
    assert lib.spy_dlpack_wrap_many(device, 2, addrs, descs, KDL_EXT_DEV, out) == lib.SPY_OK
    for m in out:
        lib.spy_dlpack_release(m)
    assert _stats(device).num_allocs == 0

"""Every extern kernel Inductor can emit, and its fallback ops, through a compiled one-liner
on the card against CPU eager: each runs on the card (our own kernels) or on the CPU inside
the compiled step; none fails to compile, and each case says where it runs.

The lists are Inductor's own: the extern kernels it chooses between (``ExternKernelChoice``)
and the ops it lowers to fallback kernels (``lowering.fallbacks``), so a torch upgrade that
adds one fails this test until it is given a case or a reason. Cases marked dynamic compile
with symbolic sizes (``dynamic=True`` and ``mark_dynamic``), so that SymInt arguments
(``topk``'s k, ``roll``'s shift, a convolution's batch) reach the CPU ops.
"""

from __future__ import annotations

import functools
import json
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from spyre_rt import card as cards
from spyre_rt import fallback
from spyre_rt.dispatch import dispatch_mode


@dataclass(frozen=True)
class Case:
    fn: Callable
    makers: tuple[Callable, ...]   # each makes an input from a generator
    cpu: frozenset[str]            # the ops that run on the CPU inside the step (empty: all on the card)
    dynamic: bool = False          # compiled with symbolic sizes, called at two sizes
    close: float = 1e-4            # rtol = atol against CPU eager
    ref: Callable | None = None    # what CPU eager computes it as, when CPU eager has no kernel for the op


def case(fn, *makers, cpu=(), dynamic=False, close=1e-4, ref=None) -> Case:
    return Case(fn, makers, frozenset(cpu), dynamic, close, ref)


def rows(n=5, cols=70):
    return lambda g: torch.randn(n, cols, generator=g)


def square(n=6):
    """A well-conditioned symmetric positive definite matrix."""
    def make(g):
        a = torch.randn(n, n, generator=g)
        return a @ a.t() + n * torch.eye(n)
    return make


def ints(lo, hi, *shape, dtype=torch.int64):
    return lambda g: torch.randint(lo, hi, shape, generator=g, dtype=dtype)


def positive(*shape):
    return lambda g: torch.rand(*shape, generator=g) + 0.5


def const(t):
    return lambda g: t.clone()


def aten(name: str) -> str:
    return f"aten.{name}"


CASES: dict[str, Case] = {
    # ---- Inductor's extern kernels (ExternKernelChoice) ----------------------------------
    "mm": case(lambda a, b: a @ b, rows(33, 70), rows(70, 40)),
    "bmm": case(torch.bmm, lambda g: torch.randn(3, 9, 70, generator=g), lambda g: torch.randn(3, 70, 20, generator=g)),
    "addmm": case(lambda c, a, b: torch.addmm(c, a, b), rows(1, 40), rows(33, 70), rows(70, 40)),
    "baddbmm": case(lambda c, a, b: torch.baddbmm(c, a, b, alpha=0.5), lambda g: torch.randn(3, 9, 20, generator=g),
                    lambda g: torch.randn(3, 9, 70, generator=g), lambda g: torch.randn(3, 70, 20, generator=g)),
    "_mm_plus_mm": case(lambda a, b, c, d: a @ b + c @ d, rows(16, 64), rows(64, 32), rows(16, 64), rows(64, 32)),
    "mm_dtype": case(lambda a, b: torch.mm(a, b, out_dtype=torch.float32), lambda g: torch.randn(8, 64, generator=g).half(),
                     lambda g: torch.randn(64, 16, generator=g).half(), ref=lambda a, b: a.float() @ b.float()),
    "mm_dtype_int8": case(lambda a, b: torch.mm(a, b, out_dtype=torch.int8), ints(-3, 3, 8, 64, dtype=torch.int8),
                          ints(-3, 3, 64, 16, dtype=torch.int8), ref=lambda a, b: a @ b, cpu=[aten("mm.default")]),
    "bmm_dtype": case(lambda a, b: torch.bmm(a, b, out_dtype=torch.float32),
                      lambda g: torch.randn(2, 8, 64, generator=g).half(), lambda g: torch.randn(2, 64, 16, generator=g).half(),
                      ref=lambda a, b: a.float() @ b.float()),
    "_int_mm": case(torch._int_mm, ints(-8, 8, 32, 64, dtype=torch.int8), ints(-8, 8, 64, 32, dtype=torch.int8),
                    cpu=[aten("_int_mm.out")]),
    "_weight_int8pack_mm": case(torch._weight_int8pack_mm, rows(8, 64), ints(-8, 8, 16, 64, dtype=torch.int8),
                                positive(16), cpu=[aten("_weight_int8pack_mm.default")]),
    "_grouped_mm": case(lambda a, b, offs: torch._grouped_mm(a, b, offs),
                        lambda g: torch.randn(32, 16, generator=g).bfloat16(),
                        lambda g: torch.randn(2, 16, 8, generator=g).bfloat16(),
                        const(torch.tensor([16, 32], dtype=torch.int32)), close=1e-2),  # on the card: compiler/inductor/grouped.py
    "convolution": case(lambda x, w: F.conv2d(x, w, padding=1, stride=(1, 2)), lambda g: torch.randn(2, 3, 9, 10, generator=g),
                        lambda g: torch.randn(4, 3, 3, 3, generator=g), cpu=[aten("convolution.default")]),
    "convolution_1x1": case(lambda x, w, b: F.conv2d(x, w, b), lambda g: torch.randn(2, 3, 8, 8, generator=g),
                            lambda g: torch.randn(5, 3, 1, 1, generator=g), lambda g: torch.randn(5, generator=g),
                            cpu=[aten("convolution.default")]),
    "conv_transpose": case(lambda x, w: F.conv_transpose1d(x, w, stride=2), lambda g: torch.randn(2, 3, 9, generator=g),
                           lambda g: torch.randn(3, 4, 3, generator=g), cpu=[aten("convolution.default")]),
    # attention: the card's kernel, or the CPU's own variant called by name
    "sdpa": case(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                 *(lambda g: torch.randn(1, 2, 16, 64, generator=g),) * 3),
    "_scaled_dot_product_flash_attention_for_cpu": case(
        lambda q, k, v: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=True)[0],
        *(lambda g: torch.randn(1, 2, 16, 64, generator=g),) * 3,
        cpu=[aten("_scaled_dot_product_flash_attention_for_cpu.default")]),
    # ---- ops Inductor lowers to fallback kernels ---------------------------------------------
    "cumsum": case(lambda x: x.cumsum(1), rows()),  # short rows on the card: compiler/inductor/ranking.py
    "cumprod": case(lambda x: x.cumprod(1), lambda g: torch.rand(5, 20, generator=g) + 0.5, cpu=[aten("cumprod.default")]),
    "cummax": case(lambda x: x.cummax(1)[0] + x.cummax(1)[1], rows(), cpu=[aten("cummax.default")]),
    "cummin": case(lambda x: x.cummin(0).values, rows(), cpu=[aten("cummin.default")]),
    "logcumsumexp": case(lambda x: x.logcumsumexp(1), rows(), cpu=[aten("logcumsumexp.default")]),
    "_cdist_forward": case(torch.cdist, rows(6, 8), rows(7, 8), cpu=[aten("_cdist_forward.default")]),
    "_pdist_forward": case(F.pdist, rows(6, 8), cpu=[aten("_pdist_forward.default")]),
    "_embedding_bag": case(lambda ids, table, offs: F.embedding_bag(ids, table, offs, mode="max"),
                           ints(0, 10, 7), rows(10, 64), const(torch.tensor([0, 3])),
                           cpu=[aten("_embedding_bag_forward_only.default")]),
    "_trilinear": case(lambda a, b, w: F.bilinear(a, b, w), rows(4, 6), rows(4, 5), lambda g: torch.randn(3, 6, 5, generator=g),
                       cpu=[aten("_trilinear.default")]),
    "addbmm": case(torch.addbmm, rows(8, 16), lambda g: torch.randn(3, 8, 64, generator=g),
                   lambda g: torch.randn(3, 64, 16, generator=g), cpu=[aten("addbmm.default")]),
    "angle": case(lambda x: torch.angle(x) + 1, rows()),
    "gcd": case(torch.gcd, ints(1, 100, 5, 70), ints(1, 100, 5, 70), cpu=[aten("gcd.default")]),
    "histc": case(lambda x: torch.histc(x, bins=7, min=-2, max=2), rows(), cpu=[aten("histc.default")]),
    "histogram": case(lambda x: torch.histogram(x, bins=5, range=(-2.0, 2.0))[0], rows(),
                      cpu=[aten("histogram.bin_ct")]),
    "histogramdd": case(lambda x: torch.histogramdd(x, bins=[3, 4], range=[-2.0, 2.0, -2.0, 2.0])[0], rows(20, 2),
                        cpu=[aten("_histogramdd_from_bin_cts.default")]),  # the edges of a fixed range are constants
    "index_reduce": case(lambda x, idx, src: x.index_reduce(0, idx, src, "amax"), rows(6, 70), const(torch.tensor([0, 2, 2, 5])),
                         rows(4, 70), cpu=[aten("index_reduce.default")]),
    "masked_scatter": case(lambda x, src: x.masked_scatter(x > 0, src), rows(), rows(), cpu=[aten("masked_scatter.default")]),
    "nanmedian": case(lambda x: torch.nanmedian(x, 1).values, rows(), cpu=[aten("nanmedian.dim")]),
    "_adaptive_avg_pool3d": case(lambda x: F.adaptive_avg_pool3d(x, (2, 3, 2)), lambda g: torch.randn(1, 2, 5, 7, 6, generator=g),
                                 cpu=[aten("_adaptive_avg_pool3d.default")]),
    "adaptive_max_pool3d": case(lambda x: F.adaptive_max_pool3d(x, (2, 3, 2)), lambda g: torch.randn(1, 2, 5, 7, 6, generator=g),
                                cpu=[aten("adaptive_max_pool3d.default")]),
    "_addmm_activation": case(lambda c, a, b: torch._addmm_activation(c, a, b, use_gelu=True), rows(1, 16), rows(8, 64),
                              rows(64, 16), cpu=[aten("_addmm_activation.default")]),
    "_fused_rms_norm": case(lambda x, w: F.rms_norm(x, (70,), w, 1e-6), rows(), lambda g: torch.randn(70, generator=g)),
    "segment_reduce": case(lambda x, lengths: torch.segment_reduce(x, "sum", lengths=lengths), rows(6, 70),
                           const(torch.tensor([2, 0, 4])), cpu=[aten("segment_reduce.default")]),
    "_amp_update_scale_": case(lambda scale, tracker, found: torch._amp_update_scale_(scale, tracker, found, 2.0, 0.5, 1)
                               + tracker, const(torch.tensor([4.0])), const(torch.tensor([0], dtype=torch.int32)),
                               const(torch.tensor([0.0])), cpu=[aten("_amp_update_scale.default")]),
    "rand_like": case(lambda x: (torch.rand_like(x) < 1).float() * x, rows(), cpu=[aten("rand.default")]),
    "bernoulli_": case(lambda x: x.bernoulli_(1.0) * 2, rows(), cpu=[aten("rand.default")]),  # rand < p; p = 1: ones
    "randperm": case(lambda x: torch.randperm(70, device=x.device).sort().values * x, rows(1, 70),
                     cpu=[aten("randperm.default")]),
    # linear algebra: small well-conditioned matrices
    "linalg_det": case(torch.linalg.det, square(), cpu=[aten("_linalg_det.default")]),
    "linalg_slogdet": case(lambda a: torch.linalg.slogdet(a)[1], square(), cpu=[aten("_linalg_slogdet.default")]),
    "linalg_eigh": case(lambda a: torch.linalg.eigvalsh(a), square(), cpu=[aten("_linalg_eigh.default")]),
    "linalg_solve": case(torch.linalg.solve, square(), rows(6, 3),
                         cpu=[aten("_linalg_solve_ex.default"), aten("_linalg_check_errors.default")]),
    "linalg_svd": case(lambda a: torch.linalg.svdvals(a), square(), cpu=[aten("_linalg_svd.default")]),
    "linalg_cholesky": case(torch.linalg.cholesky, square(),
                            cpu=[aten("linalg_cholesky_ex.default"), aten("_linalg_check_errors.default")]),
    "linalg_inv": case(torch.linalg.inv, square(),
                       cpu=[aten("linalg_inv_ex.default"), aten("_linalg_check_errors.default")]),
    "linalg_qr": case(lambda a: torch.linalg.qr(a)[1].abs(), square(), cpu=[aten("linalg_qr.default")]),
    "linalg_lu": case(lambda a: torch.linalg.lu(a)[2], square(), cpu=[aten("linalg_lu.default")]),
    "lu_unpack": case(lambda a: torch.lu_unpack(*torch.linalg.lu_factor(a))[2], square(),
                      cpu=[aten("linalg_lu_factor_ex.default"), aten("_linalg_check_errors.default"),
                           aten("lu_unpack.default")]),
    "linalg_lu_solve": case(lambda a, b: torch.linalg.lu_solve(*torch.linalg.lu_factor(a), b), square(), rows(6, 2),
                            cpu=[aten("linalg_lu_factor_ex.default"), aten("_linalg_check_errors.default"),
                                 aten("linalg_lu_solve.default")]),
    "linalg_solve_triangular": case(lambda a, b: torch.linalg.solve_triangular(a.tril(), b, upper=False), square(), rows(6, 2),
                                    cpu=[aten("linalg_solve_triangular.default")]),
    "triangular_solve": case(lambda b, a: torch.triangular_solve(b, a.triu())[0], rows(6, 2), square(),
                             cpu=[aten("triangular_solve.default")]),
    "cholesky_solve": case(lambda b, a: torch.cholesky_solve(b, torch.linalg.cholesky(a)), rows(6, 2), square(),
                           cpu=[aten("linalg_cholesky_ex.default"), aten("_linalg_check_errors.default"),
                                aten("cholesky_solve.default")]),
    "cholesky_inverse": case(lambda a: torch.cholesky_inverse(torch.linalg.cholesky(a)), square(),
                             cpu=[aten("linalg_cholesky_ex.default"), aten("_linalg_check_errors.default"),
                                  aten("cholesky_inverse.default")]),
    "geqrf_householder": case(lambda a: torch.linalg.householder_product(*torch.geqrf(a)).abs(), square(),
                              cpu=[aten("geqrf.default"), aten("linalg_householder_product.default")]),
    "ormqr": case(lambda a, c: torch.ormqr(*torch.geqrf(a), c).abs(), square(), rows(6, 3),
                  cpu=[aten("geqrf.default"), aten("ormqr.default")]),
    "linalg_ldl": case(lambda a, b: torch.linalg.ldl_solve(*torch.linalg.ldl_factor(a), b), square(), rows(6, 2),
                       cpu=[aten("linalg_ldl_factor_ex.default"), aten("_linalg_check_errors.default"),
                            aten("linalg_ldl_solve.default")]),
    "linalg_matrix_exp": case(lambda a: torch.linalg.matrix_exp(a / 10), square(), cpu=[aten("linalg_matrix_exp.default")]),
    "linalg_pinv": case(lambda a: torch.linalg.pinv(a, atol=torch.tensor(0.0, device=a.device)), square(),
                        cpu=[aten("linalg_pinv.atol_rtol_tensor")]),
    # ---- symbolic sizes: SymInt arguments of CPU ops -------------------------------------------
    "dynamic:topk": case(lambda x: torch.topk(x, x.shape[0] // 2 + 1, 0).values * 2, rows(9, 70),
                         dynamic=True),  # k a SymInt: the card's top-k of short rows
    "dynamic:roll": case(lambda x: torch.roll(x, x.shape[0] // 2, 0) + 1, rows(9, 70), cpu=[aten("roll.default")],
                         dynamic=True),
    "dynamic:kthvalue": case(lambda x: torch.kthvalue(x, x.shape[0] // 3 + 1, 0).values, rows(9, 70),
                             cpu=[aten("kthvalue.default")], dynamic=True),
    "dynamic:convolution": case(lambda x, w: F.conv1d(x, w, padding=1), lambda g: torch.randn(9, 2, 70, generator=g),
                                lambda g: torch.randn(3, 2, 3, generator=g), cpu=[aten("convolution.default")],
                                dynamic=True),
    "dynamic:cumsum": case(lambda x: x.cumsum(0)[: x.shape[0] - 1], rows(9, 70), dynamic=True),
    "dynamic:new_zeros_index_put": case(
        lambda x, idx: x.new_zeros(x.shape[0], 70).index_put_((idx,), x, accumulate=True), rows(9, 70),
        ints(0, 3, 9), cpu=[aten("index_put_.default")], dynamic=True),
    "dynamic:_int_mm": case(torch._int_mm, ints(-8, 8, 32, 64, dtype=torch.int8), ints(-8, 8, 64, 32, dtype=torch.int8),
                            cpu=[aten("_int_mm.out")], dynamic=True),
}

# Extern kernels and fallback ops without a case, and why. Each is reached only by what a
# test of the card cannot make: another device's kernels, autograd, dtypes spyre tensors do
# not hold, output sizes that depend on values (Dynamo breaks the graph there and eager runs
# the op), random numbers (no eager value to compare against), Inductor's own bookkeeping.
NO_CASE = {
    # extern kernels Inductor chooses for other devices or other graphs
    "bias_addmm": "a CUDA addmm variant (the addmm case takes Inductor's aten addmm)",
    "conv1x1_via_mm": "chosen for convolutions of CPU-device graphs only (convolution_1x1 is this shape on the card)",
    "call_aten_dw": "a convolution backward kernel (autograd graphs)",
    "call_aten_dx": "a convolution backward kernel (autograd graphs)",
    "_sparse_semi_structured_mm": "sparse tensors",
    "_scaled_grouped_mm": "fp8 grouped matmul: fp8 dtypes, which spyre tensors do not hold",
    "_scaled_mm": "fp8 matmul: fp8 dtypes, which spyre tensors do not hold",
    "_linear_pointwise": "mkldnn: CPU-device graphs with weights packed at freezing",
    "_linear_pointwise.binary": "mkldnn: CPU-device graphs with weights packed at freezing",
    "_mkl_linear": "mkldnn: CPU-device graphs with weights packed at freezing",
    "qlinear_pointwise": "mkldnn quantized linear: CPU-device graphs",
    "qlinear_pointwise.binary": "mkldnn quantized linear: CPU-device graphs",
    "int4mm_packed_weight_cpu": "CPU-device int4 weights packed at freezing",
    # fallback ops
    "_amp_update_scale": "the functional form of _amp_update_scale_ (its case)",
    "_efficientzerotensor": "ZeroTensor, an autograd construct",
    "_embedding_bag_forward_only": "what the _embedding_bag case runs (inference)",
    "_cudnn_rnn": "CUDA kernels only", "miopen_rnn": "ROCm kernels only", "_thnn_fused_lstm_cell": "CUDA kernels only",
    "_flash_attention_forward": "CUDA kernels only", "_efficient_attention_forward": "CUDA kernels only",
    "_scaled_dot_product_flash_attention": "CUDA kernels only (the CPU's variant has its case)",
    "_scaled_dot_product_efficient_attention": "CUDA kernels only", "_scaled_dot_product_cudnn_attention": "cuDNN only",
    "_scaled_dot_product_fused_attention_overrideable": "a device's own attention (none on the CPU)",
    "_scaled_dot_product_attention_math_for_mps": "MPS only",
    "_dyn_quant_matmul_4bit": "KleidiAI int4 kernels", "_dyn_quant_pack_4bit_weight": "KleidiAI int4 kernels",
    "_fused_moving_avg_obs_fq_helper": "quantization-aware training observers",
    "_fused_moving_avg_obs_fq_helper_functional": "quantization-aware training observers",
    "wrapped_fbgemm_linear_fp16_weight": "FBGEMM packed weights", "wrapped_fbgemm_pack_gemm_matrix_fp16": "FBGEMM",
    "max_pool2d": "quantized (quint8) tensors, which spyre tensors do not hold",
    "view_as_complex": "complex dtypes, which spyre tensors do not hold (a compile error: test_bad_input.py)",
    "_fft_r2c": "complex results, which spyre tensors do not hold",
    "to_sparse": "sparse tensors", "_to_sparse": "sparse tensors", "_sparse_coo_tensor_with_dims_and_tensors": "sparse",
    "resize_": "storage resizing (FSDP graphs)", "resize_as_": "storage resizing",
    "bincount": "its output size depends on values: Dynamo breaks the graph",
    "nonzero": "its output size depends on values: Dynamo breaks the graph",
    "repeat_interleave": "with a tensor of repeats its output size depends on values",
    "_unique2": "its output size depends on values", "unique_consecutive": "its output size depends on values",
    "unique_dim": "its output size depends on values", "unique_dim_consecutive": "its output size depends on values",
    "multinomial": "random numbers", "exponential": "random numbers", "uniform": "random numbers",
    "rand": "random numbers (rand_like has a case)", "randn": "random numbers", "randint": "random numbers",
    "randint_like": "random numbers", "randn_like": "random numbers", "rrelu_with_noise_functional": "random numbers",
    "inductor_rand_eager_offset": "random numbers", "inductor_rand_eager_offsets": "random numbers",
    "run_with_rng_state": "an RNG wrapper of activation checkpointing (autograd)",
    "run_and_save_rng_state": "an RNG wrapper of activation checkpointing (autograd)",
    "graphsafe_run_with_rng_state": "an RNG wrapper of CUDA graphs", "run_dtensor_rng_op": "DTensor RNG",
    "auto_functionalized": "functionalization's wrapper of a mutating custom op, removed before lowering "
                          "(custom ops with mutates_args: tests/test_cpu_ops.py)",
    "record_event": "CUDA streams", "synchronize_device": "CUDA streams", "synchronize_event": "CUDA streams",
    "wait_event": "CUDA streams",
    "_linalg_check_errors": "the check linalg ops make of their info results (the linalg_inv case runs it)",
    "linalg_lu_factor_ex": "lu_unpack's and linalg_lu_solve's cases", "geqrf": "the geqrf_householder case",
    "linalg_householder_product": "the geqrf_householder case", "linalg_ldl_factor_ex": "the linalg_ldl case",
    "linalg_ldl_solve": "the linalg_ldl case", "linalg_cholesky_ex": "the linalg_cholesky case",
    "linalg_inv_ex": "the linalg_inv case", "_linalg_det": "the linalg_det case", "_linalg_slogdet": "the linalg_slogdet case",
    "_linalg_eigh": "the linalg_eigh case", "_linalg_solve_ex": "the linalg_solve case", "_linalg_svd": "the linalg_svd case",
    "_histogramdd_bin_edges": "the histogramdd case", "_histogramdd_from_bin_cts": "the histogramdd case",
}
# pointwise ops Inductor falls back for: swept per element by tests/test_op_sweep.py
POINTWISE = re.compile(r"^(special_\w+|digamma|polygamma|igamma|igammac|angle)$")
BACKWARD = re.compile(r"_backward$")  # autograd graphs' ops (tests/test_autograd.py runs one)


# What Inductor names when its modules are imported, read in a fresh interpreter: compiles
# in this process add to both lists (an op without a lowering becomes a fallback at its
# first compile, custom-op autotuning registers extern kernels).
_INDUCTOR_LISTS = """
import json
import torch
import torch._inductor.kernel, torch._inductor.kernel.mm_grouped, torch._inductor.mkldnn_lowerings
import torch._inductor.quantized_lowerings
from torch._inductor import lowering, select_algorithm
fallbacks = {str(getattr(op, "_opname", None) or getattr(op, "__name__", op)).split(".")[0] for op in lowering.fallbacks}
print(json.dumps({"extern": sorted(select_algorithm.ExternKernelChoice._registry), "fallback": sorted(fallbacks)}))
"""


@functools.cache
def _inductor_lists() -> dict[str, list[str]]:
    out = subprocess.run([sys.executable, "-c", _INDUCTOR_LISTS], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _covered(name: str) -> bool:
    return (name in CASES or name in NO_CASE or POINTWISE.match(name) is not None or BACKWARD.search(name) is not None
            or any(k.split(":")[-1] == name for k in CASES))


def test_every_extern_kernel_has_a_case_or_a_reason():
    missing = [n for n in _inductor_lists()["extern"] if not _covered(n)]
    assert not missing, f"extern kernels with no sweep case: {missing}"


def test_every_fallback_op_has_a_case_or_a_reason():
    missing = [n for n in _inductor_lists()["fallback"] if not _covered(n)]
    assert not missing, f"fallback ops with no sweep case: {missing}"


@pytest.fixture(scope="module")
def functional():
    with cards.configured(sim_mode="functional") as cs:
        yield cs


def _close(got, want, tol: float) -> None:
    if isinstance(want, (tuple, list)):
        for g, w in zip(got, want, strict=True):
            _close(g, w, tol)
        return
    got = got.cpu()
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.dtype, want.shape)
    if want.dtype.is_floating_point:
        torch.testing.assert_close(got, want, rtol=tol, atol=tol, equal_nan=True)
    else:
        assert torch.equal(got, want)


def _inputs(c: Case, seed: int, grow: int = 0) -> list[torch.Tensor]:
    """The case's inputs; `grow` rows more along the first dimension of the first (a second
    size for a dynamic case)."""
    g = torch.Generator().manual_seed(seed)
    args = [make(g) for make in c.makers]
    if grow:
        extra = torch.randn(grow, *args[0].shape[1:], generator=g).to(args[0].dtype)
        args[0] = torch.cat([args[0], extra])
        if len(args) > 1 and args[1].dim() == 1 and args[1].dtype == torch.int64:  # indices along it
            args[1] = torch.cat([args[1], torch.randint(0, 3, (grow,), generator=g)])
    return args


@pytest.mark.parametrize("name", sorted(CASES))
def test_extern_op_runs_on_the_card_or_on_the_cpu_inside_the_step(functional, name):
    c = CASES[name]
    seed = sum(map(ord, name))
    sizes = (0, 4) if c.dynamic else (0,)
    wants = []
    for grow in sizes:
        try:
            wants.append((c.ref or c.fn)(*_inputs(c, seed, grow)))
        except (RuntimeError, NotImplementedError) as e:  # CPU eager refuses it too: nothing to compare
            pytest.skip(f"CPU eager: {str(e).splitlines()[0]}")
    torch._dynamo.reset()
    f = torch.compile(c.fn, backend="spyre_rt", dynamic=True if c.dynamic else False, fullgraph=True)
    with dispatch_mode("prebuilt"):
        f(*[a.to("spyre") for a in _inputs(c, seed)])  # compiles (its fake propagation may run ops eagerly)
    before_eager, before = sum(fallback.calls.values()), dict(fallback.in_steps)
    for grow, want in zip(sizes, wants, strict=True):
        with dispatch_mode("prebuilt"):
            got = f(*[a.to("spyre") for a in _inputs(c, seed, grow)])
        _close(got, want, c.close)
    assert sum(fallback.calls.values()) == before_eager, "the compiled call ran eager CPU ops"
    ran = {op for op, n in fallback.in_steps.items() if n != before.get(op, 0)}
    assert ran == c.cpu, f"ran on the CPU: {sorted(ran)}"


def test_a_dimension_marked_dynamic_reaches_a_cpu_op_as_a_size_argument(functional):
    """``mark_dynamic`` on the batch of a convolution and on the rows ``topk`` picks from:
    one compile, both sizes right."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()

    def fn(x, w):
        return torch.topk(F.conv1d(x, w, padding=1).flatten(1), x.shape[0], 1).values

    f = torch.compile(fn, backend="spyre_rt", fullgraph=True)
    g = torch.Generator().manual_seed(3)
    w = torch.randn(3, 2, 3, generator=g)
    for n in (5, 9):
        x = torch.randn(n, 2, 40, generator=g)
        xd = x.to("spyre")
        torch._dynamo.mark_dynamic(xd, 0)
        _close(f(xd, w.to("spyre")), fn(x, w), 1e-4)
    assert counters["stats"]["unique_graphs"] == 1



def test_with_cpu_fallback_off_an_extern_kernel_is_an_error_naming_the_op_and_the_model_line(functional):
    import spyre_rt

    torch._dynamo.reset()
    f = torch.compile(lambda x, w: F.conv2d(x, w) + 1,  # the line the error names
                      backend="spyre_rt", dynamic=False, options={"cpu_fallback": False})
    with pytest.raises(spyre_rt.SpyreCompileError) as info:
        f(torch.randn(1, 3, 8, 8).to("spyre"), torch.randn(4, 3, 3, 3).to("spyre"))
    message = str(info.value)
    assert "aten.convolution.default" in message and __file__ in message and "CPU fallback is off" in message


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_mambas_causal_conv1d_runs_on_the_card(functional, dtype):
    """A depthwise conv1d of 4 taps, as Mamba's prefill (left-padded, cut to the input's
    length, SiLU) and its decode update (the state and the new token, no padding, the state
    rolled in place) run it: card kernels only, every dispatch mode alike, fp32 within 1e-6
    of CPU eager, fp16 within one rounding of CPU eager's fp32 arithmetic."""
    from spyre_rt.dispatch import NAMES

    channels, taps = 96, 4
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(channels, 1, taps, generator=g).to(dtype), torch.randn(channels, generator=g).to(dtype)
    x, state = torch.randn(1, channels, 8, generator=g).to(dtype), torch.randn(1, channels, taps, generator=g).to(dtype)

    def prefill(x, w, b):
        return F.silu(F.conv1d(x, w, b, padding=taps - 1, groups=channels)[:, :, :x.shape[-1]])

    def update(x, state, w, b):
        full = torch.cat([state, x], -1)
        state.copy_(full[:, :, -taps:])
        return F.conv1d(full, w, b, groups=channels)[:, :, -1:]

    want = prefill(x.float(), w.float(), b.float())
    want_state = state.float().clone()
    want_update = update(x[:, :, :1].float(), want_state, w.float(), b.float())
    torch._dynamo.reset()
    fns = [torch.compile(f, backend="spyre_rt", dynamic=False) for f in (prefill, update)]
    before = dict(fallback.in_steps)
    outs = []
    for mode in NAMES:
        with dispatch_mode(mode):
            s = state.clone().to("spyre")
            card = (w.to("spyre"), b.to("spyre"))
            outs.append((fns[0](x.to("spyre"), *card).cpu(), fns[1](x[:, :, :1].to("spyre"), s, *card).cpu(), s.cpu()))
    assert dict(fallback.in_steps) == before, "nothing runs on the CPU"
    atol = 1e-6 if dtype == torch.float32 else 2 ** -10 * max(want.abs().max().item(), want_update.abs().max().item())
    for got in outs:
        assert all(torch.equal(a, b) for a, b in zip(got, outs[0], strict=True)), "the modes differ"
        torch.testing.assert_close(got[0].float(), want, rtol=0, atol=atol)
        torch.testing.assert_close(got[1].float(), want_update, rtol=0, atol=atol)
        assert torch.equal(got[2].float(), want_state)


def test_an_integer_histc_counts_as_a_bincount_eagerly_and_inside_a_step(functional):
    """transformers counts tokens per expert with ``torch.histc`` on int32 on accelerators;
    the CPU has no integer histc, so the CPU op runs it in float64 and casts back."""
    experts = torch.tensor([[0, 3], [1, 3], [3, 2], [0, 0]], dtype=torch.int32)
    want = torch.bincount(experts.flatten().long(), minlength=4).to(torch.int32)
    eager = torch.histc(experts.to("spyre"), bins=4, min=0, max=3).cpu()
    torch._dynamo.reset()
    f = torch.compile(lambda e: torch.histc(e + 0, bins=4, min=0, max=3), backend="spyre_rt", dynamic=False)
    stepped = f(experts.to("spyre")).cpu()
    for got in (eager, stepped):
        assert got.dtype == torch.int32 and torch.equal(got, want), got

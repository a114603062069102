"""Per-compile options of the spyre_rt backend, as a torch ConfigModule.

Registered with Inductor as the device's custom config, so they are part of Inductor's
FX graph cache key: a cached compile is only reused with the same options.

    torch.compile(model, backend="spyre_rt", options={"dispatch": "construct"})
"""

import sys

from torch.utils._config_module import install_config_module

dispatch: str = ""            # "" = SPYRE_RT_DISPATCH or the default (prebuilt)
cpu_fallback: bool = True     # run ops the card cannot on the CPU (else SpyreCompileError)
compute_dtype: str = "auto"   # auto | float16 | float32
fuse_epilogues: bool = True   # pointwise kernels on a matmul's product become its epilogue
# and those whose work depends on where a column lies in a period of the columns (a rotary
# embedding on a projection's heads), run in column slices (compiler/slicing.py)
slice_epilogues: bool = True
# a GEMM read only as its two halves of columns (vLLM's merged gate and up) is two GEMMs, so
# that the gated activation becomes the second one's epilogue (compiler/inductor/gated_gemm.py)
split_gated_gemms: bool = True
# a residual add of a matmul's product that several ops read (h + attn(h) * m) is computed
# once, as the matmul's epilogue, not inlined into each reader (lowering.residual_sum)
fuse_residuals: bool = True
# a loop kernel whose result only matmuls read as A (RMSNorm) becomes their prologue: its
# per-row part stays a kernel, its elementwise part runs on each A chunk (compiler/prologue.py)
fuse_prologues: bool = True
# matmuls of one A whose tilings are alike (a layer's k and v projections) are computed as one
# grouped matmul, their weights and outputs its parts (compiler/grouping.py)
group_matmuls: bool = True
# an attention whose boolean mask the step proves causal up to a bound (a static cache's mask,
# its position bounded by the cache write's index check) skips the blocks past it
# (compiler/causal.py)
bound_causal_masks: bool = True
profile_digest: str = ""      # the device profile the graph was compiled for
compiler_version: str = ""    # digest of the compiler's sources: a new compiler misses the cache
# the settings the step carries to its calls (spyre_rt.config.step_fields); {} = the process's
step_settings: dict = {}
# FX nodes that run on the CPU because a kernel holding them could not be built for the card
# (set by the backend when it compiles again after such a failure)
cpu_nodes: list = []
# FX nodes whose result is computed into a buffer of its own on the card, not fused into
# its consumers: the first answer to a fused gather construction cannot address (an index
# varying along a reduction's columns); a kernel that still cannot be built runs on the CPU
realize_nodes: list = []

install_config_module(sys.modules[__name__])

"""Inductor Scheduling for the card: each fused group of loop nodes becomes a kernel.

Inductor's fusion policy (from SIMDScheduling) decides what goes together; this class
records the result (:mod:`.record`) and describes it (:mod:`spyre_rt.compiler.describe`),
checks that construction can express it, and registers it with the wrapper, which records
the launch in the step. Buffers produced and consumed inside one kernel are removed: they
never exist in device memory.

With dynamic shapes the group stays recorded (it is described again for each concrete
size); it is described and checked now at Inductor's example sizes, so what the card cannot
express fails the compile, not the first call.
"""

from __future__ import annotations

import re

from torch._dynamo.utils import dynamo_timed
from torch._inductor.codegen.simd import SIMDScheduling
from torch._inductor.virtualized import V

from spyre_rt.construct.loops import Unsupported, check_kernel

from ..describe import NotSupported, describe
from ..errors import compile_error
from .record import computing_origins, hints, indexing_origins, kept_apart, node_key, record_kernel


class SpyreScheduling(SIMDScheduling):
    def codegen_node(self, node) -> None:
        sched = self.scheduler
        nodes = [n for n in node.get_nodes() if n.get_name() not in sched.removed_ops]
        if not nodes:
            return
        names = {n.get_name() for n in nodes}
        local = {
            b.get_name()
            for n in nodes
            for b in n.get_outputs()
            if sched.can_buffer_be_removed_through_fusion(b.get_name(), names)
            and b.get_name() not in V.graph.removed_buffers
        }
        _, (numel, rnumel) = max(nodes, key=lambda x: int(x.is_reduction())).group
        wrapper = V.graph.wrapper_code
        name = wrapper.new_kernel_name()

        def real_name(n: str) -> str:
            return sched.mutation_real_name.get(n, n)

        try:
            with dynamo_timed("spyre.describe"):  # our span of the compile time (compile_probe)
                recorded = record_kernel(name, nodes, numel, rnumel, local, real_name)
                example = hints(recorded)
                kernel = describe(recorded, example)
                check_kernel(kernel)  # what construction cannot express fails now, not at the first call
        except (NotSupported, Unsupported) as e:
            err = compile_error(str(e), nodes)
            # what the backend may run on the CPU instead: the node of the op construction
            # refused when it is known (the rest of the group stays a card kernel), else all
            err.fallback_nodes = _refused_nodes(e, nodes)
            # a gather construction cannot address inside the fusion may build on its own
            err.apart_nodes = err.fallback_nodes if getattr(e, "indirect", False) else set()
            raise err from None
        wrapper.define_spyre_kernel(recorded.stored() if example else kernel, nodes)
        V.graph.removed_buffers |= local  # before mark_run, so they are never allocated
        for n in nodes:
            n.mark_run()
        args = [b for b in recorded.buffers if b not in local]
        wrapper.generate_kernel_call(name, args, triton=False)
        self.free_buffers_in_scheduler()

    def can_fuse_vertical(self, node1, node2) -> bool:
        # a node the backend realized (see options.realize_nodes) keeps its own kernel
        from .. import options

        realized = set(options.realize_nodes) | kept_apart(V.graph)
        if realized and any(node_key(o) in realized for n in node1.get_nodes()
                            for o in getattr(n.node, "origins", ())):
            return False
        return super().can_fuse_vertical(node1, node2)

    def codegen_template(self, template_node, epilogue_nodes, prologue_nodes=(), **kwargs):
        raise compile_error("template kernels are not supported on spyre", [template_node])

    def codegen_combo_kernel(self, node) -> None:
        for sub in node.get_subkernel_nodes():
            self.codegen_node(sub)

    def codegen_sync(self) -> None:
        pass

    def flush(self) -> None:
        pass

    def ready_to_flush(self) -> bool:
        return False

    def benchmark_fused_nodes(self, nodes):
        return 0.0, ""


def _refused_nodes(e: Exception, nodes) -> set[str]:
    """The FX nodes to run on the CPU for a refusal: those of the scheduler node whose op
    construction refused (ops are named ``n{k}_...`` for the k-th node of the group, see
    ``record.record_kernel``), and of those, for an access through an index construction
    cannot address, only the indexing ops (the arithmetic fused around them stays on the
    card); every node of the group if the error names no op."""
    m = re.match(r"n(\d+)_", getattr(e, "op_id", "") or "")
    k = int(m.group(1)) if m else -1
    if not 0 <= k < len(nodes):
        return computing_origins(nodes)
    culprit = [nodes[k]]
    return ((getattr(e, "indirect", False) and indexing_origins(culprit)) or computing_origins(culprit)
            or computing_origins(nodes))

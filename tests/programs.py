"""Small card programs the runtime and trace tests launch."""

import numpy as np

from spyre_rt.program import OP_LOAD, SLOT_DRAM, ProgramBuilder, empty_cmds


def loads(cores, nbytes: int) -> np.ndarray:
    """One DRAM -> scratchpad load of `nbytes` on each core, from consecutive regions of one
    DRAM slot."""
    cores = list(cores)
    b = ProgramBuilder()
    s = b.slot(SLOT_DRAM, len(cores) * nbytes)
    cmds = empty_cmds(len(cores), OP_LOAD, np.array(cores))
    cmds["src_slot"] = s
    cmds["src_off"] = np.arange(len(cores)) * nbytes
    cmds["run_bytes"] = nbytes
    b.add(cmds)
    return b.encode()

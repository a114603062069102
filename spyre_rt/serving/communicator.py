"""The device communicator of a tensor-parallel group of cards: vLLM's collectives as
``spyreccl``'s functional collectives.

vLLM's tensor-parallel layers call their group's communicator (an all-reduce after each
row-parallel projection and the vocabulary-parallel embedding, an all-gather of the logits).
Written as ``_c10d_functional`` ops with their ``wait_tensor``, they are what a compiled
step traces to, and the backend makes them jobs of the step's graph plan: in place on the
card, through the cards' ring, no CPU op between the kernels and nothing a replay cannot
hold. Eager, the same ops go through the ``spyreccl`` group's own calls.
"""

from __future__ import annotations

import torch
from vllm.distributed.device_communicators.base_device_communicator import DeviceCommunicatorBase

_functional = torch.ops._c10d_functional


class SpyreCommunicator(DeviceCommunicatorBase):
    def __init__(self, cpu_group, device=None, device_group=None, unique_name: str = "",
                 use_all2all: bool = False) -> None:
        super().__init__(cpu_group, device, device_group, unique_name, use_all2all=use_all2all)
        # functional collectives name their group; spyreccl groups name themselves
        self.group_name = device_group.group_name

    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        return _functional.wait_tensor(_functional.all_reduce(input_, "sum", self.group_name))

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' tensors side by side along `dim`: gathered along the first dimension
        (whole rows, what the ring moves as it lies) and moved into place."""
        if dim < 0:
            dim += input_.dim()
        gathered = _functional.wait_tensor(
            _functional.all_gather_into_tensor(input_.contiguous(), self.world_size, self.group_name))
        stacked = gathered.reshape(self.world_size, *input_.shape)
        return stacked.movedim(0, dim).reshape(*input_.shape[:dim], self.world_size * input_.shape[dim],
                                               *input_.shape[dim + 1:])

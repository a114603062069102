"""vLLM's scheduler, with one thing more: a step the card failed fails its requests only.

vLLM stops the engine when a model step raises. A card fault during a step (a command or a
DMA that failed: :class:`~spyre_rt.errors.SpyreDeviceError`) leaves the card, its weights
and the other requests' KV blocks as they were (a failed call restores what it mutated), so
the runner reports the step as :class:`FailedStep` instead, and the scheduler finishes that
step's requests with vLLM's error finish reason (the server answers them HTTP 500, vLLM's
``GenerationError``) and frees their KV blocks. The next steps serve the other requests. A
lost card is not such a fault: everything on it is gone, and the engine stops.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput
from vllm.v1.request import RequestStatus

_log = logging.getLogger("spyre_rt.serving")


@dataclass
class FailedStep(ModelRunnerOutput):
    """A model step the card failed: ``req_ids`` are its requests, ``error`` the fault."""

    error: str = ""


def failed_step(req_ids: list[str], error: str) -> FailedStep:
    return FailedStep(req_ids=list(req_ids), req_id_to_index={r: i for i, r in enumerate(req_ids)}, error=error)


class SpyreScheduler(Scheduler):
    def update_from_output(self, scheduler_output, model_runner_output) -> dict[int, EngineCoreOutputs]:
        if not isinstance(model_runner_output, FailedStep):
            return super().update_from_output(scheduler_output, model_runner_output)
        _log.error("spyre_rt: the card failed a step of %d requests (%s); they end with an error",
                   len(model_runner_output.req_ids), model_runner_output.error)
        clients = {r: self.requests[r].client_index for r in model_runner_output.req_ids if r in self.requests}
        failed = self.finish_requests(list(clients), RequestStatus.FINISHED_ERROR)
        # the step's bookkeeping (statistics, finished sets) as for a step whose requests all ended
        outputs = super().update_from_output(scheduler_output, EMPTY_MODEL_RUNNER_OUTPUT)
        for request in failed:
            index = clients[request.request_id]
            eco = outputs.setdefault(index, EngineCoreOutputs())
            eco.outputs.append(EngineCoreOutput(request_id=request.request_id, new_token_ids=[],
                                                finish_reason=FinishReason.ERROR))
        return outputs

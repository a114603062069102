"""A vLLM model loader for a timing-mode card: ``load_format="spyre_timing"``.

A timing-mode card runs the command stream of every step and keeps no values, which is how
a full-size model is timed on a small host. vLLM's own loaders build the model on the host
first (``dummy``: 16 GB of random fp16 weights for an 8B model); this one builds it on the
``meta`` device and allocates its weights and buffers on the card without writing them:
no host copy, no download, nothing to read. It refuses a functional card, whose values
would be whatever the memory held.
"""

from __future__ import annotations

import torch
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
from vllm.utils.torch_utils import set_default_torch_dtype

from spyre_rt import card as cards
from spyre_rt.errors import SpyreError

LOAD_FORMAT = "spyre_timing"


@register_model_loader(LOAD_FORMAT)
class TimingModelLoader(BaseModelLoader):
    """The model's weights allocated on a timing-mode card, unwritten."""

    def download_model(self, model_config) -> None:
        pass   # nothing is read

    def load_weights(self, model: torch.nn.Module, model_config) -> None:
        pass   # a timing-mode card keeps no values

    def load_model(self, vllm_config, model_config, prefix: str = "") -> torch.nn.Module:
        index = torch.spyre.current_device()
        if cards.get(index).sim_mode != "timing":
            raise SpyreError(f"load_format={LOAD_FORMAT!r} leaves the weights unwritten: it needs a timing-mode "
                             "card (SPYRE_RT_SIM_MODE=timing); use vLLM's own formats on a functional card")
        card = torch.device("spyre", index)
        with set_default_torch_dtype(model_config.dtype), torch.device("meta"):
            model = initialize_model(vllm_config=vllm_config, model_config=model_config, prefix=prefix)
        model = model.to_empty(device=card)
        process_weights_after_loading(model, model_config, card)
        return model.eval()

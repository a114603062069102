"""Hugging Face models sharded over the cards of a process group by their tensor-parallel plan.

``from_pretrained(path, tp_plan="auto", device_mesh=...)`` shards a checkpoint as it loads it;
:func:`sharded_model` shards a model built from its config alone (random weights, or none on
timing-mode cards, as ``spyre-profile`` builds full-size models): it is made on the meta
device, given the plan's DTensor placements on a ``"spyre"`` device mesh of the default
group (``transformers.distributed.tensor_parallel.apply_tensor_parallelism``: attention
heads and MLP columns split, an all-reduce after each row-parallel projection), and only
then given memory on this rank's card.
"""

from __future__ import annotations

import torch


def sharded_model(cls, cfg, dtype: torch.dtype, sim_mode: str, tp: int) -> torch.nn.Module:
    """`cls(cfg)` sharded over the `tp` cards of the default process group by its
    tensor-parallel plan, on this rank's card (random values on a functional card; none on a
    timing-mode card, which keeps no data); a vocabulary the cards do not divide is padded
    (:func:`padded_vocab`)."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    cfg = padded_vocab(cfg, tp)
    with torch.device("meta"):
        model = cls(cfg).to(dtype).eval()
    apply_tensor_parallelism(model, init_device_mesh("spyre", (tp,)), model.tp_plan)
    model = model.to_empty(device="spyre")
    if sim_mode == "functional":
        with torch.no_grad():
            for p in model.parameters():
                local = p.to_local() if hasattr(p, "to_local") else p
                local.copy_((torch.randn(local.shape) * 0.02).to(local.dtype))
            rotary = model.model.rotary_emb  # buffers computed from the config, not left empty
            model.model.rotary_emb = type(rotary)(config=cfg).to("spyre")
    return model


# A vocabulary split over the cards is padded to whole shards of this many rows per card, as
# vLLM's vocabulary-parallel layers pad it.
VOCAB_PADDING = 64


def padded_vocab(cfg, tp: int):
    """`cfg`, or a copy whose vocabulary is padded to `tp` shards of whole VOCAB_PADDING-row
    blocks when it does not split evenly (Granite 3.3's 49,159 tokens): the plan splits the
    LM head's rows over the cards and refuses a size they do not divide."""
    import copy

    step = VOCAB_PADDING * tp
    if cfg.vocab_size % tp == 0:
        return cfg
    padded = copy.deepcopy(cfg)
    padded.vocab_size = -(-cfg.vocab_size // step) * step
    return padded

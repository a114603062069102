"""Autograd through compiled graphs: a forward in grad mode (a plain ``model(ids)``, no
``no_grad``) gives eager's values, and backward gives eager's gradients. The card's
attention kernel is forward only, so under autograd attention is torch's math; what the card
cannot build in a backward graph (an accumulating scatter) runs on the CPU inside it."""

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from spyre_rt.dispatch import dispatch_mode


def test_an_embeddings_gradient_accumulates_repeated_indices():
    def f(w, idx):
        return torch.nn.functional.embedding(idx, w).pow(2).sum()

    g = torch.Generator().manual_seed(0)
    w = torch.randn(50, 70, generator=g)
    idx = torch.tensor([[1, 2, 2, 7, 1]])
    on_card = w.to("spyre").requires_grad_()
    torch._dynamo.reset()
    torch.compile(f, backend="spyre_rt")(on_card, idx.to("spyre")).backward()
    on_cpu = w.clone().requires_grad_()
    f(on_cpu, idx).backward()
    torch.testing.assert_close(on_card.grad.cpu(), on_cpu.grad)


@pytest.mark.parametrize("mode", ["construct", "prebuilt"])
def test_a_compiled_model_in_grad_mode_gives_eagers_logits_and_gradients(mode):
    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=300, max_position_embeddings=64)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 300, (1, 11), generator=torch.Generator().manual_seed(1))
    on_card = copy.deepcopy(model).to("spyre")
    torch._dynamo.reset()
    compiled = torch.compile(on_card, backend="spyre_rt")
    with dispatch_mode(mode):
        logits = compiled(ids.to("spyre")).logits
        assert logits.requires_grad
        (logits.float() ** 2).mean().backward()
    want = model(ids).logits
    (want ** 2).mean().backward()
    torch.testing.assert_close(logits.detach().cpu(), want.detach(), atol=1e-4, rtol=1e-4)
    for (name, p), (_, q) in zip(on_card.named_parameters(), model.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad.cpu(), q.grad, atol=1e-5, rtol=1e-3, msg=name)

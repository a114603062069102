"""The card's roofline and the analytic cost of a Granite step, against figures worked by hand."""

import pytest

from spyre_rt import device_profile
from spyre_rt.cost import CostModel
from spyre_rt.profiler import analytic
from spyre_rt.profiler.roofline import kernel_figures

TINY = {"hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
        "intermediate_size": 512, "vocab_size": 1000}


@pytest.fixture(scope="module")
def card():
    return CostModel.of_figures(device_profile.load("spyre"))


def test_the_card_figures_come_from_the_device_profile(card):
    assert card.card_macs_per_ns == pytest.approx(32 * 1536 * 0.7422)  # 36,480.6 MAC/ns sustained
    assert card.dram_bytes_per_ns == 150.0
    assert card.job_latency_ns == 2000 + device_profile.load("spyre")["dma_latency_ns"]


def test_one_matmul_against_the_roofline_by_hand(card):
    # a 1024 x 1024 x 1024 fp16 matmul: 2 * 1024^3 FLOPs; A and B read and C written once
    flops, nbytes = 2 * 1024**3, 3 * 1024 * 1024 * 2
    compute_ns = 2 * 1024**3 / (2 * 36_480.6144)  # 29,433 ns
    dram_ns = 6_291_456 / 150  # 41,943 ns: this one waits on DRAM
    assert card.compute_ns(flops) == pytest.approx(compute_ns)
    assert card.dram_ns(nbytes) == pytest.approx(dram_ns)
    assert card.kernel_ns(flops, nbytes) == pytest.approx(41_943.04)
    assert card.bound(flops, nbytes) == "DRAM"
    # 16x the rows: compute grows 16x, the bytes only ~6x (B is read once)
    assert card.bound(16 * flops, (16 + 1 + 16) * 1024 * 1024 * 2) == "compute"
    # in fp32 the MAC rate is pt_fp32_ratio of fp16's
    ratio = device_profile.load("spyre")["pt_fp32_ratio"]
    assert card.compute_ns(flops, "float32") == pytest.approx(compute_ns / ratio)


def test_kernels_below_the_cost_of_a_job_are_latency_bound(card):
    assert card.bound(2 * 64**3, 3 * 64 * 64 * 2) == "latency"  # 16 ns of work, 2 µs to launch
    assert card.bound(2 * 64**3 * 1000, 3 * 64 * 64 * 2 * 1000, calls=1000) == "latency"


def test_a_trace_without_device_figures_has_no_roofline():
    assert CostModel.of_trace_metadata({}) is None
    assert CostModel.of_trace_metadata({"spyre_rt": {"device": {"figures": {"num_cores": 32}}}}) is None


def test_kernel_figures_need_flops_and_minimum_bytes():
    assert kernel_figures({"flops": 10, "dram_bytes_min": 20, "dtype": "float32"}) == (10.0, 20.0, "float32")
    assert kernel_figures({"flops": 10}) is None
    assert kernel_figures({"flops": True, "dram_bytes_min": 20}) is None
    assert kernel_figures(None) is None


def test_a_tiny_granite_prefill_by_hand():
    # h 256, 2 layers, 8 heads of 32, 2 KV heads (k and v are 64 wide), MLP 512, vocab 1000;
    # batch 1, 16 tokens, fp32
    cost = analytic.granite_step(TINY, batch=1, seq=16, phase="prefill", dtype="float32", all_logits=True)
    linear = 256 * 256 + 2 * 256 * 64 + 256 * 256 + 3 * 256 * 512  # 557,056 MACs per token and layer
    assert linear == 557_056
    # linear layers and the LM head on 16 tokens; attention over 16 * 17 / 2 = 136 pairs per head
    assert cost.flops == 2 * 16 * (2 * 557_056 + 256 * 1000) + 2 * 8 * 4 * 136 * 32 == 44_122_112
    # two layers of weights and norms, the final norm, the LM head, 16 embedding rows; 4 bytes each
    assert cost.weight_bytes == (2 * (557_056 + 512) + 256 + 256_000 + 16 * 256) * 4 == 5_501_952
    # k and v of 16 tokens written and read back by attention, in both layers
    assert cost.kv_bytes == 2 * 2 * 64 * (16 + 16) * 4 == 32_768
    # per token and layer: qkv 256 in + 384 out, attention 256 + 256, o 256 + 256,
    # gate and up 256 + 1024, down 512 + 256; embedding out, LM head in, logits out
    assert cost.activation_bytes == 16 * (2 * 3712 + 256 + 256 + 1000) * 4 == 571_904


def test_a_prefill_that_asks_for_the_last_logits_only_counts_one_lm_head_row():
    every = analytic.granite_step(TINY, batch=1, seq=16, phase="prefill", dtype="float32", all_logits=True)
    last = analytic.granite_step(TINY, batch=1, seq=16, phase="prefill", dtype="float32")
    assert every.flops - last.flops == 2 * 15 * 256 * 1000  # 15 positions fewer through the LM head
    assert every.activation_bytes - last.activation_bytes == 15 * (256 + 1000) * 4


def test_a_tiny_granite_decode_token_by_hand():
    cost = analytic.granite_step(TINY, batch=2, seq=16, phase="decode")
    assert cost.flops == 2 * 2 * (2 * 557_056 + 256_000) + 2 * 2 * 8 * 4 * 17 * 32  # 17 keys seen
    assert cost.kv_bytes == 2 * 2 * 2 * 64 * (1 + 17) * 2  # one new position written, 17 read
    assert cost.weight_bytes == (2 * (557_056 + 512) + 256 + 256_000 + 2 * 256) * 2


def test_granite_8b_decode_is_bound_by_reading_its_weights(card):
    granite = {"hidden_size": 4096, "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 8,
               "intermediate_size": 12800, "vocab_size": 49159}
    decode = analytic.granite_step(granite, batch=1, seq=1024, phase="decode")
    assert decode.bound(card) == "DRAM"
    assert decode.weight_bytes / 1e9 == pytest.approx(16.3, abs=0.1)  # 8.1 B parameters in fp16
    assert decode.roofline_ms(card) == pytest.approx(110, rel=0.02)
    prefill = analytic.granite_step(granite, batch=1, seq=1024, phase="prefill")
    assert prefill.bound(card) == "compute"
    # 16.7 TFLOP at 73 TFLOP/s (the LM head on the last position; 17.1 TFLOP on every one)
    assert prefill.roofline_ms(card) == pytest.approx(229, rel=0.02)


def test_phase_must_be_prefill_or_decode():
    with pytest.raises(ValueError, match="phase"):
        analytic.granite_step(TINY, 1, 16, "train")


def test_a_phase_with_kernel_info_is_measured_against_its_kernels(card):
    from spyre_rt.profiler import efficiency

    info = {"k1": {"flops": 2 * 1024**3, "dram_bytes_min": 3 * 1024 * 1024 * 2},  # 41.94 µs, DRAM
            "k2": {"flops": 32 * 1024**3, "dram_bytes_min": 33 * 1024 * 1024 * 2}}  # 470.9 µs, compute
    names = efficiency.kernel_names(["h2d", "k1", "k2", "k1", "d2h"])
    assert names == ["k1", "k2", "k1"]
    kernels = efficiency.kernels_roofline(names, card, info.get)
    compute_k2 = 32 * 1024**3 / (2 * 36_480.6144) / 1e6
    assert kernels["roofline_ms"] == pytest.approx(2 * 0.04194304 + compute_k2)
    assert kernels["dram_bound_ms"] == pytest.approx(2 * 0.04194304)
    assert kernels["kernels"] == kernels["kernels_with_info"] == 3
    cost = analytic.granite_step(TINY, 1, 16, "prefill")
    e = efficiency.phase_efficiency(1.0, kernels, cost, card)
    assert (e["source"], e["bound"]) == ("kernels", "compute")
    assert e["fraction"] == pytest.approx(kernels["roofline_ms"])  # over 1 ms of device time
    # one kernel without info: the analytic model stands in, and says so
    partial = efficiency.kernels_roofline(["k1", "k9"], card, info.get)
    e = efficiency.phase_efficiency(1.0, partial, cost, card)
    assert e["source"] == "analytic" and e["roofline_ms"] == pytest.approx(cost.roofline_ms(card))

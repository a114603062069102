"""The interconnect's time model (spyre_rt.distributed.interconnect) and its figures."""

import math

import pytest

from spyre_rt import device_profile
from spyre_rt.distributed import interconnect
from spyre_rt.errors import SpyreProfileError


@pytest.fixture(scope="module")
def spyre():
    return device_profile.load("spyre")


def test_the_profile_gives_the_links_figures_with_sources(spyre):
    ic = spyre.interconnect
    assert set(ic) == {"p2p_bandwidth_gbps", "p2p_latency_ns", "network_bandwidth_gbps", "network_latency_ns"}
    assert ic["p2p_bandwidth_gbps"].kind == "derived" and "[pcie5]" in ic["p2p_bandwidth_gbps"].source
    assert ic["p2p_latency_ns"].kind == "assumption"
    assert ic["network_bandwidth_gbps"].kind == "assumption" and "[ieee802.3]" in ic["network_bandwidth_gbps"].source
    assert ic["network_bandwidth_gbps"].value == pytest.approx(100 / 8)  # 100 Gb/s Ethernet, one direction
    # PCIe Gen5 x16: 32 GT/s x 16 lanes x 128/130 / 8 bits
    assert ic["p2p_bandwidth_gbps"].value == pytest.approx(32 * 16 * 128 / 130 / 8, rel=1e-3)


def test_all_reduce_is_ring_or_tree_whichever_is_faster(spyre):
    bw, alpha = spyre.interconnect["p2p_bandwidth_gbps"].value, spyre.interconnect["p2p_latency_ns"].value
    small = interconnect.cost(spyre, "all_reduce", 8192, 2)
    assert small.algorithm == "ring" and small.ns == pytest.approx(8192 / bw + 2 * alpha)
    tree = interconnect.cost(spyre, "all_reduce", 8192, 8)  # latency-bound: 6 tree steps beat 14 ring steps
    assert tree.algorithm == "tree" and tree.ns == pytest.approx(2 * 8192 / bw + 2 * 3 * alpha)
    big = interconnect.cost(spyre, "all_reduce", 8 << 20, 8)  # bandwidth-bound: the ring
    assert big.algorithm == "ring" and big.ns == pytest.approx(2 * 7 / 8 * (8 << 20) / bw + 14 * alpha)


def test_other_collectives_and_one_rank(spyre):
    bw, alpha = spyre.interconnect["p2p_bandwidth_gbps"].value, spyre.interconnect["p2p_latency_ns"].value
    assert interconnect.cost(spyre, "all_gather", 4096, 4).ns == pytest.approx(3 / 4 * 4096 / bw + 3 * alpha)
    assert interconnect.cost(spyre, "broadcast", 4096, 4).ns == pytest.approx(4096 / bw + math.log2(4) * alpha)
    assert interconnect.cost(spyre, "all_reduce", 4096, 1).ns == 0
    with pytest.raises(ValueError, match="no cost model"):
        interconnect.cost(spyre, "gossip", 1, 2)


def test_a_profile_without_links_has_no_model_and_bad_links_are_refused(spyre):
    text = open(spyre.path).read()
    start = text.index("[interconnect]")
    plain = device_profile.parse(text[:start] + text[text.index("[figures]"):])
    assert plain.interconnect == {} and interconnect.cost(plain, "all_reduce", 8192, 2) is None
    bad = text.replace('p2p_latency_ns = { value = 1000', 'p2p_latency_ns = { value = -1', 1)
    with pytest.raises(SpyreProfileError, match="positive number"):
        device_profile.parse(bad)
    with pytest.raises(SpyreProfileError, match="unknown interconnect figure"):
        device_profile.parse(text.replace("[interconnect]\n", '[interconnect]\nhops = { value = 1, unit = "x", kind = "assumption", source = "s" }\n'))


def test_a_group_on_several_machines_goes_at_the_networks_figures(spyre):
    """Between machines the slowest links are the network's: the ring's steps at its latency
    and its bandwidth."""
    bw, alpha = spyre.interconnect["network_bandwidth_gbps"].value, spyre.interconnect["network_latency_ns"].value
    one = interconnect.cost(spyre, "all_reduce", 8192, 2)
    two = interconnect.cost(spyre, "all_reduce", 8192, 2, between_machines=True)
    assert two.algorithm == "ring" and two.ns == pytest.approx(8192 / bw + 2 * alpha)
    assert two.ns > 10 * one.ns

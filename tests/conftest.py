"""Shared fixtures: cards opened directly from profiles, independent of the device registry."""

import os
import tempfile
import textwrap
from pathlib import Path

import pytest

# Every test session starts with an empty plan cache of its own.
os.environ.setdefault("SPYRE_RT_CACHE_DIR", tempfile.mkdtemp(prefix="spyre-rt-plans-"))

from small_profiles import small_profile_text  # noqa: E402

from spyre_rt import device_profile  # noqa: E402
from spyre_rt.card import Card  # noqa: E402


@pytest.fixture(scope="session")
def spyre_profile():
    return device_profile.load("spyre")


@pytest.fixture
def functional_card(spyre_profile):
    return Card(spyre_profile, "functional", 0)


@pytest.fixture
def timing_card(spyre_profile):
    return Card(spyre_profile, "timing", 1)


@pytest.fixture
def small_profile_path(tmp_path):
    path = tmp_path / "small.toml"
    path.write_text(textwrap.dedent(small_profile_text()))
    return str(path)


@pytest.fixture
def quiet_functional_compile():
    """A functional card set as the current one, Dynamo reset, warnings held back: for
    tests that compile small functions and compare them with CPU eager (the CPU-fallback
    warnings are what they count through ``fallback.in_steps``, not what they read)."""
    import warnings

    import torch

    from spyre_rt import card as cards

    torch._dynamo.reset()
    with cards.configured(sim_mode="functional"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.fixture(scope="session")
def two_card_profile(tmp_path_factory) -> str:
    """The card's profile with two cards: a machine with a card per rank."""
    text = (Path(__file__).parent.parent / "profiles" / "devices" / "spyre.toml").read_text()
    path = tmp_path_factory.mktemp("profiles") / "spyre-2.toml"
    path.write_text(text.replace("\ncount = 1 ", "\ncount = 2 ", 1))
    return str(path)

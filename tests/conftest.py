"""Shared fixtures: cards opened directly from profiles, independent of the device registry."""

import os
import tempfile
import textwrap

import pytest

# Every test session starts with an empty plan cache of its own.
os.environ.setdefault("SPYRE_RT_CACHE_DIR", tempfile.mkdtemp(prefix="spyre-rt-plans-"))

from small_profiles import small_profile_text  # noqa: E402

from spyre_rt import profile  # noqa: E402
from spyre_rt.card import Card  # noqa: E402


@pytest.fixture(scope="session")
def spyre_profile():
    return profile.load("spyre")


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

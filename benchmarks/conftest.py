"""Benchmarks of spyre_rt (pytest-benchmark). See the README's "Benchmarks" section.

Every target is a ratio measured side by side in one run, recorded in `extra_info`;
absolute times are for regression comparison between runs on one machine only.
"""

import os

import pytest

os.environ.setdefault("SPYRE_RT_CACHE_DIR", os.path.join(os.path.dirname(__file__), ".plan-cache"))

from spyre_rt import profile  # noqa: E402
from spyre_rt.card import Card  # noqa: E402


@pytest.fixture(scope="session")
def spyre_profile():
    return profile.load("spyre")


@pytest.fixture(scope="session")
def timing_card(spyre_profile):
    return Card(spyre_profile, "timing", 0)


@pytest.fixture(scope="session")
def functional_card(spyre_profile):
    return Card(spyre_profile, "functional", 1)

"""Profile texts for tests that need a card of another size, other figures or several cards.

A plain module, not conftest: benchmarks/ has a conftest of its own, and only one
module named `conftest` can be imported by name in a session.
"""

from spyre_rt import device_profile


def small_profile_text(dram_gib: float = 1 / 1024, count: int = 1) -> str:
    """The built-in profile with another capacity (default 1 MiB) and card count."""
    return profile_text_with(dram_gib=dram_gib).replace("count = 1", f"count = {count}")


def profile_text_with(**figures) -> str:
    """The built-in profile with each named figure given another value (KeyError names a
    figure the profile does not have)."""
    text = device_profile._source_text("spyre")[1]
    for key, value in figures.items():
        row = f"\n{key} = {{ value = "
        start = text.find(row)
        if start < 0:
            raise KeyError(key)
        start += len(row)
        text = text[:start] + str(value) + text[text.index(",", start):]
    return text

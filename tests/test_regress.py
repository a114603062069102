"""The interleaved base-versus-working-tree benchmark gate (benchmarks/regress.py)."""

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "regress", Path(__file__).resolve().parent.parent / "benchmarks" / "regress.py")
regress = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(regress)


def test_compare_flags_only_what_grew_past_the_threshold():
    base = {"a": [1.0, 1.1, 0.9], "b": [2.0, 2.0, 2.0], "gone": [1.0]}
    head = {"a": [1.05, 1.0, 1.1], "b": [2.5, 2.4, 2.6], "new": [1.0]}
    rows, worse = regress.compare(base, head, 0.10)
    assert worse == ["b"]
    by_name = {r[0]: r for r in rows}
    assert by_name["a"][3] == pytest.approx(1.05)
    assert by_name["b"][3] == pytest.approx(1.25)
    assert by_name["gone"][3] is None and by_name["new"][3] is None
    assert by_name["gone"][1:3] == (1.0, None) and by_name["new"][1:3] == (None, 1.0)  # medians, for the report
    regress.report(rows, 0.10, "base")  # a benchmark on one side only is listed, not compared


def test_faster_is_never_a_failure():
    rows, worse = regress.compare({"x": [1.0]}, {"x": [0.5]}, 0.10)
    assert worse == [] and rows[0][3] == pytest.approx(0.5)


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        regress.main(["--rounds", "0"])


def test_the_report_names_parametrized_benchmarks_whole(capsys):
    """A parametrized benchmark's id in brackets is part of its name, not console markup."""
    rows, _ = regress.compare({"test_step[construct]": [1.0]}, {"test_step[construct]": [1.0]}, 0.10)
    regress.report(rows, 0.10, "base")
    assert "test_step[construct]" in capsys.readouterr().out

"""``spyre-profile models``: the model-compatibility matrix, run live and drawn."""

import io
import json

import pytest
import torch
from rich.console import Console

from spyre_rt.profiler import cli, matrix, models, parity

HOST = {"cpu": "Test CPU", "cores": 2, "load_1m": 0.5, "torch": "2.13.0"}


def _rows() -> list[matrix.Row]:
    ok = matrix.Row("llama", models.DECODER, kernels={"prefill": 43, "decode": 41}, error={"fp32": 2e-5, "fp16": 2.9e-2},
                    tolerance={"fp32": 1e-4, "fp16": 7.1e-2}, compile_s={"fp32": 6.9, "fp16": 5.0})
    back = matrix.Row("roberta", models.ENCODER, status=matrix.FALLS_BACK, kernels={"forward": 35},
                      cpu_ops={"forward": {"aten.cumsum.default": 1, "aten.gather.default": 1}},
                      error={"fp32": 3.7e-6, "fp16": 5.7e-3}, tolerance={"fp32": 1e-4, "fp16": 1.6e-2},
                      compile_s={"fp32": 3.8})
    bad = matrix.Row("mistral", models.DECODER, status=matrix.FAILS,
                     reason="fp32: CompileFailed: spyre cannot compile aten.cat.default (File x.py, line 3)",
                     error={"fp32": float("nan")})
    return [ok, back, bad]


def _drawn(rows, width: int, dtypes=("fp32", "fp16")) -> str:
    out = io.StringIO()
    matrix.render(Console(file=out, width=width), rows, dtypes, matrix.MODES, HOST)
    return out.getvalue()


def test_the_matrix_at_80_columns_keeps_every_column_the_issue_asks_for():
    text = _drawn(_rows(), 80)
    assert max(len(line) for line in text.splitlines()) <= 80
    for header in ("family", "status", "kernels", "on the CPU", "fp32 max", "fp16 max", "compile"):
        assert header in text, header
    assert "43/41" in text and "cumsum ×1" in text and "gather ×1" in text and "6.9" in text
    assert "tolerance\n" not in text.split("decoders:")[0]  # the first column to give way
    assert "host: Test CPU (2 cores, load 0.5)" in " ".join(text.split())


def test_a_wide_terminal_shows_the_fp16_tolerance_too():
    text = _drawn(_rows(), 140)
    assert "tolerance" in text.split("decoders:")[0] and "7.1e-02" in text


def test_why_a_family_fails_is_a_numbered_note_under_the_table():
    text = _drawn(_rows(), 80)
    assert "fails [1]" in text
    notes = " ".join(text.split("host:")[1].split())  # below the caption, wrapped at 80 columns
    assert "[1] mistral: fp32: CompileFailed: spyre cannot compile aten.cat.default (File x.py, line 3)" in notes


def test_a_failing_row_is_recorded_not_raised(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no kernel for this\nsecond line")

    monkeypatch.setattr(matrix, "reference", lambda fam: parity.Run(prefill=torch.zeros(1), tokens=[7]))
    monkeypatch.setattr(matrix, "compare", broken)
    row = matrix.measure(models.family("gpt2"), ("fp32",), ("prebuilt",))
    assert row.status == matrix.FAILS
    assert row.reason == "fp32: RuntimeError: no kernel for this"


def test_models_runs_the_matrix_live_and_writes_json(tmp_path, capsys):
    js = tmp_path / "matrix.json"
    code = cli.main(["models", "--families", "gpt2", "--dtypes", "fp32", "--modes", "construct,prebuilt",
                     "--json", str(js)])
    assert code == 0
    out = json.loads(js.read_text())
    assert out["format"] == matrix.FORMAT and out["modes"] == ["construct", "prebuilt"] and out["host"]["cores"] >= 1
    (row,) = out["rows"]
    assert row["family"] == "gpt2" and row["status"] == matrix.OK, row
    assert row["error"]["fp32"] <= matrix.FP32_ATOL and row["compile_s"]["fp32"] > 0
    assert row["kernels"]["prefill"] > 0 and row["kernels"]["decode"] > 0
    printed = capsys.readouterr().out
    assert "gpt2" in printed and f"{row['kernels']['prefill']}/{row['kernels']['decode']}" in printed


@pytest.mark.parametrize("argv, message", [
    (["models", "--families", "llama,bogus"], "families must be a comma list of"),
    (["models", "--dtypes", "bf16"], "dtypes must be a comma list of fp32, fp16"),
    (["models", "--modes", "fast"], "modes must be a comma list of construct"),
])
def test_models_refuses_unknown_names_with_a_usage_error(argv, message, capsys):
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err

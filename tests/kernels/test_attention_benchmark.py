"""The attention benchmark script: its refusal without a GPU and its docs/benchmarks.md update."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "attention.py"


def load_benchmark():
    spec = importlib.util.spec_from_file_location("attention_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU"
)
def test_refuses_without_gpu_with_one_line_and_status_2():
    result = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 2
    assert result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1
    assert "GPU" in result.stderr


def test_write_section_creates_then_replaces_only_its_own_section(tmp_path):
    bench = load_benchmark()
    doc = tmp_path / "docs" / "benchmarks.md"
    bench.write_section("first table", doc)
    assert "first table" in doc.read_text()

    doc.write_text(
        "# Benchmarks\n\nintro\n\n"
        + doc.read_text().split("\n\n", 2)[-1]
        + "\n## Scheduler\n\nother\n"
    )
    bench.write_section("second table", doc)
    text = doc.read_text()
    assert "first table" not in text
    assert text.count(bench.BEGIN) == 1 and text.count(bench.END) == 1
    assert "second table" in text
    assert text.startswith("# Benchmarks\n\nintro\n") and text.endswith("## Scheduler\n\nother\n")

"""The runnable example in examples/seq2seq_reversal: decodes with the shipped
weights (no torch), reverses its inputs, writes the heatmap PNG."""
import os
import sys

import pytest

from support import REPO_ROOT, run_child

EXAMPLE = os.path.join(REPO_ROOT, "examples", "seq2seq_reversal")


def test_example_runs_and_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "attention.png"
    code = ("import runpy, sys\n"
            f"sys.argv = ['run.py', '--png', {str(png)!r}]\n"
            f"sys.path.insert(0, {EXAMPLE!r})\n"
            "import run\n"
            "n = run.main(sys.argv[1:])\n"
            "print('torch imported:', 'torch' in sys.modules)\n")
    r = run_child(code)
    assert r.returncode == 0, r.stderr
    assert "4/4 reversed correctly" in r.stdout, r.stdout
    assert "torch imported: False" in r.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_shipped_weights_are_small():
    assert os.path.getsize(os.path.join(EXAMPLE, "reversal_weights.npz")) < 300_000

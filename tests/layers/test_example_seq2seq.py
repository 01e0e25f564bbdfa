"""The runnable example in examples/seq2seq_reversal: decodes with the shipped
weights (no torch), reverses its inputs, writes the heatmap PNG; its
fastattn-only trainer (train.py) learns the task on a small step budget."""
import json
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


def test_train_py_learns_reversal_without_torch():
    """train.py on a fixed budget (300 steps of 64, seeded): the loss falls and
    greedy decoding reverses held-out sequences; a 10-step run repeats bit for
    bit; torch is never imported.  (~8 s on two cores.)"""
    code = ("import json, sys\n"
            f"sys.path.insert(0, {EXAMPLE!r})\n"
            "import train\n"
            "a = train.train(10, n_eval=0, log_every=0)['losses']\n"
            "b = train.train(10, n_eval=0, log_every=0)['losses']\n"
            "r = train.train(300, n_eval=200, eval_every=0, log_every=0)\n"
            "print(json.dumps({'repeat': a == b, 'first': r['losses'][0], 'last20': r['losses'][-20:],\n"
            "                  'em': r['exact_match'], 'torch': 'torch' in sys.modules}))\n")
    r = run_child(code)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["repeat"]
    assert out["torch"] is False
    assert out["first"] > 2.0                       # ~ln(13) at the start
    assert max(out["last20"]) < 0.1, out["last20"]  # 0.015 at the time of writing
    assert out["em"] >= 0.9, out["em"]              # 0.985 at the time of writing

"""Decode with the Bahdanau seq2seq model shipped in ``reversal_weights.npz``
(trained by ``train.py``) using fastattn only -- no torch needed.

    python run.py [--png attention.png]

Prints the decoded outputs, the per-token alignments as text, and saves the
attention heatmap of the first example as a PNG (needs ``fastattn[viz]``).
"""
import argparse
import json
import os

import numpy as np

from fastattn import viz
from fastattn.layers import Seq2Seq

HERE = os.path.dirname(os.path.abspath(__file__))


def load(path=os.path.join(HERE, "reversal_weights.npz")):
    with np.load(path) as f:
        config = json.loads(str(f["__config__"]))
        vocab = [str(t) for t in f["__vocab__"]]
        state = {k: f[k] for k in f.files if not k.startswith("__")}
    model = Seq2Seq.from_config(config)
    model.load_state_dict(state)
    return model, vocab


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--png", default="attention.png", help="where to write the heatmap")
    args = ap.parse_args(argv)
    model, vocab = load()
    ids = {t: i for i, t in enumerate(vocab)}
    inputs = ["3 1 4 1 5", "2 7 1 8 2 8", "9 0 3", "1 2 3 4 5 6 7"]
    toks = [s.split() for s in inputs]
    S = max(map(len, toks))
    src = np.zeros((len(toks), S), np.int64)  # 0 = <pad>
    for i, t in enumerate(toks):
        src[i, :len(t)] = [ids[c] for c in t]
    mask = src != 0
    greedy = model.greedy_decode(src, mask, max_len=S + 2)
    beam = model.beam_search(src, mask, beam_size=4, max_len=S + 2)
    n_ok = 0
    for i, t in enumerate(toks):
        out = [vocab[j] for j in greedy.tokens[i, :greedy.lengths[i]] if j != model.eos_id]
        out_b = [vocab[j] for j in beam.tokens[i, :beam.lengths[i]] if j != model.eos_id]
        ok = out == t[::-1]
        n_ok += ok
        print(f"{' '.join(t):<15} -> greedy {' '.join(out):<15} beam {' '.join(out_b):<15}"
              f"{'ok' if ok else 'WRONG'}")
    print(f"{n_ok}/{len(toks)} reversed correctly\n")
    n = greedy.lengths[0]
    out_tokens = [vocab[j] for j in greedy.tokens[0, :n]]
    weights = greedy.alignments[0, :n, :len(toks[0])]
    print(viz.highlight(weights, out_tokens, toks[0], top_k=1))
    fig = viz.heatmap(weights, out_tokens, toks[0], title=f"reversing {inputs[0]!r}", annotate=True)
    fig.savefig(args.png, dpi=120)
    print("\nwrote", args.png)
    return n_ok


if __name__ == "__main__":
    main()

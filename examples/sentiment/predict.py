"""Classify texts with a model train.py wrote, and show the tokens its
attention pooling weighted most.

    python predict.py --model model/ "这本书写得很好，值得一读"
    python predict.py --model model/ --file reviews.txt --html weights.html

For each text: the label (positive / negative), the probability of that
label, and the text with its most weighted tokens highlighted (ANSI colours
on a terminal, ``[brackets]`` otherwise).  ``--html OUT`` writes a page with
every token shaded by its weight.  The last line of stdout is one JSON list
of ``{"label", "prob", "p_positive", "weights", "tokens"}`` (``label`` 1 =
positive; ``weights`` one per token, summing to 1).
"""
import argparse
import json
import os
import sys

import numpy as np

import fastattn
from fastattn import viz

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402


class Classifier:
    """A loaded model directory: ``predict(texts)`` → one dict per text."""

    def __init__(self, model_dir):
        self.model, self.vocab, self.meta = C.read_model_dir(model_dir)
        self.model.eval()
        self.index = {t: i for i, t in enumerate(self.vocab)}
        self.kind = self.meta["tokens"]
        self.max_tokens = self.meta["max_tokens"]

    def predict(self, texts):
        toks = [C.tokenize(t, self.kind)[:self.max_tokens] for t in texts]
        seqs = [np.array([self.index.get(t, C.UNK) for t in tk] or [C.UNK], np.int64) for tk in toks]
        ids, mask = C.pad_batch(seqs)
        logits, w = self.model(ids, mask, return_weights=True)
        p = C.softmax64(logits)   # the ensemble's mean probabilities (logits are their log)
        w = w.mean(axis=1)
        out = []
        for i, tk in enumerate(toks):
            label = int(np.argmax(p[i]))
            tk = tk or ["<unk>"]   # an empty text is one unknown token
            out.append({"label": label, "prob": round(float(p[i, label]), 4),
                        "p_positive": round(float(p[i, 1]), 4),
                        "weights": [round(float(x), 4) for x in w[i, :len(tk)]],
                        "tokens": tk})
        return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="the directory train.py wrote")
    ap.add_argument("--file", help="one text per line (UTF-8)")
    ap.add_argument("--html", help="write a page with every token shaded by its weight")
    ap.add_argument("--top", type=int, default=3, help="tokens highlighted per text")
    ap.add_argument("--color", choices=("auto", "always", "never"), default="auto")
    ap.add_argument("texts", nargs="*")
    a = ap.parse_args(argv)
    texts = list(a.texts)
    if a.file:
        try:
            with open(a.file, encoding="utf-8") as f:
                texts += [line.strip() for line in f if line.strip()]
        except OSError as exc:
            ap.error(f"--file {a.file}: {exc.strerror}")
        except UnicodeDecodeError as exc:
            ap.error(f"--file {a.file}: expected UTF-8 text ({exc.reason} at byte {exc.start})")
    if not texts:
        ap.error("expected texts to classify (arguments or --file)")
    if a.top < 1:
        ap.error(f"--top: expected an integer >= 1, got {a.top}")
    clf = Classifier(a.model)
    results = clf.predict(texts)
    color = a.color == "always" or (a.color == "auto" and sys.stdout.isatty())
    sep = "" if clf.kind == "char" else " "
    for r in results:
        name = "positive" if r["label"] == 1 else "negative"
        shown = viz.highlight_tokens(r["weights"], r["tokens"], a.top, color=color, sep=sep)
        print(f"{name} {r['prob']:.3f}  {shown}")
    if a.html:
        rows = [(r["tokens"], r["weights"],
                 f"{'positive' if r['label'] == 1 else 'negative'} {r['prob']:.3f}") for r in results]
        with open(a.html, "w", encoding="utf-8") as f:
            f.write(viz.tokens_html(rows, title="Sentiment: the tokens the attention pooling weighted",
                                    sep=sep))
    print(json.dumps(results, ensure_ascii=False))
    return results


if __name__ == "__main__":
    try:
        with fastattn.threads(1):
            main()
    except C.DataError as exc:
        sys.exit(f"error: {exc}")

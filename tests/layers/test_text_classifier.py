"""TextClassifier: logits and every gradient against the same model written
in torch (float64, autograd), against finite differences, padding
invariance, its pooling weights, checkpoints and bad input."""
from __future__ import annotations

import math

import numpy as np
import pytest

import fastattn
from fastattn.layers import TextClassifier
from fastattn.layers.classifier import hash_ngrams
from fastattn.testing import check_gradients

torch = pytest.importorskip("torch")

V = 23


def _ids(rng, B=4, L=7):
    lengths = np.array([L, L - 3, 1, L - 1][:B])
    mask = np.arange(L)[None, :] < lengths[:, None]
    ids = np.where(mask, rng.integers(2, V, (B, L)), 0)
    return ids, mask


def _model(**kw):
    cfg = dict(embed_dim=8, num_heads=2, num_layers=1, ff_dim=12, dropout=0.0, max_len=16,
               ngram_buckets=11, ngram_orders=(2, 3), attn_dim=5, hops=2, seed=0,
               dtype=np.float64)
    cfg.update(kw)
    return TextClassifier(V, 3, **cfg)


def _torch_logits(m, ids, mask):
    """The model's math in torch, from its state dict: (logits, {name: tensor})."""
    sd = {n: torch.tensor(a, requires_grad=True) for n, a in m.named_parameters()}
    c = m.get_config()
    idt, mt = torch.from_numpy(ids), torch.from_numpy(mask)
    x = sd["embedding.weight"][idt]
    if c["ngram_buckets"]:
        for g in hash_ngrams(ids, mask, c["ngram_orders"], c["ngram_buckets"]):
            x = x + sd["ngrams.weight"][torch.from_numpy(g)] * torch.from_numpy(g > 0)[..., None]
    x = x + sd["positions.weight"][:ids.shape[1]]
    if c["rnn_hidden"]:
        gru = torch.nn.GRU(c["embed_dim"], c["rnn_hidden"], batch_first=True, bidirectional=True,
                           dtype=torch.float64)
        gru_params = {n: sd[f"rnn.{n}"] for n, _ in gru.named_parameters()}
        packed = torch.nn.utils.rnn.pack_padded_sequence(x, mt.sum(1), batch_first=True,
                                                         enforce_sorted=False)
        out, _ = torch.func.functional_call(gru, gru_params, (packed,))
        x, _ = torch.nn.utils.rnn.pad_packed_sequence(out, batch_first=True,
                                                      total_length=ids.shape[1])
    for i in range(c["num_layers"]):
        layer = torch.nn.TransformerEncoderLayer(x.shape[-1], c["num_heads"], c["ff_dim"], 0.0,
                                                 batch_first=True, dtype=torch.float64)
        pre = f"encoder.layers.{i}."
        params = {n: sd[pre + n] for n, _ in layer.named_parameters()}
        layer.train()
        x = torch.func.functional_call(layer, params, (x,), {"src_key_padding_mask": ~mt})
    s = (torch.tanh(x @ sd["pool.W_s1"].T) @ sd["pool.W_s2"].T).transpose(1, 2)
    a = torch.softmax(s.masked_fill(~mt[:, None, :], -math.inf), -1)
    pen = a @ a.transpose(1, 2) - torch.eye(c["hops"], dtype=torch.float64)
    P = (pen * pen).sum((1, 2)).mean()
    logits = (a @ x).flatten(1) @ sd["head.weight"].T + sd["head.bias"]
    if c["wide_buckets"]:
        rows = m._wide_ids(ids, mask)
        real = torch.from_numpy((rows != 0) & mask[None])
        per = sd["wide.weight"][torch.from_numpy(rows)] * real[..., None]
        logits = logits + c["wide_scale"] * per.sum((0, 2)) / mt.sum(1, keepdim=True)
    return logits, P, sd


@pytest.mark.parametrize("kw", [{}, {"penalty": 0.3}, {"rnn_hidden": 4, "num_layers": 1},
                                {"ngram_buckets": 0, "num_layers": 2},
                                {"num_layers": 0, "hops": 1}, {"wide_buckets": 13, "wide_scale": 7.5}],
                         ids=["ngrams", "penalty", "bigru", "two-layers", "pool-only", "wide"])
def test_matches_torch_autograd(kw, rng):
    m = _model(**kw)
    if m.wide is not None:   # non-zero wide scores (zeros at init)
        m.wide._params["weight"][...] = rng.standard_normal(m.wide._params["weight"].shape)
    ids, mask = _ids(rng)
    logits, backprop = m.forward_backward(ids, mask)
    g = rng.standard_normal(logits.shape)
    assert backprop(g) == (None, None)
    tl, P, sd = _torch_logits(m, ids, mask)
    np.testing.assert_allclose(logits, tl.detach().numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(m.last_penalty, P.item(), rtol=1e-10)
    ((tl * torch.from_numpy(g)).sum() + m.get_config()["penalty"] * P).backward()
    for name, grad in m.named_grads():
        want = sd[name].grad
        want = np.zeros_like(grad) if want is None else want.numpy()
        if name in ("embedding.weight", "wide.weight"):
            want[0] = 0   # padding_idx gets no gradient (torch's lookup above gives it some)
        np.testing.assert_allclose(grad, want, rtol=1e-9, atol=1e-11, err_msg=name)


def test_finite_differences(rng):
    # no penalty: the value checked is <g, logits> (the penalty's gradient is
    # checked against torch above)
    m = _model(rnn_hidden=3, wide_buckets=5)
    ids, mask = _ids(rng)
    errs = check_gradients(m, ids, mask, entries=4)
    assert errs and max(errs.values()) < 1e-5


def test_padding_does_not_change_the_result(rng):
    m = _model(wide_buckets=7)
    m.wide._params["weight"][...] = rng.standard_normal(m.wide._params["weight"].shape)
    ids, mask = _ids(rng, L=6)
    wide = np.concatenate([ids, np.full((4, 3), 7)], 1)          # junk ids behind the mask
    wmask = np.concatenate([mask, np.zeros((4, 3), bool)], 1)
    a, wa = m(ids, mask, return_weights=True)
    b, wb = m(wide, wmask, return_weights=True)
    np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(wa, wb[..., :6], rtol=1e-12, atol=1e-14)
    assert np.all(wb[..., 6:] == 0)
    w = m.token_weights(ids, mask)
    np.testing.assert_allclose(w.sum(1), 1.0, rtol=1e-12)
    assert np.all(w[~mask] == 0)


@pytest.mark.parametrize("kw", [dict(dropout=0.3), dict(wide_buckets=9, wide_dropout=0.5)])
def test_inference_equals_training_forward_without_dropout(kw, rng):
    m = _model(**kw)
    if m.wide is not None:
        m.wide._params["weight"][...] = rng.standard_normal(m.wide._params["weight"].shape)
    ids, mask = _ids(rng)
    m.eval()
    logits, _ = m.forward_backward(ids, mask)
    np.testing.assert_array_equal(logits, m(ids, mask))
    m.train()
    noisy, _ = m.forward_backward(ids, mask)
    assert not np.allclose(noisy, logits)


def test_float32_close_to_float64(rng):
    m64 = _model()
    m32 = _model(dtype=np.float32)
    m32.load_state_dict({k: v.astype(np.float32) for k, v in m64.state_dict().items()})
    ids, mask = _ids(rng)
    out = m32(ids, mask)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, m64(ids, mask), rtol=1e-4, atol=1e-5)


def test_save_load_round_trip(tmp_path, rng):
    m = _model(dtype=np.float32, rnn_hidden=4)
    ids, mask = _ids(rng)
    path = tmp_path / "m.npz"
    fastattn.save(m, path)
    back = fastattn.load(path)
    assert isinstance(back, TextClassifier)
    assert back.get_config() == m.get_config()
    np.testing.assert_array_equal(back(ids, mask), m(ids, mask))


def test_hash_ngrams_values():
    ids = np.array([[5, 6, 7, 0]])
    mask = ids > 0
    (bi,) = hash_ngrams(ids, mask, (2,), 1000)
    M = 1_000_003
    assert bi[0, 0] == 0 and bi[0, 3] == 0          # no bigram before the start; padding
    h = lambda a, b: 1 + (((a + 1) * M + (b + 1)) % 2 ** 64) % 1000  # noqa: E731
    assert bi[0, 1] == h(5, 6) and bi[0, 2] == h(6, 7)
    with pytest.raises(ValueError, match="buckets"):
        hash_ngrams(ids, mask, (2,), 0)
    with pytest.raises(ValueError, match="ngram_orders"):
        hash_ngrams(ids, mask, (1,), 10)


@pytest.mark.parametrize("bad, exc, msg", [
    (dict(num_heads=3), ValueError, "num_heads"),
    (dict(ngram_orders=(1,)), ValueError, "ngram_orders"),
    (dict(ngram_orders="2"), TypeError, "ngram_orders"),
    (dict(positions="rotary"), ValueError, "positions"),
    (dict(penalty=-1.0), ValueError, "penalty"),
    (dict(dropout=1.0), ValueError, "dropout"),
    (dict(num_layers=-1), ValueError, "num_layers"),
    (dict(wide_scale=0.0), ValueError, "wide_scale"),
    (dict(wide_scale=True), ValueError, "wide_scale"),
])
def test_bad_config(bad, exc, msg):
    with pytest.raises(exc, match=msg):
        _model(**bad)


def test_bad_input(rng):
    m = _model()
    ids, mask = _ids(rng)
    with pytest.raises(TypeError, match="ids: expected an integer array"):
        m(ids.astype(float), mask)
    with pytest.raises(ValueError, match=r"ids: expected ids in \[0, 23\), got 23"):
        m(np.full_like(ids, V), mask)
    with pytest.raises(ValueError, match="max_len=16"):
        m(np.ones((1, 17), np.int64))
    with pytest.raises(TypeError, match="mask: expected a boolean"):
        m(ids, mask.astype(int))
    with pytest.raises(ValueError, match="mask: expected the shape"):
        m(ids, mask[:, :3])
    gap = mask.copy()
    gap[0, 1] = False
    with pytest.raises(ValueError, match="padding at the end"):
        m(ids, gap)
    before = ids.copy()
    m.forward_backward(ids, mask)
    np.testing.assert_array_equal(ids, before)   # inputs never modified

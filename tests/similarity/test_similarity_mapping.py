"""The parameter mappings of docs/similarities.md: Keras and TF-Addons layers.

Each peer layer's score and attention are written in NumPy exactly as their
sources compute them (no TensorFlow needed); fastattn.attention with the
documented mapping must reproduce them.  When Keras 3 is installed, its real
layers (torch backend) are checked too.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

import fastattn

from support import assert_close, randn


def _softmax(s):
    s = s - s.max(axis=-1, keepdims=True)
    e = np.exp(s)
    return e / e.sum(axis=-1, keepdims=True)


# ------------------------------------------------------- reference layers

def keras_additive_attention(query, value, key, scale=None, value_mask=None):
    """keras.layers.AdditiveAttention: sum(scale * tanh(q + k), -1), softmax, @ value."""
    s = np.sum((1.0 if scale is None else scale) * np.tanh(query[..., :, None, :] + key[..., None, :, :]), axis=-1)
    if value_mask is not None:
        s = s - 1e9 * (~value_mask[..., None, :])
    w = _softmax(s)
    return w @ value, w


def keras_attention_concat(query, value, key, concat_score_weight, scale=None):
    """keras.layers.Attention(score_mode="concat"): c * sum(tanh(scale * (q + k)), -1)."""
    h = query[..., :, None, :] + key[..., None, :, :]
    if scale is not None:
        h = scale * h
    s = concat_score_weight * np.sum(np.tanh(h), axis=-1)
    w = _softmax(s)
    return w @ value, w


def tfa_bahdanau(query, memory, query_kernel, memory_kernel, attention_v,
                 normalize=False, attention_g=None, attention_b=None, memory_mask=None):
    """tfa.seq2seq.BahdanauAttention, one decoder step: query (B, d_q),
    memory (B, T, d_m); Dense kernels are (in, units)."""
    keys = memory @ memory_kernel                       # memory_layer(memory)
    processed_query = (query @ query_kernel)[:, None, :]  # query_layer(query), expanded
    if normalize:
        normed_v = attention_g * attention_v / np.sqrt(np.sum(attention_v ** 2))
        score = np.sum(normed_v * np.tanh(keys + processed_query + attention_b), axis=2)
    else:
        score = np.sum(attention_v * np.tanh(keys + processed_query), axis=2)
    if memory_mask is not None:
        score = np.where(memory_mask, score, -np.inf)
    alignments = _softmax(score)
    context = np.einsum("bt,btd->bd", alignments, memory)
    return context, alignments


def tfa_luong(query, memory, memory_kernel, scale=False, attention_g=1.0):
    """tfa.seq2seq.LuongAttention, one step: score = query . (memory @ kernel)."""
    keys = memory @ memory_kernel
    score = np.einsum("bd,btd->bt", query, keys)
    if scale:
        score = attention_g * score
    alignments = _softmax(score)
    return np.einsum("bt,btd->bd", alignments, memory), alignments


# ----------------------------------------------------------------- tests

def test_keras_additive_attention_mapping(rng):
    B, Tq, Tv, dim = 2, 5, 7, 6
    q, v, k = randn(rng, (B, Tq, dim)), randn(rng, (B, Tv, dim)), randn(rng, (B, Tv, dim))
    scale = randn(rng, (dim,))
    mask = np.ones((B, Tv), bool)
    mask[0, 4:] = False
    ref, ref_w = keras_additive_attention(q, v, k, scale, mask)
    eye = np.eye(dim)
    params = {"W_q": eye, "W_k": eye, "v": scale}
    got, w = fastattn.attention(q, k, v, "additive", params=params,
                                attn_mask=mask[:, None, :], return_weights=True)
    assert_close(got, ref, np.float64)
    assert_close(w, ref_w, np.float64)
    # use_scale=False: v = ones
    ref, _ = keras_additive_attention(q, v, k)
    got = fastattn.attention(q, k, v, "additive", params={"W_q": eye, "W_k": eye, "v": np.ones(dim)})
    assert_close(got, ref, np.float64)


def test_keras_attention_concat_mapping(rng):
    q, v, k = randn(rng, (3, 4, 5)), randn(rng, (3, 6, 5)), randn(rng, (3, 6, 5))
    c, s = 1.3, 0.7
    ref, ref_w = keras_attention_concat(q, v, k, c, s)
    params = {"W_q": s * np.eye(5), "W_k": s * np.eye(5), "v": np.full(5, c)}
    got, w = fastattn.attention(q, k, v, "additive", params=params, return_weights=True)
    assert_close(got, ref, np.float64)
    assert_close(w, ref_w, np.float64)
    # the same through "concat": W = [s I, s I]
    got = fastattn.attention(q, k, v, "concat",
                             params={"W": np.hstack([s * np.eye(5), s * np.eye(5)]), "v": np.full(5, c)})
    assert_close(got, ref, np.float64)


@pytest.mark.parametrize("normalize", [False, True])
def test_tfa_bahdanau_mapping(normalize, rng):
    B, T, d_q, d_m, units = 3, 9, 4, 6, 5
    query, memory = randn(rng, (B, d_q)), randn(rng, (B, T, d_m))
    qk, mk, av = randn(rng, (d_q, units)), randn(rng, (d_m, units)), randn(rng, (units,))
    g, b = np.sqrt(1.0 / units), randn(rng, (units,))
    lengths = np.array([9, 4, 1])
    mem_mask = np.arange(T)[None, :] < lengths[:, None]
    ref, ref_w = tfa_bahdanau(query, memory, qk, mk, av, normalize, g, b, mem_mask)
    params = {"W_q": qk.T, "W_k": mk.T, "v": av}
    if normalize:
        params.update(b=b, g=g)
    sim = fastattn.similarity.AdditiveSimilarity(normalize=normalize)
    got, w = fastattn.attention(query[:, None, :], memory, memory, sim, params=params,
                                attn_mask=mem_mask[:, None, :], return_weights=True)
    assert_close(got[:, 0], ref, np.float64)
    assert_close(w[:, 0], ref_w, np.float64)


@pytest.mark.parametrize("scale", [False, True])
def test_tfa_luong_mapping(scale, rng):
    B, T, d_q, d_m = 2, 8, 5, 3
    query, memory = randn(rng, (B, d_q)), randn(rng, (B, T, d_m))
    mk = randn(rng, (d_m, d_q))  # units must equal the query depth
    ref, ref_w = tfa_luong(query, memory, mk, scale, 1.7)
    params = {"W": mk.T, "scale": 1.7 if scale else 1.0}
    got, w = fastattn.attention(query[:, None, :], memory, memory, "general", params=params,
                                return_weights=True)
    assert_close(got[:, 0], ref, np.float64)
    assert_close(w[:, 0], ref_w, np.float64)


def _keras():
    os.environ.setdefault("KERAS_BACKEND", "torch")
    keras = pytest.importorskip("keras")
    if keras.backend.backend() != "torch":
        pytest.skip(f"keras uses the {keras.backend.backend()} backend, these tests use torch")
    return keras


def test_real_keras_additive_attention(rng):
    keras = _keras()
    q, v, k = (randn(rng, s, np.float32) for s in ((2, 5, 6), (2, 7, 6), (2, 7, 6)))
    layer = keras.layers.AdditiveAttention(use_scale=True)
    layer([q, v, k])
    scale = randn(rng, (6,), np.float32)
    layer.scale.assign(scale)
    out, scores = layer([q, v, k], return_attention_scores=True)
    out = keras.ops.convert_to_numpy(out)
    scores = keras.ops.convert_to_numpy(scores)
    eye = np.eye(6, dtype=np.float32)
    got, w = fastattn.attention(q, k, v, "additive", params={"W_q": eye, "W_k": eye, "v": scale},
                                return_weights=True)
    np.testing.assert_allclose(got, out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(w, scores, rtol=1e-5, atol=1e-6)


def test_real_keras_attention_concat(rng):
    keras = _keras()
    q, v, k = (randn(rng, s, np.float32) for s in ((2, 4, 3), (2, 6, 3), (2, 6, 3)))
    layer = keras.layers.Attention(use_scale=True, score_mode="concat")
    layer([q, v, k])
    layer.scale.assign(0.8)
    layer.concat_score_weight.assign(1.4)
    out = keras.ops.convert_to_numpy(layer([q, v, k], use_causal_mask=True))
    s = np.float32(0.8)
    got = fastattn.attention(q, k, v, "additive",
                             params={"W_q": s * np.eye(3), "W_k": s * np.eye(3), "v": np.full(3, 1.4)},
                             is_causal=True)
    np.testing.assert_allclose(got, out, rtol=1e-5, atol=1e-5)

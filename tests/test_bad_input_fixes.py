"""Regression tests for the bugs the bad-input table (docs/bad_input.md) exposed.

One test (or group) per fix; the table's rows themselves are in
tests/test_bad_input.py.
"""
from __future__ import annotations

import numpy as np
import pytest

import fastattn
from fastattn import functional as F
from fastattn import layers as L


# -------------------------------------------------- RNN layers, B = 0 or T = 0

@pytest.mark.parametrize("cls", [L.SimpleRNN, L.GRU, L.LSTM])
@pytest.mark.parametrize("shape", [(0, 3, 8), (2, 0, 8)], ids=["B0", "T0"])
def test_rnn_layer_empty_batch_or_sequence(cls, shape):
    """x.reshape(B * T, -1) cannot infer -1 from 0 elements: the layers raised
    NumPy's 'cannot reshape array of size 0' instead of returning empty outputs."""
    layer = cls(8, 4, num_layers=2, bidirectional=True, seed=0)
    x = np.zeros(shape, np.float32)
    out, state = layer(x)
    h = state[0] if isinstance(state, tuple) else state
    assert out.shape == shape[:2] + (8,) and out.dtype == np.float32
    assert h.shape == (4, shape[0], 4)
    np.testing.assert_array_equal(h, 0)  # T = 0: the initial (zero) state


def test_encoder_and_seq2seq_empty_source():
    enc = L.RNNEncoder(10, 4, 6, seed=0)
    out, final, mask = enc(np.zeros((2, 0), np.int64))
    assert out.shape == (2, 0, 6) and final.shape == (1, 2, 6) and mask.shape == (2, 0)
    out, final, mask = enc(np.zeros((0, 3), np.int64))
    assert out.shape == (0, 3, 6) and mask.shape == (0, 3)
    s2s = L.Seq2Seq(enc, L.AttentionDecoder(10, 4, 6, 6, seed=0), bos_id=1, eos_id=2)
    tokens, lengths, scores, align = s2s.greedy_decode(np.zeros((2, 0), np.int64), max_len=3)
    assert tokens.shape == (2, 3) and align.shape == (2, 3, 0)

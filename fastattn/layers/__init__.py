"""Stateful layers: parameters as NumPy arrays, seeded init, state dicts, configs.

Pure Python; every computation is a call into :mod:`fastattn.functional`.
:class:`Layer` is the base of every layer and of users' own: set
``self._params`` (``{name: ndarray}``) and ``self._config`` in ``__init__``,
return sub-layers from ``_children()``, and implement ``__call__`` and, for
training, ``forward_backward`` (its ``backprop`` adds into ``self.grads`` and
returns the float inputs' gradients); ``fastattn.testing.check_gradients``
checks it against finite differences.
"""
from ._base import Layer
from .attention import Attention, SelfAttention
from .blocks import (AttentionPooling, Dropout, FeedForward, LayerNorm, MeanPooling,
                     PositionalEmbedding, Sequential)
from .transformer import TransformerEncoder, TransformerEncoderLayer
from .multi_head import MultiHeadAttention
from .rnn import GRU, LSTM, Embedding, Linear, RNNEncoder, SimpleRNN
from .seq2seq import AttentionDecoder, DecodeResult, Memory, Seq2Seq
from .classifier import TextClassifier

__all__ = ["Layer", "Embedding", "Linear", "SimpleRNN", "GRU", "LSTM", "RNNEncoder", "Attention",
           "SelfAttention", "MultiHeadAttention", "AttentionDecoder", "Seq2Seq", "Memory",
           "DecodeResult", "LayerNorm", "Dropout", "FeedForward", "MeanPooling", "Sequential",
           "AttentionPooling", "PositionalEmbedding",
           "TransformerEncoderLayer", "TransformerEncoder", "TextClassifier"]

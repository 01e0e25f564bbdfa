"""Stateful layers: parameters as NumPy arrays, seeded init, state dicts, configs.

Pure Python; every computation is a call into :mod:`fastattn.functional`.
"""
from .attention import Attention, SelfAttention
from .blocks import (AttentionPooling, Dropout, FeedForward, LayerNorm, MeanPooling,
                     PositionalEmbedding, Sequential)
from .transformer import TransformerEncoder, TransformerEncoderLayer
from .multi_head import MultiHeadAttention
from .rnn import GRU, LSTM, Embedding, Linear, RNNEncoder, SimpleRNN
from .seq2seq import AttentionDecoder, DecodeResult, Memory, Seq2Seq

__all__ = ["Embedding", "Linear", "SimpleRNN", "GRU", "LSTM", "RNNEncoder", "Attention",
           "SelfAttention", "MultiHeadAttention", "AttentionDecoder", "Seq2Seq", "Memory",
           "DecodeResult", "LayerNorm", "Dropout", "FeedForward", "MeanPooling", "Sequential",
           "AttentionPooling", "PositionalEmbedding",
           "TransformerEncoderLayer", "TransformerEncoder"]

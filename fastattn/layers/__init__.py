"""Stateful layers (pure Python over :mod:`fastattn.functional`)."""
from .attention import Attention, SelfAttention
from .rnn import GRU, LSTM, Embedding, Linear, RNNEncoder, SimpleRNN
from .seq2seq import AttentionDecoder, DecodeResult, Memory, Seq2Seq

__all__ = ["Embedding", "Linear", "SimpleRNN", "GRU", "LSTM", "RNNEncoder", "Attention",
           "SelfAttention", "AttentionDecoder", "Seq2Seq", "Memory", "DecodeResult"]

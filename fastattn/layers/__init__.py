"""Stateful layers (pure Python over :mod:`fastattn.functional`)."""
from .attention import Attention, SelfAttention
from .rnn import GRU, LSTM, Embedding, Linear, RNNEncoder, SimpleRNN

__all__ = ["Embedding", "Linear", "SimpleRNN", "GRU", "LSTM", "RNNEncoder", "Attention",
           "SelfAttention"]

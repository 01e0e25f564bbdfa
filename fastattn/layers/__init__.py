"""Stateful layers (pure Python over :mod:`fastattn.functional`)."""
from .rnn import GRU, LSTM, Embedding, Linear, RNNEncoder, SimpleRNN

__all__ = ["Embedding", "Linear", "SimpleRNN", "GRU", "LSTM", "RNNEncoder"]

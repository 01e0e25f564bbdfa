"""Stateful attention layers: parameters as NumPy arrays, seeded init, state dicts, configs.

Pure Python; every computation is a call into :mod:`fastattn.functional`.
"""
from .multi_head import MultiHeadAttention

__all__ = ["MultiHeadAttention"]

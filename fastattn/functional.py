"""The public math of fastattn.

Shape glossary (used by every op):

========  ==========================================================
``...``   leading batch dims; broadcast against each other like NumPy
``Lq``    number of queries
``Lk``    number of keys (and values)
``d``     query / key feature size
``dv``    value feature size
========  ==========================================================

Masks: boolean ``True`` means *may attend*; a float mask is added to the
scores (use ``-inf`` to forbid).  Rows that may attend to nothing give zeros,
in the output and in the weights, on every path.

This module is the public facade: it implements nothing and re-exports each
op from its own private module (``_sdpa``, ``_attention``, ``_multihead``,
``_linear``, ``_embedding``, ``_recurrence``, ``_norm``; see ``docs/architecture.md``).
"""
from ._attention import PreparedAttention, attention, attention_backward
from ._attention import _SteppedAttention  # AttentionDecoder's training loop
from ._embedding import embedding, embedding_backward
from ._embedding import accumulate_backward as _embedding_backward_into  # the layers' in-place form
from ._linear import linear, linear_backward
from ._linear import _PackedLinear  # AttentionDecoder's per-step products
from ._linear import _linear_weight_grads  # ... and its query projection's weight gradient
from ._linear import _linear_input_grad  # ... and its input projection's embedding columns
from ._merge import merge_attention
from ._multihead import (multi_head_attention, multi_head_attention_backward,
                         multi_head_attention_forward_backward)
from ._norm import (dropout, dropout_backward, gelu, gelu_backward, layer_norm,
                    layer_norm_backward, relu, relu_backward)
from ._norm import relu_dropout as _relu_dropout  # FeedForward's fused relu + dropout
from ._norm import relu_dropout_backward as _relu_dropout_backward  # ... and its backward
from ._recurrence import rnn_cell, rnn_cell_backward, rnn_scan, rnn_scan_backward
from ._recurrence import _SteppedScan  # ... and its recurrence stepped one step a call
from ._sdpa import (BackwardPlan, Plan, explain, explain_backward, scaled_dot_product_attention,
                    sdpa_backward)

# For fastattn.layers.MultiHeadAttention (private): weights validated once, at
# load time, then the prepared call.  Looked up here at call time by the layer.
from ._multihead import MultiHeadWeights as _MultiHeadWeights  # noqa: F401
from ._multihead import multi_head_attention_prepared as _multi_head_attention_prepared  # noqa: F401
from ._multihead import prepare_weights as _prepare_mha_weights  # noqa: F401

__all__ = [
    "scaled_dot_product_attention",
    "sdpa_backward",
    "explain_backward",
    "BackwardPlan",
    "explain",
    "Plan",
    "multi_head_attention",
    "multi_head_attention_backward",
    "multi_head_attention_forward_backward",
    "attention",
    "attention_backward",
    "PreparedAttention",
    "merge_attention",
    "linear",
    "linear_backward",
    "embedding",
    "embedding_backward",
    "rnn_scan",
    "rnn_scan_backward",
    "rnn_cell",
    "rnn_cell_backward",
    "layer_norm",
    "layer_norm_backward",
    "gelu",
    "gelu_backward",
    "relu",
    "relu_backward",
    "dropout",
    "dropout_backward",
]

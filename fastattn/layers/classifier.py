"""``TextClassifier``: token ids → class logits through self-attention and
attention pooling (the sentiment classifier of ``examples/sentiment``).

Pure Python over the layers of this package; every computation is theirs.
"""
from __future__ import annotations

import numpy as np

from ._base import Layer, _config_seed, _rng, check_bool, check_dtype, check_int
from .blocks import AttentionPooling, Dropout, PositionalEmbedding, _check_activation, _check_p
from .rnn import GRU, Embedding, Linear
from .transformer import TransformerEncoder, TransformerEncoderLayer

__all__ = ["TextClassifier", "hash_ngrams"]

# n-gram hashing: h = (h * _MULT + id + 1) mod 2**64 over the n ids ending at a
# position (uint64 arithmetic wraps), then 1 + h mod buckets (0 = padding)
_MULT = np.uint64(1_000_003)


def _check_orders(orders):
    if isinstance(orders, (int, np.integer)) and not isinstance(orders, bool):
        orders = (orders,)
    if not isinstance(orders, (tuple, list)):
        raise TypeError(f"ngram_orders: expected a tuple of n-gram sizes >= 2, got "
                        f"{type(orders).__name__} {orders!r}")
    out = []
    for n in orders:
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 2:
            raise ValueError(f"ngram_orders: expected n-gram sizes >= 2, got {orders!r}")
        out.append(int(n))
    if len(set(out)) != len(out):
        raise ValueError(f"ngram_orders: expected distinct sizes, got {orders!r}")
    return tuple(sorted(out))


def hash_ngrams(ids, mask, orders, buckets):
    """``(len(orders), B, L)`` int64: for each order n, each position's hashed
    bucket (1 .. buckets) of the n ids ending there; 0 where the n-gram would
    start before the sequence or covers padding (``mask`` False).

    The hash: ``h = (h * 1000003 + id + 1) mod 2**64`` over the n ids, oldest
    first, then ``1 + h mod buckets``; deterministic across machines."""
    buckets = check_int(buckets, "buckets")
    orders = _check_orders(orders)
    ids = np.asarray(ids)
    if ids.dtype.kind not in "iu" or ids.ndim != 2:
        raise ValueError(f"ids: expected a 2-d integer array (B, L), got {ids.dtype} {ids.shape}")
    mask = np.asarray(mask, dtype=bool)
    if mask.shape != ids.shape:
        raise ValueError(f"mask: expected the shape of ids {ids.shape}, got {mask.shape}")
    B, L = ids.shape
    if not orders:
        return np.zeros((0, B, L), np.int64)
    # h_n(t) = h_{n-1}(t - 1) * M + id_t + 1 (h_1 = id + 1): one shifted
    # multiply-add per order up to the largest, the same values as the loop
    # over the n ids of each n-gram; kept where position t is a real token
    # and t >= n - 1 (real tokens come first in TextClassifier's masks).
    out = np.zeros((len(orders), B, L), np.int64)
    ids1 = ids.astype(np.uint64) + np.uint64(1)
    h = ids1
    want = {n: i for i, n in enumerate(orders)}
    with np.errstate(over="ignore"):
        for n in range(2, orders[-1] + 1):
            j = n - 1
            if j >= L:
                break
            nh = np.zeros((B, L), np.uint64)
            nh[:, j:] = h[:, j - 1:L - 1] * _MULT + ids1[:, j:]
            h = nh
            if n in want:
                bucket = (h[:, j:] % np.uint64(buckets)).astype(np.int64) + 1
                out[want[n], :, j:] = np.where(mask[:, j:], bucket, 0)
    return out


class TextClassifier(Layer):
    """Token ids ``(B, L)`` and their mask → logits ``(B, num_classes)``::

        x = Embedding(ids) [+ Σ_n NgramEmbedding(hash of the n ids ending here)]
        x = Dropout(PositionalEmbedding(x))
        x = BiGRU(x)                           (rnn_hidden > 0; padding never enters)
        x = TransformerEncoder(x, key_mask)    (num_layers encoder layers)
        p = AttentionPooling(x, mask)          (hops × attn_dim, Lin et al. 2017)
        logits = Linear(Dropout(p)) [+ mean over the tokens of Wide(token, its n-grams)]

    ``ngram_buckets > 0`` adds hashed n-gram embeddings (fastText's device;
    ``ngram_orders``, default bigrams) to each token's: a character bigram
    carries much of a Chinese word's meaning.  Positions 0 of the ids
    (``padding_idx``) are padding.  The pooling's weights ``(B, hops, L)``
    show which tokens the decision rests on (``return_weights=True``);
    ``penalty`` weighs the pooling's ``‖AAᵀ − I‖²`` term in training.
    ``wide_buckets > 0`` adds a "wide" part (Cheng et al. 2016's wide & deep;
    fastText's linear classifier): a class-score vector per token id and per
    hashed n-gram (``ngram_orders``, ``wide_buckets`` buckets of their own),
    averaged over the real tokens, times ``wide_scale``, and added to the
    logits -- a linear model over the bag of n-grams, trained jointly with the
    attention part; ``wide_dropout`` drops each of those scores with that
    probability in training (the others scaled up).  With Adam a parameter moves by about ``lr`` a step
    whatever its gradient's size, so ``wide_scale`` is the wide part's
    learning rate relative to the rest's (in logit units): its scores start at
    zero and need many times the deep part's rate to matter.

    ``forward(ids, mask=None)`` (mask: True = real token, None: all) is the
    inference path; ``forward_backward(ids, mask=None)`` → ``(logits,
    backprop)``, ``backprop(grad_logits)`` → ``(None, None)``.
    """

    def __init__(self, vocab_size, num_classes=2, embed_dim=128, *, num_heads=4, num_layers=1,
                 ff_dim=256, dropout=0.1, activation="relu", norm_first=False, max_len=512,
                 positions="learned", rnn_hidden=0, ngram_buckets=0, ngram_orders=(2,),
                 attn_dim=64, hops=1, penalty=0.0, wide_buckets=0, wide_scale=1.0, wide_dropout=0.0,
                 padding_idx=0, seed=None, dtype=np.float32):
        V = check_int(vocab_size, "vocab_size")
        C = check_int(num_classes, "num_classes")
        E = check_int(embed_dim, "embed_dim")
        heads = check_int(num_heads, "num_heads")
        nl = check_int(num_layers, "num_layers", 0)
        ff = check_int(ff_dim, "ff_dim")
        p = _check_p(dropout, "dropout")
        activation = _check_activation(activation)
        norm_first = check_bool(norm_first, "norm_first")
        n = check_int(max_len, "max_len")
        if positions not in ("learned", "sinusoidal", None):
            raise ValueError(f"positions: expected 'learned', 'sinusoidal' or None, got {positions!r}")
        rh = check_int(rnn_hidden, "rnn_hidden", 0)
        nb = check_int(ngram_buckets, "ngram_buckets", 0)
        orders = _check_orders(ngram_orders)
        wb = check_int(wide_buckets, "wide_buckets", 0)
        if isinstance(wide_scale, bool) or not isinstance(wide_scale, (int, float, np.floating)) \
                or not (0 < wide_scale < np.inf):
            raise ValueError(f"wide_scale: expected a finite number > 0, got {wide_scale!r}")
        wp = _check_p(wide_dropout, "wide_dropout")
        da = check_int(attn_dim, "attn_dim")
        r = check_int(hops, "hops")
        if isinstance(penalty, bool) or not isinstance(penalty, (int, float, np.floating)) \
                or not penalty >= 0:
            raise ValueError(f"penalty: expected a coefficient >= 0, got {penalty!r}")
        pad = check_int(padding_idx, "padding_idx", 0)
        if pad >= V:
            raise ValueError(f"padding_idx: expected an id < vocab_size={V}, got {pad}")
        dt = check_dtype(dtype)
        d_model = 2 * rh if rh else E
        if nl and d_model % heads:
            raise ValueError(f"num_heads: expected a divisor of the encoder width {d_model} "
                             f"({'2 * rnn_hidden' if rh else 'embed_dim'}), got {heads}")
        self._config = dict(vocab_size=V, num_classes=C, embed_dim=E, num_heads=heads,
                            num_layers=nl, ff_dim=ff, dropout=p, activation=activation,
                            norm_first=norm_first, max_len=n, positions=positions,
                            rnn_hidden=rh, ngram_buckets=nb, ngram_orders=list(orders),
                            attn_dim=da, hops=r, penalty=float(penalty), wide_buckets=wb,
                            wide_scale=float(wide_scale), wide_dropout=wp, padding_idx=pad,
                            seed=_config_seed(seed), dtype=dt.name)
        rng = _rng(seed)
        self.embedding = Embedding(V, E, padding_idx=pad, seed=rng, dtype=dt)
        self.ngrams = Embedding(nb + 1, E, padding_idx=0, seed=rng, dtype=dt) if nb else None
        for emb in (self.embedding, self.ngrams):   # N(0, 1/E): the sum stays O(1)
            if emb is not None:
                emb._params["weight"] *= dt.type(1.0 / np.sqrt(E))
        self.positions = PositionalEmbedding(n, E, kind=positions, seed=rng, dtype=dt) \
            if positions else None
        if self.positions is not None and positions == "learned":
            self.positions._params["weight"] *= dt.type(1.0 / np.sqrt(E))
        self.dropout = Dropout(p, seed=rng)
        self.rnn = GRU(E, rh, bidirectional=True, seed=rng, dtype=dt) if rh else None
        self.encoder = TransformerEncoder(
            TransformerEncoderLayer(d_model, heads, ff, p, activation,
                                    norm_first=norm_first, seed=rng, dtype=dt),
            nl, norm=norm_first and nl > 0, seed=rng) if nl else None
        self.pool = AttentionPooling(d_model, da, r, seed=rng, dtype=dt)
        self.head_dropout = Dropout(p, seed=rng)
        self.head = Linear(r * d_model, C, seed=rng, dtype=dt)
        # rows: the token ids (padding's row unused), then 1 + the n-gram buckets; zeros at init
        self.wide = Embedding(V + wb, C, padding_idx=pad, seed=rng, dtype=dt) if wb else None
        if self.wide is not None:
            self.wide._params["weight"][...] = 0
        self.wide_dropout = Dropout(wp, seed=rng) if wb else None
        self._params = {}

    def _children(self):
        c = {"embedding": self.embedding}
        if self.ngrams is not None:
            c["ngrams"] = self.ngrams
        if self.positions is not None:
            c["positions"] = self.positions
        c["dropout"] = self.dropout
        if self.rnn is not None:
            c["rnn"] = self.rnn
        if self.encoder is not None:
            c["encoder"] = self.encoder
        c.update(pool=self.pool, head_dropout=self.head_dropout, head=self.head)
        if self.wide is not None:
            c["wide"] = self.wide
            c["wide_dropout"] = self.wide_dropout
        return c

    def _wide_ids(self, ids, mask):
        """``(1 + len(orders), B, L)`` rows of the wide table: the token ids,
        then V - 1 + each n-gram's bucket (the padding row where none)."""
        c = self._config
        V, pad = c["vocab_size"], c["padding_idx"]
        grams = hash_ngrams(ids, mask, c["ngram_orders"], c["wide_buckets"])
        rows = np.where(grams > 0, grams + (V - 1), pad)
        return np.concatenate([ids[None], rows])

    def _wide_forward(self, ids, mask, backward=False):
        """The wide logits ``(B, C)`` (and their backprop when ``backward``)."""
        rows = self._wide_ids(ids, mask)
        real = (rows != self._config["padding_idx"]) & mask[None]
        inv = self._config["wide_scale"] / np.maximum(mask.sum(1), 1)    # (B,)
        if backward:
            e, b = self.wide.forward_backward(rows)
        else:
            e, b = self.wide(rows), None
        w = (real * inv[None, :, None]).astype(e.dtype)                   # (k, B, L)
        w = self.wide_dropout(w)     # training: each token's / n-gram's score dropped with p
        out = np.einsum("kbl,kblc->bc", w, e)

        def backprop(g):
            b(w[..., None] * np.asarray(g, e.dtype)[None, :, None, :])
        return out, backprop

    # ------------------------------------------------------------- inputs
    def _ids_mask(self, ids, mask):
        a = np.asarray(ids)
        if a.dtype.kind not in "iu":
            raise TypeError(f"ids: expected an integer array of token ids, got dtype {a.dtype}")
        if a.ndim != 2:
            raise ValueError(f"ids: expected shape (B, L), got {a.ndim}-d array of shape {a.shape}")
        V, n = self._config["vocab_size"], self._config["max_len"]
        if a.size and (a.min() < 0 or a.max() >= V):
            bad = a[(a < 0) | (a >= V)].flat[0]
            raise ValueError(f"ids: expected ids in [0, {V}), got {bad}")
        if self.positions is not None and a.shape[1] > n:
            raise ValueError(f"ids: expected at most max_len={n} tokens, got {a.shape[1]} "
                             "(truncate the sequences)")
        if mask is None:
            m = np.ones(a.shape, bool)
        else:
            m = np.asarray(mask)
            if m.dtype != np.bool_:
                raise TypeError(f"mask: expected a boolean array (True = real token), got dtype {m.dtype}")
            if m.shape != a.shape:
                raise ValueError(f"mask: expected the shape of ids {a.shape}, got {m.shape}")
            if m.size and np.any(m[:, 1:] & ~m[:, :-1]):
                raise ValueError("mask: expected the real tokens first and the padding at the end "
                                 "of each row (True ... True False ... False)")
        a = np.where(m, a, self._config["padding_idx"]).astype(np.int64)
        return a, m.copy()

    def ngram_ids(self, ids, mask):
        """:func:`hash_ngrams` of (validated) ids with this layer's orders and buckets."""
        return hash_ngrams(ids, mask, self._config["ngram_orders"], self._config["ngram_buckets"])

    # ------------------------------------------------------------- passes
    def __call__(self, ids, mask=None, *, return_weights=False):
        return self.forward(ids, mask, return_weights=return_weights)

    def forward(self, ids, mask=None, *, return_weights=False):
        """logits ``(B, num_classes)``; with ``return_weights`` also the pooling
        weights ``(B, hops, L)`` (zero at padding)."""
        logits, w, _ = self._pass(ids, mask, infer=True)
        return (logits, w) if return_weights else logits

    def forward_backward(self, ids, mask=None):
        """``(logits, backprop)``; ``backprop(grad_logits)`` adds every gradient
        (the pooling penalty's too, weighted by ``penalty``) and returns
        ``(None, None)``.  The penalty's value is in :attr:`last_penalty`."""
        logits, _, backprop = self._pass(ids, mask, infer=False)
        return logits, backprop

    def _pass(self, ids, mask, infer):
        """``(logits, pooling weights or None, backprop or None)``: the inference
        path (``infer``: each child called, nothing kept) or the training one
        (each child's ``forward_backward``), one sequence of children."""
        fb = (lambda layer, *a, **k: (layer(*a, **k), None)) if infer else \
            (lambda layer, *a, **k: layer.forward_backward(*a, **k))
        ids, mask = self._ids_mask(ids, mask)
        keep = mask[..., None]
        x, b_emb = fb(self.embedding, ids)
        b_ngr = []
        if self.ngrams is not None:
            for g in self.ngram_ids(ids, mask):   # bucket 0 (none): no vector, whatever row 0 holds
                e, b = fb(self.ngrams, g)
                x = x + np.where((g > 0)[..., None], e, 0).astype(x.dtype, copy=False)
                b_ngr.append(b)
        b_pos = None
        if self.positions is not None:
            x, b_pos = fb(self.positions, x)
        x, b_d = fb(self.dropout, x)
        b_rnn = b_enc = None
        if self.rnn is not None:
            (x, _), b_rnn = fb(self.rnn, x, lengths=mask.sum(1))
            x = np.where(keep, x, 0).astype(x.dtype, copy=False)
        if self.encoder is not None:
            x, b_enc = fb(self.encoder, x, key_mask=mask)
        if infer:
            pooled, w = self.pool(x, mask, return_weights=True)
            b_pool = None
        else:
            (pooled, self.last_penalty), b_pool = self.pool.forward_backward(
                x, mask, penalty=self._config["penalty"])
            w = None
        h, b_hd = fb(self.head_dropout, pooled)
        logits, b_head = fb(self.head, h)
        b_wide = None
        if self.wide is not None:
            wl, b_wide = self._wide_forward(ids, mask, backward=not infer)
            logits = logits + wl
        if infer:
            return logits, w, None

        def backprop(grad_logits):
            if b_wide is not None:
                b_wide(grad_logits)
            (g,) = b_head(grad_logits)
            (g,) = b_hd(g)
            g, _ = b_pool(g)
            if b_enc is not None:
                (g,) = b_enc(g)
            if b_rnn is not None:
                g, _ = b_rnn(np.where(keep, g, 0).astype(g.dtype, copy=False))
            (g,) = b_d(g)
            if b_pos is not None:
                (g,) = b_pos(g)
            for b in b_ngr:
                b(g)
            b_emb(g)
            return None, None
        return logits, w, backprop

    def token_weights(self, ids, mask=None):
        """``(B, L)``: the pooling weights averaged over the hops (each row sums
        to 1 over its real tokens), in inference mode."""
        was = self.training
        self.eval()
        try:
            _, w = self.forward(ids, mask, return_weights=True)
        finally:
            self.train(was)
        return w.mean(axis=1)

    def get_config(self):
        c = dict(self._config)
        c["ngram_orders"] = list(c["ngram_orders"])
        return c

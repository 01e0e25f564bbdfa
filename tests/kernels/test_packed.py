"""The streaming path's packed register-blocked products at awkward sizes.

Key tiles are forced small (BLOCK_K monkeypatched) so that every call walks
several tiles with partial panels (a panel with at most one vector of valid
columns takes the one-vector kernels pb_8x1 / pb_6x1): row counts that are not multiples of the
6-row block, head widths that are not multiples of a vector, value widths that
leave a partial 16-column (float) / 8-column (double) panel, and a last tile
shorter than the others.
"""
import itertools

import numpy as np
import pytest

import fastattn
from fastattn import _sdpa

from support import assert_close, oracle, randn

SIZES = [  # (Lq, Lk, d, dv)
    (5, 1, 1, 1),
    (6, 15, 3, 7),
    (7, 16, 8, 16),
    (13, 17, 9, 17),
    (19, 50, 17, 33),
    (12, 47, 64, 64),
    (31, 100, 65, 40),
    (16, 16, 64, 64),   # one half-panel of keys: the one-vector kernels, 8-row blocks
    (22, 48, 64, 64),   # a full panel then a half one; 8 + 8 + 6 rows
]


@pytest.fixture
def small_tiles(monkeypatch):
    def use(bk):
        monkeypatch.setattr(_sdpa, "BLOCK_K", bk)
        _sdpa._clear_plans()
    yield use
    _sdpa._clear_plans()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("bk", [8, 24, 256])
@pytest.mark.parametrize("size", SIZES, ids=lambda s: "x".join(map(str, s)))
def test_packed_products_awkward_sizes(simd_mode, small_tiles, rng, dtype, bk, size):
    Lq, Lk, d, dv = size
    small_tiles(bk)
    q = randn(rng, (2, Lq, d), dtype)
    k = randn(rng, (2, Lk, d), dtype)
    v = randn(rng, (2, Lk, dv), dtype)
    mask = rng.random((2, Lq, Lk)) < 0.7
    for causal, m, align in itertools.product((False, True), (None, mask),
                                              ("top_left", "bottom_right")):
        plan = fastattn.explain(q, k, v, m, causal, causal_alignment=align)
        if fastattn.simd_active():
            assert plan.path == "streaming" and not plan.blas
            assert plan.block_k == min(bk, Lk)
        got = fastattn.scaled_dot_product_attention(q, k, v, m, causal, causal_alignment=align)
        ref = oracle(q, k, v, m, causal, causal_alignment=align)
        assert_close(got, ref, dtype, err_msg=f"causal={causal} mask={m is not None} {align}")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("bk", [8, 16, 256])
def test_padding_masks_trim_tiles(simd_mode, small_tiles, rng, dtype, bk):
    """A key mask shared by every query (padding, (B, 1, Lk)) ends each tile at
    its last allowed key; trailing runs that end inside a tile, on a tile
    boundary, span tiles, or cover everything."""
    small_tiles(bk)
    Lq, Lk, d = 13, 40, 9
    q = randn(rng, (4, Lq, d), dtype)
    k = randn(rng, (4, Lk, d), dtype)
    v = randn(rng, (4, Lk, 5), dtype)
    lengths = [40, 33, 16, 0]
    pad = np.arange(Lk)[None, None, :] < np.array(lengths)[:, None, None]
    pad[1, 0, 5] = False  # a hole before the tail too
    for causal in (False, True):
        got = fastattn.scaled_dot_product_attention(q, k, v, pad, causal)
        ref = oracle(q, k, v, pad, causal)
        assert_close(got, ref, dtype)
        assert np.all(got[3] == 0)  # no key at all: zeros

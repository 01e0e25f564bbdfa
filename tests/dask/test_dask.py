"""fastattn.dask on a real distributed cluster (tests/dask/conftest.py):
every result equals the single-machine call (float32 to 1e-5, float64 to
1e-12 relative) for each chunking kind (batch, heads, queries, keys, uneven),
fully masked blocks and rows, both causal alignments, every built-in
similarity; causal blocks without keys left out of the graph, a padding
mask never expanded, the layer sent once by apply, a similarity the workers
do not know, thread settings on the workers, and bad input."""
from __future__ import annotations

import numpy as np
import pytest

da = pytest.importorskip("dask.array", reason="the 'dask' extra is not installed "
                                              "(pip install '.[dask]')")
pytest.importorskip("distributed", reason="the 'dask' extra is not installed "
                                          "(pip install '.[dask]')")

import fastattn  # noqa: E402
import fastattn.dask as fd  # noqa: E402
from fastattn import layers as L  # noqa: E402
from fastattn.similarity import Similarity  # noqa: E402

from support import randn  # noqa: E402


def tol(dt):
    return dict(rtol=1e-5, atol=1e-6) if dt == np.float32 else dict(rtol=1e-12, atol=1e-13)


def close(got, want, dt):
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert got.shape == want.shape, (got.shape, want.shape)
    lo, wo = np.where(np.isneginf(got), 0, got), np.where(np.isneginf(want), 0, want)
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    np.testing.assert_allclose(lo, wo, **tol(dt))


def partial_tasks(arr):
    g = dict(arr.__dask_graph__())
    return [k for k in g if isinstance(k, tuple) and str(k[0]).startswith("fastattn-sdpa-part")]


# (query chunks, key chunks, value chunks) for q (2, 3, 50, 16), k/v (2, 3, 70, 16/8)
CHUNKINGS = {
    "one_block": ((2, 3, 50, 16), (2, 3, 70, 16), (2, 3, 70, 8)),
    "batch": ((1, 3, 50, 16), (1, 3, 70, 16), (1, 3, 70, 8)),
    "heads": ((2, (1, 2), 50, 16), (2, (2, 1), 70, 16), (2, 1, 70, 8)),
    "queries": ((2, 3, (13, 20, 17), 16), (2, 3, 70, 16), (2, 3, 70, 8)),
    "keys": ((2, 3, 50, 16), (2, 3, (30, 25, 15), 16), (2, 3, 35, 8)),
    "uneven_all": (((1, 1), (2, 1), (7, 40, 3), 16), (2, 3, (1, 60, 9), 16), (1, 3, 70, 8)),
}


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
@pytest.mark.parametrize("chunking", list(CHUNKINGS))
def test_sdpa_equals_the_single_machine_call(client, chunking, causal, dtype, rng):
    q, k, v = randn(rng, (2, 3, 50, 16), dtype), randn(rng, (2, 3, 70, 16), dtype), randn(rng, (2, 3, 70, 8), dtype)
    cq, ck, cv = CHUNKINGS[chunking]
    kw = dict(is_causal=causal is not None, causal_alignment=causal or "top_left")
    want, want_lse = fastattn.scaled_dot_product_attention(q, k, v, return_lse=True, **kw)
    out, lse = fd.scaled_dot_product_attention(da.from_array(q, chunks=cq), da.from_array(k, chunks=ck),
                                               da.from_array(v, chunks=cv), return_lse=True, **kw)
    assert out.dtype == dtype and out.shape == want.shape
    got, got_lse = client.compute([out, lse], sync=True)
    close(got, want, dtype)
    close(got_lse, want_lse, dtype)


@pytest.mark.parametrize("split_every", [None, 2, 3, 16])
def test_reduction_shapes_agree(client, split_every, rng):
    """A fold (default) or trees of any fan-in over 7 key chunks: the same
    result to rounding (the merge is associative)."""
    q, k, v = randn(rng, (2, 20, 8)), randn(rng, (2, 70, 8)), randn(rng, (2, 70, 4))
    out, lse = fd.scaled_dot_product_attention(q, da.from_array(k, chunks=(2, 10, 8)),
                                               da.from_array(v, chunks=(2, 10, 4)),
                                               return_lse=True, split_every=split_every)
    merges = [key for key in dict(out.__dask_graph__())
              if isinstance(key, tuple) and ("merge" in key[0] or "chain" in key[0])]
    # a fold: 6 merges of two; trees: ceil(7 / k) groups a level (a group of one passes through)
    assert len(merges) == {None: 6, 2: 4 + 2 + 1, 3: 3 + 1, 16: 1}[split_every]
    want, want_lse = fastattn.scaled_dot_product_attention(q, k, v, return_lse=True)
    got, got_lse = client.compute([out, lse], sync=True)
    close(got, want, np.float64)
    close(got_lse, want_lse, np.float64)
    with pytest.raises(ValueError, match=r"split_every: expected an int >= 2 or None, got 1"):
        fd.scaled_dot_product_attention(q, k, v, split_every=1)


def test_causal_blocks_without_keys_are_left_out(client, rng):
    q, k, v = randn(rng, (1, 100, 8)), randn(rng, (1, 100, 8)), randn(rng, (1, 100, 4))
    dq, dk, dv = (da.from_array(x, chunks=(1, 25, x.shape[-1])) for x in (q, k, v))
    out = fd.scaled_dot_product_attention(dq, dk, dv, is_causal=True)
    assert len(partial_tasks(out)) == 4 + 3 + 2 + 1   # of 16 (query block, key block) pairs
    full = fd.scaled_dot_product_attention(dq, dk, dv)
    assert len(partial_tasks(full)) == 16
    close(client.compute(out, sync=True), fastattn.scaled_dot_product_attention(q, k, v, is_causal=True),
          np.float64)
    # bottom-right with more queries than keys: the first query block sees no key at all
    q2 = randn(rng, (1, 100, 8))
    out = fd.scaled_dot_product_attention(da.from_array(q2, chunks=(1, 25, 8)), dk[:, :60], dv[:, :60],
                                          is_causal=True, causal_alignment="bottom_right")
    want = fastattn.scaled_dot_product_attention(q2, k[:, :60], v[:, :60], is_causal=True,
                                                 causal_alignment="bottom_right")
    got = client.compute(out, sync=True)
    close(got, want, np.float64)
    assert np.all(got[:, :40] == 0)


@pytest.mark.parametrize("kind", ["padding", "bool", "float", "dask_padding"])
def test_masks_fully_masked_blocks_and_rows(client, kind, rng):
    B, H, Lq, Lk = 3, 2, 40, 90
    q, k, v = randn(rng, (B, H, Lq, 8)), randn(rng, (B, 1, Lk, 8)), randn(rng, (B, 1, Lk, 4))
    if kind in ("padding", "dask_padding"):
        mask = np.arange(Lk) < np.array([90, 20, 0])[:, None]      # item 2: no key at all
        mask = mask[:, None, None, :]                              # (B, 1, 1, Lk)
    elif kind == "bool":
        mask = rng.random((B, H, Lq, Lk)) < 0.5
        mask[..., 30:] = False                                     # whole key blocks masked
        mask[0, 1, 5] = False                                      # a row with no key
    else:
        mask = randn(rng, (Lq, Lk))
        mask[:, :30] = -np.inf
        mask[7] = -np.inf
    dmask = da.from_array(mask, chunks=(1, 1, 1, 30)) if kind == "dask_padding" else mask
    dq = da.from_array(q, chunks=(1, 1, 20, 8))
    dk, dv = (da.from_array(x, chunks=(1, 1, 30, x.shape[-1])) for x in (k, v))
    out = fd.scaled_dot_product_attention(dq, dk, dv, dmask)
    want = fastattn.scaled_dot_product_attention(q, k, v, mask)
    close(client.compute(out, sync=True), want, np.float64)
    if kind == "dask_padding":
        # the (B, 1, 1, Lk) mask reaches the tasks as its own blocks: B x 3 of them, never
        # expanded over heads or queries
        g = dict(out.__dask_graph__())
        mkeys = {t[4] for key, t in g.items() if key in set(partial_tasks(out))}
        assert len(mkeys) == B * 3 and all(mk[1:4] == (mk[1], 0, 0) for mk in mkeys)


def _params(name, d, rng):
    sim = fastattn.get_similarity(name)
    return sim.init_params(d, d, d_a=6, seed=1) if sim.params_spec else None


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("name", ["dot", "scaled_dot", "general", "additive", "concat", "cosine"])
def test_every_builtin_similarity_with_key_chunks(client, name, dtype, rng):
    q, k, v = randn(rng, (2, 30, 8), dtype), randn(rng, (2, 75, 8), dtype), randn(rng, (2, 75, 3), dtype)
    params = _params(name, 8, rng)
    if params:
        params = {n: np.asarray(p, dtype) for n, p in params.items()}
    mask = rng.random((30, 75)) < 0.8
    for causal in (False, True):
        want = fastattn.attention(q, k, v, name, params=params, attn_mask=mask, is_causal=causal)
        out = fd.attention(da.from_array(q, chunks=(1, 16, 8)), da.from_array(k, chunks=(2, 20, 8)),
                           da.from_array(v, chunks=(2, 20, 3)), name, params=params, attn_mask=mask,
                           is_causal=causal)
        close(client.compute(out, sync=True), want, dtype)


class ClientOnly(Similarity):
    """Registered in the client process only (the workers never import this file)."""

    name = "test_client_only_similarity"

    def score(self, query, key, params):
        return query @ np.swapaxes(key, -1, -2)


def test_a_similarity_the_workers_do_not_know(client, rng):
    fastattn.register_similarity(ClientOnly, overwrite=True)
    try:
        q = randn(rng, (2, 5, 4))
        out = fd.attention(da.from_array(q, chunks=(1, 5, 4)), q, q, "test_client_only_similarity")
        with pytest.raises(KeyError, match=r"similarity 'test_client_only_similarity' is not "
                                           r"registered on the Dask worker tcp://.*Install the "
                                           r"package that provides it"):
            client.compute(out, sync=True)
        # a similarity object travels by its registered name
        with pytest.raises(ValueError, match=r"is not the registered similarity of that name"):
            fd.attention(q, q, q, type("Other", (ClientOnly,), {"name": "test_unregistered_x"})())
    finally:
        fastattn.unregister_similarity("test_client_only_similarity")


def test_thread_settings_on_the_workers(client):
    def in_task():
        return fd.task_threads()

    workers = list(client.scheduler_info()["workers"])
    assert len(workers) == 2
    # default: 1 fastattn thread per task (each worker runs 2 task threads)
    assert [client.submit(in_task, pure=False, workers=[w]).result() for w in workers] == [1, 1]
    client.register_plugin(fd.WorkerSetup(n_threads=2))
    try:
        assert client.run(lambda: fd._worker_threads) == {w: 2 for w in workers}
        assert [client.submit(in_task, pure=False, workers=[w]).result() for w in workers] == [2, 2]
    finally:
        client.register_plugin(fd.WorkerSetup(n_threads=None))
    assert client.run(lambda: fd._worker_threads) == {w: None for w in workers}
    assert [client.submit(in_task, pure=False, workers=[w]).result() for w in workers] == [1, 1]
    assert fd.task_threads(3) == 3
    with pytest.raises(ValueError, match=r"n_threads: expected a positive int or None, got 0"):
        fd.WorkerSetup(n_threads=0)


@pytest.mark.parametrize("which", ["mha", "self_attention"])
def test_apply_a_layer_over_batch_chunks(client, which, rng):
    layer = (L.MultiHeadAttention(16, 4, seed=0) if which == "mha"
             else L.SelfAttention(16, similarity="additive", seed=0))
    x = randn(rng, (11, 9, 16), np.float32)
    km = rng.random((11, 9)) < 0.8
    km[:, 0] = True
    out = fd.apply(layer, da.from_array(x, chunks=(4, 9, 16)), key_mask=km)
    g = dict(out.__dask_graph__())
    assert sum(1 for key in g if isinstance(key, str) and key.startswith("fastattn-layer-")) == 1
    got = client.compute(out, sync=True)
    want = layer(x, key_mask=km)
    assert got.dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_bad_input(rng):
    q = da.from_array(randn(rng, (2, 10, 8)), chunks=(1, 10, 4))
    with pytest.raises(ValueError, match=r"query: the feature axis \(axis 2, size 8\) must be one chunk"):
        fd.scaled_dot_product_attention(q, q, q)
    k = randn(rng, (2, 10, 8))
    with pytest.raises(ValueError, match=r"value: expected 10 rows"):
        fd.scaled_dot_product_attention(k, k, k[:, :3])
    with pytest.raises(ValueError, match=r"causal_alignment: expected 'top_left' or 'bottom_right'"):
        fd.scaled_dot_product_attention(k, k, k, is_causal=True, causal_alignment="left")
    with pytest.raises(ValueError, match=r"attn_mask: expected shape \(\.\.\., 10 or 1, 10 or 1\)"):
        fd.scaled_dot_product_attention(k, k, k, np.ones((10, 3), bool))
    with pytest.raises(TypeError, match=r"similarity: expected a registered name"):
        fd.attention(k, k, k, 3)
    x = da.from_array(randn(rng, (4, 6, 16), np.float32), chunks=(2, 3, 16))
    with pytest.raises(ValueError, match=r"x: the sequence axis \(axis 1, size 6\) must be one chunk"):
        fd.apply(L.MultiHeadAttention(16, 4, seed=0), x)
    with pytest.raises(TypeError, match=r"key_mask: expected a boolean array"):
        fd.apply(L.MultiHeadAttention(16, 4, seed=0), x.rechunk((2, 6, 16)), key_mask=np.ones((4, 6)))


def test_import_fastattn_never_imports_dask():
    from support import run_child
    r = run_child("import sys, fastattn; print(any(m == 'dask' or m.startswith('dask.') "
                  "or m == 'distributed' for m in sys.modules))")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"

"""Sizes and offsets beyond 2**31 (issue 7, "Hardening", item 3).

The C kernels index with int64_t throughout; BLAS (scipy.linalg.cython_blas)
takes 32-bit ints, so every size or leading dimension it would be handed
beyond 2**31 - 1 is refused -- in Python with a ValueError naming the BLAS
range before anything of that size is allocated, and again in C (FA_EINVAL)
so that nothing is ever truncated.

How the tests get there without the memory:

* far apart: arrays whose batch (or row) strides are more than 2**31
  elements, views into a sparse file (``np.memmap`` of a file that is only
  holes: the pages the test writes are the only ones that exist), so every
  element offset the kernels compute for the second batch item is beyond
  int32;
* zero strides: ``np.broadcast_to`` / ``as_strided`` views that present more
  than 2**31 elements over a few bytes, refused or (a broadcast batch)
  computed;
* real size (``@pytest.mark.slow``, deselected by default; run with
  ``pytest -m slow tests/kernels/test_sizes.py``): a boolean mask of more than 2**31
  real elements.
"""
from __future__ import annotations

import json
import os
import textwrap

import numpy as np
import pytest
from numpy.lib.stride_tricks import as_strided

import fastattn
from fastattn import _kernels, _reference as R
from fastattn._validation import BLAS_INT_MAX

from support import assert_close, oracle, run_child

#: an element distance no int32 offset can express
FAR = 2**31 + 64


@pytest.fixture
def sparse(tmp_path):
    """make(n, dtype): a zero-filled array of n elements over a sparse file
    (no memory and no disk until written); the files are removed afterwards."""
    made = []

    def make(n, dtype=np.float64):
        path = tmp_path / f"sparse{len(made)}.bin"
        mm = np.memmap(path, dtype=dtype, mode="w+", shape=(n,))
        made.append(path)
        return mm

    yield make
    for path in made:
        os.unlink(path)


def far_stack(make, items, dtype=np.float64):
    """A (len(items), *shape) array equal to np.stack(items) whose items lie FAR
    elements apart (C-ordered within an item), in a sparse file."""
    dtype = np.dtype(dtype)
    shape = items[0].shape
    n = int(np.prod(shape))
    buf = make(FAR * (len(items) - 1) + n, dtype)
    inner = tuple(int(np.prod(shape[i + 1:])) * dtype.itemsize for i in range(len(shape)))
    view = as_strided(buf, shape=(len(items),) + shape, strides=(FAR * dtype.itemsize,) + inner)
    for i, it in enumerate(items):
        view[i] = it
    return view


def far_rows(make, a):
    """A 2-d array equal to a whose rows lie FAR elements apart."""
    buf = make(FAR * (a.shape[0] - 1) + a.shape[1], a.dtype)
    view = as_strided(buf, shape=a.shape, strides=(FAR * a.itemsize, a.itemsize))
    view[...] = a
    return view


# ------------------------------------------------------- the C kernels' guards
# Called through the private bindings with leading dimensions beyond int32,
# which the public functions never hand over (they copy such arrays first).


def test_sdpa_kernel_refuses_blas_leading_dims_beyond_int32(sparse, rng):
    """A query row stride of 2**31 + 64 elements: the BLAS path answers
    FA_EINVAL (2) instead of truncating the leading dimension (which gave
    'parameter number 8 had an illegal value' and an unwritten output);
    the register-blocked path, all int64, computes the right result."""
    qd = rng.standard_normal((1, 3, 4))
    q = far_stack(sparse, [qd[0, i] for i in range(3)]).reshape(1, 3, 4)
    assert q.strides[1] == FAR * 8
    k, v = rng.standard_normal((1, 5, 4)), rng.standard_normal((1, 5, 2))
    out = np.full((1, 3, 2), 7.0)
    args = (None, _kernels.MASK_NONE, out, None, (1,), False, 0, 0.5, 3, 5, _kernels.PATH_SINGLE)
    assert _kernels.sdpa(q, k, v, *args, False, 1) == 2
    assert np.all(out == 7.0)
    assert _kernels.sdpa(q, k, v, *args, True, 1) == 0
    assert_close(out, oracle(qd, k, v, scale=0.5), np.float64)


def test_projection_kernel_refuses_blas_leading_dims_beyond_int32(sparse, rng):
    from fastattn import _scores

    wd = rng.standard_normal((3, 4))
    w = far_rows(sparse, wd)
    x = rng.standard_normal((200, 4))
    y = np.full((200, 8), 7.0)
    assert _scores.project(x, w, None, y, 1) == 2
    assert np.all(y == 7.0)
    assert _scores.project(x, np.ascontiguousarray(w), None, y, 1) == 0
    assert_close(y[:, :3], x @ wd.T, np.float64)


def test_rnn_kernels_refuse_blas_leading_dims_beyond_int32(sparse, rng):
    from fastattn import _recurrence, _rnn

    _recurrence._ensure_runtime()
    H, B, T = 3, 2, 4
    wd = rng.standard_normal((H, H))
    w = far_rows(sparse, wd)
    xw = rng.standard_normal((B, T, H))
    h = rng.standard_normal((B, H))
    with pytest.raises(RuntimeError, match=r"recurrence kernel rejected its arguments \(status 2"):
        _rnn.scan(_rnn.CELLS["rnn_tanh"], xw, w, None, h.copy(), None, None, None, False, 1)
    x = rng.standard_normal((B, 5))
    wi = rng.standard_normal((H, 5))
    with pytest.raises(RuntimeError, match=r"cell kernel rejected its arguments \(status 2"):
        _rnn.cell(_rnn.CELLS["rnn_tanh"], x, wi, None, w, None, h, None,
                  np.empty((B, H)), None, 1)


# ------------------------------------------------- public calls, rows far apart


def _scan_oracle(cell, xw, w_hh, b_hh, h0):
    """rnn_scan by the reference cell: xw is x W_ih^T + b_ih, so W_ih = I."""
    mode = {"rnn_tanh": "RNN", "gru": "GRU", "lstm": "LSTM"}[cell]
    B, T, GH = xw.shape
    H = h0.shape[1]
    eye = np.eye(GH)
    out = np.zeros((B, T, H))
    hT = np.zeros((B, H))
    for b in range(B):
        h, c = h0[b], np.zeros(H)
        for t in range(T):
            h, c = R.rnn_cell(mode, xw[b, t], h, c, eye, w_hh, None, b_hh)
            out[b, t] = h
        hT[b] = h
    return out, hT


@pytest.mark.parametrize("cell", ["rnn_tanh", "gru", "lstm"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_rnn_scan_weight_rows_far_apart(sparse, rng, cell, dtype):
    """w_hh rows 2**31 + 64 elements apart: the row stride is not a leading
    dimension BLAS can take, so rnn_scan copies the weights.  (It passed it
    on, truncated: wrong states.)"""
    G = {"rnn_tanh": 1, "gru": 3, "lstm": 4}[cell]
    B, T, H = 3, 4, 2
    wd = (0.5 * rng.standard_normal((G * H, H))).astype(dtype)
    w = far_rows(sparse, wd)
    xw = rng.standard_normal((B, T, G * H)).astype(dtype)
    h0 = rng.standard_normal((B, H)).astype(dtype)
    b = rng.standard_normal(G * H).astype(dtype)
    out, hT, _ = fastattn.functional.rnn_scan(xw, w, b, h0, cell=cell)
    ref_out, ref_h = _scan_oracle(cell, xw, wd, b, h0)
    assert_close(out, ref_out, dtype)
    assert_close(hT, ref_h, dtype)


@pytest.mark.parametrize("which", ["x", "w_ih", "w_hh"])
def test_rnn_cell_rows_far_apart(sparse, rng, which):
    """x, w_ih or w_hh with rows 2**31 + 64 elements apart (float64: always
    BLAS) are copied, not handed to gemm with a truncated leading dimension."""
    B, H, In = 2, 3, 5
    a = {"x": rng.standard_normal((B, In)), "w_ih": rng.standard_normal((3 * H, In)),
         "w_hh": rng.standard_normal((3 * H, H))}
    h = rng.standard_normal((B, H))
    args = dict(a)
    args[which] = far_rows(sparse, a[which])
    h1, _ = fastattn.functional.rnn_cell(args["x"], h, args["w_ih"], None, args["w_hh"], None,
                                         cell="gru")
    ref = np.stack([R.rnn_cell("GRU", a["x"][r], h[r], None, a["w_ih"], a["w_hh"], None, None)[0]
                    for r in range(B)])
    assert_close(h1, ref, np.float64)


def _odd_stride_rows(a, pad):
    """a (n, k) float64 as a field of a packed structured array: row stride
    8 k + pad bytes (not a multiple of 8, and unaligned for pad % 8)."""
    st = np.zeros(a.shape[0], dtype=np.dtype([("w", "f8", (a.shape[1],)), ("pad", "u1", (pad,))]))
    st["w"] = a
    return st["w"]


@pytest.mark.parametrize("pad", [1, 4])
def test_rnn_weights_with_row_strides_not_a_multiple_of_the_item(rng, pad):
    """Row strides that are not a whole number of elements: rnn_scan and
    rnn_cell copy such weights.  (They divided the stride by the item size
    and read the wrong numbers.)"""
    B, T, H = 2, 3, 3
    wd = 0.5 * rng.standard_normal((H, H))
    w = _odd_stride_rows(wd, pad)
    assert w.strides[0] % 8
    xw = rng.standard_normal((B, T, H))
    h0 = rng.standard_normal((B, H))
    out, hT, _ = fastattn.functional.rnn_scan(xw, w, None, h0, cell="rnn_tanh")
    ref_out, ref_h = _scan_oracle("rnn_tanh", xw, wd, None, h0)
    assert_close(out, ref_out, np.float64)
    wi = rng.standard_normal((H, 4))
    x = rng.standard_normal((B, 4))
    for w_ih, w_hh in ((_odd_stride_rows(wi, pad), wd), (wi, w)):
        h1, _ = fastattn.functional.rnn_cell(x, h0, w_ih, None, w_hh, None, cell="rnn_tanh")
        ref = np.tanh(x @ wi.T + h0 @ wd.T)
        assert_close(h1, ref, np.float64)


def test_rnn_scan_input_with_strides_not_a_multiple_of_the_item(rng):
    """xw's batch / time strides go to C in elements: a packed structured
    field (strides 8 * 3 + 1 bytes) is copied first."""
    B, T, H = 2, 3, 3
    xd = rng.standard_normal((B, T, H))
    st = np.zeros((B, T), dtype=np.dtype([("x", "f8", (H,)), ("pad", "u1")]))
    st["x"] = xd
    wd = 0.5 * rng.standard_normal((H, H))
    h0 = rng.standard_normal((B, H))
    out, _, _ = fastattn.functional.rnn_scan(st["x"], wd, None, h0, cell="rnn_tanh")
    assert_close(out, _scan_oracle("rnn_tanh", xd, wd, None, h0)[0], np.float64)


def test_additive_projection_weight_rows_far_apart(sparse, rng):
    """The additive projections hand w's row stride to gemm as its leading
    dimension: rows 2**31 + 64 elements apart are copied first (concat's
    W[:, :d_q] view has a row stride of d_q + d_k, which can exceed int32
    with each feature size within it)."""
    from fastattn import _attention

    wd = rng.standard_normal((3, 4))
    x = rng.standard_normal((2, 100, 4))
    got = _attention._project(x, far_rows(sparse, wd), None, np.dtype(np.float64), 1)
    assert got.shape == (2, 100, 8)
    assert_close(got[..., :3], x @ wd.T, np.float64)
    assert np.all(got[..., 3:] == 0)


# ------------------------------------------ refused before any allocation
# As tests/api/test_errors.py does for scaled_dot_product_attention, for every
# other entry point: zero-stride views present sizes beyond 2**31 - 1 over a
# few bytes; the call must raise ValueError naming the size and the BLAS
# range, having allocated next to nothing (tracemalloc sees NumPy's
# allocations), in a child process whose address space is capped at +1 GiB
# (an allocation of that size fails there instead of succeeding lazily).
# The square weights of 2**31 features are int8 (a float64 view of 2**62
# elements would exceed NumPy's own size limit).

BIG = 2**31

_E = ("w = np.zeros((4, 4)); "
      "W = dict(w_query=w, w_key=w, w_value=w, w_out=w)")

REFUSE_CASES = {
    # attention(similarity=...): the sizes SDPA's checks see (on its stand-ins)
    "attention_additive_Lk": (
        "fastattn.attention(np.zeros((2, 4)), bc((BIG, 4)), bc((BIG, 1)), 'additive', "
        "params={'W_q': np.ones((3, 4)), 'W_k': np.ones((3, 4)), 'v': np.ones(3)})",
        "Lk=2147483648 exceeds the BLAS 32-bit integer range"),
    "attention_additive_Lq": (
        "fastattn.attention(bc((BIG, 4)), np.zeros((3, 4)), np.zeros((3, 2)), 'additive', "
        "params={'W_q': np.ones((3, 4)), 'W_k': np.ones((3, 4)), 'v': np.ones(3)})",
        "Lq=2147483648 exceeds the BLAS 32-bit integer range"),
    "attention_compiled_dv": (
        "fastattn.attention(np.zeros((2, 4)), np.zeros((3, 4)), bc((3, BIG)), "
        "testing.selftest_similarity())",
        "dv=2147483648 exceeds the BLAS 32-bit integer range"),
    "attention_dot_Lk_masked": (
        "fastattn.attention(np.zeros((2, 4)), bc((BIG, 4)), bc((BIG, 1)), 'dot', "
        "attn_mask=bc((1, BIG), np.bool_))",
        "Lk=2147483648 exceeds the BLAS 32-bit integer range"),
    # multi_head_attention: the projections' rows and features
    "mha_B_Lq": (
        _E + "; x = bc((2**16, 2**15, 4)); fastattn.multi_head_attention(x, x, x, num_heads=2, **W)",
        "B * Lq=2147483648 exceeds the BLAS 32-bit integer range"),
    "mha_B_Lk": (
        _E + "; q = np.zeros((1, 2, 4)); kv = bc((1, BIG, 4)); "
        "fastattn.multi_head_attention(q, kv, kv, num_heads=2, **W)",
        "B * Lk=2147483648 exceeds the BLAS 32-bit integer range"),
    "mha_kdim": (
        "w = np.zeros((4, 4)); q = np.zeros((1, 2, 4)); k = bc((1, 3, BIG)); v = np.zeros((1, 3, 4)); "
        "fastattn.multi_head_attention(q, k, v, num_heads=2, w_query=w, w_key=bc((4, BIG)), "
        "w_value=w, w_out=w)",
        "kdim=2147483648 exceeds the BLAS 32-bit integer range"),
    "mha_E": (
        "x = bc((1, 2, BIG)); w = bc((BIG, BIG), np.int8); "
        "fastattn.multi_head_attention(x, x, x, num_heads=1, w_query=w, w_key=w, w_value=w, w_out=w)",
        "E=2147483648 exceeds the BLAS 32-bit integer range"),
    # the recurrences: rows, gates and features of their gemms
    "rnn_scan_B": (
        "fastattn.functional.rnn_scan(bc((BIG, 2, 3)), np.zeros((3, 1)), None, bc((BIG, 1)), "
        "cell='gru')",
        "xw: B=2147483648 exceeds the BLAS 32-bit integer range"),
    "rnn_scan_H": (
        "fastattn.functional.rnn_scan(bc((1, 2, BIG)), bc((BIG, BIG), np.int8), None, bc((1, BIG)), "
        "cell='rnn_tanh')",
        "xw: G * H=2147483648 exceeds the BLAS 32-bit integer range"),
    "rnn_scan_B_lstm": (
        "fastattn.functional.rnn_scan(bc((BIG, 1, 4)), np.zeros((4, 1)), None, bc((BIG, 1)), "
        "cell='lstm', c0=bc((BIG, 1)))",
        "xw: B=2147483648 exceeds the BLAS 32-bit integer range"),
    "rnn_cell_B": (
        "fastattn.functional.rnn_cell(bc((BIG, 2)), bc((BIG, 1)), np.zeros((4, 2)), None, "
        "np.zeros((4, 1)), None, cell='lstm')",
        "x: B=2147483648 exceeds the BLAS 32-bit integer range"),
    "rnn_cell_I": (
        "fastattn.functional.rnn_cell(bc((1, BIG)), np.zeros((1, 1)), bc((3, BIG)), None, "
        "np.zeros((3, 1)), None, cell='gru')",
        "x: I=2147483648 exceeds the BLAS 32-bit integer range"),
    "rnn_cell_GH": (
        "fastattn.functional.rnn_cell(np.zeros((1, 1)), bc((1, 2**30)), bc((3 * 2**30, 1)), None, "
        "bc((3 * 2**30, 2**30), np.int8), None, cell='gru')",
        "x: G * H=3221225472 exceeds the BLAS 32-bit integer range"),
}

_REFUSE_CHILD = textwrap.dedent(r"""
    import json, resource, sys, tracemalloc
    import numpy as np
    import fastattn
    from fastattn import testing
    BIG = 2**31
    def bc(shape, dtype=np.float64):
        return np.broadcast_to(np.zeros((1,) * len(shape), dtype), shape)
    # warm up (thread pool, BLAS buffers, lazy imports) before capping the address space
    r = np.random.default_rng(0).standard_normal((2, 16, 8))
    w = np.eye(8)
    fastattn.multi_head_attention(r, r, r, num_heads=2, w_query=w, w_key=w, w_value=w, w_out=w)
    fastattn.attention(r, r, r, testing.selftest_similarity())
    fastattn.functional.rnn_scan(r[:, :, :6], np.zeros((6, 2)), None, np.zeros((2, 2)), cell="gru")
    fastattn.functional.rnn_cell(r[:, 0], np.zeros((2, 2)), np.zeros((6, 8)), None,
                                 np.zeros((6, 2)), None, cell="gru")
    with open("/proc/self/status") as f:
        vm = [int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:")][0]
    resource.setrlimit(resource.RLIMIT_AS, (vm + 2**30, resource.getrlimit(resource.RLIMIT_AS)[1]))
    results = {}
    for name, src in json.loads(sys.argv[1]).items():
        ns = {"np": np, "bc": bc, "BIG": BIG, "fastattn": fastattn, "testing": testing}
        tracemalloc.start()
        try:
            exec(src, ns)
            res = {"exc": None, "msg": "returned normally"}
        except BaseException as e:
            res = {"exc": type(e).__name__, "msg": str(e)}
        res["peak"] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        results[name] = res
    print(json.dumps(results))
""")


@pytest.fixture(scope="module")
def refuse_results():
    src = {name: case[0] for name, case in REFUSE_CASES.items()}
    proc = run_child(_REFUSE_CHILD, [json.dumps(src)])
    assert proc.returncode == 0, f"child crashed (rc={proc.returncode}):\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", list(REFUSE_CASES))
def test_sizes_beyond_blas_refused_before_allocating(refuse_results, case):
    res = refuse_results[case]
    assert res["exc"] == "ValueError", res
    assert REFUSE_CASES[case][1] in res["msg"], res
    assert f"(max {BLAS_INT_MAX})" in res["msg"], res
    assert res["peak"] < 64 * 2**20, f"allocated {res['peak']} bytes before raising: {res}"


# ----------------------------- public calls, batch items 2**31 elements apart
# Canonicalisation keeps any batch stride (no copy), so the kernels compute
# element offsets beyond int32 for the second item of every operand.

SDPA_SHAPES = {                # Lq, Lk, d, dv
    "decode": (2, 7, 5, 3),    # few-row products
    "single": (20, 40, 8, 4),  # one pass over the keys (scalar: BLAS or small products)
    "stream": (40, 600, 8, 4),  # key tiles (AVX2: packed products; scalar: BLAS)
}


@pytest.mark.parametrize("shape", list(SDPA_SHAPES))
@pytest.mark.parametrize("mask", ["none", "bool", "float"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sdpa_batch_items_far_apart(sparse, rng, simd_mode, shape, mask, dtype):
    """q, k, v, the mask and out all with their two batch items 2**31 + 64
    elements apart: the result (written straight into out) matches the
    float64 oracle; the weights (our own array) too."""
    Lq, Lk, d, dv = SDPA_SHAPES[shape]
    qd = rng.standard_normal((2, Lq, d)).astype(dtype)
    kd = rng.standard_normal((2, Lk, d)).astype(dtype)
    vd = rng.standard_normal((2, Lk, dv)).astype(dtype)
    q, k, v = (far_stack(sparse, list(a), dtype) for a in (qd, kd, vd))
    md = None
    m = None
    if mask == "bool":
        md = rng.random((2, Lq, Lk)) < 0.7
        md[1, -1] = False  # a fully masked row
        m = far_stack(sparse, list(md), np.bool_)
    elif mask == "float":
        md = rng.standard_normal((2, Lq, Lk)).astype(dtype)
        m = far_stack(sparse, list(md), dtype)
    out = far_stack(sparse, [np.zeros((Lq, dv), dtype)] * 2, dtype)
    res, w = fastattn.scaled_dot_product_attention(q, k, v, m, out=out, return_weights=True)
    assert res is out
    ref, ref_w = oracle(qd, kd, vd, md, return_weights=True)
    assert_close(np.array(out), ref, dtype)
    assert_close(w, ref_w, dtype)
    res = fastattn.scaled_dot_product_attention(q, k, v, m, is_causal=True, out=out)
    assert_close(np.array(out), oracle(qd, kd, vd, md, is_causal=True), dtype)


@pytest.mark.parametrize("sim", ["additive", "compiled"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_attention_batch_items_far_apart(sparse, rng, sim, dtype):
    """attention(similarity=...) with q, k, v, mask and out far apart: the
    tiled kernel (fed the projections or, for a compiled plugin, q and k as
    they are) reads and writes beyond int32 offsets."""
    from fastattn import testing

    Lq, Lk, d, dv = 30, 300, 6, 3
    qd = (0.5 * rng.standard_normal((2, Lq, d))).astype(dtype)
    kd = (0.5 * rng.standard_normal((2, Lk, d))).astype(dtype)
    vd = rng.standard_normal((2, Lk, dv)).astype(dtype)
    md = rng.random((2, Lq, Lk)) < 0.8
    q, k, v = (far_stack(sparse, list(a), dtype) for a in (qd, kd, vd))
    m = far_stack(sparse, list(md), np.bool_)
    out = far_stack(sparse, [np.zeros((Lq, dv), dtype)] * 2, dtype)
    if sim == "additive":
        P = {"W_q": rng.standard_normal((5, d)), "W_k": rng.standard_normal((5, d)),
             "v": rng.standard_normal(5)}
        res = fastattn.attention(q, k, v, "additive", params=P, attn_mask=m, out=out)
        score = lambda a, b: R.score_additive(a, b, P["W_q"], P["W_k"], P["v"])  # noqa: E731
    else:
        res = fastattn.attention(q, k, v, testing.selftest_similarity(), attn_mask=m, out=out)
        score = R.score_neg_sq_dist
    assert res is out
    assert_close(np.array(out), R.attention(qd, kd, vd, score, attn_mask=md), dtype)


@pytest.mark.parametrize("Lq", [1, 5])
def test_multi_head_attention_batch_items_far_apart(sparse, rng, Lq):
    """The projections read batch items 2**31 + 64 elements apart (for one
    row per item, not gathered into one matrix: that stride is no leading
    dimension BLAS can take)."""
    B, Lk, E, H = 2, 6, 8, 2
    qd, kd, vd = (rng.standard_normal((B, L, E)) for L in (Lq, Lk, Lk))
    W = {n: 0.3 * rng.standard_normal((E, E)) for n in ("w_query", "w_key", "w_value", "w_out")}
    q, k, v = (far_stack(sparse, list(a)) for a in (qd, kd, vd))
    got = fastattn.multi_head_attention(q, k, v, num_heads=H, **W)
    ref = R.multi_head_attention(qd, kd, vd, num_heads=H, **W)
    assert_close(got, ref, np.float64)


def test_rnn_scan_batch_items_far_apart(sparse, rng):
    """xw's batch stride is an element offset in the C time loop."""
    B, T, H = 2, 5, 4
    xd = rng.standard_normal((B, T, 3 * H))
    wd = 0.4 * rng.standard_normal((3 * H, H))
    h0 = rng.standard_normal((B, H))
    out, hT, _ = fastattn.functional.rnn_scan(far_stack(sparse, list(xd)), wd, None, h0, cell="gru")
    ref_out, ref_h = _scan_oracle("gru", xd, wd, None, h0)
    assert_close(out, ref_out, np.float64)
    assert_close(hT, ref_h, np.float64)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sdpa_broadcast_batch_beyond_2_31_elements(rng, dtype):
    """A legitimately computable call: keys and values broadcast over 2100
    queries' batch present 2.2e9 key elements (zero batch stride, 4 MiB of
    real memory); every item matches the oracle."""
    B, Lk, d = 2100, 1024, 1024
    kd = rng.standard_normal((Lk, d)).astype(dtype)
    vd = rng.standard_normal((Lk, 2)).astype(dtype)
    qd = (0.05 * rng.standard_normal((B, 1, d))).astype(dtype)
    k = np.broadcast_to(kd, (B, Lk, d))
    v = np.broadcast_to(vd, (B, Lk, 2))
    assert k.size > 2**31
    got = fastattn.scaled_dot_product_attention(qd, k, v)
    assert got.shape == (B, 1, 2)
    # the oracle as one (B, d) x (Lk, d) problem: the same keys for every query
    assert_close(got[:, 0], oracle(qd[:, 0], kd, vd), dtype)


# ------------------------------------------------------------- at real size
# Deselected by default (pyproject.toml: -m 'not slow'); run them with
#   pytest -m slow tests/kernels/test_sizes.py
# Together they need about 2.3 GB of memory and a minute or two on 2 cores.

SLOW_LQ, SLOW_LK = 40_000, 54_000   # a (Lq, Lk) mask of 2.16e9 elements


@pytest.fixture(scope="module")
def real_size_mask():
    """A C-contiguous boolean (40000, 54000) mask, 2.16e9 real elements
    (2.2 GB): key j is allowed for query i unless (7 i + j) % 5 == 0; the
    last query row is fully masked."""
    m = np.empty((SLOW_LQ, SLOW_LK), dtype=np.bool_)
    j = np.arange(SLOW_LK)
    for i0 in range(0, SLOW_LQ, 256):
        i = np.arange(i0, min(i0 + 256, SLOW_LQ))[:, None]
        np.not_equal((7 * i + j) % 5, 0, out=m[i0:i0 + 256])
    m[-1] = False
    assert m.size > 2**31
    yield m
    del m


_SLOW_ROWS = [0, 1, 17_000, SLOW_LQ - 3, SLOW_LQ - 2, SLOW_LQ - 1]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sdpa_mask_beyond_2_31_elements(real_size_mask, dtype):
    """scaled_dot_product_attention with a real mask of 2.16e9 elements: the
    mask offsets of the last rows (i * Lk + j > 2**31) are int64 in the
    kernel; rows from both ends match the oracle, the fully masked last row
    is zeros."""
    rng = np.random.default_rng(7)
    q = rng.standard_normal((SLOW_LQ, 8)).astype(dtype)
    k = rng.standard_normal((SLOW_LK, 8)).astype(dtype)
    v = rng.standard_normal((SLOW_LK, 4)).astype(dtype)
    got = fastattn.scaled_dot_product_attention(q, k, v, real_size_mask)
    rows = _SLOW_ROWS
    assert_close(got[rows], oracle(q[rows], k, v, real_size_mask[rows]), dtype)
    assert np.all(got[-1] == 0)


@pytest.mark.slow
def test_tiled_attention_mask_beyond_2_31_elements(real_size_mask):
    """The same mask through the tiled kernel of a compiled similarity."""
    from fastattn import testing

    rng = np.random.default_rng(8)
    q = (0.3 * rng.standard_normal((SLOW_LQ, 8))).astype(np.float32)
    k = (0.3 * rng.standard_normal((SLOW_LK, 8))).astype(np.float32)
    v = rng.standard_normal((SLOW_LK, 4)).astype(np.float32)
    got = fastattn.attention(q, k, v, testing.selftest_similarity(), attn_mask=real_size_mask)
    rows = _SLOW_ROWS
    ref = R.attention(q[rows], k, v, R.score_neg_sq_dist, attn_mask=real_size_mask[rows])
    assert_close(got[rows], ref, np.float32)
    assert np.all(got[-1] == 0)


@pytest.mark.slow
def test_linear_features_beyond_blas_computed_by_numpy():
    """linear() with K = 2**31 + 8 features (zero-stride views): beyond BLAS's
    ints it is NumPy's matmul, with the exact result (a sum of 2**31 + 8
    terms 0.125 in float64)."""
    K = 2**31 + 8
    x = np.broadcast_to(0.5, (1, K))
    w = np.broadcast_to(0.25, (3, K))
    y = fastattn.functional.linear(x, w, np.array([1.0, 2.0, 3.0]))
    assert y.shape == (1, 3)
    assert np.array_equal(y, [[K * 0.125 + 1, K * 0.125 + 2, K * 0.125 + 3]])

"""Every user error raises with a message that names the offending parameter."""
from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest

import fastattn

sdpa = fastattn.scaled_dot_product_attention


def qkv(Lq=3, Lk=5, d=4, dv=2, batch=()):
    rng = np.random.default_rng(0)
    return (rng.standard_normal(batch + (Lq, d)), rng.standard_normal(batch + (Lk, d)),
            rng.standard_normal(batch + (Lk, dv)))


@pytest.fixture(params=["sdpa", "explain"])
def fn(request):
    """Validation is shared: explain() must raise exactly like the call."""
    return sdpa if request.param == "sdpa" else fastattn.explain


# ----------------------------------------------------------------- shapes

def test_mismatched_feature_size(fn):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"key: expected last dim 4"):
        fn(q, k[:, :3], v)


def test_mismatched_key_value_length(fn):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"value: expected 5 rows"):
        fn(q, k, v[:4])


@pytest.mark.parametrize("shapes", [
    ((2, 3, 4), (3, 5, 4), (3, 5, 2)),
    ((2, 3, 4), (2, 5, 4), (3, 5, 2)),
    ((2, 1, 3, 4), (3, 5, 4), (4, 5, 2)),
])
def test_batch_dims_do_not_broadcast(fn, shapes):
    q, k, v = (np.zeros(s) for s in shapes)
    with pytest.raises(ValueError, match=r"leading \(batch\) dimensions do not broadcast.*query"):
        fn(q, k, v)


@pytest.mark.parametrize("mshape", [(4, 5), (3, 4), (3, 6), (2, 3), (7,), (3, 3, 5)])
def test_mask_does_not_broadcast(fn, mshape):
    q, k, v = qkv(batch=(2,))
    with pytest.raises(ValueError, match=r"attn_mask"):
        fn(q, k, v, np.ones(mshape, bool))


@pytest.mark.parametrize("dtype", [np.int64, np.int8, np.uint8, np.complex128, np.complex64, object, "U1",
                                   np.longdouble])
def test_mask_dtype(fn, dtype):
    q, k, v = qkv()
    m = np.zeros((3, 5), dtype=dtype)
    with pytest.raises(TypeError, match=r"attn_mask: expected a bool mask .* or a float mask"):
        fn(q, k, v, m)


@pytest.mark.parametrize("which", ["query", "key", "value"])
@pytest.mark.parametrize("ndim", [0, 1])
def test_too_few_dims(fn, which, ndim):
    q, k, v = qkv()
    args = {"query": q, "key": k, "value": v}
    args[which] = np.ones((4,) * ndim)
    with pytest.raises(ValueError, match=rf"{which}: expected an array with at least 2 dims"):
        fn(args["query"], args["key"], args["value"])


def test_too_many_batch_dims(fn):
    q = np.zeros((1,) * 33 + (2, 2))
    with pytest.raises(ValueError, match=r"too many leading dims"):
        fn(q, q, q)


# ----------------------------------------------------------------- dtypes

@pytest.mark.parametrize("which", ["query", "key", "value"])
@pytest.mark.parametrize("dtype", [np.complex64, np.complex128])
def test_complex_input(fn, which, dtype):
    a = dict(zip(("query", "key", "value"), qkv()))
    a[which] = a[which].astype(dtype)
    with pytest.raises(TypeError, match=rf"{which}: complex dtypes are not supported"):
        fn(a["query"], a["key"], a["value"])


@pytest.mark.parametrize("which", ["query", "key", "value"])
def test_longdouble_input(fn, which):
    a = dict(zip(("query", "key", "value"), qkv()))
    a[which] = a[which].astype(np.longdouble)
    if np.dtype(np.longdouble).itemsize <= 8:  # pragma: no cover - longdouble is double here
        pytest.skip("longdouble is float64 on this platform")
    with pytest.raises(TypeError, match=rf"{which}: .*is not supported"):
        fn(a["query"], a["key"], a["value"])


@pytest.mark.parametrize("which", ["query", "key", "value"])
@pytest.mark.parametrize("dtype", [object, "U3", "S3", "datetime64[s]", "timedelta64[s]"])
def test_non_numeric_input(fn, which, dtype):
    a = dict(zip(("query", "key", "value"), qkv()))
    a[which] = np.zeros(a[which].shape, dtype=dtype)
    with pytest.raises(TypeError, match=rf"{which}: expected a real numeric dtype"):
        fn(a["query"], a["key"], a["value"])


def test_ragged_list(fn):
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"query: expected an array-like of numbers"):
        fn([[1.0, 2.0], [3.0]], k, v)


# ------------------------------------------------------------ flags, scale

@pytest.mark.parametrize("bad", ["yes", 1, 0, 1.0, None, np.array([True])])
def test_is_causal_not_bool(fn, bad):
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"is_causal: expected a bool"):
        fn(q, k, v, is_causal=bad)


@pytest.mark.parametrize("bad", ["foo", "Top_Left", "bottom-right", None, 0])
def test_causal_alignment(fn, bad):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"causal_alignment: expected 'top_left' or 'bottom_right'"):
        fn(q, k, v, is_causal=True, causal_alignment=bad)


@pytest.mark.parametrize("bad", ["x", True, np.False_, 1j, [0.5], object()])
def test_scale_not_real(fn, bad):
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"scale: expected a real number"):
        fn(q, k, v, scale=bad)


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_return_weights_not_bool(fn, bad):
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"return_weights: expected a bool"):
        fn(q, k, v, return_weights=bad)


# ---------------------------------------------------------------- threads

@pytest.mark.parametrize("bad,exc", [(0, ValueError), (-1, ValueError), (1.5, TypeError),
                                     (True, TypeError), (False, TypeError), ("2", TypeError),
                                     (2.0, TypeError), (np.float64(2), TypeError)])
def test_n_threads(fn, bad, exc):
    q, k, v = qkv()
    with pytest.raises(exc, match=r"n_threads: expected a positive integer"):
        fn(q, k, v, n_threads=bad)


@pytest.mark.parametrize("bad,exc", [(0, ValueError), (-3, ValueError), (1.5, TypeError),
                                     (True, TypeError), ("4", TypeError)])
def test_set_num_threads_and_context_invalid(bad, exc):
    before = fastattn.get_num_threads()
    with pytest.raises(exc, match=r"\bn: expected a positive integer"):
        fastattn.set_num_threads(bad)
    with pytest.raises(exc, match=r"\bn: expected a positive integer"):
        with fastattn.threads(bad):
            pass  # pragma: no cover
    assert fastattn.get_num_threads() == before


# -------------------------------------------------------------------- out

def test_out_wrong_shape(fn):
    q, k, v = qkv()
    for shape in [(3, 3), (2, 3, 2), (3, 2, 1), (2, 3)]:
        with pytest.raises(ValueError, match=r"out: expected shape \(3, 2\)"):
            fn(q, k, v, out=np.zeros(shape))


def test_out_wrong_dtype(fn):
    q, k, v = qkv()
    for dt in (np.float32, np.float16, np.int64, np.complex128, np.longdouble):
        with pytest.raises(TypeError, match=r"out: expected dtype float64"):
            fn(q, k, v, out=np.zeros((3, 2), dt))
    with pytest.raises(TypeError, match=r"out: expected dtype float16"):
        fn(*(a.astype(np.float16) for a in (q, k, v)), out=np.zeros((3, 2), np.float32))
    with pytest.raises(TypeError, match=r"out: expected dtype float64"):  # ints -> float64
        fn(*(a.astype(np.int32) for a in (q, k, v)), out=np.zeros((3, 2), np.int32))


def test_out_read_only(fn):
    q, k, v = qkv()
    out = np.zeros((3, 2))
    out.flags.writeable = False
    with pytest.raises(ValueError, match=r"out: the array is read-only"):
        fn(q, k, v, out=out)


def test_out_broadcast_view(fn):
    q, k, v = qkv(batch=(4,))
    base = np.zeros((1, 3, 2))
    with pytest.raises(ValueError, match=r"out:"):
        fn(q, k, v, out=np.broadcast_to(base, (4, 3, 2)))
    # a writeable zero-stride view is rejected for the overlap itself
    view = np.lib.stride_tricks.as_strided(base, shape=(4, 3, 2), strides=(0,) + base.strides[1:])
    assert view.flags.writeable
    with pytest.raises(ValueError, match=r"out: its strides .* make elements overlap"):
        fn(q, k, v, out=view)
    # rows overlapping by one element
    buf = np.zeros(4 * 3 * 2)
    view = np.lib.stride_tricks.as_strided(buf, shape=(4, 3, 2), strides=(6 * 8, 8, 8))
    with pytest.raises(ValueError, match=r"out: its strides .* make elements overlap"):
        fn(q, k, v, out=view)


@pytest.mark.parametrize("bad", [[[0.0, 0.0]] * 3, (1, 2), 3.0, "out"])
def test_out_not_an_array(fn, bad):
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"out: expected a numpy.ndarray"):
        fn(q, k, v, out=bad)


def test_error_leaves_out_untouched():
    q, k, v = qkv()
    out = np.full((3, 2), 7.0)
    for kwargs in ({"attn_mask": np.ones((4, 5), bool)}, {"scale": "x"}, {"n_threads": 0},
                   {"causal_alignment": "foo", "is_causal": True}):
        with pytest.raises((TypeError, ValueError)):
            sdpa(q, k, v, out=out, **kwargs)
        assert np.all(out == 7.0)


# ------------------------------------------------------------ BLAS guard
#
# Sizes beyond 2**31 - 1 do not fit BLAS's 32-bit integers.  The inputs are
# broadcast views over a few bytes; the call must raise ValueError naming the
# BLAS range *before* allocating anything of that size.  Each case runs in a
# child process with its address space capped at +1 GiB, so a library that
# tries to allocate or compute fails there (MemoryError / crash) instead of
# taking the test machine down.

BIG = 2**31

BLAS_CASES = {
    "Lk_key_value": "q = np.zeros((2, 1)); k = bc((BIG, 1)); v = bc((BIG, 3)); args = (q, k, v); kw = {}",
    "Lk_causal": "q = np.zeros((2, 1)); k = bc((BIG, 1)); v = bc((BIG, 1)); args = (q, k, v); kw = dict(is_causal=True)",
    "Lq": "q = bc((BIG, 1)); k = np.zeros((3, 1)); v = np.zeros((3, 2)); args = (q, k, v); kw = {}",
    "d": "q = bc((2, BIG)); k = bc((3, BIG)); v = np.zeros((3, 2)); args = (q, k, v); kw = {}",
    "dv": "q = np.zeros((2, 1)); k = np.zeros((3, 1)); v = bc((3, BIG)); args = (q, k, v); kw = {}",
    "Lk_int8_key": "q = np.zeros((2, 1)); k = bc((BIG, 1), np.int8); v = bc((BIG, 1), np.int8); args = (q, k, v); kw = {}",
    "Lk_mixed_dtype": "q = np.zeros((2, 1)); k = bc((BIG, 1), np.float32); v = bc((BIG, 1), np.float32); args = (q, k, v); kw = {}",
    "Lk_weights": "q = np.zeros((2, 1)); k = bc((BIG, 1)); v = bc((BIG, 1)); args = (q, k, v); kw = dict(return_weights=True)",
    "Lk_small_bool_mask": "q = np.zeros((2, 1)); k = bc((BIG, 1)); v = bc((BIG, 1)); args = (q, k, v, np.ones((1, 1), bool)); kw = {}",
    "Lk_bool_key_mask": "q = np.zeros((2, 1)); k = bc((BIG, 1)); v = bc((BIG, 1)); args = (q, k, v, bc((1, BIG), np.bool_)); kw = {}",
    "Lk_float_mask_other_dtype": "q = np.zeros((2, 1), np.float32); k = bc((BIG, 1), np.float32); v = bc((BIG, 1), np.float32); args = (q, k, v, bc((2, BIG), np.float64)); kw = {}",
}

_CHILD = textwrap.dedent(r"""
    import json, resource, sys, tracemalloc
    import numpy as np
    import fastattn
    BIG = 2**31
    def bc(shape, dtype=np.float64):
        return np.broadcast_to(np.zeros((1,) * len(shape), dtype), shape)
    # warm up (OpenMP team, BLAS buffers) before capping the address space
    r = np.random.default_rng(0).standard_normal((4, 128, 64))
    fastattn.scaled_dot_product_attention(r, r, r, n_threads=2)
    with open("/proc/self/status") as f:
        vm = [int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:")][0]
    resource.setrlimit(resource.RLIMIT_AS, (vm + 2**30, resource.getrlimit(resource.RLIMIT_AS)[1]))
    results = {}
    for name, src in json.loads(sys.argv[1]).items():
        ns = {"np": np, "bc": bc, "BIG": BIG}
        exec(src, ns)
        tracemalloc.start()
        try:
            fastattn.scaled_dot_product_attention(*ns["args"], **ns["kw"])
            res = {"exc": None, "msg": "returned normally"}
        except BaseException as e:
            res = {"exc": type(e).__name__, "msg": str(e)}
        res["peak"] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        results[name] = res
    print(json.dumps(results))
""")


@pytest.fixture(scope="module")
def blas_guard_results():
    from support import run_child
    proc = run_child(_CHILD, [json.dumps(BLAS_CASES)])
    assert proc.returncode == 0, f"child crashed (rc={proc.returncode}):\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", list(BLAS_CASES))
def test_blas_int_guard(blas_guard_results, case):
    res = blas_guard_results[case]
    assert res["exc"] == "ValueError", res
    assert "BLAS 32-bit integer range" in res["msg"], res
    dim = case.split("_")[0]
    assert res["msg"].startswith(f"{dim}=2147483648"), res
    assert res["peak"] < 64 * 2**20, f"allocated {res['peak']} bytes before raising: {res}"



def test_max_batch_dims_works():
    """32 leading dims (the kernel's limit) are fine."""
    from support import assert_close, oracle
    rng = np.random.default_rng(1)
    shape = (1,) * 30 + (2, 1)
    q = rng.standard_normal(shape + (3, 4))
    k = rng.standard_normal((1,) * 31 + (2,) + (5, 4))
    v = rng.standard_normal((5, 2))
    o = sdpa(q, k, v)
    assert o.shape == (1,) * 30 + (2, 2, 3, 2)
    # (the oracle's np.broadcast_arrays stops at 32 dims: give it the squeezed problem)
    ref = oracle(q.reshape(2, 1, 3, 4), k.reshape(2, 5, 4), v)
    assert_close(o, ref.reshape(o.shape), np.float64)


@pytest.mark.parametrize("masked", [False, True])
def test_causal_alignment_checked_without_is_causal(masked):
    """A bad causal_alignment is an error on every path, even when is_causal is False."""
    q = np.random.default_rng(0).random((2, 64, 32))
    mask = np.ones((64, 64), bool) if masked else None  # the mask takes the general path
    with pytest.raises(ValueError, match=r"causal_alignment: expected 'top_left' or 'bottom_right'"):
        fastattn.scaled_dot_product_attention(q, q, q, mask, causal_alignment="bogus")


def test_kernel_rejects_unknown_path():
    """The C entry point answers FA_EINVAL (2) for a path it does not know, never loops."""
    from fastattn import _kernels

    q = np.zeros((1, 8, 4))
    out = np.empty_like(q)
    rc = _kernels.sdpa(q, q, q, None, _kernels.MASK_NONE, out, None, (1,), False, 0, 0.5,
                       8, 0, 7, False, 1)
    assert rc == 2

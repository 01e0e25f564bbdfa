"""Embedding, Linear, SimpleRNN / GRU / LSTM and RNNEncoder: against the float64
NumPy reference, torch (when installed), hand-computed cases, contracts."""
import numpy as np
import pytest

from fastattn import _reference as ref
from fastattn.layers import GRU, LSTM, Embedding, Linear, RNNEncoder, SimpleRNN

from support import assert_close

CELLS = [(SimpleRNN, "RNN"), (GRU, "GRU"), (LSTM, "LSTM")]


def _final(st):
    return st if not isinstance(st, tuple) else st[0]


@pytest.mark.parametrize("cls,mode", CELLS)
@pytest.mark.parametrize("num_layers,bidirectional", [(1, False), (2, False), (1, True), (2, True)])
@pytest.mark.parametrize("with_lengths", [False, True])
def test_rnn_matches_reference(cls, mode, num_layers, bidirectional, with_lengths, rng):
    layer = cls(5, 4, num_layers, bidirectional=bidirectional, seed=3, dtype=np.float64)
    x = rng.standard_normal((3, 6, 5))
    lengths = np.array([6, 2, 4]) if with_lengths else None
    D = 2 if bidirectional else 1
    h0 = rng.standard_normal((num_layers * D, 3, 4))
    c0 = rng.standard_normal((num_layers * D, 3, 4))
    state = (h0, c0) if mode == "LSTM" else h0
    x_before = x.copy()
    out, st = layer(x, state, lengths=lengths)
    np.testing.assert_array_equal(x, x_before)
    r_out, r_h, r_c = ref.rnn(mode, layer.state_dict(), x, num_layers, bidirectional, h0, c0, lengths)
    assert_close(out, r_out)
    assert_close(_final(st), r_h)
    if mode == "LSTM":
        assert_close(st[1], r_c)
    assert out.shape == (3, 6, D * 4)


@pytest.mark.parametrize("cls,mode", CELLS)
def test_unbatched_equals_batch_of_one(cls, mode, rng):
    layer = cls(3, 5, 2, bidirectional=True, seed=0, dtype=np.float64)
    x = rng.standard_normal((7, 3))
    out1, st1 = layer(x)
    outb, stb = layer(x[None])
    assert out1.shape == (7, 10)
    np.testing.assert_array_equal(out1, outb[0])
    np.testing.assert_array_equal(_final(st1), _final(stb)[:, 0])


def test_gru_hand_computed_2x2():
    # hidden 1, input 1: the six gate weights chosen by hand
    g = GRU(1, 1, dtype=np.float64)
    g.load_state_dict({"weight_ih_l0": [[1.0], [0.0], [2.0]], "weight_hh_l0": [[0.0], [1.0], [1.0]],
                       "bias_ih_l0": [0.0, 0.0, 0.0], "bias_hh_l0": [0.0, 0.0, 0.0]})
    x = np.array([[1.0], [0.0]])  # two steps
    out, h = g(x)
    # step 1, h=0: r = σ(1) , z = σ(0) = .5, n = tanh(2 + r*0) = tanh 2; h1 = .5 tanh 2
    h1 = 0.5 * np.tanh(2.0)
    # step 2, x=0: r = σ(0) = .5, z = σ(h1), n = tanh(.5 * h1); h2 = (1 - z) n + z h1
    z = 1 / (1 + np.exp(-h1))
    n = np.tanh(0.5 * h1)
    h2 = (1 - z) * n + z * h1
    np.testing.assert_allclose(out[:, 0], [h1, h2], rtol=1e-15)
    np.testing.assert_allclose(h[0, 0], h2, rtol=1e-15)


def test_lstm_hand_computed_single_step():
    l = LSTM(1, 1, bias=False, dtype=np.float64)
    l.load_state_dict({"weight_ih_l0": [[1.0], [2.0], [3.0], [4.0]], "weight_hh_l0": [[0.0]] * 4})
    out, (h, c) = l(np.array([[0.5]]), (np.zeros((1, 1)), np.array([[2.0]])))
    s = lambda v: 1 / (1 + np.exp(-v))
    c1 = s(1.0) * 2.0 + s(0.5) * np.tanh(1.5)  # f*c + i*g
    np.testing.assert_allclose(c[0, 0], c1, rtol=1e-15)
    np.testing.assert_allclose(h[0, 0], s(2.0) * np.tanh(c1), rtol=1e-15)


def test_padded_positions_do_not_leak(rng):
    """Changing what sits in the padding changes neither states nor real outputs."""
    layer = GRU(4, 3, 2, bidirectional=True, seed=1, dtype=np.float64)
    x = rng.standard_normal((2, 5, 4))
    lengths = np.array([5, 2])
    out_a, h_a = layer(x, lengths=lengths)
    y = x.copy()
    y[1, 2:] = 1e3 * rng.standard_normal((3, 4))
    out_b, h_b = layer(y, lengths=lengths)
    np.testing.assert_array_equal(h_a, h_b)
    np.testing.assert_array_equal(out_a, out_b)
    assert np.all(out_a[1, 2:] == 0)
    # and the short sequence on its own gives the same states
    out_c, h_c = layer(x[1:, :2])
    np.testing.assert_allclose(h_a[:, 1:], h_c, rtol=1e-14, atol=1e-15)


def test_step_equals_forward(rng):
    layer = LSTM(3, 4, 2, seed=2, dtype=np.float64)
    x = rng.standard_normal((2, 5, 3))
    out, (h, c) = layer(x)
    st = None
    for t in range(5):
        o, st = layer.step(x[:, t], st)
        np.testing.assert_allclose(o, out[:, t], rtol=1e-14, atol=1e-15)
    np.testing.assert_allclose(st[0], h, rtol=1e-14, atol=1e-15)
    np.testing.assert_allclose(st[1], c, rtol=1e-14, atol=1e-15)


def test_float32_computed_natively(rng):
    layer = GRU(4, 3, seed=0)
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    out, h = layer(x)
    assert out.dtype == np.float32 and h.dtype == np.float32
    r, rh, _ = ref.rnn("GRU", layer.state_dict(), x, 1, False)
    assert_close(out, r)


@pytest.mark.parametrize("cls", [SimpleRNN, GRU, LSTM])
def test_state_dict_and_config_round_trip(cls, rng):
    a = cls(3, 4, 2, bidirectional=True, seed=5, dtype=np.float64)
    names = set(a.state_dict())
    assert {"weight_ih_l0", "weight_hh_l1_reverse", "bias_ih_l1", "bias_hh_l0_reverse"} <= names
    b = cls.from_config(a.get_config())
    x = rng.standard_normal((2, 4, 3))
    np.testing.assert_array_equal(a(x)[0], b(x)[0])  # same seed, same init
    c = cls(3, 4, 2, bidirectional=True, seed=6, dtype=np.float64)
    assert not np.array_equal(a(x)[0], c(x)[0])
    c.load_state_dict(a.state_dict())
    np.testing.assert_array_equal(a(x)[0], c(x)[0])
    sd = a.state_dict()
    sd["weight_ih_l0"][...] = 0  # a copy, not the live parameter
    assert not np.all(a.state_dict()["weight_ih_l0"] == 0)


def test_load_state_dict_validates():
    g = GRU(3, 4)
    sd = g.state_dict()
    bad = dict(sd, weight_ih_l0=np.zeros((12, 2)))
    with pytest.raises(ValueError, match=r"state_dict\['weight_ih_l0'\]: expected shape \(12, 3\), got \(12, 2\)"):
        g.load_state_dict(bad)
    with pytest.raises(ValueError, match=r"missing \['bias_hh_l0'\], unexpected \['extra'\]"):
        g.load_state_dict({**{k: v for k, v in sd.items() if k != "bias_hh_l0"}, "extra": np.zeros(1)})
    np.testing.assert_array_equal(g.state_dict()["weight_ih_l0"], sd["weight_ih_l0"])  # unchanged


def test_bad_inputs():
    g = GRU(3, 4)
    with pytest.raises(ValueError, match=r"x: expected last dim 3, got shape \(2, 5, 4\)"):
        g(np.zeros((2, 5, 4)))
    with pytest.raises(ValueError, match=r"x: expected a 2-d or 3-d array, got 1-d"):
        g(np.zeros(3))
    with pytest.raises(ValueError, match=r"h0: expected shape \(1, 2, 4\)"):
        g(np.zeros((2, 5, 3)), np.zeros((1, 3, 4)))
    with pytest.raises(ValueError, match=r"lengths: expected lengths in \[0, 5\], got values in \[1, 6\]"):
        g(np.zeros((2, 5, 3)), lengths=[1, 6])
    with pytest.raises(TypeError, match=r"x: expected real numbers .*complex128"):
        g(np.zeros((2, 5, 3), complex))
    with pytest.raises(TypeError, match=r"state: expected a tuple \(h0, c0\)"):
        LSTM(3, 4)(np.zeros((2, 5, 3)), np.zeros((1, 2, 4)))
    with pytest.raises(ValueError, match=r"hidden_size: expected an int >= 1, got 0"):
        GRU(3, 0)
    with pytest.raises(ValueError, match=r"nonlinearity: expected 'tanh' or 'relu', got 'sigmoid'"):
        SimpleRNN(3, 4, nonlinearity="sigmoid")
    with pytest.raises(ValueError, match="step: a bidirectional layer"):
        GRU(3, 4, bidirectional=True).step(np.zeros((1, 3)))


def test_embedding_and_linear(rng):
    e = Embedding(5, 3, padding_idx=0, seed=0, dtype=np.float64)
    assert np.all(e.weight[0] == 0)
    ids = np.array([[1, 0], [4, 4]])
    np.testing.assert_array_equal(e(ids), e.weight[ids])
    with pytest.raises(ValueError, match=r"ids: expected token ids in \[0, 5\), got values in \[0, 5\]"):
        e(np.array([0, 5]))
    with pytest.raises(TypeError, match="ids: expected an integer array"):
        e(np.array([0.0]))
    lin = Linear(3, 2, seed=1, dtype=np.float64)
    x = rng.standard_normal((4, 3))
    np.testing.assert_allclose(lin(x), x @ lin.state_dict()["weight"].T + lin.state_dict()["bias"], rtol=1e-15)
    lin.load_state_dict({"weight": [[1.0, 2.0, 3.0], [0.0, 0.0, -1.0]], "bias": [1.0, 0.5]})
    np.testing.assert_allclose(lin(np.array([1.0, 1.0, 1.0])), [7.0, -0.5])


def test_encoder_mask_and_lengths(rng):
    enc = RNNEncoder(10, 4, 3, cell="lstm", num_layers=2, bidirectional=True, padding_idx=0, seed=0,
                     dtype=np.float64)
    src = np.array([[3, 4, 5, 6], [7, 8, 0, 0]])
    mask = src != 0
    out_m, (h_m, c_m), m = enc(src, src_mask=mask)
    out_l, (h_l, c_l), m2 = enc(src, lengths=[4, 2])
    np.testing.assert_array_equal(out_m, out_l)
    np.testing.assert_array_equal(m, mask)
    x = enc.embedding(src)
    r_out, r_h, r_c = ref.rnn("LSTM", enc.rnn.state_dict(), x, 2, True, lengths=[4, 2])
    assert_close(out_m, r_out)
    assert_close(h_m, r_h)
    with pytest.raises(ValueError, match="src_mask: padding must come after the real tokens"):
        enc(src, src_mask=np.array([[True, False, True, True], [True] * 4]))
    with pytest.raises(TypeError, match="src_mask: expected a boolean array"):
        enc(src, src_mask=mask.astype(int))
    enc2 = RNNEncoder.from_config(enc.get_config())
    np.testing.assert_array_equal(enc2(src)[0], enc(src)[0])
    assert "embedding.weight" in enc.state_dict() and "rnn.weight_hh_l1_reverse" in enc.state_dict()


# ----------------------------------------------------------------- torch
torch = pytest.importorskip("torch")


@pytest.mark.parametrize("tcls,cls", [("RNN", SimpleRNN), ("GRU", GRU), ("LSTM", LSTM)])
@pytest.mark.parametrize("num_layers,bidirectional", [(1, False), (2, True)])
def test_against_torch_packed(tcls, cls, num_layers, bidirectional, rng):
    torch.manual_seed(0)
    m = getattr(torch.nn, tcls)(5, 6, num_layers=num_layers, bidirectional=bidirectional,
                                batch_first=True).double().eval()
    f = cls.from_torch(m)
    assert f.get_config()["dtype"] == "float64"
    x = rng.standard_normal((4, 7, 5))
    lengths = np.array([7, 3, 1, 5])
    packed = torch.nn.utils.rnn.pack_padded_sequence(torch.tensor(x), torch.tensor(lengths),
                                                     batch_first=True, enforce_sorted=False)
    with torch.no_grad():
        t_out, t_st = m(packed)
        t_out, _ = torch.nn.utils.rnn.pad_packed_sequence(t_out, batch_first=True, total_length=7)
        t_full, t_st_full = m(torch.tensor(x))
    out, st = f(x, lengths=lengths)
    assert_close(out, t_out.numpy())
    assert_close(_final(st), _final(t_st).numpy())
    if tcls == "LSTM":
        assert_close(st[1], t_st[1].numpy())
    out_full, st_full = f(x)
    assert_close(out_full, t_full.numpy())
    # from a bare state dict too
    g = cls.from_torch(m.state_dict())
    np.testing.assert_array_equal(g(x)[0], out_full)


def test_torch_float32_and_relu(rng):
    torch.manual_seed(1)
    m = torch.nn.RNN(3, 4, nonlinearity="relu", batch_first=True)
    f = SimpleRNN.from_torch(m)
    assert f.get_config()["nonlinearity"] == "relu" and f.get_config()["dtype"] == "float32"
    x = rng.standard_normal((2, 5, 3)).astype(np.float32)
    with torch.no_grad():
        t, _ = m(torch.tensor(x))
    assert_close(f(x)[0], t.numpy())
    with pytest.raises(TypeError, match="expected torch.nn.GRU, got RNN"):
        GRU.from_torch(m)


def test_torch_embedding_linear(rng):
    torch.manual_seed(2)
    te, tl = torch.nn.Embedding(6, 3, padding_idx=2).double(), torch.nn.Linear(3, 4).double()
    e, lin = Embedding.from_torch(te), Linear.from_torch(tl)
    assert e.get_config()["padding_idx"] == 2
    ids = np.array([[0, 2, 5]])
    with torch.no_grad():
        want = tl(te(torch.tensor(ids))).numpy()
    assert_close(lin(e(ids)), want)


def test_functional_linear(rng):
    from fastattn.functional import linear
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    w = rng.standard_normal((5, 4)).astype(np.float32)
    b = rng.standard_normal(5).astype(np.float32)
    y = linear(x, w, b)
    assert y.dtype == np.float32 and y.shape == (2, 3, 5)
    assert_close(y, x.astype(np.float64) @ w.T.astype(np.float64) + b)
    assert linear(x, w.astype(np.float64)).dtype == np.float64
    xb = x.copy()
    linear(x, w, b)
    np.testing.assert_array_equal(x, xb)
    with pytest.raises(ValueError, match=r"x: expected last dim 4 \(weight's in_features\), got shape \(2, 3\)"):
        linear(x[..., 0], w)
    with pytest.raises(ValueError, match=r"bias: expected shape \(5,\), got \(4,\)"):
        linear(x, w, b[:4])
    with pytest.raises(TypeError, match="x: complex dtypes are not supported"):
        linear(x.astype(complex), w)


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("rows", [1, 2, 4, 5, 16, 17, 32, 128, 130])
@pytest.mark.parametrize("n_threads", [1, 2])
def test_functional_linear_dispatch_matches_reference(simd_mode, dtype, rows, n_threads, rng, monkeypatch):
    """Every dispatch of linear() (NumPy for the tiniest products, the projection kernel
    otherwise) against float64; a 32-row product (a GRU step at B=32) is split across
    both threads (the fused path's 128-row blocks ran it on one)."""
    from fastattn import _linear
    from fastattn.functional import linear
    blocks = []
    real = _linear._proj.linear

    def counting(*a):
        blocks.append(real(*a))
        return blocks[-1]

    monkeypatch.setattr(_linear._proj, "linear", counting)
    x = rng.standard_normal((rows, 256)).astype(dtype)
    w = rng.standard_normal((768, 256)).astype(dtype) * 0.1
    b = rng.standard_normal(768).astype(dtype)
    xb, wb = x.copy(), w.copy()
    y = linear(x, w, b, n_threads=n_threads)
    assert y.dtype == dtype and y.shape == (rows, 768)
    assert_close(y, x.astype(np.float64) @ w.T.astype(np.float64) + b, dtype)
    np.testing.assert_array_equal(x, xb)
    np.testing.assert_array_equal(w, wb)
    # one float32 row with >= PARALLEL_MIN_WEIGHTS weights (768 x 256 here) also goes to
    # the kernel, split over the threads: both cores read the weights
    big_row = (dtype == np.float32 and w.size >= _linear.PARALLEL_MIN_WEIGHTS
               and _linear._proj.small_kernel_active())
    used = rows > _linear.numpy_max_rows(dtype) or big_row
    assert bool(blocks) == used
    if used and n_threads == 2 and (rows >= 16 or big_row):  # else one thread runs it alone
        assert blocks[0] >= 2
    # leading dims and a non-contiguous x
    x3 = rng.standard_normal((2, rows, 300)).astype(dtype)[:, :, 10:266]
    assert_close(linear(x3, w, b, n_threads=n_threads),
                 x3.astype(np.float64) @ w.T.astype(np.float64) + b, dtype)


def test_functional_linear_few_row_kernel_for_float32():
    """With the AVX2 kernel, float32 products of more than one row go to it (measured faster
    than NumPy's matmul from 2 rows up, see fastattn/_linear.py); float64 keeps NumPy to 4."""
    from fastattn import _linear, _proj
    assert _linear.numpy_max_rows(np.float64) == 4
    want = 1 if _proj.small_kernel_active() else 16
    assert _linear.numpy_max_rows(np.float32) == want

"""Benchmarks of the seq2seq layers (issue 6 targets), float32, fastattn's thread count.

Groups

* ``seq2seq encoder+step B=32 T=64 E=H=256``: GRU encoder over (32, 64) tokens,
  the decoder memory prepared (additive-attention keys projected) and one
  Bahdanau decoder step with additive attention over that memory.
  Target: fastattn <= 1.0x torch (eval, inference_mode).
* ``seq2seq greedy 32 steps B=1 S=64``: encode one 64-token source and
  greedily decode 32 tokens (no early stop).  Target: fastattn <= 0.5x torch.

Implementations: ``fastattn`` (fastattn.layers.Seq2Seq), ``torch`` (the PyTorch
seq2seq tutorial's GRU encoder + AttnDecoderRNN with the keys projected once,
the same weights), ``numpy`` (the same model in plain NumPy, additive scores
through the dense (B, S, d_a) tanh tensor).  NumPy's OpenBLAS is held at
fastattn's thread count.  Outputs are checked against torch outside the timing.

    pytest benchmarks/test_bench_seq2seq.py --benchmark-only
"""
from __future__ import annotations

import time

import numpy as np
import pytest
from scipy.special import expit

import fastattn
from fastattn import _bench
from fastattn.layers import AttentionDecoder, RNNEncoder, Seq2Seq

N_THREADS = fastattn.get_num_threads()
torch = _bench.load_torch(N_THREADS)
V, E, H = 1000, 256, 256


def make_models():
    enc = RNNEncoder(V, E, H, seed=0)
    dec = AttentionDecoder(V, E, H, H, similarity="additive", attn_dim=H, seed=1)
    m = Seq2Seq(enc, dec, bos_id=1, eos_id=2)
    rng = np.random.default_rng(2)
    m.load_state_dict({k: (v + 0.05 * rng.standard_normal(v.shape)).astype(np.float32)
                       for k, v in m.state_dict().items()})
    m.eos_id = -1  # never stop early: always 32 steps
    return m


MODEL = make_models()
SD = MODEL.state_dict()


# ------------------------------------------------------------------ numpy
def np_gru_step(x, h, p, pre):
    gi = x @ p[pre + "weight_ih_l0"].T + p[pre + "bias_ih_l0"]
    gh = h @ p[pre + "weight_hh_l0"].T + p[pre + "bias_hh_l0"]
    r = expit(gi[:, :H] + gh[:, :H])
    z = expit(gi[:, H:2 * H] + gh[:, H:2 * H])
    n = np.tanh(gi[:, 2 * H:] + r * gh[:, 2 * H:])
    return (1 - z) * n + z * h


def np_encode(src):
    p = SD
    x = p["encoder.embedding.weight"][src]
    B, T, _ = x.shape
    h = np.zeros((B, H), np.float32)
    outs = np.empty((B, T, H), np.float32)
    for t in range(T):
        h = np_gru_step(x[:, t], h, p, "encoder.rnn.")
        outs[:, t] = h
    return outs, h, outs @ p["decoder.attn.W_k"].T


def np_step(y, h, keys, ukeys):
    p = SD
    q = h @ p["decoder.attn.W_q"].T + p["decoder.attn.b"]
    s = np.tanh(q[:, None, :] + ukeys) @ p["decoder.attn.v"]
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    ctx = np.einsum("bs,bsd->bd", w, keys)
    x = np.concatenate([p["decoder.embedding.weight"][y], ctx], -1)
    h = np_gru_step(x, h, p, "decoder.rnn.")
    return h @ p["decoder.out.weight"].T + p["decoder.out.bias"], h


def np_encoder_step(src):
    keys, h, uk = np_encode(src)
    return np_step(np.ones(src.shape[0], np.int64), h, keys, uk)[0]


def np_greedy(src, n=32):
    keys, h, uk = np_encode(src)
    y = np.ones(src.shape[0], np.int64)
    out = []
    for _ in range(n):
        logits, h = np_step(y, h, keys, uk)
        y = np.argmax(logits, -1)
        out.append(y)
    return np.stack(out, 1)


# ------------------------------------------------------------------ torch
def torch_model():
    nn = torch.nn

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc_emb, self.enc_gru = nn.Embedding(V, E), nn.GRU(E, H, batch_first=True)
            self.emb, self.gru = nn.Embedding(V, E), nn.GRU(E + H, H, batch_first=True)
            self.Wa, self.Ua, self.Va = nn.Linear(H, H), nn.Linear(H, H, bias=False), nn.Linear(H, 1, bias=False)
            self.out = nn.Linear(H, V)

        def encode(self, src):
            keys, hidden = self.enc_gru(self.enc_emb(src))
            return keys, hidden, self.Ua(keys)

        def step(self, y, hidden, keys, ukeys):
            s = self.Va(torch.tanh(self.Wa(hidden.permute(1, 0, 2)) + ukeys)).squeeze(2)
            w = torch.softmax(s, dim=-1)
            ctx = torch.bmm(w[:, None, :], keys)
            o, hidden = self.gru(torch.cat([self.emb(y[:, None]), ctx], 2), hidden)
            return self.out(o[:, 0]), hidden

    m = M().eval()
    t = {k: torch.tensor(v) for k, v in SD.items()}
    sd = {"enc_emb.weight": t["encoder.embedding.weight"], "emb.weight": t["decoder.embedding.weight"],
          "Wa.weight": t["decoder.attn.W_q"], "Wa.bias": t["decoder.attn.b"], "Ua.weight": t["decoder.attn.W_k"],
          "Va.weight": t["decoder.attn.v"][None], "out.weight": t["decoder.out.weight"],
          "out.bias": t["decoder.out.bias"]}
    for k, v in t.items():
        if k.startswith("encoder.rnn."):
            sd["enc_gru." + k[len("encoder.rnn."):]] = v
        elif k.startswith("decoder.rnn."):
            sd["gru." + k[len("decoder.rnn."):]] = v
    m.load_state_dict(sd)
    return m


def torch_encoder_step(m, src):
    with torch.inference_mode():
        keys, hidden, uk = m.encode(src)
        return m.step(torch.ones(src.shape[0], dtype=torch.long), hidden, keys, uk)[0]


def torch_greedy(m, src, n=32):
    with torch.inference_mode():
        keys, hidden, uk = m.encode(src)
        y = torch.ones(src.shape[0], dtype=torch.long)
        out = []
        for _ in range(n):
            logits, hidden = m.step(y, hidden, keys, uk)
            y = logits.argmax(-1)
            out.append(y)
        return torch.stack(out, 1)


# ------------------------------------------------------------------ fastattn
def fa_encoder_step(src):
    mem, state = MODEL.encode(src)
    return MODEL.step(np.ones(src.shape[0], np.int64), state, mem)[0]


def fa_greedy(src, n=32):
    return MODEL.greedy_decode(src, max_len=n).tokens


SRC32 = np.random.default_rng(3).integers(3, V, (32, 64))
SRC1 = np.random.default_rng(4).integers(3, V, (1, 64))
IMPLS = ["fastattn", "torch", "numpy"]


@pytest.fixture(autouse=True)
def _blas_held():
    with _bench.blas_threads(N_THREADS):
        yield
    _bench.quiesce()


def _callable(impl, kind):
    if impl == "torch":
        if torch is None:
            pytest.skip("torch is not installed")
        m = torch_model()
        if kind == "encoder":
            src = torch.tensor(SRC32)
            return lambda: torch_encoder_step(m, src), lambda r: r.numpy()
        src = torch.tensor(SRC1)
        return lambda: torch_greedy(m, src), lambda r: r.numpy()
    if impl == "numpy":
        return ((lambda: np_encoder_step(SRC32)) if kind == "encoder" else (lambda: np_greedy(SRC1))), np.asarray
    return ((lambda: fa_encoder_step(SRC32)) if kind == "encoder" else (lambda: fa_greedy(SRC1))), np.asarray


WARMUP_S = 0.3


def _warmup_rounds(fn):
    """Warm-up rounds worth WARMUP_S seconds of calls (at least one), for every
    implementation alike.  After the rest above the machine needs that long to
    come back to speed: fastattn's greedy decoding took 7.3-7.8 ms in its first
    calls after a rest, falling to 6.5-6.9 ms by the 15th and 6.1 ms steady
    (measured); one warm-up round timed that ramp instead of the decoding."""
    t0 = time.perf_counter()
    fn()
    return max(1, int(WARMUP_S / max(time.perf_counter() - t0, 1e-6)))


@pytest.mark.parametrize("impl", IMPLS)
def test_encoder_and_step(benchmark, impl):
    benchmark.group = "seq2seq encoder+step B=32 T=64 E=H=256"
    fn, conv = _callable(impl, "encoder")
    got = conv(fn())
    want = np_encoder_step(SRC32)
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3)
    _bench.quiesce()  # the check's NumPy workers (and torch's) stop spinning before the timing
    benchmark.pedantic(fn, rounds=10, iterations=1, warmup_rounds=_warmup_rounds(fn))


@pytest.mark.parametrize("impl", IMPLS)
def test_greedy_32_steps(benchmark, impl):
    benchmark.group = "seq2seq greedy 32 steps B=1 S=64"
    fn, conv = _callable(impl, "greedy")
    got = conv(fn())
    np.testing.assert_array_equal(got, np_greedy(SRC1))
    _bench.quiesce()  # the check's NumPy workers (and torch's) stop spinning before the timing
    benchmark.pedantic(fn, rounds=15, iterations=1, warmup_rounds=_warmup_rounds(fn))

"""AttentionDecoder (Bahdanau / Luong) and Seq2Seq: reference, torch, step vs
teacher forcing, greedy vs beam, masks, round trips, errors."""
import itertools
import math

import numpy as np
import pytest
from scipy.special import log_softmax

from fastattn import _reference as ref
from fastattn.layers import AttentionDecoder, Memory, RNNEncoder, Seq2Seq

from support import assert_close
from test_layers_attention import ref_score

V = 9
BOS, EOS = 1, 2


def make_model(style="bahdanau", sim="additive", cell="gru", bidirectional=True, num_layers=1,
               seed=0, dtype=np.float64, init_state="encoder"):
    H_enc = 4
    D = 2 if bidirectional else 1
    enc = RNNEncoder(V, 5, H_enc, cell=cell, num_layers=num_layers, bidirectional=bidirectional,
                     padding_idx=0, seed=seed, dtype=dtype)
    dec = AttentionDecoder(V, 6, D * H_enc, D * H_enc, style=style, similarity=sim, attn_dim=5, cell=cell,
                           num_layers=num_layers, seed=seed + 1, dtype=dtype)
    m = Seq2Seq(enc, dec, bos_id=BOS, eos_id=EOS, pad_id=0, init_state=init_state)
    rng = np.random.default_rng(seed + 2)
    # non-trivial biases everywhere (most are zero-initialised)
    m.load_state_dict({k: v + 0.3 * rng.standard_normal(v.shape) for k, v in m.state_dict().items()})
    return m


def batch(rng, B=3, S=6, T=5):
    lengths = np.array([S, 3, 1, 4][:B])
    src = rng.integers(3, V, (B, S))
    mask = np.arange(S)[None, :] < lengths[:, None]
    src[~mask] = 0
    tgt = rng.integers(3, V, (B, T))
    tgt[:, 0] = BOS
    return src, mask, tgt


def reference_logits(m, src, mask, tgt):
    sd = {k: np.asarray(v, np.float64) for k, v in m.state_dict().items()}
    dec = m.decoder
    enc_out, final, _ = m.encoder(src, src_mask=mask)
    enc_cfg = m.encoder.get_config()
    cellmode = {"gru": "GRU", "lstm": "LSTM", "rnn": "RNN"}[enc_cfg["cell"]]
    x = sd["encoder.embedding.weight"][src]
    rp = {k[len("encoder.rnn."):]: v for k, v in sd.items() if k.startswith("encoder.rnn.")}
    r_out, r_h, r_c = ref.rnn(cellmode, rp, x, enc_cfg["num_layers"], enc_cfg["bidirectional"],
                              lengths=mask.sum(1))
    assert_close(enc_out, r_out)
    D = 2 if enc_cfg["bidirectional"] else 1
    merge = (lambda h: np.concatenate([h[0::2], h[1::2]], axis=-1)) if D == 2 else (lambda h: h)
    h0 = (merge(r_h), merge(r_c)) if cellmode == "LSTM" else merge(r_h)
    if m.init_state == "zeros":
        z = np.zeros_like(merge(r_h))
        h0 = (z, z) if cellmode == "LSTM" else z
    p = {k[len("decoder.attn."):]: v for k, v in sd.items() if k.startswith("decoder.attn.")}
    score1 = ref_score(dec.similarity.name, p, dec.hidden_size)
    score = lambda s, mem: score1(s[None], mem)[0]
    cp = {k[len("decoder.rnn."):]: v for k, v in sd.items() if k.startswith("decoder.rnn.")}
    return ref.attention_decoder(dec.style, score, sd["decoder.embedding.weight"], cellmode, cp,
                                 sd["decoder.out.weight"], sd["decoder.out.bias"], r_out, mask, tgt, h0,
                                 sd.get("decoder.combine.weight"))


@pytest.mark.parametrize("style", ["bahdanau", "luong"])
@pytest.mark.parametrize("sim", ["additive", "concat", "general", "dot", "scaled_dot", "cosine"])
def test_teacher_forced_matches_reference(style, sim, rng):
    m = make_model(style, sim)
    src, mask, tgt = batch(rng)
    src_before = src.copy()
    logits, al = m(src, tgt, mask, return_alignments=True)
    np.testing.assert_array_equal(src, src_before)
    r_logits, r_al = reference_logits(m, src, mask, tgt)
    assert_close(logits, r_logits)
    assert_close(al, r_al)
    assert np.all(al[~np.broadcast_to(mask[:, None, :], al.shape)] == 0)
    np.testing.assert_allclose(al.sum(-1), 1.0, rtol=1e-12)


@pytest.mark.parametrize("style,cell,num_layers,bidi,init_state", [
    ("bahdanau", "lstm", 2, True, "encoder"), ("luong", "lstm", 2, False, "encoder"),
    ("luong", "rnn", 1, True, "zeros"), ("bahdanau", "gru", 2, False, "zeros")])
def test_cells_and_layers_match_reference(style, cell, num_layers, bidi, init_state, rng):
    m = make_model(style, "additive", cell, bidi, num_layers, init_state=init_state)
    src, mask, tgt = batch(rng)
    r_logits, r_al = reference_logits(m, src, mask, tgt)
    logits, al = m(src, tgt, mask, return_alignments=True)
    assert_close(logits, r_logits)
    assert_close(al, r_al)


@pytest.mark.parametrize("style", ["bahdanau", "luong"])
@pytest.mark.parametrize("cell", ["gru", "lstm"])
def test_step_equals_teacher_forced(style, cell, rng):
    m = make_model(style, "additive", cell)
    src, mask, tgt = batch(rng)
    logits, al = m(src, tgt, mask, return_alignments=True)
    mem, state = m.encode(src, mask)
    for t in range(tgt.shape[1]):
        lg, state, w = m.step(tgt[:, t], state, mem)
        np.testing.assert_allclose(lg, logits[:, t], rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose(w, al[:, t], rtol=1e-12, atol=1e-13)


def test_memory_keys_projected_once(rng):
    m = make_model("bahdanau", "additive")
    src, mask, _ = batch(rng)
    mem, _ = m.encode(src, mask)
    assert isinstance(mem, Memory)
    W_k = m.decoder.state_dict()["attn.W_k"]
    np.testing.assert_allclose(mem.keys, mem.values @ W_k.T, rtol=1e-14)
    assert mem.similarity.name == "additive_precomputed"
    assert mem.mask.shape == (3, 1, 6)


def test_padding_does_not_leak(rng):
    m = make_model("luong", "general")
    src, mask, tgt = batch(rng)
    a = m(src, tgt, mask)
    src2 = src.copy()
    src2[~mask] = 7  # other tokens in the padding
    np.testing.assert_array_equal(m(src2, tgt, mask), a)
    # each item alone (no padding) gives the same logits
    for b in range(3):
        n = mask[b].sum()
        np.testing.assert_allclose(m(src[b:b + 1, :n], tgt[b:b + 1])[0], a[b], rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("style", ["bahdanau", "luong"])
def test_greedy_and_beam_one(style, rng):
    m = make_model(style, "additive")
    src, mask, _ = batch(rng)
    g = m.greedy_decode(src, mask, max_len=7)
    b1 = m.beam_search(src, mask, beam_size=1, max_len=7)
    np.testing.assert_array_equal(g.tokens, b1.tokens)
    np.testing.assert_array_equal(g.lengths, b1.lengths)
    np.testing.assert_allclose(g.scores, b1.scores, rtol=1e-12)
    np.testing.assert_allclose(g.alignments, b1.alignments, rtol=1e-12, atol=1e-14)
    # greedy tokens are the arg-max of a teacher-forced pass on its own output
    for b in range(3):
        n = g.lengths[b]
        tgt_in = np.concatenate([[BOS], g.tokens[b, :n - 1]])[None]
        lg, al = m(src[b:b + 1], tgt_in, mask[b:b + 1], return_alignments=True)
        np.testing.assert_array_equal(np.argmax(lg[0], -1), g.tokens[b, :n])
        lp = log_softmax(lg[0], -1)
        np.testing.assert_allclose(g.scores[b], lp[np.arange(n), g.tokens[b, :n]].sum(), rtol=1e-10)
        np.testing.assert_allclose(g.alignments[b, :n], al[0], rtol=1e-10, atol=1e-12)
        assert np.all(g.tokens[b, n:] == 0) and np.all(g.alignments[b, n:] == 0)
        assert g.tokens[b, n - 1] == EOS or n == 7


def _exhaustive_best(m, src, max_len):
    """Best full hypothesis (ends in EOS or has max_len tokens) by brute force."""
    best, best_seq = -np.inf, None
    for L in range(1, max_len + 1):
        for body in itertools.product(range(V), repeat=L):
            if EOS in body[:-1] or (L < max_len and body[-1] != EOS):
                continue
            lg = m(src, np.array([[BOS, *body[:-1]]]))[0]
            s = log_softmax(lg, -1)[np.arange(L), list(body)].sum()
            if s > best:
                best, best_seq = s, body
    return best, best_seq


def test_wide_beam_is_exact_search(rng):
    """With beam_size >= V**(max_len-1) nothing is pruned: the best sequence by brute force."""
    m = make_model("bahdanau", "additive", bidirectional=False)
    src = np.array([[3, 4, 5]])
    max_len = 3
    best, seq = _exhaustive_best(m, src, max_len)
    r = m.beam_search(src, beam_size=V ** (max_len - 1), max_len=max_len)
    np.testing.assert_allclose(r.scores[0], best, rtol=1e-10)
    assert tuple(r.tokens[0, :r.lengths[0]]) == seq
    r4 = m.beam_search(src, beam_size=4, max_len=max_len)
    g = m.greedy_decode(src, max_len=max_len)
    assert r4.scores[0] <= best + 1e-12 and g.scores[0] <= best + 1e-12


def test_state_dict_and_config_round_trip(rng):
    m = make_model("luong", "concat", "lstm", num_layers=2)
    src, mask, tgt = batch(rng)
    m2 = Seq2Seq.from_config(m.get_config())
    assert m2.get_config() == m.get_config()
    assert not np.array_equal(m2(src, tgt, mask), m(src, tgt, mask))
    m2.load_state_dict(m.state_dict())
    np.testing.assert_array_equal(m2(src, tgt, mask), m(src, tgt, mask))
    names = set(m.state_dict())
    assert {"encoder.embedding.weight", "encoder.rnn.weight_ih_l1_reverse", "decoder.attn.W",
            "decoder.attn.v", "decoder.combine.weight", "decoder.out.bias"} <= names
    d = AttentionDecoder.from_config(m.decoder.get_config())
    assert d.get_config() == m.decoder.get_config()


def test_float32(rng):
    m = make_model("bahdanau", "additive", dtype=np.float32)
    src, mask, tgt = batch(rng)
    logits = m(src, tgt, mask)
    assert logits.dtype == np.float32
    r_logits, _ = reference_logits(m, src, mask, tgt)
    np.testing.assert_allclose(logits, r_logits, rtol=1e-4, atol=1e-4)


def test_bad_inputs(rng):
    enc = RNNEncoder(V, 5, 4, seed=0)
    with pytest.raises(ValueError, match=r"init_state: 'encoder' needs .* decoder hidden_size == encoder output size"):
        Seq2Seq(enc, AttentionDecoder(V, 5, 6, 4, seed=0), bos_id=1, eos_id=2)
    with pytest.raises(ValueError, match=r"decoder: expected memory_dim 4 \(the encoder's output size\), got 5"):
        Seq2Seq(enc, AttentionDecoder(V, 5, 4, 5, seed=0), bos_id=1, eos_id=2)
    with pytest.raises(ValueError, match=r"eos_id: expected a token id in \[0, 9\), got 9"):
        Seq2Seq(enc, AttentionDecoder(V, 5, 4, 4, seed=0), bos_id=1, eos_id=9)
    with pytest.raises(ValueError, match=r"style: expected one of \('bahdanau', 'luong'\), got 'other'"):
        AttentionDecoder(V, 5, 4, 4, style="other")
    with pytest.raises(ValueError, match=r"similarity: 'dot' needs hidden_size == memory_dim"):
        AttentionDecoder(V, 5, 4, 6, similarity="dot")
    m = make_model()
    src, mask, tgt = batch(rng)
    mem, st = m.encode(src, mask)
    with pytest.raises(ValueError, match=r"tokens: expected shape \(3,\) \(one token per batch item\), got \(2,\)"):
        m.step(np.array([1, 1]), st, mem)
    with pytest.raises(TypeError, match="memory: expected the Memory returned by precompute"):
        m.step(np.array([1, 1, 1]), st, mem.values)
    with pytest.raises(ValueError, match=r"src_mask: expected shape \(B, 6\), got \(3, 5\)"):
        m(src, tgt, mask[:, :5])
    with pytest.raises(ValueError, match=r"beam_size: expected an int >= 1, got 0"):
        m.beam_search(src, mask, beam_size=0)
    with pytest.raises(TypeError, match="tgt_in: expected an integer array"):
        m(src, tgt.astype(float), mask)


torch = pytest.importorskip("torch")
nn = torch.nn


class TorchBahdanau(nn.Module):
    """The PyTorch seq2seq tutorial's encoder and AttnDecoderRNN (batch-first)."""

    def __init__(self, V, E, H):
        super().__init__()
        self.enc_emb, self.enc_gru = nn.Embedding(V, E), nn.GRU(E, H, batch_first=True)
        self.emb, self.gru = nn.Embedding(V, E), nn.GRU(E + H, H, batch_first=True)
        self.Wa, self.Ua, self.Va = nn.Linear(H, H), nn.Linear(H, H), nn.Linear(H, 1)
        self.out = nn.Linear(H, V)

    def forward(self, src, tgt, mask):
        keys, hidden = self.enc_gru(self.enc_emb(src))
        logits, aligns = [], []
        for t in range(tgt.shape[1]):
            q = hidden.permute(1, 0, 2)
            s = self.Va(torch.tanh(self.Wa(q) + self.Ua(keys))).squeeze(2).unsqueeze(1)
            s = s.masked_fill(~mask[:, None, :], float("-inf"))
            w = torch.softmax(s, dim=-1)
            ctx = torch.bmm(w, keys)
            o, hidden = self.gru(torch.cat([self.emb(tgt[:, t:t + 1]), ctx], dim=2), hidden)
            logits.append(self.out(o))
            aligns.append(w)
        return torch.cat(logits, 1), torch.cat(aligns, 1)


def test_bahdanau_against_torch_tutorial_model(rng):
    torch.manual_seed(0)
    E, H = 5, 6
    tm = TorchBahdanau(V, E, H).double().eval()
    enc = RNNEncoder(V, E, H, seed=0, dtype=np.float64)
    dec = AttentionDecoder(V, E, H, H, style="bahdanau", similarity="additive", attn_dim=H, seed=0,
                           dtype=np.float64)
    m = Seq2Seq(enc, dec, bos_id=BOS, eos_id=EOS)
    sd = tm.state_dict()
    mapped = {"encoder.embedding.weight": sd["enc_emb.weight"], "decoder.embedding.weight": sd["emb.weight"],
              "decoder.out.weight": sd["out.weight"], "decoder.out.bias": sd["out.bias"],
              "decoder.attn.W_q": sd["Wa.weight"], "decoder.attn.W_k": sd["Ua.weight"],
              "decoder.attn.b": sd["Wa.bias"] + sd["Ua.bias"], "decoder.attn.v": sd["Va.weight"][0]}
    for k, v in sd.items():
        if k.startswith("enc_gru."):
            mapped["encoder.rnn." + k[8:]] = v
        elif k.startswith("gru."):
            mapped["decoder.rnn." + k[4:]] = v
    m.load_state_dict(mapped)
    src = rng.integers(3, V, (2, 7))
    tgt = rng.integers(3, V, (2, 4))
    mask = np.ones((2, 7), bool)  # the tutorial encoder does not pack; full-length sources
    with torch.no_grad():
        t_logits, t_al = tm(torch.tensor(src), torch.tensor(tgt), torch.tensor(mask))
    logits, al = m(src, tgt, mask, return_alignments=True)
    assert_close(logits, t_logits.numpy())
    assert_close(al, t_al.numpy())


def test_luong_general_against_torch(rng):
    """Luong (general score, combine tanh(W_c [c; s])) written in torch, bidirectional
    packed encoder, padded sources."""
    torch.manual_seed(1)
    E, H = 5, 3
    enc_emb, enc_rnn = nn.Embedding(V, E).double(), nn.GRU(E, H, batch_first=True, bidirectional=True).double()
    emb, rnn = nn.Embedding(V, E).double(), nn.GRU(E, 2 * H, batch_first=True).double()
    Wg = torch.randn(2 * H, 2 * H, dtype=torch.float64)
    Wc, out = nn.Linear(4 * H, 2 * H, bias=False).double(), nn.Linear(2 * H, V).double()
    src, mask, tgt = batch(rng)
    lengths = torch.tensor(mask.sum(1))
    with torch.no_grad():
        packed = nn.utils.rnn.pack_padded_sequence(enc_emb(torch.tensor(src)), lengths, batch_first=True,
                                                   enforce_sorted=False)
        keys, h_n = enc_rnn(packed)
        keys, _ = nn.utils.rnn.pad_packed_sequence(keys, batch_first=True, total_length=src.shape[1])
        h0 = torch.cat([h_n[0::2], h_n[1::2]], dim=-1)
        s, _ = rnn(emb(torch.tensor(tgt)), h0)
        scores = (s @ Wg) @ keys.transpose(1, 2)
        scores = scores.masked_fill(~torch.tensor(mask)[:, None, :], float("-inf"))
        a = torch.softmax(scores, -1)
        ctx = a @ keys
        want = out(torch.tanh(Wc(torch.cat([ctx, s], -1))))
    enc = RNNEncoder(V, E, H, bidirectional=True, dtype=np.float64)
    dec = AttentionDecoder(V, E, 2 * H, 2 * H, style="luong", similarity="general", dtype=np.float64)
    m = Seq2Seq(enc, dec, bos_id=BOS, eos_id=EOS)
    sd = {"encoder.embedding.weight": enc_emb.weight, "decoder.embedding.weight": emb.weight,
          "decoder.attn.W": Wg, "decoder.attn.scale": np.array(1.0), "decoder.combine.weight": Wc.weight, "decoder.out.weight": out.weight,
          "decoder.out.bias": out.bias}
    sd.update({"encoder.rnn." + k: v for k, v in enc_rnn.state_dict().items()})
    sd.update({"decoder.rnn." + k: v for k, v in rnn.state_dict().items()})
    m.load_state_dict(sd)
    logits, al = m(src, tgt, mask, return_alignments=True)
    assert_close(logits, want.numpy())
    assert_close(al, a.numpy())


def test_greedy_log_probabilities_in_batches_of_steps(rng, monkeypatch):
    """greedy_decode turns logits into log-probabilities a batch of steps at a time
    (seq2seq._LOGIT_BATCH numbers); one step at a time gives the same result."""
    from fastattn.layers import seq2seq

    m = make_model("bahdanau", "additive")
    src, mask, _ = batch(rng)
    whole = m.greedy_decode(src, mask, max_len=9)
    monkeypatch.setattr(seq2seq, "_LOGIT_BATCH", 1)
    single = m.greedy_decode(src, mask, max_len=9)
    for a, b in zip(whole, single):
        np.testing.assert_array_equal(a, b)
    # the scores are the log-softmax of a teacher-forced pass at the chosen tokens
    for b in range(src.shape[0]):
        n = whole.lengths[b]
        tgt_in = np.concatenate([[BOS], whole.tokens[b, :n - 1]])[None]
        lg = m(src[b:b + 1], tgt_in, mask[b:b + 1])
        lp = log_softmax(lg[0], -1)
        np.testing.assert_allclose(whole.scores[b], lp[np.arange(n), whole.tokens[b, :n]].sum(),
                                   rtol=1e-6)

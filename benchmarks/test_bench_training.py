"""Benchmarks of one training step (forward + backward + optimizer step),
fastattn against torch in the same run, 2 threads, float32.

* ``encoder``: ``TransformerEncoderLayer`` B=32 T=128 E=256 H=4 FF=1024
  (post-norm, relu, dropout 0.1, key padding: a quarter of the rows end
  early), masked mean pooling, ``Linear(256, 2)``, cross-entropy, Adam.
  fastattn: the layers' ``forward_backward`` (``input_grad=False``: the input
  is data, as torch's, which has no ``requires_grad``, so neither computes its
  gradient), ``fastattn.losses.cross_entropy``,
  ``fastattn.optim.Adam``; torch: the same modules (weights copied from
  fastattn's), ``nn.functional.cross_entropy``, ``torch.optim.Adam``.  torch's
  dropout on the attention weights (``self_attn.dropout``) is set to 0, as
  fastattn has none (its streaming kernel never holds the weights); that also
  leaves torch its fused attention kernel.

* ``seq2seq``: GRU encoder + Bahdanau decoder with additive attention, B=32
  S=T=32, E=H=256 (d_a=256), V=1000, teacher forced, a quarter of the
  sources padded to half length, cross-entropy (pad ignored), Adam.
  fastattn: ``Seq2Seq.loss_and_grads`` and ``fastattn.optim.Adam``; torch:
  ``nn.Embedding`` + ``nn.GRU`` (packed) encoder and a decoder loop of
  ``nn.GRUCell`` on ``[embedding; context]`` with ``v·tanh(W_q s + W_k h +
  b)`` attention (the PyTorch seq2seq tutorial's layout), the same weights.

Before timing, one step of each from the same weights is checked: the
losses agree (dropout off for the check; the masks are the libraries' own
when timing).

    pytest benchmarks/test_bench_training.py --benchmark-only
"""
from __future__ import annotations

import numpy as np
import pytest

import fastattn
from fastattn import _bench, losses, optim
from fastattn import layers as L

pytestmark = pytest.mark.usefixtures("quiesce_after")

N_THREADS = fastattn.get_num_threads()
torch = _bench.load_torch(N_THREADS)

B, T, E, H, FF = 32, 128, 256, 4, 1024


def encoder_data():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((B, T, E), dtype=np.float32)
    lengths = np.where(np.arange(B) % 4 == 0, T // 2, T)
    mask = np.arange(T)[None, :] < lengths[:, None]
    y = rng.integers(0, 2, B)
    return x, mask, y


class FastattnEncoder:
    def __init__(self, dropout=0.1):
        self.enc = L.TransformerEncoderLayer(E, H, FF, dropout, seed=1)
        self.pool = L.MeanPooling()
        self.head = L.Linear(E, 2, seed=2)
        self.opt = optim.Adam([(f"enc.{n}", p, g) for (n, p), (_, g) in
                               zip(self.enc.named_parameters(), self.enc.named_grads())]
                              + [(f"head.{n}", p, g) for (n, p), (_, g) in
                                 zip(self.head.named_parameters(), self.head.named_grads())],
                              lr=1e-4)

    def step(self, x, mask, y):
        self.enc.zero_grad()
        self.head.zero_grad()
        # x is data: no input gradient (torch's x has no requires_grad either)
        h, b_enc = self.enc.forward_backward(x, key_mask=mask, input_grad=False)
        p, b_pool = self.pool.forward_backward(h, mask)
        logits, b_head = self.head.forward_backward(p)
        loss, g = losses.cross_entropy(logits, y)
        (gp,) = b_head(g)
        gh, _ = b_pool(gp)
        b_enc(gh)
        self.opt.step()
        return loss


def torch_encoder(fa):
    layer = torch.nn.TransformerEncoderLayer(E, H, FF, fa.enc.get_config()["dropout"],
                                             batch_first=True)
    layer.self_attn.dropout = 0.0
    head = torch.nn.Linear(E, 2)
    with torch.no_grad():
        sd = fa.enc.state_dict()
        for n, p in layer.named_parameters():
            p.copy_(torch.from_numpy(sd[n]))
        for n, p in head.named_parameters():
            p.copy_(torch.from_numpy(fa.head.state_dict()[n]))
    opt = torch.optim.Adam(list(layer.parameters()) + list(head.parameters()), lr=1e-4)

    def step(x, mask, y):
        opt.zero_grad()
        h = layer(x, src_key_padding_mask=~mask)
        m = mask[..., None].float()
        logits = head((h * m).sum(1) / m.sum(1))
        loss = torch.nn.functional.cross_entropy(logits, y)
        loss.backward()
        opt.step()
        return loss.item()
    return layer, step


def _params():
    for impl in ("fastattn", "torch"):
        marks = [pytest.mark.benchmark(group="train step encoder")]
        if impl == "torch" and torch is None:
            marks.append(pytest.mark.skip(reason="torch is not importable"))
        yield pytest.param(impl, id=f"encoder-{impl}", marks=marks)


@pytest.mark.parametrize("impl", list(_params()))
def test_train_step_encoder(benchmark, impl):
    x, mask, y = encoder_data()
    fa = FastattnEncoder()
    benchmark.extra_info.update(kind="train_step", case="encoder", impl=impl, threads=N_THREADS)
    if torch is not None:   # the same first loss from the same weights, dropout off
        check = FastattnEncoder(dropout=0.0)
        _, tstep = torch_encoder(check)
        tx, tm, ty = torch.from_numpy(x), torch.from_numpy(mask), torch.from_numpy(y)
        np.testing.assert_allclose(check.step(x, mask, y), tstep(tx, tm, ty), rtol=1e-4)
        _bench.quiesce()
    if impl == "fastattn":
        fn = lambda: fa.step(x, mask, y)  # noqa: E731
    else:
        _, tstep = torch_encoder(fa)
        tx, tm, ty = torch.from_numpy(x), torch.from_numpy(mask), torch.from_numpy(y)
        fn = lambda: tstep(tx, tm, ty)  # noqa: E731
    _bench.time_benchmark(benchmark, fn)


# ------------------------------------------------------------ seq2seq
SB, SS, ST, SE, SV = 32, 32, 32, 256, 1000


def seq2seq_data():
    rng = np.random.default_rng(3)
    lengths = np.where(np.arange(SB) % 4 == 0, SS // 2, SS)
    mask = np.arange(SS)[None, :] < lengths[:, None]
    src = np.where(mask, rng.integers(3, SV, (SB, SS)), 0)
    tgt = rng.integers(3, SV, (SB, ST + 1))
    tgt[:, 0] = 1
    return src, mask, tgt[:, :-1], tgt[:, 1:]


def fastattn_seq2seq():
    enc = L.RNNEncoder(SV, SE, SE, padding_idx=0, seed=4)
    dec = L.AttentionDecoder(SV, SE, SE, SE, style="bahdanau", similarity="additive",
                             attn_dim=SE, seed=5)
    model = L.Seq2Seq(enc, dec, bos_id=1, eos_id=2, pad_id=0)
    opt = optim.Adam(model, lr=1e-4)

    def step(src, mask, tgt_in, tgt_out):
        model.zero_grad()
        loss = model.loss_and_grads(src, tgt_in, tgt_out, mask)
        opt.step()
        return loss
    return model, step


def torch_seq2seq(model):
    nn = torch.nn
    sd = {n: torch.from_numpy(np.array(a)) for n, a in model.named_parameters()}
    emb_e, gru = nn.Embedding(SV, SE, padding_idx=0), nn.GRU(SE, SE, batch_first=True)
    emb_d, cell = nn.Embedding(SV, SE), nn.GRUCell(2 * SE, SE)
    W_q, W_k = nn.Linear(SE, SE, bias=False), nn.Linear(SE, SE, bias=False)
    b, v = nn.Parameter(torch.zeros(SE)), nn.Parameter(torch.zeros(SE))
    out = nn.Linear(SE, SV)
    with torch.no_grad():
        emb_e.weight.copy_(sd["encoder.embedding.weight"])
        for n in ("weight_ih_l0", "weight_hh_l0", "bias_ih_l0", "bias_hh_l0"):
            getattr(gru, n).copy_(sd[f"encoder.rnn.{n}"])
            getattr(cell, n[:-3]).copy_(sd[f"decoder.rnn.{n}"])
        emb_d.weight.copy_(sd["decoder.embedding.weight"])
        W_q.weight.copy_(sd["decoder.attn.W_q"])
        W_k.weight.copy_(sd["decoder.attn.W_k"])
        b.copy_(sd["decoder.attn.b"])
        v.copy_(sd["decoder.attn.v"])
        out.weight.copy_(sd["decoder.out.weight"])
        out.bias.copy_(sd["decoder.out.bias"])
    params = [*emb_e.parameters(), *gru.parameters(), *emb_d.parameters(), *cell.parameters(),
              *W_q.parameters(), *W_k.parameters(), b, v, *out.parameters()]
    opt = torch.optim.Adam(params, lr=1e-4)

    def step(src, mask, tgt_in, tgt_out):
        opt.zero_grad()
        lengths = mask.sum(1)
        packed = nn.utils.rnn.pack_padded_sequence(emb_e(src), lengths, batch_first=True,
                                                   enforce_sorted=False)
        mem, h = gru(packed)
        mem, _ = nn.utils.rnn.pad_packed_sequence(mem, batch_first=True, total_length=SS)
        s = h[0]
        keys = W_k(mem)
        e = emb_d(tgt_in)
        logits = []
        for t in range(ST):
            sc = torch.tanh(W_q(s)[:, None, :] + keys + b) @ v
            a = torch.softmax(sc.masked_fill(~mask, float("-inf")), -1)
            ctx = torch.einsum("bs,bsd->bd", a, mem)
            s = cell(torch.cat([e[:, t], ctx], -1), s)
            logits.append(out(s))
        loss = nn.functional.cross_entropy(torch.stack(logits, 1).reshape(-1, SV),
                                           tgt_out.reshape(-1), ignore_index=0)
        loss.backward()
        opt.step()
        return loss.item()
    return step


def _s2s_params():
    for impl in ("fastattn", "torch"):
        marks = [pytest.mark.benchmark(group="train step seq2seq")]
        if impl == "torch" and torch is None:
            marks.append(pytest.mark.skip(reason="torch is not importable"))
        yield pytest.param(impl, id=f"seq2seq-{impl}", marks=marks)


@pytest.mark.parametrize("impl", list(_s2s_params()))
def test_train_step_seq2seq(benchmark, impl):
    data = seq2seq_data()
    model, fa_step = fastattn_seq2seq()
    benchmark.extra_info.update(kind="train_step", case="seq2seq", impl=impl, threads=N_THREADS)
    tdata = None
    if torch is not None:   # the same first loss from the same weights
        tdata = tuple(torch.from_numpy(np.ascontiguousarray(a)) for a in data)
        t_step = torch_seq2seq(model)
        np.testing.assert_allclose(fa_step(*data), t_step(*tdata), rtol=1e-4)
        _bench.quiesce()
    if impl == "fastattn":
        fn = lambda: fa_step(*data)  # noqa: E731
    else:
        t_step = torch_seq2seq(model)
        fn = lambda: t_step(*tdata)  # noqa: E731
    _bench.time_benchmark(benchmark, fn)

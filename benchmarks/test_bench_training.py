"""Benchmarks of one training step (forward + backward + optimizer step),
fastattn against torch in the same run, 2 threads, float32.

* ``encoder``: ``TransformerEncoderLayer`` B=32 T=128 E=256 H=4 FF=1024
  (post-norm, relu, dropout 0.1, key padding: a quarter of the rows end
  early), masked mean pooling, ``Linear(256, 2)``, cross-entropy, Adam.
  fastattn: the layers' ``forward_backward``, ``fastattn.losses.cross_entropy``,
  ``fastattn.optim.Adam``; torch: the same modules (weights copied from
  fastattn's), ``nn.functional.cross_entropy``, ``torch.optim.Adam``.  torch's
  dropout on the attention weights (``self_attn.dropout``) is set to 0, as
  fastattn has none (its streaming kernel never holds the weights); that also
  leaves torch its fused attention kernel.

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
        h, b_enc = self.enc.forward_backward(x, key_mask=mask)
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

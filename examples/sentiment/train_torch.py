"""The comparison: train.py's model, data, hyper-parameters, batches and
epochs in PyTorch (``pip install torch==2.13.0``), same command line and
same last JSON line (``"impl": "torch"``).  Not needed to use the example.

    python train_torch.py --out model_torch/

Same architecture as ``fastattn.layers.TextClassifier``: token + hashed
n-gram embeddings, learned positions, ``nn.TransformerEncoderLayer``
(batch_first, post-norm, relu; its attention-weight dropout off, as
fastattn's streaming attention never holds the weights), Lin et al.'s
attention pooling, a linear head; AdamW, warm-up + cosine, gradient norm
clipping -- and the same batches (fastattn's ``bucket_batches``, NumPy).
Writes ``model.pt`` (a list of the members' state dicts) with the vocabulary.
"""
import math
import os
import sys
import time

import numpy as np
import torch
from torch import nn

from fastattn import train as fa_train
from fastattn.layers.classifier import hash_ngrams

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402
from train import finish, parse_args, prepare  # noqa: E402


class TorchClassifier(nn.Module):
    def __init__(self, vocab_size, num_classes, embed_dim, num_heads, num_layers, ff_dim, dropout,
                 ngram_buckets, ngram_orders, attn_dim, hops, max_len, wide_buckets=0,
                 wide_scale=1.0, wide_dropout=0.0, **unused):
        super().__init__()
        if unused.get("rnn_hidden") or unused.get("positions") not in ("learned", None) \
                or unused.get("penalty"):
            raise SystemExit(f"train_torch.py implements rnn_hidden=0, learned positions and no "
                             f"penalty only, got {unused}")
        E = embed_dim
        self.orders, self.buckets = list(ngram_orders), ngram_buckets
        self.embedding = nn.Embedding(vocab_size, E, padding_idx=C.PAD)
        self.ngrams = nn.Embedding(ngram_buckets + 1, E, padding_idx=0) if ngram_buckets else None
        self.positions = nn.Parameter(torch.randn(max_len, E) / math.sqrt(E))
        with torch.no_grad():
            for emb in (self.embedding, self.ngrams):
                if emb is not None:
                    emb.weight.mul_(1 / math.sqrt(E))
        self.dropout = nn.Dropout(dropout)
        layer = nn.TransformerEncoderLayer(E, num_heads, ff_dim, dropout, batch_first=True)
        layer.self_attn.dropout = 0.0
        self.encoder = nn.TransformerEncoder(layer, num_layers, enable_nested_tensor=False) \
            if num_layers else None
        self.W_s1 = nn.Linear(E, attn_dim, bias=False)
        self.W_s2 = nn.Linear(attn_dim, hops, bias=False)
        self.head_dropout = nn.Dropout(dropout)
        self.head = nn.Linear(hops * E, num_classes)
        self.wide_scale = wide_scale
        self.wide_dropout = nn.Dropout(wide_dropout)
        self.wide = nn.Embedding(vocab_size + wide_buckets, num_classes, padding_idx=C.PAD) \
            if wide_buckets else None
        if self.wide is not None:
            with torch.no_grad():
                self.wide.weight.zero_()

    def forward(self, ids, mask, grams, wide_rows=None):
        x = self.embedding(ids)
        if self.ngrams is not None:
            for g in grams:
                x = x + self.ngrams(g)
        x = self.dropout(x + self.positions[:ids.shape[1]])
        if self.encoder is not None:
            x = self.encoder(x, src_key_padding_mask=~mask)
        s = self.W_s2(torch.tanh(self.W_s1(x))).transpose(1, 2)        # (B, r, L)
        a = torch.softmax(s.masked_fill(~mask[:, None, :], float("-inf")), dim=-1)
        logits = self.head(self.head_dropout((a @ x).flatten(1)))
        if self.wide is not None:   # the mean over the tokens of their and their n-grams' scores
            real = ((wide_rows != C.PAD) & mask[None]).to(logits.dtype)
            w = self.wide_dropout(real * (self.wide_scale / mask.sum(1))[None, :, None])
            logits = logits + torch.einsum("kbl,kblc->bc", w, self.wide(wide_rows))
        return logits


def main(argv=None):
    a, hp, tr = parse_args(argv, __doc__)
    n_threads = a.threads or torch.get_num_threads()
    torch.set_num_threads(n_threads)
    vocab, seqs, labels = prepare(a)
    bs = tr["batch_size"]
    steps = tr["epochs"] * sum(1 for _ in range(0, len(seqs["train"]), bs))
    warm = int(tr["warmup"] * steps)
    n_members = tr["ensemble"]

    def lr_at(t):   # fastattn.optim.WarmupCosine's formula (eta_min 0)
        if t < warm:
            return t / warm
        p = min(1.0, (t - warm) / (steps - warm)) if steps > warm else 1.0
        return (1 + math.cos(math.pi * p)) / 2

    def tensors(batch):
        ids, mask, y = batch
        grams = hash_ngrams(ids, mask, hp["ngram_orders"], hp["ngram_buckets"]) \
            if hp["ngram_buckets"] else []
        wide = None
        if hp.get("wide_buckets"):   # TextClassifier's wide rows: ids, then V - 1 + bucket
            wg = hash_ngrams(ids, mask, hp["ngram_orders"], hp["wide_buckets"])
            wide = torch.from_numpy(np.concatenate(
                [ids[None], np.where(wg > 0, wg + (len(vocab) - 1), C.PAD)]))
        return (torch.from_numpy(ids), torch.from_numpy(mask),
                [torch.from_numpy(g) for g in grams], wide, torch.from_numpy(np.asarray(y)))

    def probabilities(model, k):
        """The model's class probabilities on split ``k`` (eval batches' order) and the labels."""
        model.eval()
        probs, ys = [], []
        with torch.no_grad():
            for batch in fa_train.bucket_batches(seqs[k], labels[k], batch_size=128, shuffle=False):
                ids, mask, grams, wide, y = tensors(batch)
                probs.append(torch.softmax(model(ids, mask, grams, wide).double(), -1).numpy())
                ys.append(y.numpy())
        model.train()
        return np.concatenate(probs), np.concatenate(ys)

    def accuracy(probs, y):
        return float(np.mean(np.argmax(probs, -1) == y))

    def train_member(m):
        seed = C.member_seed(a.seed, m)
        torch.manual_seed(seed)
        model = TorchClassifier(len(vocab), 2, max_len=C.MAX_TOKENS, **hp)
        opt = torch.optim.AdamW(model.parameters(), lr=tr["lr"], weight_decay=tr["weight_decay"])
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
        who = f"member {m + 1}/{n_members}, " if n_members > 1 else ""
        best, best_state, best_epoch = -1.0, None, 0
        for epoch in range(tr["epochs"]):
            te = time.perf_counter()
            model.train()
            total, n = 0.0, 0
            for batch in fa_train.bucket_batches(seqs["train"], labels["train"], batch_size=bs,
                                                 seed=seed * 1000 + epoch):
                ids, mask, grams, wide, y = tensors(batch)
                opt.zero_grad()
                loss = nn.functional.cross_entropy(model(ids, mask, grams, wide), y,
                                                   label_smoothing=tr["label_smoothing"])
                loss.backward()
                if tr["clip"]:
                    nn.utils.clip_grad_norm_(model.parameters(), tr["clip"])
                opt.step()
                sched.step()
                total += loss.item() * len(y)
                n += len(y)
            acc = accuracy(*probabilities(model, "valid"))
            if acc > best:
                best, best_epoch = acc, epoch
                best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            print(f"{who}epoch {epoch + 1}/{tr['epochs']}: loss {total / n:.4f}, valid accuracy "
                  f"{acc:.4f}, {time.perf_counter() - te:.1f} s", file=sys.stderr)
        model.load_state_dict(best_state)
        return model, best, best_epoch

    t0 = time.perf_counter()
    members = [train_member(m) for m in range(n_members)]
    train_s = time.perf_counter() - t0
    got, member_test = {}, []
    for k in ("valid", "test"):
        runs = [probabilities(model, k) for model, _, _ in members]
        got[k] = accuracy(np.mean([p for p, _ in runs], axis=0), runs[0][1])
        if k == "test":
            member_test = [accuracy(p, y) for p, y in runs]

    os.makedirs(a.out, exist_ok=True)
    torch.save([model.state_dict() for model, _, _ in members], os.path.join(a.out, "model.pt"))
    n_params = sum(p.numel() for model, _, _ in members for p in model.parameters())
    return finish(a, vocab, hp, tr, "torch", test_acc=round(got["test"], 4),
                  valid_acc=round(got["valid"], 4), train_s=round(train_s, 1),
                  epochs=tr["epochs"], members=n_members,
                  best_epochs=[e + 1 for _, _, e in members],
                  member_valid_acc=[round(b, 4) for _, b, _ in members],
                  member_test_acc=[round(x, 4) for x in member_test],
                  n_params=n_params, threads=n_threads, n_train=len(labels["train"]))


if __name__ == "__main__":
    try:
        main()
    except C.DataError as exc:
        sys.exit(f"error: {exc}")

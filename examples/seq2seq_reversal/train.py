"""Train the example's seq2seq model with fastattn alone (NumPy + SciPy, no
torch) and write ``reversal_weights.npz``, the file ``run.py`` loads.

Same task, data generator, model and hyper-parameters as ``train_torch.py``
(reverse 3-8 digits; GRU encoder, Bahdanau decoder with additive attention,
E=16, H=48; Adam lr 3e-3, batches of 64, gradient norm clipped to 1.0), but
the forward, backward and update are fastattn's ``Seq2Seq.loss_and_grads``,
``Adam`` and ``clip_grad_norm``.

    python train.py                       # trains, evaluates, writes reversal_weights.npz
    python train.py --steps 300 --out /tmp/w.npz

Exact match: greedy decoding of a held-out source (its own seeded generator)
must give the reversed digits followed by ``</s>`` -- no more, no fewer.
"""
import argparse
import json
import os
import sys
import time

import numpy as np

from fastattn.layers import Seq2Seq
from fastattn.optim import Adam, clip_grad_norm

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(HERE, "reversal_weights.npz")

PAD, BOS, EOS = 0, 1, 2
DIGITS = [str(d) for d in range(10)]
VOCAB = ["<pad>", "<s>", "</s>"] + DIGITS
V, E, H = len(VOCAB), 16, 48
MIN_LEN, MAX_LEN = 3, 8


def batch(rng, n):
    """n random digit sequences, their lengths and the teacher-forcing decoder
    input / target (reversed digits, then EOS); train_torch.py imports it."""
    lens = rng.integers(MIN_LEN, MAX_LEN + 1, n)
    src = np.full((n, MAX_LEN), PAD, np.int64)
    tgt_in = np.full((n, MAX_LEN + 1), PAD, np.int64)
    tgt_out = np.full((n, MAX_LEN + 1), PAD, np.int64)
    for i, L in enumerate(lens):
        seq = rng.integers(3, V, L)
        src[i, :L] = seq
        rev = seq[::-1]
        tgt_in[i, 0] = BOS
        tgt_in[i, 1:L + 1] = rev
        tgt_out[i, :L] = rev
        tgt_out[i, L] = EOS
    return src, lens, tgt_in, tgt_out


def make_config(embed_dim=E, hidden_size=H):
    """The Seq2Seq config (that of ``train_torch.CONFIG`` at the default sizes)."""
    return {
        "encoder": {"vocab_size": V, "embed_dim": embed_dim, "hidden_size": hidden_size, "cell": "gru",
                    "num_layers": 1, "bidirectional": False, "padding_idx": PAD, "seed": None,
                    "dtype": "float32"},
        "decoder": {"vocab_size": V, "embed_dim": embed_dim, "hidden_size": hidden_size,
                    "memory_dim": hidden_size, "style": "bahdanau", "similarity": "additive",
                    "attn_dim": hidden_size, "cell": "gru", "num_layers": 1, "padding_idx": PAD,
                    "seed": None, "dtype": "float32"},
        "bos_id": BOS, "eos_id": EOS, "pad_id": PAD, "init_state": "encoder",
    }


def exact_match(model, src, lens, chunk=500):
    """Fraction of rows whose greedy decoding is exactly reversed(src) + EOS."""
    n_ok = 0
    for a in range(0, len(src), chunk):
        s, ls = src[a:a + chunk], lens[a:a + chunk]
        res = model.greedy_decode(s, lengths=ls, max_len=MAX_LEN + 2)
        for i, L in enumerate(ls):
            want = list(s[i, :L][::-1]) + [EOS]
            n_ok += res.lengths[i] == L + 1 and list(res.tokens[i, :L + 1]) == want
    return n_ok / len(src)


def save(model, path, config):
    np.savez_compressed(path, __config__=np.array(json.dumps(config)), __vocab__=np.array(VOCAB),
                        **{k: np.asarray(v, np.float32) for k, v in model.state_dict().items()})


def train(steps=1500, *, batch_size=64, lr=3e-3, clip=1.0, embed_dim=E, hidden_size=H, seed=0,
          eval_every=250, n_eval=1000, eval_seed=12345, log_every=100, out=None, log=print):
    """Train from scratch; returns a dict: ``model``, ``config``, ``losses``
    (one per step), ``exact_match`` (on ``n_eval`` held-out sequences, or None
    when ``n_eval`` is 0), ``evals`` ([(step, exact match)]), ``seconds``."""
    config = make_config(embed_dim, hidden_size)
    model = Seq2Seq.from_config(config, seed=seed)
    model.train()
    opt = Adam(model, lr=lr)
    rng = np.random.default_rng(seed)
    ev_src, ev_lens = batch(np.random.default_rng(eval_seed), n_eval)[:2] if n_eval else (None, None)
    losses, evals = [], []
    t0 = time.perf_counter()

    def evaluate(step):
        model.eval()
        em = exact_match(model, ev_src, ev_lens)
        model.train()
        evals.append((step, em))
        log(f"step {step:5d}  exact match {em:.4f} on {n_eval} held-out  "
            f"elapsed {time.perf_counter() - t0:.1f}s")
        return em

    for step in range(steps):
        src, lens, tgt_in, tgt_out = batch(rng, batch_size)
        opt.zero_grad()
        loss = model.loss_and_grads(src, tgt_in, tgt_out, lengths=lens)
        if clip:
            clip_grad_norm(model, clip)
        opt.step()
        losses.append(loss)
        if log_every and (step % log_every == 0 or step == steps - 1):
            log(f"step {step:5d}  loss {loss:.4f}  elapsed {time.perf_counter() - t0:.1f}s")
        if n_eval and eval_every and step and step % eval_every == 0 and step != steps - 1:
            evaluate(step)
    model.eval()
    em = evaluate(steps) if n_eval else None
    seconds = time.perf_counter() - t0
    if out:
        save(model, out, config)
        log(f"wrote {out}")
    return {"model": model, "config": config, "losses": losses, "exact_match": em, "evals": evals,
            "seconds": seconds}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--n-eval", type=int, default=1000)
    ap.add_argument("--out", default=DEFAULT_OUT, help="where to write the weights ('' = nowhere)")
    args = ap.parse_args(argv)
    r = train(args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
              eval_every=args.eval_every, n_eval=args.n_eval, out=args.out or None,
              log=lambda s: print(s, flush=True))
    summary = {"steps": args.steps, "batch_size": args.batch_size, "lr": args.lr, "seed": args.seed,
               "final_loss": round(r["losses"][-1], 4), "exact_match": r["exact_match"],
               "n_eval": args.n_eval, "seconds": round(r["seconds"], 1), "out": args.out or None,
               "torch_imported": "torch" in sys.modules}
    print(json.dumps(summary), flush=True)
    return r


if __name__ == "__main__":
    main()

"""Train the example's seq2seq model with PyTorch (torch==2.13.0) and write
``reversal_weights.npz`` in fastattn's state-dict names.

Task: reverse a sequence of 3-8 digits.  Model: the PyTorch seq2seq
tutorial's layout -- Embedding + GRU encoder (packed, so padding never
enters the states), Bahdanau decoder (the previous decoder state is scored
against the encoder states with v·tanh(W_q s + W_k h + b); the context is fed
into the GRU with the embedding of the previous token), Linear to the vocab.

    python train_torch.py            # a few minutes on two CPU cores
"""
import json
import os

import numpy as np
import torch
from torch import nn

# the task's data and sizes: train.py's (one generator for both trainings)
from train import BOS, E, EOS, H, MAX_LEN, PAD, V, VOCAB, batch  # noqa: E402,F401


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc_emb, self.enc_gru = nn.Embedding(V, E, padding_idx=PAD), nn.GRU(E, H, batch_first=True)
        self.emb, self.gru = nn.Embedding(V, E, padding_idx=PAD), nn.GRU(E + H, H, batch_first=True)
        self.Wa, self.Ua, self.Va = nn.Linear(H, H), nn.Linear(H, H, bias=False), nn.Linear(H, 1, bias=False)
        self.out = nn.Linear(H, V)

    def forward(self, src, lens, tgt_in):
        packed = nn.utils.rnn.pack_padded_sequence(self.enc_emb(src), lens, batch_first=True,
                                                   enforce_sorted=False)
        keys, hidden = self.enc_gru(packed)
        keys, _ = nn.utils.rnn.pad_packed_sequence(keys, batch_first=True, total_length=src.shape[1])
        mask = (torch.arange(src.shape[1])[None, :] < lens[:, None])
        ukeys = self.Ua(keys)
        logits = []
        for t in range(tgt_in.shape[1]):
            s = self.Va(torch.tanh(self.Wa(hidden.permute(1, 0, 2)) + ukeys)).squeeze(2)
            w = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
            ctx = torch.bmm(w[:, None, :], keys)
            o, hidden = self.gru(torch.cat([self.emb(tgt_in[:, t:t + 1]), ctx], dim=2), hidden)
            logits.append(self.out(o))
        return torch.cat(logits, 1)


def fastattn_state(model):
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    out = {"encoder.embedding.weight": sd["enc_emb.weight"], "decoder.embedding.weight": sd["emb.weight"],
           "decoder.out.weight": sd["out.weight"], "decoder.out.bias": sd["out.bias"],
           "decoder.attn.W_q": sd["Wa.weight"], "decoder.attn.W_k": sd["Ua.weight"],
           "decoder.attn.b": sd["Wa.bias"], "decoder.attn.v": sd["Va.weight"][0]}
    for k, v in sd.items():
        if k.startswith("enc_gru."):
            out["encoder.rnn." + k[len("enc_gru."):]] = v
        elif k.startswith("gru."):
            out["decoder.rnn." + k[len("gru."):]] = v
    return out


CONFIG = {
    "encoder": {"vocab_size": V, "embed_dim": E, "hidden_size": H, "cell": "gru", "num_layers": 1,
                "bidirectional": False, "padding_idx": PAD, "seed": None, "dtype": "float32"},
    "decoder": {"vocab_size": V, "embed_dim": E, "hidden_size": H, "memory_dim": H, "style": "bahdanau",
                "similarity": "additive", "attn_dim": H, "cell": "gru", "num_layers": 1,
                "padding_idx": PAD, "seed": None, "dtype": "float32"},
    "bos_id": BOS, "eos_id": EOS, "pad_id": PAD, "init_state": "encoder",
}


def main(steps=500, out_path=None):
    torch.manual_seed(0)
    torch.set_num_threads(2)
    rng = np.random.default_rng(0)
    model = Model()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    loss_fn = nn.CrossEntropyLoss(ignore_index=PAD)
    for step in range(steps):
        src, lens, tgt_in, tgt_out = map(torch.tensor, batch(rng, 64))
        logits = model(src, lens, tgt_in)
        loss = loss_fn(logits.reshape(-1, V), tgt_out.reshape(-1))
        opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == steps - 1:
            print(f"step {step:5d}  loss {loss.item():.4f}", flush=True)
    model.eval()
    out_path = out_path or os.path.join(os.path.dirname(os.path.abspath(__file__)), "reversal_weights.npz")
    np.savez_compressed(out_path, __config__=np.array(json.dumps(CONFIG)),
                        __vocab__=np.array(VOCAB), **fastattn_state(model))
    print("wrote", out_path)


if __name__ == "__main__":
    main()

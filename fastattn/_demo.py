"""``python -m fastattn demo``: self-attention over a sentence, then a timing check.

The token embeddings are bags of character n-grams, so the attention weights
mean something a reader can check: words that share spelling (``runner`` /
``runners`` / ``running``, ``walker`` / ``walking``, the two ``the``) attend
to each other.  Everything printed is deterministic except the timings.
"""
from __future__ import annotations

import re
import sys
import zlib

import numpy as np

import fastattn

from . import _bench

SENTENCE = "the runner was running while other runners ran past the slow walker walking home"
NGRAM_RANGE = (2, 4)
# Hash buckets (the embedding size).  2**11 is large enough that the 135
# distinct n-grams of SENTENCE do not collide, so q.k is exactly their cosine.
N_BUCKETS = 2048
# Cosine similarities lie in [0, 1]; a scale of 8 turns a similarity gap of
# 0.3 into a weight ratio of about 11, peaky enough to read.
SCALE = 8.0
TOP_K = 3
BATCH_SHAPE = (8, 8, 256, 64)


def tokenize(text: str) -> list[str]:
    """Lower-case words (letters, digits, apostrophes)."""
    return re.findall(r"[a-z0-9']+", text.lower())


def char_ngrams(word: str, lo: int = NGRAM_RANGE[0], hi: int = NGRAM_RANGE[1]) -> list[str]:
    """Character n-grams of ``<word>`` (``<`` and ``>`` mark the word boundaries)."""
    w = f"<{word}>"
    return [w[i:i + n] for n in range(lo, hi + 1) for i in range(len(w) - n + 1)]


def embed(tokens: list[str], dim: int = N_BUCKETS) -> np.ndarray:
    """``(len(tokens), dim)`` float32: hashed n-gram counts, each row L2-normalised.

    crc32 (not Python's salted ``hash``) keeps the buckets the same in every run.
    """
    x = np.zeros((len(tokens), dim), dtype=np.float64)
    for t, word in enumerate(tokens):
        for g in char_ngrams(word):
            x[t, zlib.crc32(g.encode("utf-8")) % dim] += 1.0
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x.astype(np.float32)


def strongest_links(weights: np.ndarray, k: int = TOP_K) -> list[list[tuple[int, float]]]:
    """For each query row, the ``k`` keys with the largest weight, ties by position."""
    links = []
    for i, row in enumerate(weights):
        order = [j for j in np.argsort(-row, kind="stable") if j != i][:k]
        links.append([(int(j), float(row[j])) for j in order])
    return links


def run(text: str = SENTENCE, scale: float = SCALE, timing: bool = True, budget: float = 0.25,
        file=None) -> int:
    out = file or sys.stdout

    def say(line=""):
        print(line, file=out, flush=True)

    tokens = tokenize(text)
    if len(tokens) < 2:
        print("fastattn demo: the text needs at least two words", file=sys.stderr)
        return 2
    n = len(tokens)
    x = embed(tokens)
    may_attend = ~np.eye(n, dtype=bool)  # True = may attend: every other token, not itself

    result, weights = fastattn.scaled_dot_product_attention(
        x, x, x, attn_mask=may_attend, scale=scale, return_weights=True
    )
    expected, expected_w = _bench.numpy_sdpa(x, x, x, may_attend, scale, return_weights=True)

    lo, hi = NGRAM_RANGE
    say(f"fastattn {fastattn.__version__} demo: self-attention over a sentence")
    say()
    say(f'  text        "{" ".join(tokens)}"')
    say(f"  embeddings  character {lo}-{hi}-grams of <word>, hashed into {x.shape[1]} buckets,")
    say("              L2-normalised, so q.k is the cosine similarity of two spellings")
    say(f"  attention   scaled_dot_product_attention(x, x, x, attn_mask=~eye({n}), "
        f"scale={scale:g}, return_weights=True)")
    say("              the mask (True = may attend) keeps each token from attending to itself")
    say()
    width = max(len(t) for t in tokens) + 4
    say(f"  {'query':<{width + 4}}strongest links (attention weight)")
    for i, (tok, links) in enumerate(zip(tokens, strongest_links(weights))):
        cells = "   ".join(f"{f'{tokens[j]}[{j}]':<{width}} {w:.2f}" for j, w in links)
        row = weights[i][may_attend[i]]
        if row.max() - row.min() < 1e-3:  # no n-gram in common with any other word
            cells += "   (no shared n-grams: spread evenly)"
        say(f"  {i:>2} {tok:<{width}}-> {cells}")
    say()
    say(f"  checked against plain NumPy (float32): max |difference| output "
        f"{np.max(np.abs(result - expected)):.1e}, weights {np.max(np.abs(weights - expected_w)):.1e}")

    if not timing:
        return 0

    q, k, v = _bench.random_qkv(BATCH_SHAPE, np.float32)
    big = fastattn.scaled_dot_product_attention(q, k, v)
    big_expected = _bench.numpy_sdpa(q, k, v)
    cases = [
        (f"sentence {n}x{n}, d={x.shape[1]}",
         lambda: fastattn.scaled_dot_product_attention(x, x, x, attn_mask=may_attend, scale=scale),
         lambda: _bench.numpy_sdpa(x, x, x, may_attend, scale)),
        ("batch " + "x".join(map(str, BATCH_SHAPE)),
         lambda: fastattn.scaled_dot_product_attention(q, k, v),
         lambda: _bench.numpy_sdpa(q, k, v)),
    ]
    say(f"  random batch {'x'.join(map(str, BATCH_SHAPE))} (B x H x N x d): max |difference| "
        f"{np.max(np.abs(big - big_expected)):.1e}")
    say()
    say(f"  timing, float32, {fastattn.get_num_threads()} thread(s), SIMD "
        f"{'on' if fastattn.simd_active() else 'off'} (median per call)")
    us = _bench.micro_unit(out)
    say(f"  {'':<26}{'fastattn':>12}{'numpy':>12}{'numpy/fastattn':>16}")
    for label, fa, npy in cases:
        t_fa = _bench.time_call(fa, budget)
        t_np = _bench.time_call(npy, budget)
        say(f"  {label:<26}{_bench.format_us(t_fa) + ' ' + us:>12}"
            f"{_bench.format_us(t_np) + ' ' + us:>12}{t_np / t_fa:>15.2f}x")
    say()
    say("  more: fastattn bench   |   pytest benchmarks/ --benchmark-only")
    return 0

"""Looking at attention weights.

* :func:`heatmap` -- a weight matrix as an image with token labels; returns a
  matplotlib ``Figure``.  matplotlib (the ``viz`` extra) is imported only when
  called; the object API is used (``matplotlib.figure.Figure`` with an Agg
  canvas), so no pyplot global state, no display and no backend switch are
  needed: ``heatmap(w).savefig("a.png")`` works on a headless server.
* :func:`highlight` -- a terminal rendering: for each query token, the key
  tokens with the largest weights highlighted (ANSI colours optional, plain
  ``[brackets]`` otherwise).
* :func:`highlight_tokens` -- one sequence with its largest-weight tokens
  highlighted (e.g. an attention pooling's weights over a sentence).
* :func:`tokens_html` -- a self-contained HTML page with every token of each
  row shaded by its weight.
"""
from __future__ import annotations

import numpy as np

__all__ = ["heatmap", "highlight", "highlight_tokens", "tokens_html"]


def _real_array(weights, name, ndim, what, sep=","):
    """``weights`` as a finite float64 array of ``ndim`` dims (``what``: the
    message's description of the expected array)."""
    try:
        w = np.asarray(weights)
    except Exception as exc:
        raise TypeError(f"{name}: expected an array of real numbers, got {type(weights).__name__} ({exc})") from None
    if w.dtype.kind not in "fiub":
        raise TypeError(f"{name}: expected real numbers, got dtype {w.dtype}")
    if w.ndim != ndim:
        raise ValueError(f"{name}: expected {what}{sep} got {w.ndim}-d array of shape {w.shape}")
    w = w.astype(np.float64)
    if not np.all(np.isfinite(w)):
        raise ValueError(f"{name}: contains NaN or infinite values")
    return w


def _weights_2d(weights, name="weights"):
    try:
        return _real_array(weights, name, 2, "a 2-d array (Lq, Lk)", sep=";")
    except ValueError as exc:
        if "-d array of shape" not in str(exc):
            raise
        raise ValueError(f"{exc} (select one batch item / head first, e.g. weights[0])") from None


def _tokens(tokens, n, name, axis):
    if tokens is None:
        return [str(i) for i in range(n)]
    if isinstance(tokens, str):
        raise TypeError(f"{name}: expected a sequence of tokens, got a str (split it first)")
    toks = [str(t) for t in tokens]
    if len(toks) != n:
        raise ValueError(f"{name}: expected {n} tokens (weights has {n} {axis}), got {len(toks)}")
    return toks


def heatmap(weights, query_tokens=None, key_tokens=None, ax=None, *, cmap="viridis", title=None,
            colorbar=True, annotate=False, vmin=0.0, vmax=None, figsize=None):
    """Draw ``weights (Lq, Lk)`` as a heatmap: rows = queries (top to bottom),
    columns = keys, labelled with the tokens.

    ax : an existing matplotlib Axes to draw into (its figure is returned);
        otherwise a new ``Figure`` with an Agg canvas is made.
    annotate : write each weight in its cell.
    vmin, vmax : colour limits (default 0 and the largest weight).

    Returns the ``matplotlib.figure.Figure``.
    """
    w = _weights_2d(weights)
    Lq, Lk = w.shape
    qt = _tokens(query_tokens, Lq, "query_tokens", "rows")
    kt = _tokens(key_tokens, Lk, "key_tokens", "columns")
    try:
        from matplotlib.figure import Figure
        from matplotlib.backends.backend_agg import FigureCanvasAgg
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("fastattn.viz.heatmap needs matplotlib: pip install 'fastattn[viz]'") from exc
    if ax is None:
        if figsize is None:
            figsize = (max(3.0, 0.5 * Lk + 2.0), max(2.5, 0.45 * Lq + 1.5))
        fig = Figure(figsize=figsize, layout="constrained")
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
    else:
        fig = ax.figure
    hi = float(w.max()) if vmax is None and w.size else (1.0 if vmax is None else vmax)
    im = ax.imshow(w, cmap=cmap, vmin=vmin, vmax=max(hi, vmin + 1e-12), aspect="auto",
                   interpolation="nearest")
    ax.set_xticks(range(Lk), labels=kt, rotation=90 if max(map(len, kt), default=0) > 3 else 0)
    ax.set_yticks(range(Lq), labels=qt)
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    if title is not None:
        ax.set_title(title)
    if annotate:
        mid = (vmin + hi) / 2
        for i in range(Lq):
            for j in range(Lk):
                ax.text(j, i, f"{w[i, j]:.2f}", ha="center", va="center", fontsize=7,
                        color="black" if w[i, j] > mid else "white")
    if colorbar:
        fig.colorbar(im, ax=ax)
    return fig


_ANSI = ("\x1b[1;97;41m", "\x1b[1;30;43m", "\x1b[30;46m")  # rank 1, 2, 3+ backgrounds
_RESET = "\x1b[0m"


def _marked(w, toks, top_k, color):
    """``(order, parts)``: the indices of the ``top_k`` largest positive weights
    of ``w`` (largest first) and ``toks`` with those marked (ANSI colours by
    rank, or ``[brackets]``)."""
    order = [j for j in np.argsort(-w, kind="stable")[:top_k] if w[j] > 0]
    rank = {j: r for r, j in enumerate(order)}
    parts = []
    for j, tok in enumerate(toks):
        if j not in rank:
            parts.append(tok)
        elif color:
            parts.append(f"{_ANSI[min(rank[j], 2)]}{tok}{_RESET}")
        else:
            parts.append(f"[{tok}]")
    return order, parts


def highlight(weights, query_tokens, key_tokens, top_k=3, *, color=False, show_weights=True,
              decimals=2):
    """A terminal rendering of ``weights (Lq, Lk)``: one line per query token,
    the key sentence with the ``top_k`` largest-weight keys highlighted.

    color : True for ANSI colours (rank 1 red, 2 yellow, others cyan); False
        (default) marks them ``[token]`` -- plain text for logs and files.
    show_weights : append ``token=weight`` for the highlighted keys, largest first.

    Keys with weight 0 (masked) are never highlighted.  Returns a str.
    """
    w = _weights_2d(weights)
    Lq, Lk = w.shape
    qt = _tokens(query_tokens, Lq, "query_tokens", "rows")
    kt = _tokens(key_tokens, Lk, "key_tokens", "columns")
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 1:
        raise ValueError(f"top_k: expected an int >= 1, got {top_k!r}")
    if not isinstance(color, (bool, np.bool_)):
        raise TypeError(f"color: expected a bool, got {type(color).__name__}")
    width = max(map(len, qt), default=0)
    lines = []
    for i in range(Lq):
        order, parts = _marked(w[i], kt, top_k, color)
        line = f"{qt[i]:<{width}} | " + " ".join(parts)
        if show_weights and order:
            line += "   (" + ", ".join(f"{kt[j]}={w[i, j]:.{decimals}f}" for j in order) + ")"
        lines.append(line)
    return "\n".join(lines)


def _weights_1d(weights, n, name="weights"):
    w = _real_array(weights, name, 1, "a 1-d array (one weight per token)")
    if w.shape[0] != n:
        raise ValueError(f"{name}: expected {n} weights (one per token), got {w.shape[0]}")
    return w


def _token_list(tokens, name="tokens"):
    if isinstance(tokens, str) or tokens is None:
        raise TypeError(f"{name}: expected a sequence of tokens, got {type(tokens).__name__} (split it first)")
    return [str(t) for t in tokens]


def highlight_tokens(weights, tokens, top_k=3, *, color=False, sep=" "):
    """One sequence with its ``top_k`` largest-weight tokens highlighted:
    ``weights (L,)`` over ``tokens`` (e.g. an attention pooling's weights).

    color : True for ANSI colours (rank 1 red, 2 yellow, others cyan); False
        marks them ``[token]``.
    sep : what joins the tokens (``""`` for characters of Chinese text).

    Tokens of weight 0 (masked) are never highlighted.  Returns a str."""
    toks = _token_list(tokens)
    w = _weights_1d(weights, len(toks))
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 1:
        raise ValueError(f"top_k: expected an int >= 1, got {top_k!r}")
    if not isinstance(color, (bool, np.bool_)):
        raise TypeError(f"color: expected a bool, got {type(color).__name__}")
    if not isinstance(sep, str):
        raise TypeError(f"sep: expected a str, got {type(sep).__name__}")
    return sep.join(_marked(w, toks, top_k, color)[1])


def tokens_html(rows, *, title="Attention weights", sep=" "):
    """A self-contained HTML page: each row's tokens shaded by their weights.

    rows : iterable of ``(tokens, weights)`` or ``(tokens, weights, caption)``
        ``weights (len(tokens),)``; each row is shaded relative to its own
        largest weight (the darkest token), its weights shown on hover.
    sep : what joins the tokens (``""`` for characters of Chinese text).

    Returns the page as a str (write it to a ``.html`` file)."""
    import html

    if not isinstance(title, str):
        raise TypeError(f"title: expected a str, got {type(title).__name__}")
    if not isinstance(sep, str):
        raise TypeError(f"sep: expected a str, got {type(sep).__name__}")
    if isinstance(rows, (str, bytes)):
        raise TypeError("rows: expected an iterable of (tokens, weights[, caption]), got a str")
    body = []
    for i, row in enumerate(rows):
        if not isinstance(row, (tuple, list)) or len(row) not in (2, 3):
            raise TypeError(f"rows[{i}]: expected (tokens, weights) or (tokens, weights, caption), "
                            f"got {type(row).__name__}")
        toks = _token_list(row[0], f"rows[{i}] tokens")
        w = _weights_1d(row[1], len(toks), f"rows[{i}] weights")
        top = float(w.max()) if w.size and w.max() > 0 else 1.0
        spans = []
        for tok, x in zip(toks, w):
            a = max(0.0, x) / top
            spans.append(f'<span title="{x:.4f}" style="background: rgba(220, 40, 40, {a:.3f})">'
                         f"{html.escape(tok)}</span>")
        cap = f'<div class="cap">{html.escape(str(row[2]))}</div>' if len(row) == 3 else ""
        body.append(f'<div class="row">{cap}<div class="toks">{html.escape(sep).join(spans)}</div></div>')
    return ("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\">"
            f"<title>{html.escape(title)}</title><style>"
            "body{font-family:sans-serif;max-width:60em;margin:2em auto}"
            ".row{margin:1em 0;padding:.5em;border-bottom:1px solid #ddd}"
            ".cap{font-size:.85em;color:#555;margin-bottom:.3em}"
            ".toks{font-size:1.2em;line-height:1.8}span{padding:0 1px;border-radius:2px}"
            f"</style></head><body><h1>{html.escape(title)}</h1>\n"
            + "\n".join(body) + "\n</body></html>\n")

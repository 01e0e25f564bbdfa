"""fastattn.viz: heatmap (matplotlib, Agg, no pyplot) and the terminal highlight."""
import io

import numpy as np
import pytest

from fastattn import viz

from support import run_child

W = np.array([[0.7, 0.2, 0.1], [0.0, 0.25, 0.75]])


def test_highlight_plain_exact():
    s = viz.highlight(W, ["je", "suis"], ["I", "am", "here"], top_k=2)
    assert s == ("je   | [I] [am] here   (I=0.70, am=0.20)\n"
                 "suis | I [am] [here]   (here=0.75, am=0.25)")


def test_highlight_masked_keys_never_highlighted_and_color():
    s = viz.highlight(W, ["a", "b"], ["x", "y", "z"], top_k=3, show_weights=False)
    assert s.splitlines()[1] == "b | x [y] [z]"  # weight 0 is not highlighted
    c = viz.highlight(W, ["a", "b"], ["x", "y", "z"], top_k=1, color=True)
    assert "\x1b[1;97;41mx\x1b[0m" in c.splitlines()[0]
    assert "[x]" not in c  # colours replace the plain-text brackets


def test_highlight_errors():
    with pytest.raises(ValueError, match=r"key_tokens: expected 3 tokens \(weights has 3 columns\), got 2"):
        viz.highlight(W, ["a", "b"], ["x", "y"])
    with pytest.raises(ValueError, match=r"weights: expected a 2-d array \(Lq, Lk\); got 3-d"):
        viz.highlight(W[None], ["a", "b"], ["x", "y", "z"])
    with pytest.raises(ValueError, match=r"top_k: expected an int >= 1, got 0"):
        viz.highlight(W, ["a", "b"], ["x", "y", "z"], top_k=0)
    with pytest.raises(TypeError, match="query_tokens: expected a sequence of tokens, got a str"):
        viz.highlight(W, "ab", ["x", "y", "z"])
    with pytest.raises(ValueError, match="weights: contains NaN"):
        viz.highlight(np.array([[np.nan]]), ["a"], ["x"])


matplotlib = pytest.importorskip("matplotlib")


def test_heatmap_figure_labels_and_data():
    w = W.copy()
    fig = viz.heatmap(w, ["je", "suis"], ["I", "am", "here"], title="t", annotate=True)
    from matplotlib.figure import Figure
    assert isinstance(fig, Figure)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["I", "am", "here"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["je", "suis"]
    np.testing.assert_array_equal(ax.images[0].get_array(), W)
    assert len(ax.texts) == 6 and ax.get_title() == "t"
    assert len(fig.axes) == 2  # the colorbar
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    assert buf.getvalue()[:8] == b"\x89PNG\r\n\x1a\n"
    np.testing.assert_array_equal(w, W)  # input untouched


def test_heatmap_into_existing_axes():
    from matplotlib.figure import Figure
    fig = Figure()
    ax = fig.add_subplot(1, 2, 2)
    assert viz.heatmap(W, ax=ax, colorbar=False) is fig
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0", "1", "2"]


def test_heatmap_errors():
    with pytest.raises(ValueError, match=r"query_tokens: expected 2 tokens \(weights has 2 rows\), got 3"):
        viz.heatmap(W, ["a", "b", "c"])
    with pytest.raises(TypeError, match="weights: expected real numbers, got dtype complex128"):
        viz.heatmap(W.astype(complex))


def test_heatmap_needs_no_pyplot_and_no_display(tmp_path):
    code = (
        "import sys, numpy as np\n"
        "from fastattn import viz\n"
        "fig = viz.heatmap(np.eye(3) / 1.0, list('abc'), list('xyz'))\n"
        f"fig.savefig({str(tmp_path / 'h.png')!r})\n"
        "print('pyplot' in ' '.join(sys.modules))\n")
    r = run_child(code, env_remove=("DISPLAY", "MPLBACKEND"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"
    assert (tmp_path / "h.png").read_bytes()[:4] == b"\x89PNG"


def test_highlight_tokens_exact_and_color():
    s = viz.highlight_tokens([0.1, 0.5, 0.0, 0.4], ["很", "好", "的", "书"], top_k=3, sep="")
    assert s == "[很][好]的[书]"                    # weight 0 never highlighted
    c = viz.highlight_tokens([0.1, 0.5, 0.4], ["a", "b", "c"], top_k=2, color=True)
    assert c == "a \x1b[1;97;41mb\x1b[0m \x1b[1;30;43mc\x1b[0m"


@pytest.mark.parametrize("args, exc, msg", [
    (([0.1, 0.2], "ab"), TypeError, "tokens: expected a sequence of tokens, got str"),
    (([0.1, 0.2], ["a"]), ValueError, r"weights: expected 1 weights \(one per token\), got 2"),
    (([[0.1]], ["a"]), ValueError, "weights: expected a 1-d array"),
    (([np.nan], ["a"]), ValueError, "NaN"),
    ((["x"], ["a"]), TypeError, "weights: expected real numbers"),
])
def test_highlight_tokens_errors(args, exc, msg):
    with pytest.raises(exc, match=msg):
        viz.highlight_tokens(*args)
    with pytest.raises(ValueError, match="top_k"):
        viz.highlight_tokens([0.5], ["a"], top_k=0)


def test_tokens_html_shades_relative_to_the_row_max_and_escapes():
    page = viz.tokens_html([(["<b>", "ok"], [0.25, 0.5], "pos & 0.9"), (["x"], [0.0])], sep="")
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert '<span title="0.2500" style="background: rgba(220, 40, 40, 0.500)">&lt;b&gt;</span>' in page
    assert 'rgba(220, 40, 40, 1.000)">ok</span>' in page
    assert '<div class="cap">pos &amp; 0.9</div>' in page
    assert 'rgba(220, 40, 40, 0.000)">x</span>' in page     # an all-zero row: no shade, no error
    with pytest.raises(TypeError, match=r"rows\[0\]: expected \(tokens, weights\)"):
        viz.tokens_html([["a"]])
    with pytest.raises(ValueError, match=r"rows\[0\] weights: expected 2 weights"):
        viz.tokens_html([(["a", "b"], [1.0])])

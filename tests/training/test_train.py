"""fastattn.train: fit (the loop's contract, convergence of a tiny classifier,
determinism, keep_best, checkpoint, schedules, KeyboardInterrupt, progress)
and bucket_batches (coverage, padding, masks, determinism, less padding)."""
from __future__ import annotations

import io
import math
import os
import signal

import numpy as np
import pytest

import fastattn
from fastattn import train
from fastattn.layers import (Embedding, Linear, MeanPooling, PositionalEmbedding,
                             TransformerEncoderLayer)
from fastattn.layers._base import Layer
from fastattn.optim import SGD, Adam, LambdaLR, WarmupCosine


# ================================================================ helpers
class Classifier(Layer):
    """Embedding -> MeanPooling (masked) -> Linear(2): ids (B, L), mask (B, L) -> logits (B, 2)."""

    def __init__(self, vocab=10, dim=16, seed=0):
        rng = np.random.default_rng(seed)
        self.emb = Embedding(vocab, dim, padding_idx=0, seed=int(rng.integers(2 ** 31)))
        self.pool = MeanPooling()
        self.head = Linear(dim, 2, seed=int(rng.integers(2 ** 31)))
        self._params, self._config = {}, {}

    def _children(self):
        return {"emb": self.emb, "pool": self.pool, "head": self.head}

    def __call__(self, ids, mask):
        return self.head(self.pool(self.emb(ids), mask))

    def forward_backward(self, ids, mask):
        e, back_e = self.emb.forward_backward(ids)
        p, back_p = self.pool.forward_backward(e, mask)
        out, back_h = self.head.forward_backward(p)

        def backprop(g):
            back_e(back_p(back_h(g)[0])[0])
            return None, None
        return out, backprop


class TransformerClassifier(Layer):
    """Embedding -> sinusoidal positions -> TransformerEncoderLayer (dropout 0.1, key mask)
    -> MeanPooling -> Linear(2)."""

    def __init__(self, seed=0):
        rng = np.random.default_rng(seed)

        def s():
            return int(rng.integers(2 ** 31))
        self.emb = Embedding(10, 16, padding_idx=0, seed=s())
        self.pos = PositionalEmbedding(32, 16, kind="sinusoidal")
        self.enc = TransformerEncoderLayer(16, 2, 32, dropout=0.1, seed=s())
        self.pool = MeanPooling()
        self.head = Linear(16, 2, seed=s())
        self._params, self._config = {}, {}

    def _children(self):
        return {"emb": self.emb, "pos": self.pos, "enc": self.enc, "pool": self.pool, "head": self.head}

    def __call__(self, ids, mask):
        return self.head(self.pool(self.enc(self.pos(self.emb(ids)), key_mask=mask), mask))

    def forward_backward(self, ids, mask):
        e, b_emb = self.emb.forward_backward(ids)
        p, b_pos = self.pos.forward_backward(e)
        h, b_enc = self.enc.forward_backward(p, key_mask=mask)
        q, b_pool = self.pool.forward_backward(h, mask)
        out, b_head = self.head.forward_backward(q)

        def backprop(g):
            b_emb(b_pos(b_enc(b_pool(b_head(g)[0])[0])[0])[0])
            return None, None
        return out, backprop


def contains3(n, seed, lengths=(2, 17)):
    """Balanced synthetic task: label 1 iff token 3 occurs (ids 1..9, 0 is padding)."""
    rng = np.random.default_rng(seed)
    seqs, labels = [], []
    for i in range(n):
        L = int(rng.integers(*lengths))
        s = rng.choice([1, 2, 4, 5, 6, 7, 8, 9], size=L)
        if i % 2:
            s[rng.integers(L)] = 3
        seqs.append(s)
        labels.append(i % 2)
    return seqs, np.array(labels)


def accuracy(model, batches):
    right = total = 0
    for ids, mask, y in batches:
        right += int(np.sum(np.argmax(model(ids, mask), axis=-1) == y))
        total += len(y)
    return right / total


def params(model):
    return {k: v.copy() for k, v in model.named_parameters()}


def same_params(a, b):
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def linear_batches(n_batches=6, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((1, 3))
    out = []
    for _ in range(n_batches):
        x = rng.standard_normal((8, 3))
        out.append((x, x @ w.T))
    return out


def mse_loss(model, batch):
    x, y = batch
    pred, back = model.forward_backward(x)
    loss, g = fastattn.losses.mse(pred, y)
    back(g)
    return loss


SEQS, LABELS = contains3(512, seed=1)
HELD_SEQS, HELD_LABELS = contains3(256, seed=2)


def run_classifier(model_seed=0, epochs=15, lr=0.01, **kw):
    model = Classifier(seed=model_seed)
    opt = Adam(model, lr=lr)
    hist = train.fit(model, train.classification_loss(), opt,
                     lambda e: train.bucket_batches(SEQS, LABELS, batch_size=32, seed=100 + e),
                     epochs=epochs, progress=False, **kw)
    return model, hist


# ============================================================= convergence
@pytest.mark.parametrize("model_seed", [0, 1])
def test_tiny_classifier_converges_in_fixed_steps(model_seed):
    eval_train = train.bucket_batches(SEQS, LABELS, batch_size=128, shuffle=False)
    eval_held = train.bucket_batches(HELD_SEQS, HELD_LABELS, batch_size=128, shuffle=False)
    untrained = Classifier(seed=model_seed)
    assert accuracy(untrained, eval_train) < 0.75  # chance level, not already solved
    model, hist = run_classifier(model_seed, valid=train.classification_eval(eval_held))
    assert [r["steps"] for r in hist] == [16] * 15  # 240 steps, fixed
    assert accuracy(model, eval_train) >= 0.95
    assert accuracy(model, eval_held) >= 0.95
    assert hist[-1]["val_accuracy"] >= 0.95
    assert hist[-1]["loss"] < 0.5 * hist[0]["loss"]
    assert not hist.interrupted and not any(r["interrupted"] for r in hist)
    for r in hist:
        assert {"epoch", "loss", "steps", "seconds", "lr", "val_loss", "val_accuracy",
                "interrupted"} <= set(r)
    assert [r["epoch"] for r in hist] == list(range(15))


def run_transformer(epochs=4):
    model = TransformerClassifier(seed=0)
    opt = Adam(model, lr=0.01)
    held = train.bucket_batches(HELD_SEQS, HELD_LABELS, batch_size=128, shuffle=False)
    hist = train.fit(model, train.classification_loss(), opt,
                     lambda e: train.bucket_batches(SEQS, LABELS, batch_size=32, seed=100 + e),
                     epochs=epochs, valid=train.classification_eval(held),
                     schedule=WarmupCosine(opt, 16, 16 * epochs), keep_best=("val_accuracy", "max"),
                     progress=False)
    return model, hist


def test_transformer_classifier_trains_with_dropout_schedule_and_keep_best():
    held = train.bucket_batches(HELD_SEQS, HELD_LABELS, batch_size=128, shuffle=False)
    assert accuracy(TransformerClassifier(seed=0), held) < 0.75
    model, hist = run_transformer()
    assert [r["steps"] for r in hist] == [16] * 4
    assert accuracy(model, held) >= 0.95  # the restored best epoch, in eval mode
    assert hist.best["val_accuracy"] == max(r["val_accuracy"] for r in hist)
    assert hist[-1]["lr"] == pytest.approx(0.0, abs=1e-12)  # the cosine schedule ran to its end
    model2, hist2 = run_transformer()  # dropout is seeded: the run repeats bit for bit
    assert same_params(params(model), params(model2))
    assert [r["loss"] for r in hist] == [r["loss"] for r in hist2]


def test_a_broken_backward_does_not_converge():
    """The convergence test can fail: the same run with the gradient's sign flipped."""
    def wrong(model, batch):
        ids, mask, y = batch
        logits, back = model.forward_backward(ids, mask)
        loss, g = fastattn.losses.cross_entropy(logits, y)
        back(-g)
        return loss
    model = Classifier(seed=0)
    train.fit(model, wrong, Adam(model, lr=0.01),
              lambda e: train.bucket_batches(SEQS, LABELS, batch_size=32, seed=100 + e),
              epochs=15, progress=False)
    assert accuracy(model, train.bucket_batches(SEQS, LABELS, batch_size=128, shuffle=False)) < 0.95


def test_seeded_runs_are_bit_identical():
    m1, h1 = run_classifier(epochs=3)
    m2, h2 = run_classifier(epochs=3)
    assert same_params(params(m1), params(m2))
    assert [r["loss"] for r in h1] == [r["loss"] for r in h2]
    # the sequence form with fit's own seed: same seed same run, another seed another order
    batches = train.bucket_batches(SEQS, LABELS, batch_size=32, seed=5)
    runs = []
    for seed in (7, 7, 8):
        m = Classifier(seed=0)
        h = train.fit(m, train.classification_loss(), Adam(m, lr=0.01), batches, epochs=2,
                      seed=seed, progress=False)
        runs.append((params(m), [r["loss"] for r in h]))
    assert same_params(runs[0][0], runs[1][0]) and runs[0][1] == runs[1][1]
    assert runs[0][1] != runs[2][1]


def test_seed_reorders_a_sequence_per_epoch():
    seen = []

    def loss_fn(model, batch):
        seen.append(batch[2])
        return 0.0
    batches = [(None, None, i) for i in range(10)]
    model = Linear(3, 1, seed=0)
    train.fit(model, loss_fn, SGD(model, lr=0.0), batches, epochs=3, seed=3, progress=False)
    epochs = [seen[i * 10:(i + 1) * 10] for i in range(3)]
    assert all(sorted(e) == list(range(10)) for e in epochs)
    assert epochs[0] != epochs[1] and epochs[0] != list(range(10))
    seen.clear()
    train.fit(model, loss_fn, SGD(model, lr=0.0), batches, epochs=2, progress=False)
    assert seen == list(range(10)) * 2  # no seed: the order given


# ========================================================= loop contract
class SpyOptimizer:
    def __init__(self, inner, log):
        self.inner, self.log = inner, log

    @property
    def lr(self):
        return self.inner.lr

    def zero_grad(self):
        self.log.append("zero_grad")
        self.inner.zero_grad()

    def step(self):
        self.log.append("step")
        self.inner.step()


def test_call_order_zero_grad_loss_step_schedule():
    log = []
    model = Linear(3, 1, seed=0)
    opt = SpyOptimizer(SGD(model, lr=0.1), log)

    class Sched:
        def step(self):
            log.append("schedule")

    def loss_fn(m, batch):
        log.append("loss")
        return mse_loss(m, batch)
    hist = train.fit(model, loss_fn, opt, linear_batches(3), epochs=2, schedule=Sched(), progress=False)
    assert log == ["zero_grad", "loss", "step", "schedule"] * 6
    assert [r["steps"] for r in hist] == [3, 3]


def test_schedule_is_stepped_each_step_and_sets_lr():
    model = Linear(3, 1, seed=0)
    opt = SGD(model, lr=0.1)
    sched = LambdaLR(opt, lambda t: 1.0 / (1 + t))
    hist = train.fit(model, mse_loss, opt, linear_batches(4), epochs=3, schedule=sched, progress=False)
    assert sched.state_dict()["last_epoch"] == 12
    assert opt.lr == pytest.approx(0.1 / 13)
    assert [r["lr"] for r in hist] == pytest.approx([0.1 / 5, 0.1 / 9, 0.1 / 13])


def test_train_loss_is_the_mean_over_steps_or_weighted_by_n():
    values = iter([1.0, 2.0, 6.0, 3.0])
    model = Linear(3, 1, seed=0)
    hist = train.fit(model, lambda m, b: next(values), SGD(model, lr=0.0), [0, 1], epochs=2,
                     progress=False)
    assert [r["loss"] for r in hist] == [1.5, 4.5]
    pairs = iter([(1.0, 1), (4.0, 3)])
    hist = train.fit(model, lambda m, b: next(pairs), SGD(model, lr=0.0), [0, 1], epochs=1,
                     progress=False)
    assert hist[0]["loss"] == pytest.approx((1.0 + 12.0) / 4)


def test_valid_and_metrics_run_in_eval_mode_and_training_mode_is_restored():
    modes = []
    model = Linear(3, 1, seed=0)

    def loss_fn(m, batch):
        modes.append(("step", m.training))
        return mse_loss(m, batch)

    def valid(m):
        modes.append(("valid", m.training))
        return {"score": 1.0}

    def metric(m):
        modes.append(("metric", m.training))
        return np.float32(2.0)
    model.eval()
    hist = train.fit(model, loss_fn, SGD(model, lr=0.1), linear_batches(2), epochs=2, valid=valid,
                     metrics={"other": metric}, progress=False)
    assert modes == [("step", True), ("step", True), ("valid", False), ("metric", False)] * 2
    assert model.training is False  # the mode on entry
    assert hist[0]["score"] == 1.0 and hist[0]["other"] == 2.0
    assert type(hist[0]["other"]) is float


def test_callback_returning_true_stops():
    model = Linear(3, 1, seed=0)
    seen = []

    def cb(record):
        seen.append(record["epoch"])
        return record["epoch"] == 1
    hist = train.fit(model, mse_loss, SGD(model, lr=0.1), linear_batches(2), epochs=5,
                     callbacks=[lambda r: None, cb], progress=False)
    assert seen == [0, 1] and len(hist) == 2 and hist.stopped_by == 1


# ============================================================== keep_best
def fake_valid(values, key="acc"):
    it = iter(values)
    return lambda m: {key: next(it)}


@pytest.mark.parametrize("mode, values, best", [
    ("max", [0.2, 0.7, 0.5, 0.6], 1),
    ("min", [0.9, 0.8, 0.3, 0.4], 2),
    ("max", [0.5, float("nan"), 0.5, 0.4], 0),  # NaN never best, ties keep the first
])
def test_keep_best_restores_the_best_epoch(mode, values, best):
    model = Linear(3, 1, seed=0)
    snapshots = []
    hist = train.fit(model, mse_loss, SGD(model, lr=0.1), linear_batches(3), epochs=4,
                     valid=fake_valid(values), keep_best=("acc", mode),
                     callbacks=[lambda r: snapshots.append(params(model))], progress=False)
    assert len(hist) == 4
    assert not same_params(snapshots[best], snapshots[-1])  # training moved on
    assert same_params(params(model), snapshots[best])
    assert hist.best["epoch"] == best


def test_keep_best_on_train_loss_and_without_it_keeps_last():
    model = Linear(3, 1, seed=0)
    snapshots = []
    train.fit(model, mse_loss, SGD(model, lr=0.1), linear_batches(3), epochs=3,
              callbacks=[lambda r: snapshots.append(params(model))], progress=False)
    assert same_params(params(model), snapshots[-1])
    model2 = Linear(3, 1, seed=0)
    hist = train.fit(model2, mse_loss, SGD(model2, lr=0.1), linear_batches(3), epochs=3,
                     keep_best=("loss", "min"), progress=False)
    assert hist.best["loss"] == min(r["loss"] for r in hist)


def test_keep_best_unknown_metric():
    model = Linear(3, 1, seed=0)
    with pytest.raises(ValueError, match=r"keep_best: no metric 'acc'.*'loss'"):
        train.fit(model, mse_loss, SGD(model, lr=0.1), linear_batches(2), epochs=2,
                  keep_best=("acc", "max"), progress=False)


def test_checkpoint_holds_the_best_weights(tmp_path):
    path = tmp_path / "best.npz"
    model = Linear(3, 1, seed=0)
    snapshots = []
    train.fit(model, mse_loss, SGD(model, lr=0.1), linear_batches(3), epochs=4,
              valid=fake_valid([0.1, 0.9, 0.2, 0.3]), keep_best=("acc", "max"), checkpoint=path,
              callbacks=[lambda r: snapshots.append(params(model))], progress=False)
    loaded = fastattn.load(path)
    assert same_params(params(loaded), snapshots[1])
    # without keep_best the file follows the last epoch
    path2 = tmp_path / "last.npz"
    train.fit(model, mse_loss, SGD(model, lr=0.1), linear_batches(3), epochs=2, checkpoint=str(path2),
              progress=False)
    assert same_params(params(fastattn.load(path2)), params(model))


# ====================================================== KeyboardInterrupt
@pytest.mark.parametrize("k", [0, 4, 7])
def test_keyboard_interrupt_in_loss_fn_stops_cleanly(k):
    model = Linear(3, 1, seed=0)
    opt = Adam(model, lr=0.05)
    calls = []

    def loss_fn(m, batch):
        calls.append(params(m))  # the parameters after the previous step
        loss = mse_loss(m, batch)  # gradients accumulated ...
        if len(calls) == k + 1:
            raise KeyboardInterrupt  # ... then the interrupt: this step must not apply
        return loss
    hist = train.fit(model, loss_fn, opt, linear_batches(3), epochs=5, progress=False)
    assert hist.interrupted and hist[-1]["interrupted"]
    assert len(hist) == k // 3 + 1
    assert hist[-1]["steps"] == k % 3
    assert sum(r["steps"] for r in hist) == k
    assert same_params(params(model), calls[k])
    assert all(not np.any(g) for _, g in model.named_grads())  # partial gradients dropped
    assert model.training
    # the run reproduces an uninterrupted one of k steps
    ref = Linear(3, 1, seed=0)
    ref_opt = Adam(ref, lr=0.05)
    batches = (linear_batches(3) * 3)[:k]
    if k:
        train.fit(ref, mse_loss, ref_opt, batches, epochs=1, progress=False)
    assert same_params(params(ref), params(model))


def test_keyboard_interrupt_during_optimizer_step_is_deferred():
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("SIGINT has a custom handler in this process")
    model = Linear(3, 1, seed=0)
    ref = Linear(3, 1, seed=0)
    inner, ref_opt = SGD(model, lr=0.1), SGD(ref, lr=0.1)
    count = [0]

    class Interrupting:
        lr = 0.1

        def zero_grad(self):
            inner.zero_grad()

        def step(self):
            count[0] += 1
            if count[0] == 2:
                os.kill(os.getpid(), signal.SIGINT)  # arrives mid-step
            inner.step()
    hist = train.fit(model, mse_loss, Interrupting(), linear_batches(4), epochs=2, progress=False)
    assert hist.interrupted and hist[-1]["steps"] == 2  # the second step completed, then stop
    train.fit(ref, mse_loss, ref_opt, linear_batches(4)[:2], epochs=1, progress=False)
    assert same_params(params(model), params(ref))
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_keyboard_interrupt_during_the_best_copy_is_deferred():
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("SIGINT has a custom handler in this process")

    class Interrupting(Linear):
        def state_dict(self):
            os.kill(os.getpid(), signal.SIGINT)  # arrives while the best weights are copied
            return super().state_dict()
    model = Interrupting(3, 1, seed=0)
    snapshots = []
    hist = train.fit(model, mse_loss, SGD(model, lr=0.1), linear_batches(3), epochs=3,
                     valid=fake_valid([0.5, 0.6, 0.7]), keep_best=("acc", "max"),
                     callbacks=[lambda r: snapshots.append(params(model))], progress=False)
    assert hist.interrupted and len(hist) == 1 and hist[0]["interrupted"]
    assert hist[0]["steps"] == 3 and "acc" in hist[0] and hist.best is hist[0]
    assert snapshots == []  # stopped before the callbacks of the interrupted epoch
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_keyboard_interrupt_while_making_the_epochs_batches():
    model = Linear(3, 1, seed=0)

    def batches(epoch):
        if epoch == 1:
            raise KeyboardInterrupt
        return linear_batches(2)
    hist = train.fit(model, mse_loss, SGD(model, lr=0.1), batches, epochs=3, progress=False)
    assert hist.interrupted and [r["steps"] for r in hist] == [2, 0]
    assert math.isnan(hist[1]["loss"]) and not hist[0]["interrupted"]


def test_keep_best_is_restored_after_an_interrupt():
    model = Linear(3, 1, seed=0)
    snapshots = []
    n = [0]

    def loss_fn(m, batch):
        n[0] += 1
        if n[0] == 8:
            raise KeyboardInterrupt
        return mse_loss(m, batch)
    hist = train.fit(model, loss_fn, SGD(model, lr=0.1), linear_batches(3), epochs=5,
                     valid=fake_valid([0.9, 0.1, 0.1]), keep_best=("acc", "max"),
                     callbacks=[lambda r: snapshots.append(params(model))], progress=False)
    assert hist.interrupted and len(hist) == 3
    assert same_params(params(model), snapshots[0])


# ================================================================ progress
def test_progress_is_quiet_when_stderr_is_not_a_terminal(capsys):
    model = Linear(3, 1, seed=0)
    train.fit(model, mse_loss, SGD(model, lr=0.1), linear_batches(3), epochs=2, progress=True)
    out = capsys.readouterr()
    assert out.err == "" and out.out == ""


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


def test_progress_line_on_a_terminal(monkeypatch):
    fake = FakeTTY()
    monkeypatch.setattr("sys.stderr", fake)
    model = Linear(3, 1, seed=0)
    train.fit(model, mse_loss, SGD(model, lr=0.1), linear_batches(3), epochs=2, progress=True)
    text = fake.getvalue()
    assert "steps/s" in text and "ETA" in text and "loss" in text and "epoch 2/2" in text
    assert text.endswith("\n")
    fake2 = FakeTTY()
    monkeypatch.setattr("sys.stderr", fake2)
    train.fit(model, mse_loss, SGD(model, lr=0.1), linear_batches(3), epochs=1, progress=False)
    assert fake2.getvalue() == ""


# ================================================================== errors
def test_fit_bad_arguments():
    model = Linear(3, 1, seed=0)
    opt = SGD(model, lr=0.1)
    b = linear_batches(2)
    with pytest.raises(ValueError, match=r"epochs: expected an integer >= 1, got 0"):
        train.fit(model, mse_loss, opt, b, epochs=0)
    with pytest.raises(TypeError, match=r"epochs: expected an integer, got float"):
        train.fit(model, mse_loss, opt, b, epochs=2.0)
    with pytest.raises(TypeError, match=r"loss_fn: expected a callable"):
        train.fit(model, None, opt, b, epochs=1)
    with pytest.raises(TypeError, match=r"optimizer: expected an object with step\(\), zero_grad\(\)"):
        train.fit(model, mse_loss, object(), b, epochs=1)
    with pytest.raises(TypeError, match=r"model: expected an object with named_parameters"):
        train.fit(object(), mse_loss, opt, b, epochs=1)
    with pytest.raises(ValueError, match=r"keep_best\[1\]: expected 'max' or 'min', got 'best'"):
        train.fit(model, mse_loss, opt, b, epochs=1, keep_best=("acc", "best"))
    with pytest.raises(TypeError, match=r"keep_best: expected a pair"):
        train.fit(model, mse_loss, opt, b, epochs=1, keep_best="acc")
    with pytest.raises(TypeError, match=r"batches: a one-shot iterator .* epochs=2"):
        train.fit(model, mse_loss, opt, iter(b), epochs=2)
    with pytest.raises(ValueError, match=r"batches: epoch 0 gave no batch"):
        train.fit(model, mse_loss, opt, [], epochs=1)
    with pytest.raises(TypeError, match=r"batches: expected batches\(0\) to return an iterable"):
        train.fit(model, mse_loss, opt, lambda e: 3, epochs=1)
    with pytest.raises(TypeError, match=r"progress: expected a bool"):
        train.fit(model, mse_loss, opt, b, epochs=1, progress="yes")
    with pytest.raises(TypeError, match=r"callbacks\[0\]: expected a callable"):
        train.fit(model, mse_loss, opt, b, epochs=1, callbacks=[1])
    with pytest.raises(TypeError, match=r"checkpoint: expected a str, bytes or os.PathLike"):
        train.fit(model, mse_loss, opt, b, epochs=1, checkpoint=3)
    with pytest.raises(TypeError, match=r"seed: expected None, an int"):
        train.fit(model, mse_loss, opt, b, epochs=1, seed="x")
    with pytest.raises(TypeError, match=r"batches: seed reorders a sequence of batches; got generator"):
        train.fit(model, mse_loss, opt, (x for x in b), epochs=1, seed=0)
    with pytest.raises(TypeError, match=r"loss_fn \(step 0\): expected a real number, got str"):
        train.fit(model, lambda m, bt: "low", opt, b, epochs=1)
    with pytest.raises(TypeError, match=r"loss_fn \(step 0\): expected a loss .* tuple of 3"):
        train.fit(model, lambda m, bt: (1.0, 2, 3), opt, b, epochs=1)
    with pytest.raises(TypeError, match=r"valid: expected valid\(model\) to return a mapping"):
        train.fit(model, mse_loss, opt, b, epochs=1, valid=lambda m: 0.5)
    with pytest.raises(ValueError, match=r"metrics: 'acc' is also a metric of valid"):
        train.fit(model, mse_loss, opt, b, epochs=1, valid=lambda m: {"acc": 1.0},
                  metrics={"acc": lambda m: 1.0})
    assert model.training


def test_classification_helpers_bad_batches():
    loss_fn = train.classification_loss()
    model = Classifier()
    ids, mask, _ = train.bucket_batches(SEQS[:4], batch_size=4)[0]
    with pytest.raises(ValueError, match=r"batch: the batch has no labels"):
        loss_fn(model, (ids, mask, None))
    with pytest.raises(TypeError, match=r"batch: expected a batch \(\*inputs, labels\)"):
        loss_fn(model, ids)
    with pytest.raises(TypeError, match=r"batches: expected a sequence of \(\*inputs, labels\)"):
        train.classification_eval(3)


# ========================================================== bucket_batches
def skewed(n=2000, seed=0):
    rng = np.random.default_rng(seed)
    lengths = np.minimum(1 + rng.geometric(0.08, size=n), 200)
    return [rng.integers(1, 50, size=int(L)) for L in lengths]


def rows(batches):
    """[(sequence as tuple, label)] recovered from ids and mask."""
    out = []
    for ids, mask, y in batches:
        for r in range(ids.shape[0]):
            out.append((tuple(ids[r][mask[r]].tolist()), None if y is None else int(y[r])))
    return out


@pytest.mark.parametrize("shuffle", [True, False])
def test_bucket_batches_cover_every_sequence_once(shuffle):
    seqs = skewed(500)
    labels = np.arange(500)
    batches = train.bucket_batches(seqs, labels, batch_size=16, shuffle=shuffle, seed=1, bucket_size=64)
    got = rows(batches)
    assert len(got) == 500
    assert sorted(lab for _, lab in got) == list(range(500))
    assert all(s == tuple(seqs[lab].tolist()) for s, lab in got)
    assert sum(len(y) for _, _, y in batches) == 500
    assert all(1 <= len(y) <= 16 for _, _, y in batches)


def test_bucket_batches_padding_and_masks():
    seqs = [[5, 6, 7], [8], [9, 10], [11, 12, 13, 14]]
    batches = train.bucket_batches(seqs, [0, 1, 2, 3], batch_size=2, pad_id=-1, shuffle=False)
    (ids0, m0, y0), (ids1, m1, y1) = batches
    assert ids0.dtype == np.int64 and m0.dtype == np.bool_
    np.testing.assert_array_equal(ids0, [[8, -1], [9, 10]])
    np.testing.assert_array_equal(m0, [[True, False], [True, True]])
    np.testing.assert_array_equal(y0, [1, 2])
    np.testing.assert_array_equal(ids1, [[5, 6, 7, -1], [11, 12, 13, 14]])
    np.testing.assert_array_equal(m1, [[True, True, True, False], [True, True, True, True]])
    for ids, mask, _ in train.bucket_batches(skewed(300), batch_size=8, seed=0):
        assert ids.shape == mask.shape
        assert mask[:, 0].all()  # right padding: every row starts real
        assert mask.sum(axis=1).max() == ids.shape[1]  # L is the longest in the batch
        assert np.all(ids[~mask] == 0)  # pad_id default
        assert np.all(np.diff(mask.astype(int), axis=1) <= 0)  # True then False
    assert train.bucket_batches(seqs, batch_size=3)[0][2] is None


def test_bucket_batches_deterministic_for_a_seed():
    seqs, labels = skewed(400), np.arange(400)

    def key(bs):
        return [(ids.tobytes(), ids.shape, mask.tobytes(), y.tobytes()) for ids, mask, y in bs]
    a = train.bucket_batches(seqs, labels, batch_size=10, seed=3)
    b = train.bucket_batches(seqs, labels, batch_size=10, seed=3)
    c = train.bucket_batches(seqs, labels, batch_size=10, seed=4)
    assert key(a) == key(b) and key(a) != key(c)
    g1 = train.bucket_batches(seqs, labels, batch_size=10, seed=np.random.default_rng(3))
    assert key(g1) == key(a)
    assert key(train.bucket_batches(seqs, labels, batch_size=10, shuffle=False)) == \
        key(train.bucket_batches(seqs, labels, batch_size=10, shuffle=False, seed=9))


def test_bucket_batches_less_padding_than_unbucketed():
    seqs = skewed(2000)

    def padding(bs):
        return sum(int((~mask).sum()) for _, mask, _ in bs)
    bucketed = padding(train.bucket_batches(seqs, batch_size=32, seed=0))
    random_batches = padding(train.bucket_batches(seqs, batch_size=32, seed=0, bucket_size=32))
    sorted_all = padding(train.bucket_batches(seqs, batch_size=32, shuffle=False))
    assert bucketed < 0.25 * random_batches
    assert sorted_all <= bucketed


def test_bucket_batches_batch_order_is_shuffled():
    seqs = skewed(1000)
    bs = train.bucket_batches(seqs, batch_size=10, seed=0, bucket_size=1000)
    widths = [ids.shape[1] for ids, _, _ in bs]
    assert widths != sorted(widths)


def test_bucket_batches_bad_input():
    with pytest.raises(ValueError, match=r"batch_size: expected an integer >= 1, got 0"):
        train.bucket_batches([[1]], batch_size=0)
    with pytest.raises(TypeError, match=r"batch_size: expected an integer, got float"):
        train.bucket_batches([[1]], batch_size=2.0)
    with pytest.raises(ValueError, match=r"bucket_size: expected an integer >= batch_size \(4\), got 2"):
        train.bucket_batches([[1]], batch_size=4, bucket_size=2)
    with pytest.raises(ValueError, match=r"seqs\[1\]: expected at least one id"):
        train.bucket_batches([[1], []], batch_size=2)
    with pytest.raises(TypeError, match=r"seqs\[0\]: expected integer ids, got dtype float64"):
        train.bucket_batches([[1.5, 2.0]], batch_size=2)
    with pytest.raises(ValueError, match=r"seqs\[0\]: expected a 1-d sequence"):
        train.bucket_batches([[[1, 2]]], batch_size=2)
    with pytest.raises(ValueError, match=r"seqs: expected at least one sequence"):
        train.bucket_batches([], batch_size=2)
    with pytest.raises(TypeError, match=r"seqs: expected a sequence of integer id sequences, got str"):
        train.bucket_batches("abc", batch_size=2)
    with pytest.raises(ValueError, match=r"labels: expected one label per sequence \(2\), got 3"):
        train.bucket_batches([[1], [2]], [0, 1, 1], batch_size=2)
    with pytest.raises(TypeError, match=r"shuffle: expected a bool"):
        train.bucket_batches([[1]], batch_size=2, shuffle=1)
    with pytest.raises(TypeError, match=r"seed: expected None, an int or a np.random.Generator"):
        train.bucket_batches([[1]], batch_size=2, seed=1.5)
    with pytest.raises(TypeError, match=r"pad_id: expected an integer, got str"):
        train.bucket_batches([[1]], batch_size=2, pad_id="0")
    with pytest.raises(ValueError, match=r"pad_id: expected an int64 id"):
        train.bucket_batches([[1]], batch_size=2, pad_id=2 ** 63)


def test_bucket_batches_accepts_a_2d_array():
    a = np.arange(1, 13).reshape(4, 3)
    bs = train.bucket_batches(a, batch_size=4, shuffle=False)
    np.testing.assert_array_equal(bs[0][0], a)
    assert bs[0][1].all()


def test_bucket_batches_does_not_modify_input():
    seqs = [np.array([1, 2, 3]), np.array([4])]
    train.bucket_batches(seqs, batch_size=2, pad_id=9)
    np.testing.assert_array_equal(seqs[0], [1, 2, 3])

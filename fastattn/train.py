"""A training loop for fastattn layers: :func:`fit`, the loss helper
:func:`classification_loss`, the evaluation helper :func:`classification_eval`
and the length-bucketed batcher :func:`bucket_batches`.

Pure Python over NumPy.  Nothing here knows a layer's inside: the model is
anything with ``named_parameters()``, ``train()`` / ``eval()`` (and
``state_dict()`` / ``load_state_dict()`` for ``keep_best``), and one step of
training is the user's ``loss_fn``::

    def loss_fn(model, batch):
        ids, mask, labels = batch
        logits, backprop = model.forward_backward(ids, mask)
        loss, dlogits = fastattn.losses.cross_entropy(logits, labels)
        backprop(dlogits)                  # ADDS into the model's grads
        return loss, len(labels)           # or just: return loss

    history = fit(model, loss_fn, Adam(model, lr=1e-2), batches, epochs=5)

``loss_fn`` runs the forward, the loss and the backward itself, so any model,
any number of inputs and any loss work; :func:`classification_loss` builds the
one above.  :func:`fit` does the rest: ``optimizer.zero_grad()`` before each
step, ``optimizer.step()`` after it, ``schedule.step()`` after the optimizer.
"""
from __future__ import annotations

import math
import numbers
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence

import numpy as np

from . import losses as _losses

__all__ = ["fit", "History", "classification_loss", "classification_eval", "bucket_batches"]


# ================================================================ checkers
def _describe(value) -> str:
    if isinstance(value, np.ndarray):
        return f"array of shape {value.shape} and dtype {value.dtype}"
    return f"{type(value).__name__} {value!r}"


def _int(value, name, minimum=0) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an integer, got {_describe(value)}")
    if value < minimum:
        raise ValueError(f"{name}: expected an integer >= {minimum}, got {value!r}")
    return int(value)


def _bool(value, name) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a bool, got {_describe(value)}")
    return bool(value)


def _seed(value, name="seed"):
    if value is None or isinstance(value, np.random.Generator):
        return value
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected None, an int or a np.random.Generator, got {_describe(value)}")
    if value < 0:
        raise ValueError(f"{name}: expected an int >= 0, got {value!r}")
    return int(value)


def _require(obj, name, methods, why):
    missing = [m for m in methods if not callable(getattr(obj, m, None))]
    if missing:
        raise TypeError(f"{name}: expected an object with {', '.join(m + '()' for m in methods)} "
                        f"({why}), got {type(obj).__name__} without {', '.join(missing)}")


def _real_metric(value, label) -> float:
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value[()]
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{label}: expected a real number, got {_describe(value)}")
    return float(value)


# ================================================================ history
class History(list):
    """The list of per-epoch records :func:`fit` returns (a ``list`` of dicts),
    with ``interrupted`` (True when a KeyboardInterrupt stopped the run),
    ``stopped_by`` (the index of the callback that asked to stop, or None) and
    ``best`` (with ``keep_best``: the best epoch's record, else None)."""

    def __init__(self):
        super().__init__()
        self.interrupted = False
        self.stopped_by = None
        self.best = None

    def __repr__(self):
        return (f"History({list.__repr__(self)}, interrupted={self.interrupted}, "
                f"stopped_by={self.stopped_by})")


# ====================================================== interrupt handling
class _DeferInterrupt:
    """While active (main thread only, default SIGINT handler in place), a
    Ctrl-C is recorded instead of raised, so the optimizer step it would
    have cut in half completes; :attr:`hit` tells the loop to stop after it."""

    def __init__(self):
        self.hit = False
        self._old = None

    def _handler(self, signum, frame):
        self.hit = True

    def __enter__(self):
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
            self._old = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
            self._old = None
        return False


# ================================================================ progress
class _Progress:
    """One line on stderr, rewritten in place (only when stderr is a terminal)."""

    def __init__(self, enabled, epochs):
        stream = sys.stderr
        try:
            tty = bool(stream.isatty())
        except (AttributeError, ValueError):
            tty = False
        self.on = enabled and tty
        self.stream = stream
        self.epochs = epochs
        self._last = 0.0

    def step(self, epoch, step, total, loss_mean, t0, force=False):
        if not self.on:
            return
        now = time.perf_counter()
        if not force and now - self._last < 0.1:
            return
        self._last = now
        dt = max(now - t0, 1e-9)
        rate = step / dt
        parts = [f"epoch {epoch + 1}/{self.epochs}",
                 f"step {step}/{total}" if total is not None else f"step {step}",
                 f"{rate:.1f} steps/s", f"loss {loss_mean:.4g}"]
        if total is not None and rate > 0:
            parts.append(f"ETA {max(total - step, 0) / rate:.0f}s")
        self.stream.write("\r" + "  ".join(parts) + "\033[K")
        self.stream.flush()

    def end_epoch(self, record):
        if not self.on:
            return
        skip = {"epoch", "interrupted"}
        items = "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                          for k, v in record.items() if k not in skip)
        self.stream.write(f"\repoch {record['epoch'] + 1}/{self.epochs}  {items}\033[K\n")
        self.stream.flush()


# ===================================================================== fit
def _epoch_batches(batches, epoch, seed):
    """The iterable of batches of ``epoch`` and its length (None if unknown)."""
    if callable(batches):
        it = batches(epoch)
        if isinstance(it, (str, bytes)) or not isinstance(it, Iterable):
            raise TypeError(f"batches: expected batches({epoch}) to return an iterable of batches, "
                            f"got {_describe(it)}")
    else:
        it = batches
        if seed is not None:
            order = np.random.default_rng([seed, epoch]).permutation(len(it))
            it = [it[i] for i in order]
    try:
        n = len(it)
    except TypeError:
        n = None
    return it, n


def _loss_value(result, step):
    """``(loss, weight)`` from loss_fn's return: a number, or ``(loss, n)``."""
    label = f"loss_fn (step {step})"
    if isinstance(result, tuple):
        if len(result) != 2:
            raise TypeError(f"{label}: expected a loss (a real number) or a (loss, n) pair, "
                            f"got a tuple of {len(result)} items")
        loss, n = result
        n = _real_metric(n, f"{label}: n")
        if not (math.isfinite(n) and n >= 0):
            raise ValueError(f"{label}: expected n (the batch's number of items) finite and >= 0, got {n!r}")
        return _real_metric(loss, f"{label}: loss"), n
    return _real_metric(result, label), 1.0


def _check_keep_best(keep_best):
    if keep_best is None:
        return None
    if not isinstance(keep_best, (tuple, list)) or len(keep_best) != 2:
        raise TypeError(f"keep_best: expected a pair (metric name, 'max' or 'min'), got {_describe(keep_best)}")
    name, mode = keep_best
    if not isinstance(name, str):
        raise TypeError(f"keep_best[0]: expected a metric name (str), got {_describe(name)}")
    if mode not in ("max", "min"):
        raise ValueError(f"keep_best[1]: expected 'max' or 'min', got {mode!r}")
    return name, mode


def _evaluate(model, valid, metrics, epoch):
    """The metrics of ``epoch`` (model in eval mode, its training mode restored)."""
    out = {}
    if valid is None and not metrics:
        return out
    was = bool(getattr(model, "training", True))
    model.eval()
    try:
        if valid is not None:
            res = valid(model)
            if not isinstance(res, Mapping):
                raise TypeError(f"valid: expected valid(model) to return a mapping of metric names "
                                f"to numbers, got {_describe(res)}")
            for k, v in res.items():
                if not isinstance(k, str):
                    raise TypeError(f"valid: expected metric names (str), got {_describe(k)}")
                out[k] = _real_metric(v, f"valid: metric {k!r} (epoch {epoch})")
        for k, fn in (metrics or {}).items():
            if k in out:
                raise ValueError(f"metrics: {k!r} is also a metric of valid(model); rename one")
            out[k] = _real_metric(fn(model), f"metrics[{k!r}] (epoch {epoch})")
    finally:
        model.train(was)
    return out


def fit(model, loss_fn, optimizer, batches, *, epochs, valid=None, metrics=None, schedule=None,
        callbacks=(), seed=None, progress=True, keep_best=None, checkpoint=None):
    """Train ``model`` for ``epochs`` passes over ``batches``; returns a :class:`History`.

    Parameters
    ----------
    model : a layer (anything with ``named_parameters()``, ``train(mode)`` and
        ``eval()``; ``state_dict()`` / ``load_state_dict()`` with ``keep_best``).
        Put in training mode for the steps; its mode on entry is restored at
        the end.
    loss_fn : callable ``loss_fn(model, batch)``
        One training step's forward and backward: it calls
        ``model.forward_backward(...)``, a loss, and the returned
        ``backprop(grad)`` (which *adds* into the model's grads), and returns
        the batch's loss, either as a real number or as a pair ``(loss, n)``
        where ``n`` is the batch's number of items (the epoch's ``loss`` is
        then the mean weighted by ``n``: the per-item mean when ``loss`` is a
        per-item mean).  It must not step the optimizer.  See
        :func:`classification_loss`.
    optimizer : e.g. :class:`fastattn.optim.Adam` over ``model``.
        ``optimizer.zero_grad()`` runs before each step, ``optimizer.step()``
        after ``loss_fn``.
    batches : a sequence or iterable of batches (passed to ``loss_fn`` as
        they are), or a callable ``batches(epoch) -> iterable`` called at the
        start of each epoch (``epoch`` counts from 0; e.g. ``lambda e:
        bucket_batches(seqs, labels, batch_size=32, seed=1000 + e)`` for a new
        seeded order each epoch).  A one-shot iterator is refused when
        ``epochs > 1``.  An epoch with no batch raises ``ValueError``.
    epochs : int >= 1
    valid : callable ``valid(model) -> {name: number}``, optional
        Run after each epoch with the model in eval mode (its training mode
        restored after); the metrics go into the epoch's record.
    metrics : mapping ``{name: callable(model) -> number}``, optional
        More per-epoch metrics, run as ``valid`` (names must differ from
        ``valid``'s).
    schedule : a learning-rate schedule (:mod:`fastattn.optim`), optional;
        ``schedule.step()`` runs after every ``optimizer.step()``.
    callbacks : iterable of callables ``callback(record)``
        Called with each epoch's record (after ``keep_best`` and
        ``checkpoint``); a callback returning ``True`` stops the run after
        that epoch (``history.stopped_by`` is its index) -- early stopping.
    seed : int, optional
        With a sequence ``batches``: each epoch visits the batches in an order
        drawn from ``seed`` and the epoch (the same for the same seed).  Not
        used with a callable ``batches`` (seed that yourself) or an iterable.
        The loop has no other randomness: the same seeds (model, batches,
        dropout) and thread count give bit-identical parameters and losses.
    progress : bool
        A progress line (epoch, step, steps/s, loss, ETA) on stderr, rewritten
        in place -- only when stderr is a terminal; quiet otherwise.
    keep_best : ``(metric, "max" | "min")``, optional
        Keep in memory a copy of the weights (``state_dict()``) of the epoch
        with the best ``metric`` (a key of the records: a ``valid`` /
        ``metrics`` name or ``"loss"``; the first of equal values wins, NaN
        never does) and load them back at the end of the run, also one
        stopped by a callback or a KeyboardInterrupt.  ``history.best`` is
        that epoch's record.
    checkpoint : path, optional
        Write the model with :func:`fastattn.save` after each epoch -- with
        ``keep_best`` only when the epoch is a new best (so the file holds
        the best weights).  The model must be a class ``fastattn.save``
        accepts.

    Returns
    -------
    History
        A list with one dict per epoch run: ``epoch`` (from 0), ``loss`` (the
        mean training loss over the epoch's steps, weighted by ``n``), ``steps``
        (steps completed), ``seconds`` (the epoch's wall time, evaluation
        included), ``lr`` (the optimizer's ``lr`` at the end of the epoch when
        it has one), the metrics, and ``interrupted`` (bool).

    KeyboardInterrupt
        Ends the run cleanly and is not re-raised: an interrupt inside
        ``loss_fn`` abandons that step (no optimizer update; the partial
        gradients are zeroed) so the parameters are those after the previous
        step; one that arrives during ``optimizer.step()`` / ``schedule.step()``
        (main thread) is deferred until they finish, so no parameter is left
        half updated -- so is one during the ``keep_best`` copy and the
        ``checkpoint`` write (the run then stops after them).  One while
        ``batches(epoch)`` or an iteration of the batches runs, or during
        ``valid`` / ``metrics``, stops the run there.  No evaluation runs for
        the interrupted epoch; its record has ``interrupted=True`` as has
        ``history.interrupted``.  Other exceptions propagate (the training
        mode is restored and, with ``keep_best``, the best weights loaded).
    """
    _require(model, "model", ("named_parameters", "train", "eval"), "a fastattn layer")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn: expected a callable loss_fn(model, batch), got {_describe(loss_fn)}")
    _require(optimizer, "optimizer", ("step", "zero_grad"), "e.g. fastattn.optim.Adam")
    epochs = _int(epochs, "epochs", minimum=1)
    if valid is not None and not callable(valid):
        raise TypeError(f"valid: expected None or a callable valid(model) -> dict, got {_describe(valid)}")
    if metrics is not None:
        if not isinstance(metrics, Mapping):
            raise TypeError(f"metrics: expected None or a mapping {{name: callable(model)}}, got {_describe(metrics)}")
        for k, fn in metrics.items():
            if not isinstance(k, str) or not callable(fn):
                raise TypeError(f"metrics: expected str names and callables, got {k!r}: {_describe(fn)}")
    if schedule is not None:
        _require(schedule, "schedule", ("step",), "e.g. fastattn.optim.WarmupCosine")
    if isinstance(callbacks, (str, bytes)) or not isinstance(callbacks, Iterable):
        raise TypeError(f"callbacks: expected an iterable of callables, got {_describe(callbacks)}")
    callbacks = list(callbacks)
    for i, cb in enumerate(callbacks):
        if not callable(cb):
            raise TypeError(f"callbacks[{i}]: expected a callable callback(record), got {_describe(cb)}")
    seed = _seed(seed)
    if isinstance(seed, np.random.Generator):
        raise TypeError("seed: expected None or an int (the per-epoch orders are drawn from it), "
                        "got a np.random.Generator")
    progress = _bool(progress, "progress")
    best_spec = _check_keep_best(keep_best)
    if best_spec is not None:
        _require(model, "model", ("state_dict", "load_state_dict"), "keep_best copies the weights")
    if checkpoint is not None:
        from ._checkpoint import save
        try:
            checkpoint = os.fspath(checkpoint)
        except TypeError:
            raise TypeError(f"checkpoint: expected a str, bytes or os.PathLike path (rewritten after "
                            f"each epoch), got {_describe(checkpoint)}") from None
    if callable(batches):
        pass
    elif isinstance(batches, (str, bytes, Mapping)) or not isinstance(batches, Iterable):
        raise TypeError(f"batches: expected a sequence or iterable of batches, or a callable "
                        f"batches(epoch), got {_describe(batches)}")
    elif isinstance(batches, Iterator) and epochs > 1:
        raise TypeError(f"batches: a one-shot iterator ({type(batches).__name__}) cannot be "
                        f"replayed for epochs={epochs}; pass a list or a callable batches(epoch)")
    elif seed is not None and not isinstance(batches, Sequence):
        raise TypeError(f"batches: seed reorders a sequence of batches; got {type(batches).__name__} "
                        f"(pass a list, or seed inside a callable batches(epoch))")

    history = History()
    best_value, best_state = None, None
    display = _Progress(progress, epochs)
    was_training = bool(getattr(model, "training", True))
    model.train(True)
    try:
        for epoch in range(epochs):
            t0 = time.perf_counter()
            steps, loss_sum, weight_sum = 0, 0.0, 0.0
            interrupted = False
            try:
                it, total = _epoch_batches(batches, epoch, seed)
                iterator = iter(it)
            except KeyboardInterrupt:
                iterator, total, interrupted = iter(()), None, True
            while not interrupted:
                try:
                    try:
                        batch = next(iterator)
                    except StopIteration:
                        break
                    optimizer.zero_grad()
                    result = loss_fn(model, batch)
                except KeyboardInterrupt:
                    optimizer.zero_grad()  # drop the partial gradients; parameters untouched
                    interrupted = True
                    break
                with _DeferInterrupt() as guard:  # from here the step completes
                    loss, n = _loss_value(result, steps)
                    optimizer.step()
                    if schedule is not None:
                        schedule.step()
                    steps += 1
                    loss_sum += loss * n
                    weight_sum += n
                    display.step(epoch, steps, total, loss_sum / weight_sum if weight_sum else math.nan, t0)
                if guard.hit:
                    interrupted = True
                    break
            if steps == 0 and not interrupted:
                raise ValueError(f"batches: epoch {epoch} gave no batch")
            record = {"epoch": epoch,
                      "loss": loss_sum / weight_sum if weight_sum else math.nan,
                      "steps": steps}
            if not interrupted:
                try:
                    record.update(_evaluate(model, valid, metrics, epoch))
                except KeyboardInterrupt:
                    interrupted = True
            lr = getattr(optimizer, "lr", None)
            if isinstance(lr, numbers.Real):
                record["lr"] = float(lr)
            record["seconds"] = time.perf_counter() - t0
            record["interrupted"] = interrupted
            history.append(record)
            display.end_epoch(record)
            if interrupted:
                history.interrupted = True
                break
            new_best = False
            with _DeferInterrupt() as guard:  # the best copy and the checkpoint are never half made
                if best_spec is not None:
                    name, mode = best_spec
                    if name not in record:
                        raise ValueError(f"keep_best: no metric {name!r} in the epoch's record; it has "
                                         f"{sorted(k for k in record if k not in ('epoch', 'interrupted'))}")
                    v = record[name]
                    if not math.isnan(v) and (best_value is None or
                                              (v > best_value if mode == "max" else v < best_value)):
                        best_value, best_state, new_best = v, model.state_dict(), True
                        history.best = record
                if checkpoint is not None and (best_spec is None or new_best):
                    save(model, checkpoint)
            if guard.hit:
                record["interrupted"] = history.interrupted = True
                break
            stop = None
            for i, cb in enumerate(callbacks):
                if cb(record) is True and stop is None:
                    stop = i
            if stop is not None:
                history.stopped_by = stop
                break
    finally:
        if best_state is not None:
            model.load_state_dict(best_state)
        model.train(was_training)
    return history


# ============================================================ loss helpers
def _split_batch(batch, label):
    if not isinstance(batch, (tuple, list)) or len(batch) < 2:
        raise TypeError(f"{label}: expected a batch (*inputs, labels), e.g. bucket_batches' "
                        f"(ids, mask, labels), got {_describe(batch)}")
    *inputs, labels = batch
    if labels is None:
        raise ValueError(f"{label}: the batch has no labels (None); give bucket_batches labels=")
    return inputs, labels


def classification_loss(*, ignore_index=-100, label_smoothing=0.0, weight=None):
    """A ``loss_fn`` for :func:`fit`: the batch is ``(*inputs, labels)`` (as
    :func:`bucket_batches` gives ``(ids, mask, labels)``); it runs
    ``logits, backprop = model.forward_backward(*inputs)``,
    :func:`fastattn.losses.cross_entropy` (with these keywords) and
    ``backprop(dlogits)``, and returns ``(loss, number of labels)``."""
    def loss_fn(model, batch):
        inputs, labels = _split_batch(batch, "batch")
        logits, backprop = model.forward_backward(*inputs)
        loss, dlogits = _losses.cross_entropy(logits, labels, ignore_index=ignore_index,
                                              label_smoothing=label_smoothing, weight=weight)
        backprop(dlogits)
        return loss, int(np.size(labels))
    return loss_fn


def classification_eval(batches):
    """A ``valid`` for :func:`fit`: ``valid(model)`` runs ``model(*inputs)``
    (the inference path) on every ``(*inputs, labels)`` of ``batches`` (a
    sequence, or a callable ``() -> iterable``) and returns ``{"val_loss",
    "val_accuracy"}`` (cross entropy and argmax accuracy over all labels)."""
    if not callable(batches) and (isinstance(batches, (str, bytes)) or not isinstance(batches, Sequence)):
        raise TypeError(f"batches: expected a sequence of (*inputs, labels) batches or a callable, "
                        f"got {_describe(batches)}")

    def valid(model):
        total, correct, loss_sum = 0, 0, 0.0
        for batch in (batches() if callable(batches) else batches):
            inputs, labels = _split_batch(batch, "batches")
            logits = np.asarray(model(*inputs))
            labels = np.asarray(labels)
            loss, _ = _losses.cross_entropy(logits, labels, reduction="sum")
            loss_sum += loss
            correct += int(np.sum(np.argmax(logits, axis=-1) == labels))
            total += labels.size
        if total == 0:
            return {"val_loss": math.nan, "val_accuracy": math.nan}
        return {"val_loss": loss_sum / total, "val_accuracy": correct / total}
    return valid


# ================================================================ batching
def _as_seqs(seqs):
    if isinstance(seqs, (str, bytes, Mapping)) or not isinstance(seqs, Iterable):
        raise TypeError(f"seqs: expected a sequence of integer id sequences, got {_describe(seqs)}")
    if isinstance(seqs, np.ndarray) and seqs.dtype != object:
        if seqs.ndim != 2:
            raise ValueError(f"seqs: expected a 2-d integer array or a list of 1-d sequences, "
                             f"got {_describe(seqs)}")
    out = []
    for i, s in enumerate(seqs):
        try:
            a = np.asarray(s)
        except Exception as exc:  # noqa: BLE001 - ragged and the like
            raise TypeError(f"seqs[{i}]: expected a 1-d sequence of integer ids, got "
                            f"{type(s).__name__} ({exc})") from None
        if a.ndim != 1:
            raise ValueError(f"seqs[{i}]: expected a 1-d sequence of ids, got {_describe(a)}")
        if a.size and a.dtype.kind not in "iu":
            raise TypeError(f"seqs[{i}]: expected integer ids, got dtype {a.dtype}")
        if a.size == 0:
            raise ValueError(f"seqs[{i}]: expected at least one id, got an empty sequence")
        if a.dtype.kind == "u" and a.dtype.itemsize == 8 and int(a.max()) >= 2 ** 63:
            # astype(int64) would wrap them to negative ids
            raise ValueError(f"seqs[{i}]: expected int64 ids (< 2**63), got {int(a.max())}")
        out.append(a.astype(np.int64, copy=False))
    if not out:
        raise ValueError("seqs: expected at least one sequence, got none")
    return out


def bucket_batches(seqs, labels=None, *, batch_size, pad_id=0, shuffle=True, seed=None, bucket_size=None):
    """Batches of padded id sequences with little padding: a list of
    ``(ids, mask, labels)``.

    Parameters
    ----------
    seqs : sequence of 1-d integer sequences (lists or arrays; lengths >= 1)
    labels : sequence / array of one label per sequence, optional
        Indexed alongside (``np.asarray(labels)[idx]``); None gives None.
    batch_size : int >= 1
        Every batch but possibly the last of each bucket has this many rows.
    pad_id : int
        The id written in the padding positions.
    shuffle : bool
        True: the sequences are shuffled, cut into buckets of ``bucket_size``,
        each bucket sorted by length and cut into batches, and the batch order
        shuffled (all drawn from ``seed``).  False: no randomness -- the whole
        set sorted by length (stable), cut into batches in that order.
    seed : None, int or np.random.Generator
        The same int gives the same batches; for a new order each epoch pass
        ``seed=base + epoch`` (e.g. in ``fit(batches=lambda e: ...)``).
    bucket_size : int >= batch_size, optional
        Sequences sorted together (default ``50 * batch_size``): larger means
        less padding, smaller means more randomness in what shares a batch.

    Returns
    -------
    list of ``(ids, mask, labels)``
        ``ids`` int64 ``(B, L)`` with ``L`` the longest sequence of the batch,
        padded with ``pad_id`` on the right; ``mask`` bool ``(B, L)``, True
        at the real positions (fastattn's mask convention); ``labels`` the
        batch's labels (an array) or None.  Every sequence is in exactly one
        batch.
    """
    seqs = _as_seqs(seqs)
    n = len(seqs)
    batch_size = _int(batch_size, "batch_size", minimum=1)
    pad_id = _int(pad_id, "pad_id", minimum=-(2 ** 63))
    if pad_id >= 2 ** 63:
        raise ValueError(f"pad_id: expected an int64 id (< 2**63), got {pad_id}")
    shuffle = _bool(shuffle, "shuffle")
    seed = _seed(seed)
    if bucket_size is None:
        bucket_size = 50 * batch_size
    bucket_size = _int(bucket_size, "bucket_size", minimum=1)
    if bucket_size < batch_size:
        raise ValueError(f"bucket_size: expected an integer >= batch_size ({batch_size}), got {bucket_size}")
    if labels is not None:
        if isinstance(labels, (str, bytes)):
            raise TypeError(f"labels: expected one label per sequence, got {_describe(labels)}")
        labels = np.asarray(labels)
        if labels.ndim == 0 or len(labels) != n:
            raise ValueError(f"labels: expected one label per sequence ({n}), got "
                             f"{'a scalar' if labels.ndim == 0 else len(labels)}")
    lengths = np.array([len(s) for s in seqs])
    if shuffle:
        rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
        order = rng.permutation(n)
        groups = []
        for start in range(0, n, bucket_size):
            chunk = order[start:start + bucket_size]
            chunk = chunk[np.argsort(lengths[chunk], kind="stable")]
            groups += [chunk[i:i + batch_size] for i in range(0, len(chunk), batch_size)]
        groups = [groups[i] for i in rng.permutation(len(groups))]
    else:
        order = np.argsort(lengths, kind="stable")
        groups = [order[i:i + batch_size] for i in range(0, n, batch_size)]
    out = []
    for idx in groups:
        L = int(lengths[idx].max())
        ids = np.full((len(idx), L), pad_id, dtype=np.int64)
        mask = np.zeros((len(idx), L), dtype=bool)
        for r, j in enumerate(idx):
            ids[r, :lengths[j]] = seqs[j]
            mask[r, :lengths[j]] = True
        out.append((ids, mask, None if labels is None else labels[idx]))
    return out

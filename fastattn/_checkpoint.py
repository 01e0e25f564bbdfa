"""Checkpoints: ``save(model, path)`` and ``load(path)`` for the layers of
:mod:`fastattn.layers`.

A checkpoint is one uncompressed ``.npz`` file (a zip of ``.npy`` members,
readable with plain NumPy) holding

* every parameter under its dotted :meth:`~fastattn.layers._base.Layer.state_dict`
  name (``encoder.rnn.weight_ih_l0``), in the layer's dtype, and
* ``__fastattn__``: a JSON document (UTF-8 bytes as a 1-d ``uint8`` array)::

      {"format": "fastattn.checkpoint", "format_version": 1,
       "fastattn_version": "0.1.0", "class": "Seq2Seq",
       "config": {...get_config()...},
       "params": [{"name": "encoder.embedding.weight", "shape": [20, 8],
                   "dtype": "float32"}, ...]}

Loading never runs code from the file: members are read with
``np.load(..., allow_pickle=False)`` (an object array is refused, not
unpickled), the class is looked up by name among the public layer classes of
:mod:`fastattn.layers` (nothing is imported by name), and the layer is rebuilt
with ``from_config`` and filled with ``load_state_dict(strict=True)``.

Paths are used exactly as given: unlike ``np.savez``, ``save`` appends no
``.npz`` suffix, so ``load`` reads the same name ``save`` wrote.  ``path`` may
also be a binary file object (``write`` for ``save``; ``read`` and ``seek``
for ``load``), e.g. ``io.BytesIO``.
"""
from __future__ import annotations

import json
import os
import secrets
import sys
import zipfile

import numpy as np

from . import layers as _layers
from .layers._base import Layer

__all__ = ["save", "load", "FORMAT_VERSION"]

#: the format ``save`` writes; ``load`` reads this version and older ones
FORMAT_VERSION = 1
_FORMAT = "fastattn.checkpoint"
_HEADER = "__fastattn__"
# np.savez(file, *args, allow_pickle=..., **arrays): names it cannot take as keywords
_RESERVED = frozenset({_HEADER, "file", "allow_pickle"})


def _classes() -> dict:
    """The allow-list: ``{name: class}`` of the public layer classes of
    :mod:`fastattn.layers` (``__all__`` entries that are ``Layer`` subclasses)."""
    out = {}
    for name in _layers.__all__:
        obj = getattr(_layers, name, None)
        if isinstance(obj, type) and issubclass(obj, Layer) and obj is not Layer:
            out[name] = obj
    return out


def _version():
    # read at call time from the imported package (fastattn/__init__.py defines
    # __version__ after importing its modules, this one among them)
    return getattr(sys.modules.get(__package__), "__version__", None)


def _where(path) -> str:
    """How messages name the checkpoint: its path, or the file object's name."""
    if hasattr(path, "read") or hasattr(path, "write"):
        name = getattr(path, "name", None)
        return f"checkpoint {name!r}" if isinstance(name, (str, bytes)) else "checkpoint (file object)"
    return f"checkpoint {os.fsdecode(path)!r}"


def _a(name) -> str:
    return f"{'an' if name[:1] in 'AEIOU' else 'a'} {name}"


def _fspath(path, name="path"):
    try:
        return os.fspath(path)
    except TypeError:
        raise TypeError(f"{name}: expected a str, bytes or os.PathLike path or a binary file object, "
                        f"got {type(path).__name__}") from None


def _expected_dtype(layer, own):
    """The dtype ``load_state_dict`` stores parameter ``own`` of ``layer`` in
    (the base's ``_canonical_param`` rule)."""
    return np.dtype(layer._config.get("dtype") or layer._params[own].dtype)


def _json_config(model):
    cfg = model.get_config()
    try:
        text = json.dumps(cfg, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"model: {type(model).__name__}.get_config() is not JSON-serialisable ({exc}); "
                        f"got {cfg!r}") from None
    return json.loads(text)


# ==================================================================== save
def save(model, path) -> None:
    """Write ``model`` (a layer of :mod:`fastattn.layers`) to ``path``.

    Parameters
    ----------
    model : a public layer class of :mod:`fastattn.layers` (its ``__all__``:
        Embedding, Linear, SimpleRNN, GRU, LSTM, RNNEncoder, Attention,
        SelfAttention, MultiHeadAttention, AttentionDecoder, Seq2Seq,
        LayerNorm, Dropout, FeedForward, MeanPooling, Sequential,
        AttentionPooling, PositionalEmbedding, TransformerEncoderLayer,
        TransformerEncoder, TextClassifier)
        Exactly one of these classes (a subclass is refused: ``load`` could
        not rebuild it).
    path : str, bytes, os.PathLike or a binary file object
        Written exactly as named (no ``.npz`` is appended).  A path is written
        through a temporary file in the same folder and renamed over ``path``
        at the end, so an interrupted save never leaves half a checkpoint in
        place of an old one.

    The model is not modified (its parameters are copied by ``state_dict``).
    Only what ``get_config`` records is kept: the training flag, a
    ``MultiHeadAttention``'s ``freeze()`` and gradients are not saved.

    Raises
    ------
    TypeError
        ``model`` is not one of the classes above, or its config is not
        JSON-serialisable; ``path`` is not a path or file object.
    ValueError
        A parameter that ``load`` would refuse: NaN or infinite values, a
        dtype other than the layer's, a shape or name the layer does not
        expect (e.g. after assigning into ``params`` by hand).
    """
    classes = _classes()
    cls = type(model)
    if classes.get(cls.__name__) is not cls:
        bases = [b.__name__ for b in cls.__mro__[1:] if classes.get(b.__name__) is b]
        hint = f" (a subclass of {bases[0]}: load could not rebuild it)" if bases else ""
        raise TypeError(f"model: expected a layer of fastattn.layers ({', '.join(classes)}), "
                        f"got {cls.__module__}.{cls.__qualname__}{hint}")
    config = _json_config(model)
    table = model._param_table()
    arrays = model.state_dict()
    if arrays.keys() != table.keys():
        missing = [n for n in table if n not in arrays]
        unexpected = sorted(n for n in arrays if n not in table)
        raise ValueError(f"model: its parameters do not match its architecture ({cls.__name__}): "
                         f"missing {missing}, unexpected {unexpected}")
    params = []
    for name, a in arrays.items():
        layer, own, shape = table[name]
        if name in _RESERVED or name.startswith("__"):
            raise ValueError(f"model: parameter name {name!r} is reserved in a checkpoint")
        want = _expected_dtype(layer, own)
        if a.shape != shape:
            raise ValueError(f"model: parameter {name!r}: expected shape {shape}, got {a.shape}")
        if a.dtype != want:
            raise ValueError(f"model: parameter {name!r}: expected dtype {want} (the layer's), got {a.dtype}; "
                             "a checkpoint keeps parameters in the layer's dtype")
        if not np.all(np.isfinite(a)):
            raise ValueError(f"model: parameter {name!r} contains NaN or infinite values "
                             "(load_state_dict would refuse them)")
        params.append({"name": name, "shape": list(a.shape), "dtype": a.dtype.name})
    header = {"format": _FORMAT, "format_version": FORMAT_VERSION, "fastattn_version": _version(),
              "class": cls.__name__, "config": config, "params": params}
    blob = np.frombuffer(json.dumps(header, allow_nan=False).encode("utf-8"), dtype=np.uint8)
    members = {_HEADER: blob, **arrays}

    if hasattr(path, "write"):
        np.savez(path, **members)
        return None
    target = os.fsdecode(_fspath(path))
    folder, base = os.path.split(target)
    if os.path.isdir(target):
        raise IsADirectoryError(f"path: expected a file name, got the directory {target!r}")
    if folder and not os.path.isdir(folder):
        raise FileNotFoundError(f"path: expected a file in an existing directory, got {target!r} "
                                f"(no directory {folder!r})")
    tmp = os.path.join(folder, f".{base}.{secrets.token_hex(4)}.tmp")
    # os.open with 0o666: the file gets the umask's permissions, as open() would give it
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **members)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return None


# ==================================================================== load
def _strip_seeds(config):
    """The config without its ``seed`` entries (nested ones too): they choose
    the initial values, not the architecture."""
    if isinstance(config, dict):
        return {k: _strip_seeds(v) for k, v in config.items() if k != "seed"}
    if isinstance(config, list):
        return [_strip_seeds(v) for v in config]
    return config


def _config_diff(a, b, prefix=""):
    """Dotted keys where the configs ``a`` (the checkpoint's) and ``b`` differ, with both values."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in list(a) + [k for k in b if k not in a]:
            out += _config_diff(a.get(k, "<absent>"), b.get(k, "<absent>"), f"{prefix}{k}.")
        return out
    return [] if a == b else [f"{prefix[:-1]}: checkpoint {a!r}, model {b!r}"]


def _read_header(data, where):
    try:
        raw = data[_HEADER]
    except ValueError as exc:  # an object array: refused by allow_pickle=False
        raise ValueError(f"{where}: the {_HEADER!r} entry could not be read safely ({exc})") from None
    if not isinstance(raw, np.ndarray) or raw.dtype != np.uint8 or raw.ndim != 1:
        got = f"{raw.ndim}-d {raw.dtype}" if isinstance(raw, np.ndarray) else "a member that is not .npy"
        raise ValueError(f"{where}: the {_HEADER!r} entry is not a JSON document "
                         f"(expected a 1-d uint8 array, got {got})")
    try:
        header = json.loads(raw.tobytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"{where}: the {_HEADER!r} entry is not valid JSON ({exc})") from None
    if not isinstance(header, dict) or header.get("format") != _FORMAT:
        got = header.get("format") if isinstance(header, dict) else type(header).__name__
        raise ValueError(f"{where}: not a fastattn checkpoint (format {got!r}, expected {_FORMAT!r})")
    version = header.get("format_version")
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= FORMAT_VERSION:
        raise ValueError(f"{where}: unknown format version {version!r}; this fastattn "
                         f"({_version()}) reads versions 1 to {FORMAT_VERSION} "
                         f"(written by fastattn {header.get('fastattn_version')!r})")
    for key, kind in (("class", str), ("config", dict), ("params", list)):
        if not isinstance(header.get(key), kind):
            raise ValueError(f"{where}: header field {key!r}: expected a {kind.__name__}, "
                             f"got {type(header.get(key)).__name__}")
    specs = {}
    for i, p in enumerate(header["params"]):
        ok = (isinstance(p, dict) and isinstance(p.get("name"), str)
              and isinstance(p.get("shape"), list)
              and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in p["shape"])
              and p.get("dtype") in ("float32", "float64"))
        if not ok:
            raise ValueError(f"{where}: header params[{i}]: expected {{'name': str, 'shape': [int, ...], "
                             f"'dtype': 'float32' or 'float64'}}, got {p!r}")
        if p["name"] in specs or p["name"] in _RESERVED:
            raise ValueError(f"{where}: header params[{i}]: name {p['name']!r} repeated or reserved")
        specs[p["name"]] = (tuple(p["shape"]), np.dtype(p["dtype"]))
    return header, specs


def _read_arrays(data, specs, where):
    """The parameter arrays the header declares, checked against it; undeclared
    entries are reported, never read."""
    present = [k for k in data.files if k != _HEADER]
    missing = [n for n in specs if n not in present]
    unexpected = sorted(k for k in present if k not in specs)
    if missing or unexpected:
        raise ValueError(f"{where}: the header and the stored arrays disagree: declared but absent "
                         f"{missing}, stored but not declared {unexpected}")
    arrays = {}
    for name, (shape, dtype) in specs.items():
        try:
            a = data[name]
        except ValueError as exc:  # object arrays: refused, never unpickled
            raise ValueError(f"{where}: entry {name!r} could not be read safely ({exc}); a checkpoint "
                             "holds float32 / float64 arrays only") from None
        if not isinstance(a, np.ndarray):
            raise ValueError(f"{where}: entry {name!r} is not an .npy array")
        if a.dtype != dtype or a.shape != shape:
            raise ValueError(f"{where}: entry {name!r}: the header declares {dtype} {shape}, "
                             f"the file holds {a.dtype} {a.shape}")
        arrays[name] = a
    return arrays


def load(path, *, into=None):
    """The layer stored at ``path`` by :func:`save`.

    Parameters
    ----------
    path : str, bytes, os.PathLike or a binary file object (readable, seekable)
        Read exactly as named (no ``.npz`` is appended, as :func:`save`
        appends none).
    into : layer, optional
        Load the weights into this existing layer instead of building a new
        one (e.g. to fine-tune a model you already hold, or to refill a frozen
        ``MultiHeadAttention``).  It must be of the checkpoint's class and
        have the checkpoint's config (its ``seed`` entries aside: they only
        choose initial values); otherwise ``ValueError`` lists the
        differences and ``into`` is left unchanged.  Gradients, the training
        flag and ``freeze()`` of ``into`` are kept.

    Returns
    -------
    The new layer (``into`` itself when given), in the default training mode,
    every parameter bit-identical to the saved one.

    Raises
    ------
    ValueError
        Not a fastattn checkpoint (not an ``.npz`` zip, no ``__fastattn__``
        entry, a header that is not the format's JSON), an unknown format
        version, a class that is not one of fastattn.layers' public layers, a
        config that does not build the layer (e.g. a similarity that is not
        registered in this process), parameters missing, unexpected or of
        the wrong shape or dtype, object arrays (refused, never unpickled).
    TypeError
        ``path`` is not a path or file object; ``into`` is not a layer.
    FileNotFoundError
        No file at ``path``.
    """
    if into is not None and not isinstance(into, Layer):
        raise TypeError(f"into: expected a layer of fastattn.layers or None, got {type(into).__name__}")
    if hasattr(path, "read"):
        source = path
    else:
        source = _fspath(path)
    where = _where(source)
    try:
        data = np.load(source, allow_pickle=False)
    except FileNotFoundError:
        alt = os.fsdecode(source) + ".npz"
        hint = (f" (there is {alt!r}: fastattn.save appends no suffix, np.savez does)"
                if os.path.exists(alt) else "")
        raise FileNotFoundError(f"{where}: no such file{hint}") from None
    except IsADirectoryError:
        raise IsADirectoryError(f"{where}: expected a checkpoint file, got a directory") from None
    except (ValueError, EOFError, zipfile.BadZipFile) as exc:
        # a pickle is refused here by allow_pickle=False, before anything is unpickled
        raise ValueError(f"{where}: not a fastattn checkpoint (not an .npz archive: {exc})") from None
    if not isinstance(data, np.lib.npyio.NpzFile):
        raise ValueError(f"{where}: not a fastattn checkpoint (a single .npy array, not an .npz archive)")
    with data:
        if _HEADER not in data.files:
            raise ValueError(f"{where}: not a fastattn checkpoint (no {_HEADER!r} entry; "
                             f"entries {sorted(data.files)[:8]})")
        try:
            header, specs = _read_header(data, where)
            classes = _classes()
            name = header["class"]
            cls = classes.get(name)
            if cls is None:
                raise ValueError(f"{where}: unknown layer class {name!r}; expected one of {list(classes)}")
            arrays = _read_arrays(data, specs, where)
        except (EOFError, zipfile.BadZipFile) as exc:  # a damaged member
            raise ValueError(f"{where}: damaged archive ({type(exc).__name__}: {exc})") from None

    config = header["config"]
    if into is None:
        try:
            model = cls.from_config(config)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: its config does not build {_a(name)}: {exc}") from exc
    else:
        if type(into) is not cls:
            raise ValueError(f"into: the checkpoint holds {_a(name)}, got {_a(type(into).__name__)}")
        diff = _config_diff(_strip_seeds(config), _strip_seeds(_json_config(into)))
        if diff:
            raise ValueError(f"into: the {name} does not have the checkpoint's config: " + "; ".join(diff))
        model = into

    # dtypes: load_state_dict would cast; a checkpoint's arrays are the layer's own
    table = model._param_table()
    for pname, a in arrays.items():
        if pname in table:
            layer, own, _ = table[pname]
            want = _expected_dtype(layer, own)
            if a.dtype != want:
                raise ValueError(f"{where}: parameter {pname!r}: expected dtype {want} (the {name}'s), "
                                 f"got {a.dtype}")
    try:
        model.load_state_dict(arrays, strict=True)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from exc
    return model

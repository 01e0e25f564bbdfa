"""fastattn's import graph, read from the source with ast (nothing is imported):
no cycles, every import points down the layers of docs/architecture.md, and
``fastattn.functional`` is a facade that only re-exports.

Every import statement counts, also one inside a function or a ``try`` block:
a function-level import does not hide a cycle from this test.  Imports of
other packages (numpy, torch, ...) are not part of the graph.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = "fastattn"
# tests/ sits beside the package in the checkout (the source is what is checked)
SOURCE = next(p / PACKAGE for p in Path(__file__).resolve().parents
              if (p / PACKAGE / "__init__.py").is_file())

# The layers, lowest first (docs/architecture.md draws them).  A module may
# import only modules of a lower layer; inside the ``fastattn.layers``
# subpackage its modules may also import each other (the cycle test keeps
# those one-way).  A new module must be placed here.
LAYERS = [
    # compiled: Cython over csrc/ (C knows nothing of Python)
    ("compiled", {"fastattn._kernels", "fastattn._proj", "fastattn._rnn", "fastattn._rowwise",
                  "fastattn._scores", "fastattn._memory"}),
    # plain NumPy: argument checks, the float64 oracle, plotting, parameter write stamps
    ("base", {"fastattn._validation", "fastattn._reference", "fastattn.viz", "fastattn._stamps"}),
    # the runtime the kernels share, and masks as the kernels read them
    # (and the block cache the layers allocate through)
    ("runtime", {"fastattn._threads", "fastattn._masks", "fastattn._alloc"}),
    # one op family each (ops may build on lower ops)
    ("ops", {"fastattn._sdpa", "fastattn._linear", "fastattn._embedding", "fastattn._merge",
             "fastattn._norm", "fastattn.losses", "fastattn._optim_ops"}),
    ("ops2", {"fastattn._multihead", "fastattn._recurrence", "fastattn.similarity",
              "fastattn.optim"}),
    ("registry", {"fastattn.registry"}),
    ("ops3", {"fastattn._attention"}),
    # the public facade of the math
    ("facade", {"fastattn.functional"}),
    # stateful layers (pure Python, on the facade) and the testing helpers
    ("layers", {"fastattn.layers", "fastattn.layers._base", "fastattn.layers.rnn",
                "fastattn.layers.attention", "fastattn.layers.multi_head",
                "fastattn.layers.seq2seq", "fastattn.layers.blocks",
                "fastattn.layers.transformer", "fastattn.layers.classifier",
                "fastattn.testing"}),
    # checkpoints: the public layer classes are its allow-list
    ("checkpoint", {"fastattn._checkpoint"}),
    ("training", {"fastattn.train"}),
    ("package", {"fastattn"}),
    # tools on top of the public package
    ("tools", {"fastattn._bench", "fastattn.dask"}),
    ("tools2", {"fastattn._demo"}),
    ("cli", {"fastattn.__main__"}),
]
RANK = {m: i for i, (_, mods) in enumerate(LAYERS) for m in mods}
SUBPACKAGE_PEERS = "fastattn.layers"
COMPILED = LAYERS[0][1]

_PY_IMPORT = re.compile(r"^\s*(?:from\s+(\.+[\w.]*|fastattn[\w.]*)\s+import\s+([^#]+)|import\s+(fastattn[\w.]*))",
                        re.M)


def module_files(root: Path, package: str) -> dict:
    """{module name: path} for every .py and .pyx file of the package."""
    mods = {}
    for path in sorted(root.rglob("*.py")) + sorted(root.rglob("*.pyx")):
        rel = path.relative_to(root).with_suffix("")
        parts = [package, *rel.parts]
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def _resolve(current: str, is_pkg: bool, level: int, module: str | None) -> str:
    """The absolute name ``from <level dots><module>`` refers to inside ``current``."""
    if level == 0:
        return module or ""
    base = current.split(".")
    if not is_pkg:
        base = base[:-1]
    if level > 1:
        base = base[:-(level - 1)]
    return ".".join(base + ([module] if module else []))


def _targets(mod: str, is_pkg: bool, level: int, module: str | None, names, known) -> set:
    """Modules of the package that one import statement loads."""
    target = _resolve(mod, is_pkg, level, module)
    out = set()
    if names is None:  # import a.b.c
        out.add(target)
    else:
        # from X import y: y is a submodule when one of that name exists
        subs = {f"{target}.{n}" for n in names if f"{target}.{n}" in known}
        out |= subs
        if len(subs) < len(names):
            out.add(target)
    return {t for t in out if t == PACKAGE or t.startswith(PACKAGE + ".")}


def import_graph(root: Path, package: str = PACKAGE) -> dict:
    """{module: {(imported module, line)}} from the source: ast for .py files (every
    import statement, at any depth), a line scan for the Python imports of .pyx files
    (``cimport`` is compile-time and not an edge)."""
    files = module_files(root, package)
    known = set(files)
    graph = {}
    for mod, path in files.items():
        is_pkg = path.stem == "__init__"
        text = path.read_text(encoding="utf-8")
        edges = set()
        if path.suffix == ".py":
            for node in ast.walk(ast.parse(text, filename=str(path))):
                if isinstance(node, ast.Import):
                    for alias in node.names:
                        for t in _targets(mod, is_pkg, 0, alias.name, None, known):
                            edges.add((t, node.lineno))
                elif isinstance(node, ast.ImportFrom):
                    names = [a.name for a in node.names]
                    for t in _targets(mod, is_pkg, node.level, node.module, names, known):
                        edges.add((t, node.lineno))
        else:
            for m in _PY_IMPORT.finditer(text):
                line = text.count("\n", 0, m.start()) + 1
                if m.group(3):
                    ts = _targets(mod, is_pkg, 0, m.group(3), None, known)
                else:
                    spec = m.group(1)
                    level = len(spec) - len(spec.lstrip("."))
                    names = [n.strip().split(" as ")[0] for n in m.group(2).strip("() \n").split(",")]
                    ts = _targets(mod, is_pkg, level, spec.lstrip(".") or None, names, known)
                edges |= {(t, line) for t in ts}
        graph[mod] = {(t, ln) for t, ln in edges if t != mod}
    return graph


def _adjacency(graph: dict) -> dict:
    return {m: sorted({t for t, _ in e if t in graph}) for m, e in graph.items()}


def components(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan): the
    modules that import each other, directly or around a loop."""
    adj = _adjacency(graph)
    index, low, stack, on, comps = {}, {}, [], set(), []

    def strong(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in adj[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(set(comp))

    for v in sorted(adj):
        if v not in index:
            strong(v)
    return sorted(comps, key=min)


def find_cycles(graph: dict) -> list:
    """For every component of :func:`components`, one shortest closed path
    ``[a, b, ..., a]`` through its first module, sorted."""
    adj = _adjacency(graph)
    cycles = []
    for comp in components(graph):
        start = min(comp)
        # a shortest path back to start inside the component (BFS)
        prev, frontier, found = {start: None}, [start], None
        while frontier and found is None:
            nxt = []
            for v in frontier:
                for w in adj[v]:
                    if w == start:
                        found = v
                        break
                    if w in comp and w not in prev:
                        prev[w] = v
                        nxt.append(w)
                if found is not None:
                    break
            frontier = nxt
        path = [start]
        v = found
        while v is not None and v != start:
            path.insert(1, v)
            v = prev[v]
        cycles.append(path + [start])
    return sorted(cycles)


def _describe(graph, cycle):
    hops = []
    for a, b in zip(cycle, cycle[1:]):
        line = min(ln for t, ln in graph[a] if t == b)
        hops.append(f"{a} -> {b} (line {line})")
    return "; ".join(hops)


GRAPH = import_graph(SOURCE)


def test_no_import_cycles():
    comps, cycles = components(GRAPH), find_cycles(GRAPH)
    assert not comps, "import cycles:\n" + "\n".join(
        f"{len(comp)} modules import each other: {', '.join(sorted(comp))}\n"
        f"    e.g. {' -> '.join(c)}: {_describe(GRAPH, c)}" for comp, c in zip(comps, cycles))


def test_every_module_has_a_layer():
    missing = sorted(set(GRAPH) - set(RANK))
    assert not missing, (f"modules not placed in LAYERS (tests/api/test_import_graph.py, "
                         f"docs/architecture.md): {missing}")
    gone = sorted(set(RANK) - set(GRAPH))
    assert not gone, f"LAYERS names modules that do not exist: {gone}"


def test_imports_point_down():
    bad = []
    for mod, edges in sorted(GRAPH.items()):
        for target, line in sorted(edges):
            if target not in RANK or mod not in RANK:
                continue  # reported by test_every_module_has_a_layer
            peers = (mod.startswith(SUBPACKAGE_PEERS) and target.startswith(SUBPACKAGE_PEERS))
            if RANK[target] >= RANK[mod] and not peers:
                bad.append(f"{mod} (layer {LAYERS[RANK[mod]][0]}) imports {target} "
                           f"(layer {LAYERS[RANK[target]][0]}) at line {line}")
    assert not bad, "imports that do not point down:\n" + "\n".join(bad)


def test_layers_reach_the_kernels_only_through_functional():
    bad = sorted(f"{m} imports {t} (line {ln})" for m, e in GRAPH.items()
                 if m.startswith("fastattn.layers") for t, ln in e
                 if t in COMPILED or (t.startswith("fastattn._")
                                      and t not in ("fastattn._reference", "fastattn._validation",
                                                    "fastattn._stamps", "fastattn._alloc")))
    assert not bad, ("layers must call fastattn.functional, not the op modules (they may share "
                     "_validation's argument checkers, _stamps' write stamps and _alloc's "
                     "block cache switch):\n" + "\n".join(bad))


def test_functional_only_reexports():
    path = SOURCE / "functional.py"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    imported, exported, other = set(), None, []
    for i, node in enumerate(tree.body):
        if i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring (the shape glossary)
        if isinstance(node, ast.ImportFrom) and (node.level == 1 or node.module == "__future__"):
            imported |= {a.asname or a.name for a in node.names}
        elif (isinstance(node, ast.Assign) and len(node.targets) == 1
              and getattr(node.targets[0], "id", None) == "__all__"):
            exported = ast.literal_eval(node.value)
        else:
            other.append(f"line {node.lineno}: {ast.dump(node)[:60]}")
    assert not other, "fastattn/functional.py may only re-export:\n" + "\n".join(other)
    assert exported is not None and set(exported) <= imported, sorted(set(exported or ()) - imported)


def test_no_import_only_for_a_side_effect():
    """Outside the two package facades, every name an internal import binds is used
    (an import kept only for what importing does hides an order dependence)."""
    files = module_files(SOURCE, PACKAGE)
    unused = []
    for mod, path in files.items():
        if path.suffix != ".py" or mod in ("fastattn", "fastattn.functional", "fastattn.layers"):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        all_names = set()
        for node in tree.body:
            if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "__all__":
                all_names = set(ast.literal_eval(node.value))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith(PACKAGE)):
                for a in node.names:
                    name = a.asname or a.name
                    if name not in used and name not in all_names:
                        unused.append(f"{mod} line {node.lineno}: {name}")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == PACKAGE and (a.asname or PACKAGE) not in used:
                        unused.append(f"{mod} line {node.lineno}: {a.name}")
    assert not unused, "internal imports whose name is never used:\n" + "\n".join(unused)


# ------------------------------------------------------------ the checker itself

def _write(root: Path, files: dict):
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def test_checker_finds_and_names_a_cycle_through_a_function_level_import(tmp_path):
    pkg = tmp_path / "fastattn"
    _write(pkg, {
        "__init__.py": "from .a import f\n",
        "a.py": "from . import b\n\ndef f():\n    return b.g()\n",
        "b.py": "def g():\n    from .c import h  # hidden in a function\n    return h()\n",
        "c.py": "import fastattn.a\n\ndef h():\n    return 1\n",
        "sub/__init__.py": "from .. import a\nfrom .x import y\n",
        "sub/x.py": "from ..c import h\ny = h\n",
        "_k.pyx": "import os\nfrom fastattn.c import h\ncimport cython\n",
    })
    g = import_graph(pkg)
    assert {t for t, _ in g["fastattn.sub"]} == {"fastattn.a", "fastattn.sub.x"}
    assert {t for t, _ in g["fastattn._k"]} == {"fastattn.c"}
    assert components(g) == [{"fastattn.a", "fastattn.b", "fastattn.c"}]
    assert find_cycles(g) == [["fastattn.a", "fastattn.b", "fastattn.c", "fastattn.a"]]
    assert "fastattn.b -> fastattn.c (line 2)" in _describe(g, find_cycles(g)[0])
    # without the hidden import: no cycle
    _write(pkg, {"b.py": "def g():\n    return 2\n"})
    assert components(import_graph(pkg)) == find_cycles(import_graph(pkg)) == []


def test_layer_table_matches_the_architecture_doc():
    doc = (SOURCE.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    missing = [m for m in sorted(RANK)
               if f"`{m if m == PACKAGE else m[len(PACKAGE) + 1:]}`" not in doc]
    assert not missing, f"docs/architecture.md does not place {missing}"

"""The layers of python/rumor (docs/architecture.md): every import, module-level or inside a
function (only `if TYPE_CHECKING:` blocks are left out), points down the order below or stays
in its own layer, no group of modules imports itself in a circle, and no module reaches for
another folder's private names. Parsed with ast: nothing is imported."""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

import pytest

PKG = Path(__file__).resolve().parents[2] / "python" / "rumor"

# Bottom to top. A name is a module or a folder (the folder's every module). Each layer may
# import its own and the layers below it. This list is the one place the order lives.
LAYERS: List[Tuple[str, List[str]]] = [
    ("ground", ["rumor._C", "rumor._env", "rumor._ports", "rumor.errors", "rumor._renamed", "rumor._secret", "rumor._shm", "rumor._tensor"]),
    ("runtime", ["rumor._etcd_store", "rumor._storetls", "rumor._rendezvous", "rumor._runtime"]),
    ("host collectives", ["rumor._host_collectives"]),
    ("gpu", ["rumor.gpu"]),
    ("collectives", ["rumor.collectives"]),
    ("compression, topology, timeline", ["rumor.compression", "rumor.topology", "rumor.timeline"]),
    ("neighbor", ["rumor.neighbor"]),
    ("engine", ["rumor.engine"]),
    ("optim", ["rumor.optim"]),
    ("algorithms", ["rumor.algorithms"]),
    ("autotune", ["rumor._autotune_cache", "rumor.autotune"]),
    ("wrapper", ["rumor.parallel"]),
    ("tools", ["rumor.netplugin", "rumor.data", "rumor._parity", "rumor._live", "rumor._live_launch", "rumor._etcd_member", "rumor._tlsauto", "rumor.elastic", "rumor.interactive", "rumor.advisor",
               "rumor.run", "rumor.torch_backend", "rumor.lightning"]),
    ("package", ["rumor"]),
    ("on top of the package", ["rumor.compat", "rumor.testing", "rumor._zygote"]),
]


def _modname(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules(root: Path = PKG) -> Dict[str, Path]:
    return {_modname(p, root): p for p in root.rglob("*.py")}


def _layer_of(mod: str) -> Optional[int]:
    best, best_len = None, -1
    for i, (_, names) in enumerate(LAYERS):
        for n in names:
            if (mod == n or (n != "rumor" and mod.startswith(n + "."))) and len(n) > best_len:
                best, best_len = i, len(n)
    return best


def _folder(mod: str, path: Optional[Path]) -> str:
    return mod if path is not None and path.name == "__init__.py" else mod.rpartition(".")[0]


class _Imports(ast.NodeVisitor):
    """(lineno, ImportFrom|Import) of a module, TYPE_CHECKING blocks left out."""

    def __init__(self):
        self.nodes = []

    def visit_If(self, node):
        t = node.test
        if (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or \
                (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"):
            for n in node.orelse:
                self.visit(n)
            return
        self.generic_visit(node)

    def visit_Import(self, node):
        self.nodes.append(node)

    def visit_ImportFrom(self, node):
        self.nodes.append(node)


def _resolve(mod: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _known(name: str, mods) -> str:
    """The module an import of `name` loads (rumor._C is the extension)."""
    while name not in mods and name != "rumor._C" and "." in name:
        name = name.rpartition(".")[0]
    return name


def import_graph(mods=None):
    """{module: {imported module: first line}}, plus the private names each module takes from
    other modules: [(module, line, source module, name)]."""
    mods = mods if mods is not None else _modules()
    graph: Dict[str, Dict[str, int]] = {}
    private: List[Tuple[str, int, str, str]] = []
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        v = _Imports()
        v.visit(tree)
        is_pkg = path.name == "__init__.py"
        edges: Dict[str, int] = {}
        bound: Dict[str, str] = {}  # local name -> rumor module it is bound to

        own = _folder(mod, path)

        def add(target: str, line: int) -> None:
            # Importing rumor.a.b runs rumor/a/__init__ first: an edge to each enclosing package,
            # but not to the importer's own packages (a module's package is already importing it:
            # that is how packages work, not a circle) nor to the top package (every import passes
            # through it, and it only re-exports).
            parts = target.split(".")
            for i in range(2, len(parts) + 1):
                t = ".".join(parts[:i])
                if t == target or not (own == t or own.startswith(t + ".")):
                    if t != mod and (t in mods or t == "rumor._C"):
                        edges.setdefault(t, line)

        for node in v.nodes:
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name == "rumor" or a.name.startswith("rumor."):
                        add(_known(a.name, mods), node.lineno)
                        if a.name == "rumor":
                            edges.setdefault("rumor", node.lineno)
                        if a.asname:
                            bound[a.asname] = _known(a.name, mods)
                continue
            src = _resolve(mod, is_pkg, node)
            if src != "rumor" and not src.startswith("rumor."):
                continue
            for a in node.names:
                full = f"{src}.{a.name}"
                if full in mods or full == "rumor._C":
                    add(full, node.lineno)
                    bound[a.asname or a.name] = full
                    continue
                target = _known(src, mods)
                if target == "rumor":
                    edges.setdefault("rumor", node.lineno)
                else:
                    add(target, node.lineno)
                if a.name.startswith("_") and not a.name.startswith("__"):
                    private.append((mod, node.lineno, target, a.name))
        # module._private attribute reads through a bound module name
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound:
                src = bound[node.value.id]
                if node.attr.startswith("_") and not node.attr.startswith("__") and f"{src}.{node.attr}" not in mods \
                        and src != "rumor._C":
                    private.append((mod, node.lineno, src, node.attr))
        graph[mod] = edges
    return graph, private


def upward_imports(graph) -> List[str]:
    out = []
    for mod, edges in sorted(graph.items()):
        lm = _layer_of(mod)
        for target, line in sorted(edges.items()):
            lt = _layer_of(target)
            if lm is not None and lt is not None and lt > lm:
                out.append(f"{mod}:{line} imports {target} ({LAYERS[lm][0]} -> {LAYERS[lt][0]})")
    return out


def circles(graph) -> List[List[str]]:
    """Strongly connected groups of more than one module (Tarjan), through the edges between
    modules below the top package (every module passes through `rumor`, which only re-exports)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    out: List[List[str]] = []
    counter = [0]
    nodes = [m for m in graph if m != "rumor"]

    def succ(m):
        return [t for t in graph.get(m, {}) if t != "rumor" and t in graph]

    def strong(v):
        work = [(v, iter(succ(v)))]
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        while work:
            node, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(succ(w))))
                    break
                if w in on:
                    low[node] = min(low[node], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == node:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))

    for n in nodes:
        if n not in index:
            strong(n)
    return out


def private_reaches(private, mods) -> List[str]:
    out = []
    for mod, line, src, name in private:
        if mod.startswith(("rumor.compat", "rumor.testing")):
            continue
        if _folder(mod, mods.get(mod)) != _folder(src, mods.get(src)):
            out.append(f"{mod}:{line} uses {src}.{name}")
    return sorted(set(out))


@pytest.fixture(scope="module")
def parsed():
    mods = _modules()
    graph, private = import_graph(mods)
    return mods, graph, private


def test_every_module_has_a_layer(parsed):
    mods, _, _ = parsed
    missing = sorted(m for m in mods if _layer_of(m) is None)
    assert not missing, f"modules without a layer in test_layers.LAYERS: {missing}"


def test_imports_point_down(parsed):
    _, graph, _ = parsed
    up = upward_imports(graph)
    assert not up, "imports pointing up the layers:\n" + "\n".join(up)


def test_no_import_circles(parsed):
    _, graph, _ = parsed
    found = circles(graph)
    assert not found, "modules that import each other in a circle:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_no_private_names_across_folders(parsed):
    mods, _, private = parsed
    found = private_reaches(private, mods)
    assert not found, "private names used outside their folder:\n" + "\n".join(found)


def test_the_checks_catch_a_planted_upward_import_and_circle(tmp_path):
    """The checks themselves, on a copy of the tree with one import planted where it must fail."""
    import shutil

    root = tmp_path / "rumor"
    shutil.copytree(PKG, root, ignore=shutil.ignore_patterns("*.so", "__pycache__", "lib"))
    errors = root / "errors.py"
    errors.write_text(errors.read_text() + "\n\ndef _planted():\n    from .parallel import DistributedDataParallel\n")
    graph, _ = import_graph(_modules(root))
    up = upward_imports(graph)
    assert any(u.startswith("rumor.errors:") and "rumor.parallel" in u for u in up), up
    assert any("rumor.errors" in c and "rumor.parallel" in c for c in circles(graph))

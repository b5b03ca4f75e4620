"""What pyproject.toml promises a `pip install`: every third-party module rumor imports comes with
a declared distribution (the required ones for what `import rumor` loads, an extra for the rest),
and an unsupported torch is refused at import with both versions named. scripts/check_install.sh
builds and installs the real thing; these run on the checkout."""
from __future__ import annotations

import ast
import functools
import importlib.metadata as md
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, FrozenSet, Iterable, Set

import pytest

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "python" / "rumor"


def _rumor_path() -> str:
    """The folder holding the rumor this test process imports (the installed one in CI; the
    checkout's python/ where a developer put it on PYTHONPATH with a built _C)."""
    import rumor

    return str(Path(rumor.__file__).resolve().parents[1])


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _name(req: str) -> str:
    return re.split(r"[\s<>=!~;\[]", req, maxsplit=1)[0].lower().replace("_", "-")


def _closure(reqs: Iterable[str]) -> Set[str]:
    """The declared distributions and, where installed, everything they require in turn (their
    own extras aside): a module may come with a declared package rather than be declared itself."""
    seen: Set[str] = set()
    todo = [r for r in reqs]
    while todo:
        req = todo.pop()
        if ";" in req and "extra ==" in req.split(";", 1)[1]:
            continue
        n = _name(req)
        if n in seen or n == "rumor":
            continue
        seen.add(n)
        try:
            todo += md.requires(n) or []
        except md.PackageNotFoundError:
            pass
    return seen


def _declared() -> Dict[str, Set[str]]:
    p = _project()
    out = {"required": _closure(p["dependencies"])}
    for extra, reqs in p["optional-dependencies"].items():
        if extra != "all":
            out[extra] = _closure(reqs)
    return out


@functools.lru_cache(maxsize=None)
def _dists_of(module: str) -> FrozenSet[str]:
    return frozenset(d.lower().replace("_", "-") for d in _packages().get(module.split(".")[0], []))


@functools.lru_cache(maxsize=None)
def _packages() -> Dict[str, list]:
    return md.packages_distributions()


def _third_party(names: Iterable[str]) -> Set[str]:
    return {n for n in names if n not in sys.stdlib_module_names and n not in ("rumor", "__future__")}


def test_every_third_party_import_is_declared():
    declared = _declared()
    everything = set().union(*declared.values())
    found: Dict[str, str] = {}
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for top in _third_party(n.split(".")[0] for n in names):
                found.setdefault(top, f"{path.relative_to(ROOT)}:{node.lineno}")
    assert {"torch", "numpy", "networkx", "redis", "optuna", "ipyparallel"} <= set(found), sorted(found)
    missing = {top: where for top, where in found.items()
               if _dists_of(top) and not (_dists_of(top) & everything)}
    unknown = {top: where for top, where in found.items() if not _dists_of(top)}
    assert not missing, f"imported but declared nowhere in pyproject.toml: {missing}"
    assert not unknown, f"imported, but no installed distribution provides them (install the extras): {unknown}"


# Run by `import rumor`: records the top-level third-party modules that rumor's own code imports
# (the frame that asked, past importlib's), not those its dependencies import for themselves.
_RECORD_IMPORTS = """
import sys

asked = set()


class Recorder:
    def find_spec(self, name, path=None, target=None):
        f = sys._getframe(1)
        while f is not None and f.f_globals.get("__name__", "").startswith(("importlib", "_frozen_importlib")):
            f = f.f_back
        if f is not None and f.f_globals.get("__name__", "").split(".")[0] == "rumor":
            asked.add(name.split(".")[0])
        return None


sys.meta_path.insert(0, Recorder())
import rumor  # noqa: E402

print(" ".join(sorted(asked)))
"""


def test_import_rumor_needs_only_required_dependencies():
    """`import rumor` must work with the required dependencies alone: what rumor's code imports
    on the way comes with them, not with an extra."""
    out = subprocess.run([sys.executable, "-c", _RECORD_IMPORTS], env=dict(os.environ, PYTHONPATH=_rumor_path()),
                         capture_output=True, text=True, timeout=120, check=True).stdout
    asked = _third_party(out.split())
    # Declared directly, not only pulled in by another dependency, which may drop it.
    required = {_name(r) for r in _project()["dependencies"]}
    outside = {m: sorted(_dists_of(m)) for m in asked if not (_dists_of(m) & required)}
    # First imports only (a module already loaded is not looked for again): numpy comes via torch.
    assert {"torch", "networkx"} <= asked, asked
    assert not outside, f"import rumor imports modules of undeclared or optional distributions: {outside}"


def _import_rumor_with(tmp_path: Path, torch_init: str) -> subprocess.CompletedProcess:
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text(torch_init)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), _rumor_path()]))
    return subprocess.run([sys.executable, "-c", "import rumor"], env=env, capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)


@pytest.mark.parametrize("version", ["2.0.1+cpu", "1.13.1", "2.0.0a0+git1234"])
def test_old_torch_is_refused_naming_both_versions(tmp_path, version):
    r = _import_rumor_with(tmp_path, f"__version__ = {version!r}\n")
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: rumor needs torch >= 2.1"), r.stderr
    assert f"found torch {version} at" in last


def test_missing_torch_is_named(tmp_path):
    r = _import_rumor_with(tmp_path, "raise ImportError('No module named torch')\n")
    assert r.returncode != 0
    assert "ImportError: rumor needs PyTorch (torch >= 2.1), which is not installed" in r.stderr, r.stderr


def test_declared_torch_floor_matches_the_import_check():
    reqs = {_name(r): r for r in _project()["dependencies"]}
    assert reqs["torch"].replace(" ", "") == "torch>=2.1"
    assert "torch >= 2.1" in (PKG / "__init__.py").read_text()

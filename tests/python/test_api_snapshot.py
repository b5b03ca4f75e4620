"""The public API, name by name with signatures, against tests/python/api_snapshot.txt.

A change to the public surface (a name gone, a parameter renamed or reordered, a default changed)
fails here until the snapshot is regenerated on purpose:

    RUMOR_UPDATE_API_SNAPSHOT=1 python -m pytest tests/python/test_api_snapshot.py

and the diff of api_snapshot.txt is reviewed with the change (renames go in docs/api.md's list).
A module's public names are its __all__; every public module has one, so dir() shows the API."""
from __future__ import annotations

import enum
import importlib
import importlib.util
import inspect
import os
import re
import types
from pathlib import Path

import pytest

SNAPSHOT = Path(__file__).with_name("api_snapshot.txt")

# The modules users import by name (docs/api.md); the compat modules are found by walking.
PUBLIC_MODULES = [
    "rumor",
    "rumor.algorithms",
    "rumor.optim",
    "rumor.data",
    "rumor.elastic",
    "rumor.interactive",
    "rumor.topology",
    "rumor.compression",
    "rumor.timeline",
    "rumor.compat",
    "rumor.torch_backend",
]
# Modules over an optional dependency (a pyproject extra): in the API only where it is installed.
OPTIONAL_MODULES = {"rumor.lightning": "lightning"}
PUBLIC_MODULES += [m for m, dep in OPTIONAL_MODULES.items() if importlib.util.find_spec(dep) is not None]


def _compat_modules():
    import pkgutil

    import rumor.compat

    out = []
    for info in pkgutil.walk_packages(rumor.compat.__path__, "rumor.compat."):
        if not any(p.startswith("_") for p in info.name.split(".")):
            out.append(info.name)
    return sorted(out)


_ADDR = re.compile(r" at 0x[0-9a-fA-F]+")


def _sig(obj) -> str:
    try:
        s = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "(...)"
    return _ADDR.sub("", s)


def _public_names(mod) -> list:
    names = getattr(mod, "__all__", None)
    if names is None:
        names = [n for n in vars(mod) if not n.startswith("_")]
    return sorted(names)


def _describe(qual: str, obj) -> list:
    if inspect.isclass(obj):
        kind = "enum" if issubclass(obj, enum.Enum) else "class"
        lines = [f"{qual}: {kind}{_sig(obj) if kind == 'class' else ''}"]
        if kind == "enum":
            lines += [f"{qual}.{m}: member" for m in obj.__members__]
            return lines
        # What the class offers, its own and inherited from rumor's classes (a method moved into
        # a base or mix-in is still there); torch's and object's are not rumor's API.
        members = {}
        for klass in reversed(obj.__mro__):
            if str(getattr(klass, "__module__", "")).startswith("rumor"):
                members.update(vars(klass))
        for name, member in sorted(members.items()):
            if name.startswith("_"):
                continue
            if isinstance(member, property):
                lines.append(f"{qual}.{name}: property")
            elif isinstance(member, (staticmethod, classmethod)):
                lines.append(f"{qual}.{name}{_sig(member.__func__)}")
            elif inspect.isfunction(member):
                lines.append(f"{qual}.{name}{_sig(member)}")
        return lines
    if callable(obj):
        return [f"{qual}{_sig(obj)}"]
    return [f"{qual}: {type(obj).__name__}"]


def current_api() -> list:
    lines = []
    for modname in PUBLIC_MODULES + _compat_modules():
        mod = importlib.import_module(modname)
        for name in _public_names(mod):
            if not hasattr(mod, name):
                lines.append(f"{modname}.{name}: MISSING (listed in __all__)")
                continue
            obj = getattr(mod, name)
            if isinstance(obj, types.ModuleType):
                continue  # submodules are listed by their own entries; other modules are imports
            if not isinstance(obj, types.ModuleType) and getattr(obj, "__module__", "rumor") is not None \
                    and not str(getattr(obj, "__module__", "rumor")).startswith("rumor") \
                    and getattr(mod, "__all__", None) is None:
                continue  # typing names and other modules' helpers imported for use, not re-exported
            lines += _describe(f"{modname}.{name}", obj)
    return lines


def test_public_api_matches_snapshot():
    lines = current_api()
    if os.environ.get("RUMOR_UPDATE_API_SNAPSHOT") == "1":
        SNAPSHOT.write_text("\n".join(lines) + "\n")
    want = [w for w in SNAPSHOT.read_text().splitlines()
            if not any(w.startswith(m + ".") and m not in PUBLIC_MODULES for m in OPTIONAL_MODULES)]
    if lines != want:
        import difflib

        diff = "\n".join(difflib.unified_diff(want, lines, "api_snapshot.txt", "now", lineterm="", n=0))
        pytest.fail("the public API changed; if on purpose, regenerate with RUMOR_UPDATE_API_SNAPSHOT=1 "
                    "and list the change in docs/api.md:\n" + diff)


@pytest.mark.parametrize("modname", PUBLIC_MODULES + _compat_modules())
def test_every_public_module_declares_all(modname):
    mod = importlib.import_module(modname)
    assert isinstance(getattr(mod, "__all__", None), (list, tuple)), f"{modname} has no __all__"
    missing = [n for n in mod.__all__ if not hasattr(mod, n)]
    assert not missing, f"{modname}.__all__ names what it does not define: {missing}"
    assert len(set(mod.__all__)) == len(mod.__all__), f"{modname}.__all__ repeats a name"


@pytest.mark.parametrize("module, old, new", [
    ("rumor.optim", "OneBitAdam", "OneBitAdamOptimizer"),
    ("rumor.optim", "GradientAllreduce", "GradientAllReduceOptimizer"),
    ("rumor.algorithms", "OneBitAdam", "OneBitAdamAlgorithm"),
])
def test_renamed_names_still_work_and_warn_once(module, old, new):
    """In a fresh interpreter, so that no other test has used the old name (it warns once)."""
    import subprocess
    import sys

    script = f"""
import importlib, warnings
mod = importlib.import_module({module!r})
with warnings.catch_warnings(record=True) as got:
    warnings.simplefilter("always")
    first = getattr(mod, {old!r})
    second = getattr(mod, {old!r})
assert first is getattr(mod, {new!r}) and second is first
msgs = [str(w.message) for w in got if issubclass(w.category, FutureWarning)]
assert msgs == [{f"{module}.{old} was renamed {module}.{new}; the old name will go away"!r}], msgs
assert {old!r} not in mod.__all__ and {new!r} in mod.__all__
try:
    mod.NoSuchName
except AttributeError as e:
    assert "no attribute 'NoSuchName'" in str(e), e
else:
    raise AssertionError("no AttributeError")
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr

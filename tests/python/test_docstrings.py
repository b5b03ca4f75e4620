"""Every public callable has a docstring, and every function's docstring names its parameters.

"Public" is test_api_snapshot's definition (a public module's __all__; its compat modules found
by walking), plus the tool modules that docs/reference/ also renders (autotune, advisor, testing).
A public class counts with its public methods and properties, its own and those inherited from
rumor's classes; its constructor's parameters may be described in the class docstring or in
__init__'s. A parameter is "mentioned" when its name appears as a word in the docstring; *args,
**kwargs, self and cls are left out.

The failure lists every offender at once, so one run shows the whole backlog."""
from __future__ import annotations

import dataclasses
import enum
import importlib
import inspect
import re
import types
from typing import Dict, List, Optional

from test_api_snapshot import PUBLIC_MODULES, _compat_modules, _public_names

# Rendered in docs/reference/ but not in the API snapshot (they are tools, not the training API).
TOOL_MODULES = ["rumor.autotune", "rumor.advisor", "rumor.testing"]

SKIP_PARAMS = {"self", "cls"}


def documented_modules() -> List[str]:
    return PUBLIC_MODULES + _compat_modules() + TOOL_MODULES


def _own_doc(obj) -> Optional[str]:
    """obj's own docstring: not one inherited from a base class, nor the one dataclasses or
    namedtuple make up from the field list (that says nothing the signature does not)."""
    doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else getattr(obj, "__doc__", None)
    if not doc or not doc.strip():
        return None
    if inspect.isclass(obj):
        made_up = obj.__name__ + "("
        if dataclasses.is_dataclass(obj) and doc.startswith(made_up):
            return None
        if issubclass(obj, tuple) and hasattr(obj, "_fields") and doc.startswith(made_up):
            return None
    return doc


def _params(func) -> List[str]:
    try:
        sig = inspect.signature(func)
    except (TypeError, ValueError):
        return []
    return [p.name for p in sig.parameters.values()
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name not in SKIP_PARAMS]


def _unmentioned(params: List[str], doc: str) -> List[str]:
    return [p for p in params if not re.search(r"(?<![A-Za-z0-9_])" + re.escape(p) + r"(?![A-Za-z0-9_])", doc)]


def _is_rumor(obj) -> bool:
    return str(getattr(obj, "__module__", "") or "").startswith("rumor")


def _class_members(cls) -> Dict[str, object]:
    members: Dict[str, object] = {}
    for klass in reversed(cls.__mro__):
        if _is_rumor(klass):
            members.update(vars(klass))
    return members


def _inherited_doc(cls, name: str) -> Optional[str]:
    """The docstring of the nearest rumor class in cls's MRO that defines name with one: a hook
    overridden by every Algorithm is documented once, on Algorithm, where its contract lives.
    torch's docstrings do not count (they describe torch's method, not rumor's)."""
    for klass in cls.__mro__:
        if not _is_rumor(klass) or name not in vars(klass):
            continue
        member = vars(klass)[name]
        func = member.__func__ if isinstance(member, (staticmethod, classmethod)) else member
        doc = _own_doc(func) if inspect.isfunction(func) else None
        if doc is not None:
            return doc
    return None


def _check_function(qual: str, func, problems: List[str], doc: Optional[str] = None) -> None:
    doc = doc or _own_doc(func)
    if doc is None:
        problems.append(f"{qual}: no docstring")
        return
    missing = _unmentioned(_params(func), doc)
    if missing:
        problems.append(f"{qual}: docstring does not mention {', '.join(missing)}")


def _check_class(qual: str, cls, problems: List[str]) -> None:
    doc = _own_doc(cls)
    if doc is None:
        problems.append(f"{qual}: no docstring")
    if issubclass(cls, enum.Enum):
        return  # members are values, described by the class docstring
    init = cls.__dict__.get("__init__")
    if doc is not None and not (inspect.isfunction(init) or dataclasses.is_dataclass(cls)):
        init = None  # a constructor inherited from elsewhere is documented there
    if doc is not None:
        init_doc = (getattr(init, "__doc__", None) or "") if inspect.isfunction(init) else ""
        missing = _unmentioned(_params(cls), doc + "\n" + init_doc)
        if missing:
            problems.append(f"{qual}: constructor parameters not described: {', '.join(missing)}")
    for name, member in sorted(_class_members(cls).items()):
        if name.startswith("_"):
            continue
        mqual = f"{qual}.{name}"
        if isinstance(member, property):
            if _own_doc(member.fget) is None and not (member.__doc__ or "").strip():
                problems.append(f"{mqual}: property without a docstring")
        elif isinstance(member, (staticmethod, classmethod)):
            _check_function(mqual, member.__func__, problems, _inherited_doc(cls, name))
        elif inspect.isfunction(member):
            _check_function(mqual, member, problems, _inherited_doc(cls, name))


def undocumented() -> List[str]:
    problems: List[str] = []
    seen = set()
    for modname in documented_modules():
        mod = importlib.import_module(modname)
        names = _public_names(mod)
        if getattr(mod, "__all__", None) is None:
            # No __all__: the public names are those defined in the module, not its imports.
            names = [n for n in names if getattr(getattr(mod, n), "__module__", None) == modname]
        for name in names:
            obj = getattr(mod, name, None)
            if obj is None or isinstance(obj, types.ModuleType):
                continue
            # One object exported from several modules is reported once, under its first name.
            if id(obj) in seen:
                continue
            if inspect.isclass(obj):
                seen.add(id(obj))
                if _is_rumor(obj):
                    _check_class(f"{modname}.{name}", obj, problems)
            elif inspect.isfunction(obj):
                seen.add(id(obj))
                if _is_rumor(obj):
                    _check_function(f"{modname}.{name}", obj, problems)
    return problems


def test_every_public_callable_is_documented():
    problems = undocumented()
    assert not problems, f"{len(problems)} public callables lack documentation:\n" + "\n".join(problems)


def test_the_checker_sees_a_missing_docstring_and_an_unnamed_parameter():
    """The checks themselves, on planted functions: if these pass vacuously the test above would
    too."""
    def bare(x):
        pass

    def half(alpha, beta=1):
        """Uses alpha only."""

    def full(alpha, *args, beta=1, **kwargs):
        """alpha and beta (default 1)."""

    @dataclasses.dataclass
    class Plain:
        size: int

    problems: List[str] = []
    _check_function("bare", bare, problems)
    _check_function("half", half, problems)
    _check_function("full", full, problems)
    _check_class("Plain", Plain, problems)
    assert problems == ["bare: no docstring", "half: docstring does not mention beta", "Plain: no docstring"]

"""Old public names that keep working after a rename: a module's __getattr__ (PEP 562) hands out
the new object and warns once per name, so code written for the old name runs and says what to
change (docs/api.md lists the renames)."""
from __future__ import annotations

import warnings
from typing import Callable, Dict


def module_getattr(module: str, renamed: Dict[str, str], namespace: dict) -> Callable[[str], object]:
    """A __getattr__ for `module` resolving each old name in `renamed` to the new name's object
    in `namespace` (the module's globals), with a FutureWarning the first time it is used."""
    warned = set()

    def __getattr__(name: str):
        new = renamed.get(name)
        if new is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        if name not in warned:
            warned.add(name)
            warnings.warn(f"{module}.{name} was renamed {module}.{new}; the old name will go away",
                          FutureWarning, stacklevel=2)
        return namespace[new]

    return __getattr__

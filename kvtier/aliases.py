"""Old module paths kept importable for one release after a module moved.

A package lists its moved modules once (``alias_modules`` in its ``__init__``); importing an old
path then returns the module at its new home (the same module object, so classes compare equal)
and warns with a DeprecationWarning that names the new path. Nothing else is copied or wrapped.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Mapping
from types import ModuleType


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves each old path in ``moved`` to its new module."""

    def __init__(self) -> None:
        self.moved: dict[str, str] = {}

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.moved:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = self.moved[spec.name]
        warnings.warn(f"{spec.name} moved to {new}; the old path will be removed in the next release",
                      DeprecationWarning, stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module: ModuleType) -> None:
        """The module was executed at its new home."""


_FINDER = _MovedModules()


def alias_modules(moved: Mapping[str, str]) -> None:
    """Make each old module path (key) import the module now at the new path (value)."""
    _FINDER.moved.update(moved)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)

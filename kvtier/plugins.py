"""Plug-ins found by name through Python entry points, so kvtier's core never names the packages
that implement them (and users add their own by declaring an entry point in their package).

Groups:

- ``kvtier.backends``: storage backends. Each entry point is a module that exposes the backend's
  classes (``memory``, ``lmdb``, ``gpu``, ``s3``, ``daemon``; see pyproject.toml). The daemon
  opens its tiers, key mirror and revocation feed through these names.
- ``kvtier.bench``: ``kvtier bench NAME`` harnesses. Each is a module with
  ``add_arguments(parser)`` and ``run(args) -> int``.

Entry points are read from the installed distributions (``pip install -e .`` registers
kvtier's own); an unknown name is a ConfigError that lists the known ones.
"""

from __future__ import annotations

import importlib
from importlib.metadata import EntryPoint, entry_points
from types import ModuleType

from kvtier.errors import ConfigError

BACKENDS = "kvtier.backends"
BENCHES = "kvtier.bench"


def _group(group: str) -> dict[str, EntryPoint]:
    return {ep.name: ep for ep in entry_points(group=group)}


def names(group: str) -> list[str]:
    """Every name registered in ``group``, sorted."""
    return sorted(_group(group))


def target(group: str, name: str) -> str:
    """The module path ``name`` stands for in ``group`` (nothing is imported)."""
    ep = _group(group).get(name)
    if ep is None:
        known = names(group)
        hint = "" if known else " (none registered: is kvtier installed? pip install -e .)"
        raise ConfigError(f"no {group} plug-in named {name!r}; known: {known}{hint}")
    return ep.value.split(":", 1)[0]


def load(group: str, name: str) -> ModuleType:
    """The module registered as ``name`` in ``group``, imported."""
    return importlib.import_module(target(group, name))


def backend(name: str) -> ModuleType:
    """A storage backend's module by name (``kvtier.backends``)."""
    return load(BACKENDS, name)

"""Packages that import a name's module only when the name is first used.

Note [lazy package]: a package whose ``__init__`` maps each public name to the module defining it
imports none of those modules when the package itself is imported.  A light caller, such as the
CLI's parser reading a config's defaults for ``transcover analyze``, then does not pay for torch
(about 1.7 s), which only the computing modules import.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from importlib import import_module

__all__ = ["lazy_attributes"]


def lazy_attributes(package: str, table: Mapping[str, str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: ``table`` maps each name to its relative module
    (``"._mod:attr"``: the module's ``attr``, exported under the table's name).

    A name is imported on first access and kept in the package's namespace, so later accesses
    are plain attribute lookups.
    """

    def __getattr__(name: str) -> object:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, _, attr = module.partition(":")  # "._mod:other" exports ``other`` under this name
        value = getattr(import_module(module, package), attr or name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(table))

    return __getattr__, __dir__

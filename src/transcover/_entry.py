"""Subpackages that are also functions: ``transcover.lipschitz(model)`` beside ``transcover.lipschitz.F``.

Note [callable modules]: the public API mirrors the CLI (``transcover.lipschitz``, ``.approx``,
``.train`` ...), but three of those names are also subpackages.  A plain function of that name in
``transcover/__init__`` would be replaced by the module as soon as the subpackage is imported
(the import system sets the parent's attribute), and ``import transcover.lipschitz as m`` would
hand out the function.  Instead the subpackage's module object becomes an instance of
:class:`CallableModule` (``sys.modules[__name__].__class__ = CallableModule``, allowed for
``ModuleType`` subclasses): attribute access is unchanged, and calling it calls the API function
that ``transcover._api`` registered under the module's last name.  The subpackage imports only
this ground-floor module, never the API above it; ``transcover/__init__`` imports ``_api`` (which
registers) before any subpackage can be imported.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable

__all__ = ["CallableModule", "register_entry", "make_callable"]

_ENTRIES: dict[str, Callable] = {}


def register_entry(name: str, fn: Callable) -> None:
    """``transcover.<name>(...)`` calls ``fn(...)`` once the subpackage ``name`` is made callable."""
    _ENTRIES[name] = fn


class CallableModule(types.ModuleType):
    """A module that is also the API function of the same name (Note [callable modules])."""

    def __call__(self, *args, **kwargs):
        name = self.__name__.rpartition(".")[2]
        try:
            fn = _ENTRIES[name]
        except KeyError:
            raise TypeError(f"module {self.__name__!r} has no registered API function") from None
        return fn(*args, **kwargs)

    @property
    def __signature__(self):
        import inspect

        fn = _ENTRIES.get(self.__name__.rpartition(".")[2])
        return inspect.signature(fn) if fn is not None else None


def make_callable(module_name: str) -> None:
    """Turn the (imported) module ``module_name`` into a :class:`CallableModule`."""
    sys.modules[module_name].__class__ = CallableModule

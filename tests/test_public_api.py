"""Every name a package exports in ``__all__`` exists (STYLE point 4), and the CLI lists every command."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import transcover

PACKAGES = ["transcover"] + [
    f"transcover.{m.name}" for m in pkgutil.iter_modules(transcover.__path__) if m.ispkg
]


@pytest.mark.parametrize("name", PACKAGES)
def test_all_names_resolve(name):
    module = importlib.import_module(name)
    exported = getattr(module, "__all__", None)
    assert exported, f"{name} has no __all__"
    assert len(set(exported)) == len(exported), f"{name}.__all__ has duplicates"
    missing = [n for n in exported if not hasattr(module, n)]
    assert not missing, f"{name}.__all__ names missing attributes: {missing}"


def test_cli_commands_are_discovered():
    from transcover.cli import build_parser

    _, commands = build_parser()
    assert "analyze" in commands
    for module in commands.values():
        assert module.NAME and module.HELP and callable(module.run)

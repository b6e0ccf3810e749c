"""The package order is a law: no import upward, no private module across packages, no cycles.

Every ``import``/``from ... import`` in ``src/transcover`` is read with ``ast`` (function-local and
``TYPE_CHECKING`` imports included: a lazy import is still a dependency) and resolved to the
package it names.  The order (issue 11, "model is the ground floor; report is the sink")::

    ground floor (_errors, _results, _io, _views, _entry, _version, _threads, _lazy, _printed)
      < model < norms < lipschitz < {covering, empirical, approx, compress} < constrain < train
      < scale < report < public API (_api, _api_lab, _api_results) < cli < transcover/__init__, __main__

A package may import its own level or below; packages on one level may import each other as long
as no cycle forms.  Packages export what others need through their ``__init__``: ``from
..pkg._mod import x`` across packages is a violation even downward.

``ALLOWED`` lists the violations that still live in files other sessions own while issue 11 is
being merged; each names its owner and what removes it.  The lead empties it when merging.  Files
owned by the "sink" task (report/, the thin CLI modules, the public API) have none.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "transcover"

_GROUND = ("_errors", "_results", "_io", "_views", "_entry", "_version", "_threads", "_lazy", "_printed")
_API = ("_api", "_api_lab", "_api_results")
LEVELS: dict[str, int] = {
    **{m: 0 for m in _GROUND},
    "model": 1, "norms": 2, "lipschitz": 3,
    "covering": 4, "empirical": 4, "approx": 4, "compress": 4,
    "constrain": 5, "train": 6, "scale": 7, "report": 8,
    **{m: 9 for m in _API},
    "cli": 10, "__init__": 11, "__main__": 11,
}

# (importing file, imported module) -> owner and what removes it.  Temporary: see the module docstring.
ALLOWED: dict[tuple[str, str], str] = {
}


def _unit(parts: list[str]) -> str:
    """The layering unit of a module path inside transcover: its subpackage or top-level module."""
    return parts[0] if parts else "__init__"


def _imports(path: Path, root: Path = SRC):
    """``(imported module path as parts, line)`` for every import in ``path``, resolved to absolute
    parts inside transcover (``from .. import approx`` names the module ``approx``)."""
    rel = path.relative_to(root)
    here = list(rel.with_suffix("").parts)
    package = here[:-1]  # the package a relative import starts from (also right for __init__.py)
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "transcover" or alias.name.startswith("transcover."):
                    yield alias.name.split(".")[1:], node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                if not (node.module == "transcover" or (node.module or "").startswith("transcover.")):
                    continue
                base = node.module.split(".")[1:]
            else:
                up = node.level - 1
                if up > len(package):
                    raise AssertionError(f"{rel}:{node.lineno}: relative import above the package")
                base = package[: len(package) - up] + (node.module.split(".") if node.module else [])
            for alias in node.names:
                candidate = base + [alias.name]
                # "from X import name" imports the module X.name when that module exists
                is_module = (root.joinpath(*candidate).is_dir()
                             or root.joinpath(*candidate).with_suffix(".py").is_file())
                yield (candidate if is_module else base), node.lineno


def _edges():
    """``(file, unit, target parts, line)`` for every import of another unit."""
    out = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC)
        unit = _unit(list(rel.with_suffix("").parts)) if len(rel.parts) > 1 else rel.stem
        for target, line in _imports(path):
            t_unit = _unit(target)
            if t_unit != unit:
                out.append((rel.as_posix(), unit, target, line))
    return out


def _key(target: list[str]) -> str:
    """How the allow-list names an imported module: the unit, plus a private submodule if any."""
    private = next((p for p in target[1:] if p.startswith("_") and not p.startswith("__")), None)
    return target[0] if private is None else f"{target[0]}.{private}"


def _violations():
    upward, private = [], []
    for file, unit, target, line in _edges():
        t_unit = _unit(target)
        assert unit in LEVELS, f"{file}: package {unit!r} has no place in LEVELS; add it to the order"
        assert t_unit in LEVELS, f"{file}:{line}: imports {'.'.join(target)}, which has no place in LEVELS"
        if LEVELS[t_unit] > LEVELS[unit]:
            upward.append((file, t_unit, f"{file}:{line} imports {'.'.join(target)} (level {LEVELS[t_unit]} > "
                                         f"{unit}'s {LEVELS[unit]})"))
        if t_unit not in _GROUND + _API:  # top-level modules are the package's own, shared by all
            key = _key(target)
            if "." in key:
                private.append((file, key, f"{file}:{line} imports the private module {'.'.join(target)}"))
    return upward, private


def test_no_upward_imports():
    upward, _ = _violations()
    bad = [msg for file, t, msg in upward if (file, t) not in ALLOWED]
    assert not bad, "imports from a higher package:\n" + "\n".join(bad)


def test_no_private_modules_across_packages():
    _, private = _violations()
    bad = [msg for file, key, msg in private if (file, key) not in ALLOWED]
    assert not bad, "private modules imported across packages (export them from the package's __init__):\n" + \
        "\n".join(bad)


def _graph(skip_allowed: bool) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for file, unit, target, _ in _edges():
        if skip_allowed and ((file, _unit(target)) in ALLOWED or (file, _key(target)) in ALLOWED):
            continue
        graph[unit].add(_unit(target))
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a list of nodes, or None (iterative three-colour DFS)."""
    colour: dict[str, int] = {}
    for start in sorted(graph):
        if colour.get(start):
            continue
        stack = [(start, iter(sorted(graph[start])))]
        path = [start]
        colour[start] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                colour[node] = 2
                stack.pop()
                path.pop()
            elif colour.get(child) == 1:
                return path[path.index(child):] + [child]
            elif not colour.get(child):
                colour[child] = 1
                path.append(child)
                stack.append((child, iter(sorted(graph.get(child, ())))))
    return None


def test_no_package_cycles():
    cycle = _cycle(_graph(skip_allowed=True))
    assert cycle is None, "package import cycle: " + " -> ".join(cycle)


def test_allow_list_is_still_needed():
    """An entry whose violation is gone must leave the list (so the list only shrinks)."""
    upward, private = _violations()
    live = {(f, t) for f, t, _ in upward} | {(f, k) for f, k, _ in private}
    stale = sorted(k for k in ALLOWED if k not in live)
    assert not stale, "allow-list entries without a violation (remove them): " + ", ".join(map(str, stale))


def test_sink_files_have_no_allowed_violations():
    """report/ (but _build.py, spine's), the CLI modules of the sink task and the public API own none."""
    spine = {"report/_build.py", "cli/_bound.py", "cli/_lipschitz.py", "cli/_perturb.py"}
    mine = [k for k in ALLOWED if k[0].startswith(("report/", "cli/", "_api", "__init__")) and k[0] not in spine]
    assert not mine, f"violations in the sink's own files: {mine}"


@pytest.mark.parametrize("source, expected", [
    ("from ..model._spec import X\n", ["model", "_spec"]),
    ("def f():\n    from ..report import y\n", ["report"]),
    ("from .. import approx\n", ["approx"]),
    ("import transcover.norms._analyze\n", ["norms", "_analyze"]),
])
def test_the_parser_sees_every_form(tmp_path, monkeypatch, source, expected):
    """The checker itself: relative, function-local, package and absolute imports all resolve."""
    pkg = tmp_path / "transcover"
    for sub in ("model", "report", "approx", "norms", "covering"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "model" / "_spec.py").write_text("")
    (pkg / "norms" / "_analyze.py").write_text("")
    f = pkg / "covering" / "_x.py"
    f.write_text(source)
    assert [target for target, _ in _imports(f, pkg)] == [expected]


def test_every_imported_name_exists():
    """Every ``from <transcover module> import name`` names something that module has.

    Most imports across packages are function-local (the CLI must start fast), so a name that a
    merge renamed or stopped exporting only fails when that path runs (issue 11's merges broke
    ``transcover report`` this way: ``report/_build.py`` imported ``lipschitz.spec_norms`` after it
    left ``lipschitz.__init__``).  This reads every import statement and resolves it now.
    """
    import importlib

    bad = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC)
        package = ["transcover", *rel.with_suffix("").parts[:-1]]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level == 0:
                if not (node.module == "transcover" or (node.module or "").startswith("transcover.")):
                    continue
                module = node.module
            else:
                base = package[: len(package) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            found = importlib.import_module(module)
            for alias in node.names:
                if alias.name == "*" or hasattr(found, alias.name):
                    continue
                try:
                    importlib.import_module(f"{module}.{alias.name}")
                except ModuleNotFoundError:
                    bad.append(f"{rel}:{node.lineno}: {module} has no {alias.name}")
    assert not bad, "imports of names that do not exist:\n" + "\n".join(bad)

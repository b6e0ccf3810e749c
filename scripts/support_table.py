"""Rewrite the README's support table from the adapters' registry (``transcover analyze --list-archs``).

Run after an adapter registers a family or a feature:
``PYTHONPATH=src python scripts/support_table.py`` (``--check`` exits 1 if the README is stale).
"""

from __future__ import annotations

import sys
from pathlib import Path

START, END = "<!-- support-table:start -->\n", "<!-- support-table:end -->"


def main(argv: list[str]) -> int:
    from transcover.model._adapters._registry import SUPPORTED_ARCHITECTURES  # noqa: F401  (adapters register)
    from transcover.model._adapters._support import support_table

    readme = Path(__file__).resolve().parents[1] / "README.md"
    text = readme.read_text()
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    new = head + START + support_table() + END + tail
    if "--check" in argv:
        return 0 if new == text else 1
    if new != text:
        readme.write_text(new)
        print(f"updated {readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Shared spellings: a hidden, deprecated alias keeps old command lines working while help shows one name."""

from __future__ import annotations

import argparse

__all__ = ["add_deprecated_alias"]


class _Deprecated(argparse.Action):
    def __init__(self, option_strings, dest, new: str = "", **kwargs):
        self.new = new
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        import sys

        # parsing happens before main() routes warnings, so the line is printed in the CLI's own form
        print(f"transcover: warning: {option_string} is deprecated; use {self.new}", file=sys.stderr)
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)


def add_deprecated_alias(p: argparse.ArgumentParser, old: str, new: str, dest: str, **kwargs) -> None:
    """``old`` sets ``dest`` like ``new`` does, warns once that it is deprecated, and is not in the help."""
    p.add_argument(old, dest=dest, action=_Deprecated, new=new, default=argparse.SUPPRESS, help=argparse.SUPPRESS,
                   **kwargs)

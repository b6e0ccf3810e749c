"""Shared spellings: a hidden, deprecated alias keeps old command lines working while help shows one name; numbers
are read as typed (a literal that float64 rounds to 0 or to infinity is refused, naming the text); every command that
reads a model takes the same four options for how it is read."""

from __future__ import annotations

import argparse

__all__ = ["add_deprecated_alias", "add_load_arguments", "literal_problem", "load_options", "model_inputs",
           "read_float"]


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


def literal_problem(text: str) -> str | None:
    """Why float64 cannot hold the number ``text`` spells (it rounds to 0 or to infinity), or None: ``--eps 1e-400``
    was refused as "got --eps=0.0", a value the user never typed, and ``--perturb W_Q=1e-400`` left W_Q unperturbed
    without a word (red teams 162, 166). ``text`` must already parse as a float."""
    value = float(text)
    mantissa = text.strip().lower().lstrip("+-").split("e")[0]
    if value == 0.0 and any(c in "123456789" for c in mantissa):
        return f"{text.strip()!r} is below float64's range (it would read as 0)"
    if value in (float("inf"), float("-inf")) and "inf" not in text.lower():
        return f"{text.strip()!r} is beyond float64's range (it would read as infinity)"
    return None


def read_float(text: str, what: str) -> float:
    """``float(text)`` for a value inside a list or a ROLE=VALUE item: one ``InputError`` line naming ``what`` if it is
    not a number or float64 cannot hold it (``literal_problem``)."""
    from .._errors import InputError

    try:
        value = float(text)
    except ValueError:
        raise InputError(f"{what} must be a number, but got {text.strip()!r}") from None
    problem = literal_problem(text)
    if problem:
        raise InputError(f"{what}: {problem}")
    return value


def add_load_arguments(p: argparse.ArgumentParser) -> None:
    """How a command reads its model(s): ``--arch``, ``--roles``, ``--allow-pickle``, ``--strict``, spelt and explained
    alike in every command (``lipschitz``, ``perturb``, ``bound`` and ``report`` had no ``--roles``: a layout analysed
    through a mapping file could not be certified by the same command line)."""
    p.add_argument("--arch", default=None, help="architecture of a bare .safetensors file (bert, gpt2, llama, vit, "
                                                "torch_encoder, reference, ...: analyze --list-archs names them all)")
    p.add_argument("--roles", metavar="JSON", default=None,
                   help="a mapping file naming the role of each tensor of a layout no adapter knows "
                        "(docs/architectures.md); transcover_roles.json beside the weights is read by default")
    p.add_argument("--allow-pickle", action="store_true",
                   help="load pickled checkpoints (.bin/.pt) with torch.load(weights_only=True)")
    p.add_argument("--strict", action="store_true",
                   help="refuse a checkpoint with tensors inside a layer that the architecture does not define "
                        "(default: warn, naming each)")


def load_options(args: argparse.Namespace) -> dict:
    """The keyword arguments of ``transcover.load`` (and of the API functions that load) that ``add_load_arguments``
    parsed."""
    return {"arch": args.arch, "allow_pickle": args.allow_pickle, "strict": args.strict, "roles": args.roles}


def model_inputs(args: argparse.Namespace, *models) -> list:
    """What a command's JSON envelope hashes as its inputs: the models it read and the mapping file that named their
    tensors (``--roles``), which chose the function as much as the weights did."""
    return [*models, *([args.roles] if getattr(args, "roles", None) else [])]

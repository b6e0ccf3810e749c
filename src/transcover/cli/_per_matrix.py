"""``transcover analyze`` of a model outside every adapter: the per-matrix table, JSON and CSV.

The note saying why (the loader's one line) and the scope ("outside the decomposition") come
first, so no reader takes these numbers for the per-head quantities of a supported architecture.
"""

from __future__ import annotations

import argparse
import csv
import io

from .._errors import InputError

__all__ = ["finish_per_matrix"]


def _csv(result) -> str:
    out = io.StringIO()
    w = csv.writer(out)
    w.writerow(["name", "shape", "orientation", "kind"] + [f"{k}_{e}" for k in ("spectral", "frobenius", "l21")
                                                          for e in ("lower", "upper")])
    for m in result.matrices:
        w.writerow([m.name, "x".join(map(str, m.shape)), m.orientation, result.kind.value]
                   + [repr(getattr(getattr(m, k), e)) for k in ("spectral", "frobenius", "l21") for e in ("lower", "upper")])
    return out.getvalue()


def finish_per_matrix(args: argparse.Namespace, result, console) -> int:
    """Render (unless ``--quiet``) and write ``--json``/``--csv``; ``--plot``/``--heads`` need the decomposition."""
    from rich.table import Table

    from ..norms import PER_MATRIX_SCHEMA
    from ..report import envelope_json, print_table, write_outputs
    from ._conventions import model_inputs

    if args.plot or args.heads:
        raise InputError(f"{'--plot' if args.plot else '--heads'} needs the decomposition (per-head norms); "
                         f"{result.model} is outside it: {result.notes[0]}")
    outputs = []
    if args.json:
        outputs.append((args.json, envelope_json(result.to_dict(), schema=PER_MATRIX_SCHEMA, schema_version="1.0",
                                                 inputs=model_inputs(args, args.model)).encode()))
    if args.csv:
        outputs.append((args.csv, _csv(result).encode()))
    if not args.quiet:
        for note in result.notes:
            console.print(f"note: {note}", highlight=False, markup=False)
        from rich.markup import escape

        # a model's path and its tensors' names are the user's text, never markup (red team 215)
        table = Table(title=f"{escape(str(result.model))}: certified norms per matrix "
                            f"({len(result.matrices)} matrices)")
        for col in ("matrix", "shape", "x @ W from", "‖W‖₂", "‖W‖_F", "‖W‖₂,₁"):
            table.add_column(col, justify="left" if col in ("matrix", "x @ W from") else "right")
        from .._printed import for_kind

        # an interval's ends are printed as bounds (Note [printed bounds]: red team 173), an estimate to nearest
        certified = "certified" in str(getattr(result.kind, "value", result.kind))
        lower_kind, upper_kind = ("certified lower bound", "certified upper bound") if certified else ("estimate",) * 2
        for m in result.matrices:
            table.add_row(escape(m.name), "x".join(map(str, m.shape)), m.orientation,
                          *(f"\\[{for_kind(getattr(m, k).lower, lower_kind, 5)}, "
                            f"{for_kind(getattr(m, k).upper, upper_kind, 5)}]"
                            for k in ("spectral", "frobenius", "l21")))
        print_table(console, table)
        if result.skipped:
            console.print(f"skipped {len(result.skipped)} tensors that are not 2-D weights (biases, norm scales, "
                          "kernels)", highlight=False, markup=False)
    write_outputs(outputs)
    return 0

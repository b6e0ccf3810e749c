"""``transcover train``: train the reference Transformer (+ MLP head) under norm constraints."""

from __future__ import annotations

import argparse

NAME = "train"
HELP = "train on digits or a sparse-token task under norm constraints (staged schedules, monitoring, resume)"


def add_constraint_arguments(p: argparse.ArgumentParser, *, with_method_default: str = "none") -> None:
    """Arguments shared with ``transcover experiment``."""
    p.add_argument("--method", default=with_method_default,
                   help="none | spectral (power-iteration cap: sigma exceeds the radius during training, "
                        "measured up to ~1.3x, reported; projected exactly at the end) | "
                        "project (exact SVD after each step, certified) | clip | "
                        "penalty (hinge) | log_penalty | lipschitz (F8 regulariser)")
    p.add_argument("--radius", action="append", default=[], metavar="GROUP=C",
                   help="target radius per group (KQ OV W1 W2 b1 b2 head all; KQ.1 for one layer); repeatable")
    p.add_argument("--schedule", default="constant", help="constant | linear | cosine | step")
    p.add_argument("--loose-factor", type=float, default=4.0, help="start radius = factor x target")
    p.add_argument("--start-fraction", type=float, default=0.0, help="tightening starts at this fraction of training")
    p.add_argument("--end-fraction", type=float, default=1.0, help="the target is reached at this fraction")
    p.add_argument("--penalty-weight", type=float, default=1e-2, help="lambda of soft penalties")


def add_training_arguments(p: argparse.ArgumentParser, *, epochs: int = 30, n_train: int | None = None) -> None:
    p.add_argument("--task", default="digits", help="digits | parity | majority | holder | retrieval")
    p.add_argument("--n-train", type=int, default=n_train, help="training samples (digits: rest is test)")
    p.add_argument("--n-test", type=int, default=1000, help="test samples (sparse tasks)")
    p.add_argument("--seq-len", type=int, default=16, help="sequence length (sparse tasks)")
    p.add_argument("--sparsity", type=int, default=2, help="|I| (sparse tasks)")
    p.add_argument("--epochs", type=int, default=epochs, help="passes over the training set")
    p.add_argument("--batch-size", type=int, default=64, help="examples per step")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    p.add_argument("--d-model", type=int, default=32, help="model width d")
    p.add_argument("--n-heads", type=int, default=2, help="attention heads per layer")
    p.add_argument("--n-layers", type=int, default=2, help="Transformer layers")
    p.add_argument("--d-ff", type=int, default=64, help="FFN hidden width")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (1 is fastest for these small models on a shared machine)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_training_arguments(parser)
    add_constraint_arguments(parser)
    parser.add_argument("--seed", type=int, default=0, help="random seed (data split, initialisation)")
    parser.add_argument("--bound-every", type=int, default=0, metavar="EPOCHS",
                        help="log the certified covering bound every EPOCHS epochs (about 1 s each; 0: only at the end)")
    parser.add_argument("--out", default="out/train", help="folder for history.jsonl/.csv/.png and checkpoint/")
    parser.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    parser.add_argument("--stop-after", type=int, default=None, metavar="EPOCHS",
                        help="run at most this many epochs now (continue later with --resume)")
    parser.add_argument("--quiet", dest="no_progress", action="store_true", help="no progress bar")
    from ._conventions import add_deprecated_alias

    add_deprecated_alias(parser, "--no-progress", "--quiet", "no_progress", nargs=0, const=True)
    parser.add_argument("--json", metavar="PATH", help="write the final result as JSON (atomically)")


def constraint_from_args(args, **override):
    from ..constrain import ConstraintConfig, parse_radii

    radii = parse_radii(",".join(args.radius))
    fields = dict(method=args.method, radii=radii, schedule=args.schedule, loose_factor=args.loose_factor,
                  start_fraction=args.start_fraction, end_fraction=args.end_fraction,
                  penalty_weight=args.penalty_weight)
    fields.update(override)
    return ConstraintConfig(**fields)


def train_config_from_args(args, constraint, seed: int):
    from ..train import TrainConfig

    extra = {"bound_every": args.bound_every} if hasattr(args, "bound_every") else {}
    return TrainConfig(
        task=args.task, n_train=args.n_train, n_test=args.n_test, seq_len=args.seq_len, sparsity=args.sparsity,
        epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, weight_decay=args.weight_decay, seed=seed,
        d_model=args.d_model, n_heads=args.n_heads, n_layers=args.n_layers, d_ff=args.d_ff, constraint=constraint, **extra,
    )


def set_threads(n: int) -> None:
    from .._errors import InputError

    if n <= 0:
        raise InputError(f"threads must be >= 1, but got threads={n}")
    import torch

    torch.set_num_threads(n)


def _up(x: float, digits: int = 6) -> str:
    """``x`` rounded *up* to ``digits`` decimals: an upper bound stays an upper bound when printed."""
    import math

    return f"{math.ceil(x * 10**digits) / 10**digits:.{digits}f}"


def constraint_warnings(result) -> list[str]:
    """One line per group whose forward weights exceeded the target (sigma / c > 1) during or after training."""
    lines = []
    for g, row in result.exceeded.items():
        during = row.get("max_ratio")
        if during is not None and during > 1.0:
            end = (f"the final model was projected exactly: certified sigma/c <= {_up(row['ratio'])}"
                   if row["finalized"] and row["ratio"] is not None and row["ratio"] <= 1.0
                   else f"final sigma/c = {_up(row['ratio'] if row['ratio'] is not None else row['sigma'] / row['target'])}")
            lines.append(f"warning: {g} exceeded its target during training: max sigma/c = {_up(during)} at step "
                         f"{row['max_ratio_step']} (exact sigma of the weights used in the forward pass); {end}")
        elif row["ratio"] is not None and row["ratio"] > 1.0:
            lines.append(f"warning: {g} ends above its target: certified sigma/c = {_up(row['ratio'])}")
    return lines


def run(args) -> int:
    from pathlib import Path

    from rich.console import Console
    from rich.table import Table

    from ..constrain import plot_history
    from ..report import atomic_write_text
    from ..train import train

    set_threads(args.threads)
    config = train_config_from_args(args, constraint_from_args(args), args.seed)
    out = Path(args.out)
    result = train(config, out_dir=out, resume=args.resume, progress=not args.no_progress,
                   stop_after=args.stop_after)
    plot_history(result.history, out / "history.png", title=f"{config.task}, method={config.constraint.method}")
    console = Console()
    t = Table(title=f"transcover train: {config.task} ({result.task_source})")
    t.add_column("quantity")
    t.add_column("value", justify="right")
    t.add_column("target", justify="right")
    t.add_column("ratio", justify="right")
    t.add_column("kind")
    for label, v in (("train loss", result.train_loss), ("test loss", result.test_loss),
                     ("train accuracy", result.train_acc), ("test accuracy", result.test_acc),
                     ("generalisation gap", result.gap)):
        if v is not None:
            t.add_row(label, f"{v:.4f}", "", "", "measured")
    for g, v in result.norms.items():
        kind = "exact (l2 norm)" if g in ("b1", "b2") else "exact (float64 SVD)"
        row = result.constraints.get(g)
        if row is None:
            t.add_row(f"max norm {g}", f"{v:.4f}", "", "", kind)
            continue
        ratio = row["ratio"]
        certified = ratio is not None and ratio <= 1.0
        t.add_row(f"max norm {g}", f"{v:.4f}", f"{row['target']:.6g}", "" if ratio is None else _up(ratio),
                  kind + (f"; certified <= {_up(row['certified'])} <= target" if certified else
                          f"; certified upper {_up(row['certified'])}"))
    t.add_row("capacity proxy (F8)", f"{result.capacity.value:.4g}", "", "", result.capacity.kind.value)
    if result.lipschitz is not None:
        t.add_row("Lip(g_L) (transcover.lipschitz)", f"{result.lipschitz.value:.4g}", "", "", result.lipschitz.kind.value)
    if result.covering is not None:
        t.add_row("log10 log N(eps=0.1) (transcover.covering)", f"{result.covering.value:.4g}", "", "",
                  result.covering.kind.value)
    if result.bound is not None:
        vacuous = getattr(result.bound, "vacuous", False)
        raw = getattr(result.bound, "raw", result.bound.value)
        t.add_row("gap bound (transcover.covering)" + (" (vacuous: the trivial loss range)" if vacuous else ""),
                  f"{result.bound.value:.4g}", "", "", result.bound.kind.value)
        t.add_row("  raw formula (before the clip at the loss range)", f"{raw:.4g}", "", "",
                  "not a bound above the loss range" if vacuous else result.bound.kind.value)
    console.print(t)
    for line in constraint_warnings(result):
        console.print(line, markup=False, highlight=False)
    console.print(f"history: {out / 'history.jsonl'}, {out / 'history.csv'}, {out / 'history.png'}; "
                  f"checkpoint: {out / 'checkpoint'}")
    if args.json:
        from ..report import envelope_json

        atomic_write_text(args.json, envelope_json(result.to_dict(), schema="transcover.train", schema_version="1"))
    return 0

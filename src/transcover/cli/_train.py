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
    from .._threads import set_torch_threads

    set_torch_threads(n)


def run(args) -> int:
    from pathlib import Path

    from rich.console import Console

    from .._api import train
    from ..report import (TrainingDisplay, atomic_write_bytes, atomic_write_text, constraint_warnings,
                          display_bytes, envelope_json, train_table)

    set_threads(args.threads)
    config = train_config_from_args(args, constraint_from_args(args), args.seed)
    out = Path(args.out)
    result = train(config, out_dir=out, resume=args.resume, progress=not args.no_progress,
                   stop_after=args.stop_after)
    figure = TrainingDisplay.from_result(result, f"{config.task}, method={config.constraint.method}").plot()
    atomic_write_bytes(out / "history.png", display_bytes(figure, out / "history.png", fmt="png"))
    console = Console()
    console.print(train_table(result, config.task))
    for line in constraint_warnings(result):
        console.print(line, markup=False, highlight=False)
    console.print(f"history: {out / 'history.jsonl'}, {out / 'history.csv'}, {out / 'history.png'}; "
                  f"checkpoint: {out / 'checkpoint'}", markup=False, highlight=False)  # paths (red team 215)
    if args.json:
        atomic_write_text(args.json, envelope_json(result.to_dict(), schema="transcover.train", schema_version="1"))
    return 0

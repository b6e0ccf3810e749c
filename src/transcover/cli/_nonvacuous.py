"""``transcover experiment nonvacuous``: certified finite-class bounds for trained Transformers (THEORY F18).

Registered as a sub-experiment by ``_experiment`` (``add_nonvacuous_parser`` / ``run_nonvacuous``).
"""

from __future__ import annotations

HELP = ("train small Transformers on sparse majority and digits, quantise and code them, and print the "
        "certified finite-class (kl Occam) bound beside the measured test error")


def add_nonvacuous_parser(sub) -> None:
    p = sub.add_parser("nonvacuous", help=HELP, description=HELP)
    p.add_argument("--quick", action="store_true", help="one small sparse-majority run (seconds; smoke test)")
    p.add_argument("--ablation", action="store_true",
                   help="sparse majority at n = 1e4 without L1, without QAT, with 15 levels (what moves the bound)")
    p.add_argument("--tasks", default=None,
                   help="comma list among majority, majority-noise, digits (default: every task of the plan)")
    p.add_argument("--n", default=None, metavar="N1,N2,...",
                   help="training-set sizes for the sparse tasks (default: the plan's, 1e3, 1e4, 1e5)")
    p.add_argument("--seed", type=int, default=None, help="seed for data and training (default: the plan's, 0)")
    p.add_argument("--delta", type=float, default=None, help="failure probability of each bound (default 0.05)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--jobs", type=int, default=1,
                   help="run the cases in this many worker processes, one thread each (default 1)")
    p.add_argument("--out", default="out/nonvacuous", help="folder for nonvacuous.json and nonvacuous.png")
    p.add_argument("--json", metavar="PATH", help="also write the result JSON here (atomically)")


def _plan(args):
    from dataclasses import replace

    from .._errors import InputError
    from ..train import ABLATION_PLAN, FULL_PLAN, NONVACUOUS_TASKS, QUICK_PLAN

    if args.quick and args.ablation:
        raise InputError("choose one of --quick and --ablation")
    plan = QUICK_PLAN if args.quick else ABLATION_PLAN if args.ablation else FULL_PLAN
    if args.tasks is not None:
        tasks = [t.strip() for t in args.tasks.split(",")]
        bad = [t for t in tasks if t not in NONVACUOUS_TASKS]  # an empty item too ("majority,,digits")
        if bad or not tasks:
            raise InputError(f"tasks must be a comma list of {', '.join(NONVACUOUS_TASKS)}, but got {args.tasks!r}")
        plan = tuple(c for c in plan if c.task in tasks)
        if not plan:
            raise InputError(f"the chosen plan has no run for tasks={args.tasks!r}")
    if args.n is not None:
        try:
            sizes = [int(x) for x in args.n.split(",")]  # an empty item ("1,,2") is refused, not skipped
        except ValueError:
            raise InputError(f"n must be a comma list of positive integers, but got n={args.n!r}") from None
        if not sizes or min(sizes) <= 0:
            raise InputError(f"n must be a comma list of positive integers, but got n={args.n!r}")
        sparse = {(c.task, c.variant): c for c in plan if c.task != "digits"}  # one per task and variant
        plan = tuple(replace(c, n_train=n) for c in sparse.values() for n in sizes) + tuple(
            c for c in plan if c.task == "digits")
    if args.delta is not None:
        plan = tuple(replace(c, delta=float(args.delta)) for c in plan)  # validated by the config
    if args.seed is not None:
        plan = tuple(replace(c, seed=args.seed) for c in plan)
    return plan


def _check_out(out) -> None:  # noqa: ANN001  (a Path)
    """Refuse, before any training, an ``--out`` that is a file, lies under one, or whose nearest existing folder is
    not writable: it failed only after the whole run, with "[Errno 17] File exists" (red team 204).  ``--json`` is
    checked up front by the CLI's own output check."""
    import os

    from .._errors import InputError

    for folder in (out, *out.parents):  # the first that exists must be a writable folder (mkdir makes the rest)
        if folder.exists() or folder.is_symlink():
            if not folder.is_dir():
                where = "is" if folder == out else f"lies under {str(folder)!r}, which is"
                raise InputError(f"cannot write to --out {str(out)!r}: it {where} a file, not a folder")
            if not os.access(folder, os.W_OK | os.X_OK):
                raise InputError(f"cannot write to --out {str(out)!r}: folder {str(folder)!r} is not writable")
            return


def run_nonvacuous(args) -> int:
    from pathlib import Path

    from rich.console import Console

    from ..report import atomic_write_text
    from ..train import nonvacuous_experiment
    from ._train import set_threads

    plan = _plan(args)
    if args.jobs < 1:
        from .._errors import InputError

        raise InputError(f"jobs must be a positive integer, but got jobs={args.jobs}")
    set_threads(args.threads)
    out = Path(args.out)
    _check_out(out)
    if args.json and not Path(args.json).parent.exists():
        from .._errors import InputError

        raise InputError(f"cannot write {args.json}: folder {Path(args.json).parent} does not exist")
    console = Console()
    if not console.is_terminal:  # keep the tables readable in logs and pipes
        console = Console(width=200)
    with console.status("training") as status:
        result = nonvacuous_experiment(plan, progress=status.update, jobs=args.jobs)
    console.print(result.table())
    console.print(result.matrix_table())
    out.mkdir(parents=True, exist_ok=True)
    from ..report import envelope_json

    data = envelope_json(result.to_dict(), schema="transcover.experiment.nonvacuous", schema_version="1")
    atomic_write_text(out / "nonvacuous.json", data)
    fig = result.plot(out / "nonvacuous.png")
    if args.json:
        atomic_write_text(args.json, data)
    console.print(f"every bound: certified upper bound on the test error, delta per row; "
                  f"test error: measured. figure: {fig}; data: {out / 'nonvacuous.json'} "
                  f"({result.seconds:.0f} s wall, {sum(c.cpu_seconds for c in result.cases):.0f} s CPU)",
                  markup=False, highlight=False)  # paths (red team 215)
    return 0

"""``transcover bound [MODEL]``: covering number and generalisation bound from the weights (issue 4)."""

from __future__ import annotations

import argparse

NAME = "bound"
HELP = "log covering number at eps, generalisation bound at n samples, and where it comes from"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="HF model directory, .safetensors file, a `transcover train` checkpoint folder (n and T "
                        "default to its task's), or short name (default: the bundled all-MiniLM-L6-v2)")
    p.add_argument("--arch", default=None, help="architecture of a bare .safetensors file")
    p.add_argument("--allow-pickle", action="store_true", help="load pickled checkpoints (.bin/.pt)")
    p.add_argument("--strict", action="store_true",
                   help="refuse a checkpoint with tensors inside a layer that the architecture does not define "
                        "(default: warn, naming each)")
    p.add_argument("--eps", type=float, default=0.1, help="covering scale eps (default 0.1)")
    p.add_argument("--n-samples", type=float, nargs="+", default=None,
                   help="training-set sizes n for the generalisation bound (default 1e6; a training "
                        "checkpoint: its n_train)")
    p.add_argument("--seq-len", type=int, default=None,
                   help="sequence length T (enters as log(nT); default 128; a training checkpoint: its task's)")
    p.add_argument("--radius", type=float, default=1.0, help="bound R on input token norms (default 1)")
    p.add_argument("--c-sm", type=float, default=1.0, help="softmax constant >= 1: 1 (proven and tight, default) or 2 (Edelman)")
    p.add_argument("--family", choices=("auto", "l21", "spectral", "best"), default="auto",
                   help="auto (default): compute every route below and report the smallest certified log N; "
                        "l21: (2,1)-norm covers, 1/eps^2 (the seed's form); spectral: parameter-count covers "
                        "(dimension-dependent); best: the cheaper of the two per matrix inside Lemma G.1")
    p.add_argument("--sigma-min", type=float, default=0.0,
                   help="assumed floor on every LayerNorm input's std (0: global max|gamma|/sqrt(eps) constant)")
    p.add_argument("--reference", default=None, metavar="MODEL",
                   help="initialisation: measure distances from this model's weights instead of from 0")
    p.add_argument("--loss-lipschitz", type=float, default=1.0, help="Lipschitz constant of the loss (default 1)")
    p.add_argument("--loss-bound", type=float, default=1.0, help="the loss takes values in [0, b] (default 1)")
    p.add_argument("--delta", type=float, default=0.05, help="failure probability (default 0.05)")
    p.add_argument("--target-gap", type=float, default=None,
                   help="also report the n needed for a gap <= this (default: 0.1 * loss bound)")
    p.add_argument("--top", type=int, default=10, help="matrices in the breakdown table (default 10)")
    p.add_argument("--json", metavar="PATH", default=None, help="write the result as JSON")
    p.add_argument("--plot", metavar="PATH", default=None, help="write a PNG: log N(eps) and the bound against n")
    p.add_argument("--quiet", action="store_true", help="print no tables and no progress")


def _validate(args: argparse.Namespace) -> None:
    from .._errors import InputError

    from ..lipschitz._attention import check_c_sm

    check_c_sm(args.c_sm, "--c-sm")
    for flag, v in (("--eps", args.eps), ("--radius", args.radius),
                    ("--loss-lipschitz", args.loss_lipschitz), ("--loss-bound", args.loss_bound)):
        if not (v > 0 and v < float("inf")):
            raise InputError(f"{flag} must be a finite number > 0, but got {flag}={v}")
    for n in args.n_samples or ():
        if not (n >= 1 and n < float("inf")):
            raise InputError(f"--n-samples must be >= 1, but got --n-samples={n}")
    if args.seq_len is not None and args.seq_len < 1:
        raise InputError(f"--seq-len must be >= 1, but got --seq-len={args.seq_len}")
    if not (0 < args.delta < 1):
        raise InputError(f"--delta must be in (0, 1), but got --delta={args.delta}")
    if not (args.sigma_min >= 0):
        raise InputError(f"--sigma-min must be >= 0, but got --sigma-min={args.sigma_min}")
    if args.target_gap is not None and not (args.target_gap > 0):
        raise InputError(f"--target-gap must be > 0, but got --target-gap={args.target_gap}")
    if args.top < 0:
        raise InputError(f"--top must be >= 0, but got --top={args.top}")
    if args.plot is not None and not args.plot.lower().endswith(".png"):
        raise InputError(f"--plot writes a PNG; the path must end in .png, but got --plot={args.plot}")


def _json_safe(obj):
    """Strict JSON: non-finite floats (a zero-coefficient matrix's eps_i = inf) become strings."""
    import math

    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def _fmt_log(ln_value: float) -> str:
    """A number given by its natural log, printed as a float or as 10^x."""
    import math

    if ln_value == -math.inf:
        return "0"
    if ln_value < math.log(1e6):
        return f"{math.exp(ln_value):.4g}"
    return f"10^{ln_value / math.log(10):.2f}"


def run(args: argparse.Namespace) -> int:
    import math
    import sys

    from ..covering import diagnose, model_bound, sample_size_for_gap
    from ..model import load
    from ..report import atomic_write_text, start_progress

    _validate(args)
    tracker = start_progress(quiet=args.quiet)
    tracker.step("loading the model")
    from ..train import checkpoint_spec, is_train_checkpoint

    if args.model is not None and is_train_checkpoint(args.model):
        spec, n_train, seq_len = checkpoint_spec(args.model)
        spec = spec.to_torch()
        args.n_samples = args.n_samples or [float(n_train)]
        args.seq_len = args.seq_len or seq_len
    else:
        spec = load(args.model, arch=args.arch, allow_pickle=args.allow_pickle, strict=args.strict).to_torch()
    args.n_samples = args.n_samples or [1e6]
    args.seq_len = args.seq_len or 128
    reference = None if args.reference is None else load(args.reference, arch=args.arch, allow_pickle=args.allow_pickle,
                                                         strict=args.strict).to_torch()
    tracker.step("covering number and generalisation bound")
    result = model_bound(spec, eps=args.eps, n_samples=tuple(args.n_samples), seq_len=args.seq_len,
                         radius=args.radius, c_sm=args.c_sm, family=args.family, sigma_min=args.sigma_min,
                         reference=reference, loss_lipschitz=args.loss_lipschitz, loss_bound=args.loss_bound,
                         delta=args.delta)
    target = args.target_gap if args.target_gap is not None else 0.1 * args.loss_bound
    terms = list(result.transformer.contributions)
    curve = result.curve
    n_needed = sample_size_for_gap(curve, target, loss_lipschitz=args.loss_lipschitz, loss_bound=args.loss_bound,
                                   delta=args.delta)
    data = _json_safe(result.to_dict())
    data["n_needed_for_gap"] = {"target_gap": target, "n": n_needed if math.isfinite(n_needed) else "> 1e300"}
    diagnosis = diagnose(result)
    data["diagnosis"] = _json_safe(diagnosis.to_dict())
    data["warnings"] = list(spec.warnings) + ([] if reference is None else list(reference.warnings))
    # Render and build every output before writing any, so an error leaves nothing half-written.
    outputs = []
    if args.json:
        from ..report import envelope_json

        outputs.append(("json", args.json, envelope_json(data, schema="transcover.bound", schema_version="1",
                                                         inputs=[args.model] + ([args.reference] if args.reference
                                                                                else []))))
    if args.plot:
        tracker.step("plotting")
    png = _plot(result, curve, n_needed, target, args) if args.plot else None
    tracker.close()
    if not args.quiet:
        _render(result, terms, n_needed, target, args.top, diagnosis)
    for _, path, text in outputs:
        atomic_write_text(path, text)
        print(f"wrote {path}", file=sys.stderr)
    if png is not None:
        from ..report import atomic_write_bytes

        atomic_write_bytes(args.plot, png)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def _render(result, terms, n_needed: float, target: float, top: int, diagnosis) -> None:
    import math

    from rich.console import Console
    from rich.table import Table

    from ..covering import CompositeCovering

    con = Console()
    cov = result.covering
    con.print(f"[bold]{result.model}[/bold] ({result.arch}, {result.n_layers} layers): "
              f"log N_inf(eps={result.eps!r}, n={result.transformer.n_points // result.seq_len:g} x T={result.seq_len}) "
              f"<= {_fmt_log(cov.log_log_N)}  [{result.kind.value}]")
    if result.routes:
        others = ", ".join(f"{k} {_fmt_log(v)}" for k, v in result.routes.items())
        con.print(f"  route: {result.route}" + (" (family auto: the smallest certified log N of the routes "
                                                 if result.family == "auto" else " (routes for comparison: ")
                  + others + ")")
    if isinstance(cov, CompositeCovering):
        con.print(f"  Theorem G.5: MLP head log N(eps/2) <= {_fmt_log(cov.mlp.log_log_N)} "
                  f"({cov.mlp.n_params} params, C = {_fmt_log(cov.log_C)}); Transformer log N(eps/2C) <= "
                  f"{_fmt_log(cov.transformer.log_log_N)}; 4C^2(eta+eta~)^3/eps^2 = {_fmt_log(cov.log_leading)}")
    t = Table(title="generalisation gap (w.p. >= 1 - delta)")
    for col in ("n", "gap bound (reported)", "raw formula", "Rademacher", "vacuous", "BFT-baseline gap"):
        t.add_column(col, justify="right")
    b_loss = result.generalisation[0].loss_bound
    for g, b in zip(result.generalisation, result.bft_generalisation):
        t.add_row(f"{g.n:.3g}", _fmt_log(g.log_gap) + (" (trivial)" if g.vacuous else ""), _fmt_log(g.raw_log_gap),
                  f"{g.rademacher.value:.4g}" + (" (trivial 4b)" if g.rademacher.trivial else ""),
                  "yes" if g.vacuous else "no",
                  _fmt_log(b.log_gap) + (f" (vacuous, raw {_fmt_log(b.raw_log_gap)})" if b.vacuous else ""))
    con.print(t)
    if any(g.vacuous for g in result.generalisation):
        con.print(f"vacuous: the bound's formula is >= the loss range b = {b_loss:g} (a [0, b] loss never has a "
                  f"larger gap), so the reported gap is the trivial b; the raw formula is shown for comparison only")
    con.print(f"n needed for a gap <= {target:g}: {n_needed:.3g}" if math.isfinite(n_needed)
              else f"n needed for a gap <= {target:g}: more than 1e300")
    if diagnosis.vacuous:
        dom = ", ".join(f"n={g.n:.3g}: {d}" for g, d in zip(result.generalisation, diagnosis.dominant_term))
        con.print(f"[bold]why vacuous[/bold]: dominant gap term ({dom}); largest shares of the Transformer's log N: "
                  + ", ".join(f"{m} {s:.1%} ({c.split()[0]})" for m, _, c, s, _ in diagnosis.top)
                  + "; by layer: " + ", ".join(f"{ly}: {s:.1%}" for ly, s in diagnosis.layers[:3]))
        con.print("[bold]what would tighten it[/bold] (advice):")
        for tip in diagnosis.suggestions:
            con.print(f"  - {tip}")
    con.print("BFT baseline (an estimate, not a bound here: BFT's theorem covers feed-forward chains; the "
              "Transformer's matrices are treated as one chain without residuals, LayerNorm or softmax)")
    con.print(f"BFT spectral complexity R_A = {_fmt_log(result.bft.log_R)} [{result.bft.kind.value}]; "
              f"BFT log N ~ A/eps^2 with A = {_fmt_log(result.bft.log_A)}, "
              f"ours at eps: log N * eps^2 = {_fmt_log(cov.log_log_N + 2 * math.log(result.eps))}")
    lt = Table(title="share of the Transformer's log N by layer")
    lt.add_column("layer", justify="right")
    lt.add_column("share", justify="right")
    for layer, share in sorted(result.transformer.by_layer().items()):
        lt.add_row({-1: "input (embedding norm)"}.get(layer, str(layer)), f"{share:.3%}")
    con.print(lt)
    from rich import box

    # 80 columns: light borders, the cover as its formula number, names never cut to "layer0.W…"
    mt = Table(title=f"largest {top} contributions (cover: F1 parameter count, F2 (2,1)-norm)",
               box=box.SIMPLE_HEAD, padding=(0, 1), collapse_padding=True)
    for col in ("matrix", "group", "cover", "log10 c_i", "eps_i", "log N_i", "share"):
        mt.add_column(col, justify="left" if col in ("matrix", "group", "cover") else "right",
                      overflow="fold", no_wrap=True)
    for c in sorted(terms, key=lambda c: c.log_cost, reverse=True)[:top]:
        cover = c.cover[c.cover.rfind("(") + 1:].rstrip(")") if "(" in c.cover else c.cover
        mt.add_row(c.name.replace("layer-1.", "input."), c.group, cover, f"{c.log_c / math.log(10):.2f}",
                   _fmt_log(c.log_eps_i)
                   if c.log_eps_i > -700 else f"10^{c.log_eps_i / math.log(10):.1f}", _fmt_log(c.log_cost),
                   f"{c.share:.3%}")
    con.print(mt)
    con.print("[bold]assumptions[/bold]")
    for a in result.assumptions:
        con.print(f"  - {a}")


def _plot(result, curve, n_needed: float, target: float, args) -> bytes:
    import io
    import math

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from ..covering import generalisation_bound

    n0 = result.generalisation[0].n
    eps = np.logspace(-3, 1, 41) * result.eps
    loglog = np.array([curve(float(e), n0) for e in eps]) / math.log(10)
    hi = max(12.0, (math.log10(n_needed) + 1) if math.isfinite(n_needed) else 40.0)
    ns = np.logspace(2, hi, 25)
    gaps = np.array([generalisation_bound(curve, float(n), loss_lipschitz=args.loss_lipschitz,
                                          loss_bound=args.loss_bound, delta=args.delta, n_grid=150).raw_log_gap
                     for n in ns]) / math.log(10)
    reported = np.minimum(gaps, math.log10(args.loss_bound))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    a1.plot(eps, loglog, "o-", ms=3)
    a1.set_xscale("log")
    a1.set_xlabel(r"$\varepsilon$")
    a1.set_ylabel(r"$\log_{10}\,\log \mathcal{N}_\infty(\varepsilon)$")
    a1.set_title(f"covering bound, $n$={n0:.3g}, $T$={result.seq_len}")
    a1.axvline(result.eps, color="grey", ls=":", label=rf"$\varepsilon$={result.eps!r}")
    a1.legend()
    a2.plot(ns, reported, "o-", ms=3, label="certified gap bound (reported: min(formula, b))")
    a2.plot(ns, gaps, ":", color="grey", label="raw formula (vacuous above b)")
    a2.axhline(math.log10(args.loss_bound), color="red", ls="--", label="trivial (loss bound b)")
    a2.axhline(math.log10(target), color="grey", ls=":", label=f"target {target:g}")
    a2.set_xscale("log")
    a2.set_xlabel("$n$ (training sequences)")
    a2.set_ylabel(r"$\log_{10}$ gap bound")
    a2.set_title("generalisation gap vs n")
    a2.legend()
    fig.suptitle(f"{result.model} ({result.arch}, {result.n_layers} layers), family={result.family}")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()

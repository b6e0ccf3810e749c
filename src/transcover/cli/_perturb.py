"""``transcover perturb MODEL_A MODEL_B``: Lemma G.3's certified bound vs the measured output change."""

from __future__ import annotations

import argparse

NAME = "perturb"
HELP = "certified bound (Lemma G.3) on how far two same-architecture models' outputs differ, vs measured"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ._lipschitz import add_model_arguments

    p.add_argument("model_a", help="first model (path or short name)")
    p.add_argument("model_b", help="second model with the same architecture (e.g. a fine-tuned version)")
    add_model_arguments(p)
    p.add_argument("--top", type=int, default=10, help="print the largest TOP terms c_i ||dW_i|| (default 10)")
    p.add_argument("--plot", metavar="PATH", default=None,
                   help="write the bound per layer and the total beside the measured change (.png, .svg or .pdf)")


def run(args: argparse.Namespace) -> int:
    import sys

    from .._errors import InputError
    from .._results import check_certified
    from ..lipschitz import PerturbConfig, perturbation_bound, perturbation_lower
    from ..model import require_same_structure, sequence_length
    from ..train import load_model as load
    from ..report import atomic_write_text, start_progress
    from ..report import perturb_payload, render_perturb
    from ._conventions import load_options, model_inputs
    from ._lipschitz import check_common, config_from_args, small_threads

    check_common(args)
    if args.top < 0:
        raise InputError(f"--top must be >= 0, but got --top={args.top}")
    if args.plot:
        from ..report import check_output_path

        check_output_path(args.plot, "--plot", (".png", ".svg", ".pdf"))
    tracker = start_progress(quiet=args.quiet)
    tracker.step("loading the models")
    a = load(args.model_a, **load_options(args)).to_torch()
    b = load(args.model_b, **load_options(args)).to_torch()
    # Lemma G.3 charges weight distances only: refuse before any search (Note [structural differences])
    require_same_structure(a, b)
    args.seq_len = sequence_length(args.seq_len, PerturbConfig.seq_len, "--seq-len", a, b)  # b may cover fewer (197)
    cfg = config_from_args(args, PerturbConfig)
    outside = _outside_g(a, b)
    small_threads(a.d_model, cfg.seq_len)
    tracker.step("certified bound (Lemma G.3)")
    bound = perturbation_bound(a, b, **cfg.bound_options())
    tracker.step(f"measured lower ({cfg.samples} starts x {cfg.steps} steps)")
    low = perturbation_lower(a, b, radius=cfg.radius, metric=cfg.metric, seq_len=cfg.seq_len,
                             sigma_min=cfg.sigma_min, n_samples=cfg.samples, n_steps=cfg.steps, seed=cfg.seed)
    tracker.close()
    up, lw = bound.total.value, low.value.value
    check_certified(f"output change ||g(A)(X) - g(B)(X)||_{cfg.metric} (Lemma G.3)", up, lw)
    if outside:
        print(f"warning: {outside}", file=sys.stderr)
    render_perturb(bound, cfg.metric, cfg.radius, cfg.samples, cfg.seq_len, lw, a.n_layers, args.top)
    if args.plot:
        from ..report import atomic_write_bytes, figure_bytes

        atomic_write_bytes(args.plot, figure_bytes(bound.plot(lower=lw, n_layers=a.n_layers).figure_, args.plot))
        print(f"wrote {args.plot}", file=sys.stderr)
    if args.json:
        from ..report import envelope_json

        payload = perturb_payload(a, b, bound, low)
        if outside:
            payload["warnings"] = [*payload["warnings"], outside]
        atomic_write_text(args.json, envelope_json(payload, schema="transcover.perturb",
                                                   schema_version="1",
                                                   inputs=model_inputs(args, args.model_a, args.model_b)))
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def _outside_g(a, b) -> str:  # noqa: ANN001
    """What the bound does not see: g takes its inputs after the embedding tables (THEORY F8), so two models that
    differ only there were reported as "0, no change" without a word, and a NaN table passed (stop 38 red team).
    Non-finite tables are refused, as ``analyze`` refuses them; differing ones are named in a warning (empty: none).

    Raises:
        InputError: an embedding table with NaN or infinite entries.
    """
    import torch

    from .._errors import InputError

    differ = []
    for name in sorted(set(a.embeddings) | set(b.embeddings)):
        ta, tb = a.embeddings.get(name), b.embeddings.get(name)
        for who, t in (("A", ta), ("B", tb)):
            if t is not None and not bool(torch.isfinite(torch.as_tensor(t)).all()):
                raise InputError(f"model {who}'s embedding {name!r} has NaN or infinite entries")
        if ta is None or tb is None or tuple(ta.shape) != tuple(tb.shape) or not torch.equal(torch.as_tensor(ta),
                                                                                                 torch.as_tensor(tb)):
            differ.append(name)
    if not differ:
        return ""
    return (f"the models' embedding tables differ ({', '.join(differ)}); the bound is for g, whose inputs are taken "
            "after the embedding, so it does not include that change")

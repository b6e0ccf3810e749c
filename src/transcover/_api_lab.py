"""The lab half of the public API: empirical covering numbers, the approximation lab, advice, training.

Same conventions as :mod:`transcover._api` (the options of the CLI command as keyword arguments,
results whose ``to_dict()`` is the command's JSON payload); kept apart only for the file's length.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["cover", "approx", "advise", "train"]

_COVER_MODES = ("finite", "reference", "uniform", "local")
_RADII = ("B_KQ", "B_V", "B_W1", "B_W2", "B_b1", "B_b2", "B_head")


def _positive(name: str, v) -> None:
    from ._errors import check_positive_int

    check_positive_int(v, name)


def cover(source=None, *, mode: str | None = None, eps: Sequence[float] | float = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5),
          q: float | str = "inf", seed: int = 0, workers: int | None = None,
          key: str | None = None, orders: int = 1, exact: bool = False,
          layers: int = 2, d_model: int = 16, heads: int = 2, d_ff: int = 32, head_hidden: Sequence[int] = (16,),
          n_outputs: int = 1, radius: float = 1.0, radii: Mapping[str, float] | None = None,
          radial: str = "volume", output: str = "head", functions: int | None = None, samples: int | None = None,
          seq_len: int = 4, n: int = 4, restarts: int = 3, pool: int = 64,
          perturb: Mapping[str, float] | None = None, arch: str | None = None, strict: bool = False,
          allow_pickle: bool = False, progress=None):
    """Empirical covering numbers (``transcover cover MODE``; issue 5): eps-nets (certified upper
    ends of the finite set's covering number) beside packings (lower ends).

    Modes:
        ``"finite"`` (the default when ``source`` is given): ``source`` holds the outputs of M
        functions on n samples, ``(M, n, b)`` -- a ``.npy``/``.safetensors`` file, a ``.pt`` with
        ``allow_pickle`` (``key`` picks a tensor), or an array; ``orders`` visiting orders, ``exact``
        internal numbers (M <= 400).
        ``"reference"`` (the default without ``source``): Monte Carlo over the seed's norm-bounded
        reference class (``layers``, ``d_model``, ``heads``, ``d_ff``, ``head_hidden``,
        ``n_outputs``; spectral ``radii`` per name in B_KQ B_V B_W1 B_W2 B_b1 B_b2 B_head, default 1,
        all multiplied by ``radius``; ``functions`` members M (2000), ``samples`` inputs (16) of
        ``seq_len`` tokens).  ``"uniform"``: a lower estimate of the uniform covering number by a
        search over sample sets of size ``n``.  ``"local"``: a model ``source`` plus weight
        perturbations of spectral radius ``perturb`` per role in every layer (default W_1, W_2: 0.05); for W_Q,
        W_K, W_V, W_O the radius bounds each head's block, not the whole matrix.

    Returns:
        :class:`transcover._api_results.CoverResult` (``.to_dict()``, ``.plot()``).

    Example:
        >>> import transcover
        >>> r = transcover.cover(mode="reference", functions=20, samples=4, eps=[0.1, 0.5])   # doctest: +SKIP
        >>> r.monte_carlo.net_sizes                                                       # doctest: +SKIP
    """
    from . import empirical as E
    from ._api_results import CoverResult
    from ._errors import InputError
    from ._results import check_certified

    mode = mode or ("finite" if source is not None else "reference")
    if mode not in _COVER_MODES:
        raise InputError(f"mode must be one of {', '.join(_COVER_MODES)}, but got mode={mode!r}")
    eps = [float(eps)] if isinstance(eps, (int, float)) else [float(e) for e in eps]
    for e in eps:
        E.check_eps(e, "--eps")
    q = E.check_q(q)
    if workers is not None:
        _positive("workers", workers)
    defaults = {"reference": (2000, 16), "uniform": (2000, 16), "local": (500, 8)}.get(mode, (1, 1))
    functions = defaults[0] if functions is None else functions
    samples = defaults[1] if samples is None else samples
    for name, v in (("functions", functions), ("samples", samples), ("seq-len", seq_len), ("n", n),
                    ("restarts", restarts), ("pool", pool), ("orders", orders), ("layers", layers),
                    ("d-model", d_model), ("heads", heads), ("d-ff", d_ff), ("n-outputs", n_outputs)):
        _positive(name, v)
    step = progress.step if progress is not None else (lambda *a, **k: None)
    if mode == "finite":
        in_memory = hasattr(source, "shape") and not isinstance(source, (str, bytes))
        Y = E.as_outputs(source if in_memory else E.load_outputs(source, key=key, allow_pickle=allow_pickle))
        ests, exacts = [], []
        for e in eps:
            est = E.estimate_covering_number(Y, e, q, n_orders=orders, seed=seed, workers=workers)
            # packing <= N_ext <= N_int <= net (the net is a certificate, the packing a witness)
            check_certified(f"covering number at eps={e!r} (packing vs net)", est.net_size, est.packing_size)
            ests.append(est)
            if exact:
                x = E.exact_covering_number(Y, e, q)
                check_certified(f"internal covering number at eps={e!r} (exact vs net)", est.net_size, x)
                check_certified(f"covering number at eps={e!r} (packing vs exact)", x, est.packing_size)
                exacts.append(x)
        label = f"<array {tuple(Y.shape)}>" if in_memory else str(source)
        return CoverResult("finite", tuple(eps), q, label, "", tuple(Y.shape), tuple(ests),
                           tuple(exacts) if exact else None)
    if mode == "local":
        from .train import load_model as load

        spec = load(source, arch=arch, strict=strict).to_torch()
        sample = E.sample_local_class(spec, dict(perturb or {"W_1": 0.05, "W_2": 0.05}), functions, radial=radial,
                                      seed=seed)
        width, warnings = spec.d_model, tuple(spec.warnings)
    else:
        from .model import ReferenceConfig

        try:
            cfg = ReferenceConfig(d_model=d_model, n_heads=heads, n_layers=layers, d_ff=d_ff,
                                  head_hidden=tuple(head_hidden), n_outputs=n_outputs)
        except ValueError as err:
            raise InputError(str(err)) from None
        given = dict(radii or {})
        bad = sorted(set(given) - set(_RADII))
        if bad:
            raise InputError(f"radii names must be among {', '.join(_RADII)}, but got {', '.join(bad)}")
        norm_radii = E.NormRadii(**{k: float(given.get(k, 1.0)) for k in _RADII}).scaled(radius)
        # the reference mode draws its members in seed blocks below: one member here checks the class
        sample = E.sample_reference_class(cfg, norm_radii, functions if mode == "uniform" else 1, radial=radial,
                                          seed=seed, output=output)
        width, warnings = cfg.d_model, ()
    if mode == "uniform":
        if functions > E.MAX_FUNCTIONS:
            raise InputError(f"--functions must be <= {E.MAX_FUNCTIONS} for the uniform search, "
                             f"but got --functions={functions}")

        def sampler(count: int, s: int):
            return E.random_inputs(count, seq_len, width, seed=s)

        step("uniform search over sample sets", total=len(eps))
        searches = []
        for e in eps:
            if progress is not None:
                progress.update(len(searches), len(eps))
            searches.append(E.uniform_covering_search(sample, n, e, q, input_sampler=sampler, restarts=restarts,
                                                      pool_size=pool, seed=seed, workers=workers))
        return CoverResult("uniform", tuple(eps), q, None, sample.description, (functions, n, seq_len),
                           searches=tuple(searches))
    X = E.random_inputs(samples, seq_len, width, seed=seed + 1)
    step(f"Monte Carlo covering ({functions} functions)")
    if mode == "reference":  # members in seed blocks, as `cover reference` on any backend (issue 14)
        from .scale import monte_carlo_reference

        mc = monte_carlo_reference(cfg, norm_radii, X, functions, eps, q, seed=seed, radial=radial, output=output,
                                   threads=workers or 1)
    else:
        mc = E.monte_carlo_covering(sample, X, eps, q, workers=workers)
    fit, fit_error = None, ""
    try:
        fit = E.fit_eps_growth(*E.usable_points(mc))
    except InputError as err:
        fit_error = str(err)
    return CoverResult(mode, tuple(eps), q, None if mode == "reference" else str(source), sample.description,
                       (functions, samples, seq_len), monte_carlo=mc, fit=fit, fit_error=fit_error, warnings=warnings)


_CONSTRUCT = {"seq_len": 16, "sparsity": 2, "smoothness": 1.0, "R": 20.0, "encoding": "equiangular", "delta": 0.2,
              "pos_dim": 64, "grid": 8, "gamma": 1.0, "key_leak": 0.0, "norm": "ball", "search": 1000, "seed": 0}


def approx(what: str = "construct", **options):
    """The approximation lab (``transcover approx WHAT``; seed sections 4, 5, 7.2, THEORY F16, Lemma H.1).

    ``what="construct"`` (default): build the Lemma H.1 Transformer for a Hölder I-sparse target and
    measure its error decomposition; options (CLI defaults) ``seq_len=16``, ``sparsity=2``,
    ``smoothness=1.0``, ``R=20.0``, ``encoding="equiangular"``, ``delta=0.2``, ``pos_dim=64``,
    ``grid=8``, ``gamma=1.0``, ``key_leak=0.0``, ``norm="ball"``, ``search=1000``, ``seed=0``.
    Returns :class:`transcover._api_results.ApproxResult`.

    ``what="encodings"``: ``kind="random"``, ``n=64``, ``dim=64``, ``delta=0.25``,
    ``failure_prob=0.01``, ``seed=0`` -> :class:`transcover._api_results.EncodingsResult`.
    ``what="sweep"``: ``over="R"`` (``Rs``, ``ns``, ``deltas``, ``lemma_worst_case``) or ``over="dm"``
    (``cases``: (beta, s) pairs) -> ``AttentionRate`` / ``MLPRate``.
    ``what="failures"``: ``mode`` in weak | delta | shift -> ``FailureCurve``.

    Example:
        >>> import transcover
        >>> r = transcover.approx(seq_len=8, search=50)                  # doctest: +SKIP
        >>> r.decomposition.total.value <= r.decomposition.bound.total.value   # doctest: +SKIP
        True
        >>> transcover.approx.make_encoding                             # the subpackage is still a package
        <function make_encoding at ...>
    """
    from . import approx as A
    from ._api_results import ApproxResult, EncodingsResult
    from ._errors import InputError

    def take(defaults: dict) -> dict:
        unknown = sorted(set(options) - set(defaults))
        if unknown:
            raise InputError(f"approx {what} has no option {', '.join(unknown)}; it takes {', '.join(defaults)}")
        return {**defaults, **options}

    if what == "construct":
        o = take(_CONSTRUCT)
        if o["search"] <= 0:
            raise InputError(f"--search must be > 0, but got --search={o['search']}")
        for name in ("seq_len", "sparsity"):  # before comparing them: "s=2 > n=0" did not name the bad option
            if isinstance(o[name], bool) or not isinstance(o[name], int) or o[name] <= 0:
                raise InputError(f"--{name.replace('_', '-')} must be a positive integer, but got {o[name]!r}")
        if o["sparsity"] > o["seq_len"]:
            raise InputError(f"sparsity s must be <= seq_len n, but got s={o['sparsity']} > n={o['seq_len']}")
        if o["encoding"] == "equiangular" and not (0.0 <= o["delta"] < 0.5):
            raise InputError(f"--delta must be in [0, 1/2), but got --delta={o['delta']}")
        target = A.sparse_target("holder", o["seq_len"], sparsity=o["sparsity"], beta=o["smoothness"], seed=o["seed"])
        enc = A.make_encoding(o["encoding"], o["seq_len"], dim=o["pos_dim"], delta=o["delta"], seed=o["seed"])
        c = A.build_construction(target, enc, R=o["R"], grid=o["grid"], gamma=o["gamma"], key_leak=o["key_leak"],
                                 norm=o["norm"])
        d = A.decompose_construction(c, n_random=o["search"], seed=o["seed"])
        return ApproxResult(c, target, enc, d, A.construction_capacity(c), o)
    if what == "encodings":
        o = take({"kind": "random", "n": 64, "dim": 64, "delta": 0.25, "failure_prob": 0.01, "seed": 0})
        if not (0.0 <= o["delta"] < 0.5):
            raise InputError(f"--delta must be in [0, 1/2), but got --delta={o['delta']}")
        enc = A.make_encoding(o["kind"], o["n"], dim=o["dim"], delta=o["delta"], seed=o["seed"])
        need = A.random_sign_dimension(max(o["n"], 2), o["delta"], o["failure_prob"]) if o["delta"] > 0 else None
        return EncodingsResult(enc, o["delta"], A.welch_bound(enc.n, enc.dim), A.welch_dimension(o["n"], o["delta"]),
                               need, o["failure_prob"])
    if what == "sweep":
        o = take({"over": "R", "Rs": (2, 4, 6, 8, 10, 14, 18, 24, 30), "ns": (16,), "deltas": (0.0, 0.2, 0.4),
                  "lemma_worst_case": False, "cases": ((0.5, 1), (1, 1), (2, 1), (0.5, 2), (1, 2), (2, 2))})
        if o["over"] == "R":
            return A.attention_rate_sweep([float(r) for r in o["Rs"]], [int(x) for x in o["ns"]],
                                          [float(x) for x in o["deltas"]], lemma_worst_case=o["lemma_worst_case"])
        if o["over"] == "dm":
            return A.mlp_rate_sweep([(float(b), int(s)) for b, s in o["cases"]])
        raise InputError(f"over must be 'R' or 'dm', but got over={o['over']!r}")
    if what == "failures":
        o = take({"mode": "weak"})
        curves = {"weak": (A.weak_dependence_curve, [0.0, 0.01, 0.03, 0.1, 0.3, 1.0]),
                  "delta": (A.delta_to_half_curve, [0.0, 0.1, 0.2, 0.3, 0.4, 0.45, 0.49]),
                  "shift": (A.shift_curve, [0.0, 0.05, 0.1, 0.2, 0.5, 1.0])}
        if o["mode"] not in curves:
            raise InputError(f"mode must be weak, delta or shift, but got mode={o['mode']!r}")
        fn, xs = curves[o["mode"]]
        return fn(xs)
    raise InputError(f"what must be construct, sweep, encodings or failures, but got what={what!r}")


def advise(sparsity: int, smoothness: float, seq_len: int, n_samples: int, *, delta: float = 0.25,
           gamma: float = 1.0, holder_constant: float = 1.0):
    """Design advice for an (s, beta)-sparse target: MLP width, heads, depth, temperature R,
    balancing the approximation and estimation errors (``transcover advise``; seed 5.1).

    Returns:
        :class:`transcover.approx.Advice` (estimates; ``.to_dict()``, ``.plot(ax)``).

    Example:
        >>> import transcover
        >>> a = transcover.advise(2, 1.0, 16, 10_000)
        >>> a.heads
        2
    """
    from .approx import advise as _advise

    return _advise(sparsity, smoothness, seq_len, n_samples, delta=delta, gamma=gamma, holder_constant=holder_constant)


def train(config=None, *, out_dir=None, resume: bool = False, progress: bool = False, stop_after: int | None = None,
          **fields):
    """Train the reference Transformer (+ MLP head) under norm constraints (``transcover train``).

    ``config`` is a :class:`transcover.train.TrainConfig`; without one, ``fields`` build it: the
    TrainConfig fields (``task``, ``n_train``, ``epochs``, ``d_model`` ...) and the constraint's
    (``method``, ``radii`` -- a mapping or the CLI's "GROUP=C,..." text --, ``schedule``,
    ``loose_factor``, ``start_fraction``, ``end_fraction``, ``penalty_weight``).  Files go to
    ``out_dir`` when given (history.jsonl/.csv, checkpoint/).

    Returns:
        :class:`transcover.train.TrainResult` (``.to_dict()`` is ``transcover train --json``'s payload).

    Example:
        >>> import transcover
        >>> r = transcover.train(task="majority", sparsity=3, epochs=2, n_train=200, n_test=100)  # doctest: +SKIP
        >>> r.test_acc                                                                           # doctest: +SKIP
    """
    from dataclasses import fields as dc_fields

    from ._errors import InputError
    from .constrain import ConstraintConfig, parse_radii
    from .train import TrainConfig
    from .train import train as _train

    if config is None:
        names = {f.name for f in dc_fields(ConstraintConfig)}
        cons = {k: fields.pop(k) for k in list(fields) if k in names}
        if isinstance(cons.get("radii"), str):
            cons["radii"] = parse_radii(cons["radii"])
        unknown = sorted(set(fields) - {f.name for f in dc_fields(TrainConfig)})
        if unknown:
            raise InputError(f"train has no option {', '.join(unknown)}")
        config = TrainConfig(**fields, constraint=ConstraintConfig(**cons))
    elif fields:
        raise InputError("give either a TrainConfig or its fields, not both")
    return _train(config, out_dir=out_dir, resume=resume, progress=progress, stop_after=stop_after)

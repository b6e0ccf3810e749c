"""The one-call entry points: point at a model, get typed results.

The public API mirrors the CLI: ``transcover.analyze``, ``.lipschitz``, ``.perturb``, ``.bound``,
``.cover``, ``.approx``, ``.advise``, ``.train`` take the command's options as keyword arguments
(same names, same defaults) and return the result objects whose ``to_dict()`` is the payload of
the command's ``--json``.  ``lipschitz``, ``approx`` and ``train`` are also subpackages; calling
the subpackage calls the function here (Note [callable modules] in ``transcover._entry``).
Every function imports its subpackages on first call, so ``import transcover`` stays fast.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ._entry import register_entry

__all__ = ["analyze", "load", "describe", "lipschitz", "perturb", "bound", "cover", "approx", "advise", "train"]


def _spec(model, *, arch=None, allow_pickle=False, strict=False, roles=None):
    """``model`` as a TransformerSpec (anything :func:`load` reads, or a spec); ``roles`` as :func:`load`."""
    from .model import TransformerSpec

    return model if isinstance(model, TransformerSpec) else load(model, arch=arch, allow_pickle=allow_pickle,
                                                                  strict=strict, roles=roles)


def _config(cls, config, options: dict):
    """``config`` (default: ``cls()``, whose fields hold every default) with ``options`` overriding
    single fields; an unknown option is one clear line naming the fields there are."""
    from dataclasses import fields, replace

    from ._errors import InputError

    names = [f.name for f in fields(cls)]
    unknown = sorted(set(options) - set(names))
    if unknown:
        raise InputError(f"no option {', '.join(unknown)}; the options are {', '.join(names)}")
    if config is not None and not isinstance(config, cls):
        raise InputError(f"config must be a {cls.__name__}, but got {type(config).__name__}")
    return replace(config if config is not None else cls(), **options)


def _shrunk(cfg, config, options: dict, *specs):
    """``cfg`` with its ``seq_len`` resolved as the CLI resolves it (``model.sequence_length``, red team 197): a T
    given in ``options`` or ``config`` checked against what ``specs`` cover, the default shrunk to it."""
    from dataclasses import replace

    from .model import sequence_length

    given = cfg.seq_len if config is not None or "seq_len" in options else None
    return replace(cfg, seq_len=sequence_length(given, cfg.seq_len, "seq_len", *specs))


def _small_threads(d_model: int, seq_len: int):
    """One intra-op torch thread for small forwards, as the CLI runs them (Note [small problems] in
    ``transcover._threads``); the caller's setting is restored afterwards."""
    from contextlib import nullcontext

    import torch  # noqa: F401  (limit_threads sets torch's pool only once torch is imported)

    from ._threads import limit_threads, small_problem

    return limit_threads(1, blas=False) if small_problem(d_model, seq_len) else nullcontext()


def analyze(
    model=None,
    *,
    arch: str | None = None,
    allow_pickle: bool = False,
    strict: bool = False,
    roles=None,
    fast: bool = False,
    rtol: float = 1e-3,
    embeddings: bool = True,
    progress: Callable[[int, int], None] | None = None,
    per_matrix: bool = True,
):
    """Per-layer, per-head norms of a Transformer as certified intervals (issue 2, seed 2.1).

    Args:
        model: ``None`` (the bundled all-MiniLM-L6-v2), a short model name, a Hugging Face model
            directory, a ``.safetensors`` file, an ``nn.Module``, or a ``TransformerSpec``.
        arch: the architecture of a bare ``.safetensors`` file ("bert", "gpt2", ...).
        allow_pickle: permit pickled checkpoints (loaded with ``torch.load(weights_only=True)``).
        strict: refuse (InputError) a checkpoint with tensors inside a layer that the architecture
            does not define; by default each is a :class:`~transcover.TranscoverWarning`.
        roles: a mapping file (path or dict) naming the tensors of a layout no adapter knows (:func:`load`).
        fast: Lanczos estimates instead of certified intervals.
        rtol: target relative gap of each interval.
        per_matrix: for an architecture outside every adapter, return per-matrix norms (else refuse).

    Returns:
        :class:`transcover.norms.AnalysisResult` (``.to_dict()``, ``.to_dataframe()``); for an
        architecture outside every adapter (and no ``arch``), a
        :class:`transcover.norms._per_matrix.PerMatrixResult`: certified norms of each 2-D weight on
        its own, labelled as outside the decomposition.

    Example:
        >>> import transcover
        >>> result = transcover.analyze()            # doctest: +SKIP
        >>> result.layers[0].B_KQ.upper              # doctest: +SKIP
    """
    from .model import OutsideDecompositionError
    from .norms import analyze_spec

    try:
        spec = _spec(model, arch=arch, allow_pickle=allow_pickle, strict=strict, roles=roles)
    except OutsideDecompositionError as err:
        # an architecture no adapter reads: every 2-D weight on its own (issue 15, item 3)
        if model is None or arch is not None or roles is not None or not per_matrix:
            raise
        from .norms import per_matrix_norms

        note = f"{err}; per-matrix norms only" + ("; --fast has no per-matrix route, so these are certified" if fast else "")
        return per_matrix_norms(model, rtol=rtol, note=note)
    return analyze_spec(spec, fast=fast, rtol=rtol, embeddings=embeddings, progress=progress)


def load(source=None, *, arch: str | None = None, allow_pickle: bool = False, strict: bool = False, roles=None):
    """A model's decomposition: :func:`transcover.model.load` (see there for every argument).

    ``strict=True`` refuses a checkpoint holding tensors inside a layer that the architecture does
    not define (they could change the function); by default each is warned about.  ``roles``: a
    mapping file (path or dict) naming the tensors of a layout no adapter knows (docs/architectures.md).
    A ``transcover train`` checkpoint folder, or the run folder (``--out``) holding one, gives the
    trained model exactly as ``train`` exports it (caps certified; :func:`transcover.train.checkpoint_spec`).
    """
    from .train import load_model

    return load_model(source, arch=arch, allow_pickle=allow_pickle, strict=strict, roles=roles)


def describe(model=None, *, arch: str | None = None, allow_pickle: bool = False, strict: bool = False, roles=None):
    """Dry run of :func:`analyze`: which checkpoint tensor plays which role, nothing measured.

    Returns:
        :class:`transcover.report.Description` (``print()`` it, or ``.to_dataframe()``).
    """
    from .report import describe_spec

    return describe_spec(_spec(model, arch=arch, allow_pickle=allow_pickle, strict=strict, roles=roles))


def lipschitz(model=None, config=None, *, arch: str | None = None, allow_pickle: bool = False, strict: bool = False,
              roles=None, lower: bool = True, data=None, rho: float | Sequence[float] = 1e-3,
              rho_relative: bool = False, max_len: int = 32, limit: int | None = None,
              whole_network: str | None = None, **options):
    """Certified upper Lipschitz constants per stage, layer and network, beside empirical lower ones
    (``transcover lipschitz``; THEORY F6, F7, F8, F13, F14); with ``data``, certified local constants
    on balls of radius ``rho`` around real inputs (``transcover lipschitz --data``; THEORY F17).

    Args:
        model, arch, allow_pickle, strict, roles: as in :func:`analyze`.
        config: a :class:`transcover.lipschitz.LipschitzConfig` (the CLI's choices and their defaults:
            ``radius`` R of the input tokens, ``metric`` "2,inf" or "fro", ``seq_len``, ``c_sm``,
            ``sigma_min``, and the lower search's ``samples``, ``steps``, ``seed``); ``options``
            override single fields (``transcover.lipschitz(radius=4.1)``).
        lower: ``False`` skips the search (certified bounds only).
        data: token ids (.npy int (n, T)), embeddings (.npy float (n, T, d)), raw inputs of a model with
            an input embedding (.npy float (n, T, d_in)), or any of these arrays in memory (a numpy array, a torch
            tensor or nested lists, read exactly as the .npy), texts (.txt, the model's tokenizer),
            ``"sklearn-descr"`` or ``"task"`` (a ``transcover train`` run's held-out inputs); ``rho`` one
            radius or a non-empty sequence of them (per token, l2; factors of each layer's median token norm with
            ``rho_relative``), ``max_len`` truncates texts, ``limit`` keeps the first sequences;
            ``whole_network`` ("auto", "product" or "stack") adds the whole network's row per rho.

    Returns:
        :class:`transcover._api_results.LipschitzResult` (``.bounds``, ``.lower``, ``.to_dict()``,
        ``.plot()``), or with ``data`` a :class:`transcover._api_results.LocalLipschitzResult`.

    Example:
        >>> import transcover
        >>> r = transcover.lipschitz(samples=1, steps=2)     # doctest: +SKIP
        >>> r.upper.value, r.upper.kind.value                # doctest: +SKIP
        >>> transcover.lipschitz.lipschitz_bounds            # the subpackage is still a package
        <function lipschitz_bounds at ...>
    """
    import torch

    from ._api_results import LipschitzResult
    from .lipschitz import LipschitzConfig, lipschitz_bounds, lipschitz_lower

    cfg = _config(LipschitzConfig, config, options)
    if data is not None:
        return _lipschitz_local(model, data, arch=arch, allow_pickle=allow_pickle, strict=strict, roles=roles,
                                rho=rho, rho_relative=rho_relative, max_len=max_len, limit=limit, lower=lower,
                                steps=cfg.steps, whole=whole_network)
    spec = _spec(model, arch=arch, allow_pickle=allow_pickle, strict=strict, roles=roles).to_torch()
    cfg = _shrunk(cfg, config, options, spec)
    l2 = any(layer.attention.kind == "l2" for layer in spec.layers)
    with _small_threads(spec.d_model, cfg.seq_len):
        bounds = lipschitz_bounds(spec, radius=cfg.radius, c_sm=cfg.c_sm, metric=cfg.metric,
                                  seq_len=cfg.seq_len if cfg.metric == "fro" or l2 else None, sigma_min=cfg.sigma_min)
        found = {}
        if lower:
            torch.manual_seed(cfg.seed)
            found = lipschitz_lower(spec, bounds, seq_len=cfg.seq_len, n_samples=cfg.samples, n_steps=cfg.steps,
                                    seed=cfg.seed)
    return LipschitzResult(spec.name, bounds, found, tuple(spec.warnings))


def _lipschitz_local(model, data, *, arch, allow_pickle, strict, roles, rho, rho_relative, max_len, limit, lower, steps,
                     whole=None):
    """The ``data`` route of :func:`lipschitz`: every check (rho, data, tokenizer) before any work."""
    import torch

    from ._api_results import LocalLipschitzResult
    from ._errors import InputError, check_positive_int
    from .lipschitz import local_table
    from .train import load_data

    rhos = _radii(rho)
    for flag, v in (("max_len", max_len), ("limit", limit)):
        if v is not None:
            check_positive_int(v, flag)  # limit=1.5 failed deep in a slice (red team 216)
    if whole not in (None, "auto", "product", "stack"):
        raise InputError(f"whole_network must be 'auto', 'product' or 'stack', but got whole_network={whole!r}")
    spec = _spec(model, arch=arch, allow_pickle=allow_pickle, strict=strict, roles=roles).to_torch(torch.float64)
    seqs = load_data(model, spec, data, max_len=max_len, limit=limit)
    rows = local_table(spec, seqs, rhos, lower=lower, relative=rho_relative, lower_iter=max(steps // 2, 5),
                       whole=whole)
    return LocalLipschitzResult(spec.name, len(seqs), tuple(rhos), bool(rho_relative), tuple(rows))


def _radii(rho) -> list[float]:  # noqa: ANN001  (a number or a sequence of numbers)
    """``rho`` as a non-empty list of finite radii > 0: one real number (a numpy scalar or 0-d tensor too) or a
    non-empty sequence of them; a string, a bool or an empty sequence is refused in one line (red team 216: a
    numpy scalar was "not iterable", "0.001" was read character by character, ``[]`` gave an empty table)."""
    from ._errors import InputError, check_number

    if not isinstance(rho, (str, bytes)) and (getattr(rho, "ndim", None) == 0 or not hasattr(rho, "__iter__")):
        return [check_number(rho, "rho", low=0.0, strict=True)]
    rhos = [] if isinstance(rho, (str, bytes)) else list(rho)
    if not rhos:
        raise InputError(f"rho must be a number > 0 or a non-empty sequence of them, but got rho={rho!r}")
    return [check_number(r, "rho", low=0.0, strict=True) for r in rhos]


def perturb(model_a, model_b, config=None, *, arch: str | None = None, allow_pickle: bool = False,
            strict: bool = False, roles=None, **options):
    """How far two same-architecture models' outputs can differ: Lemma G.3's certified bound
    ``sum_i c_i ||W_i^A - W_i^B||`` beside the change a search measures (``transcover perturb``).

    ``config``: a :class:`transcover.lipschitz.PerturbConfig` (the fields of :func:`lipschitz`'s
    config); ``options`` override single fields; ``arch``, ``allow_pickle``, ``strict`` and ``roles``
    read both models as :func:`analyze` does.  Models that differ in structure (not only in
    weights) are refused with :class:`~transcover.InputError`.

    Returns:
        :class:`transcover._api_results.PerturbResult` (``.bound``, ``.lower``, ``.ratio``, ``.to_dict()``).

    Example:
        >>> import transcover
        >>> r = transcover.perturb("gpt2-a", "gpt2-b", samples=1, steps=2)   # doctest: +SKIP
        >>> r.bound.total.value >= r.lower.value.value                     # doctest: +SKIP
        True
    """
    from ._api_results import PerturbResult
    from ._results import check_certified
    from .lipschitz import PerturbConfig, perturbation_bound, perturbation_lower
    from .model import require_same_structure

    cfg = _config(PerturbConfig, config, options)
    a = _spec(model_a, arch=arch, allow_pickle=allow_pickle, strict=strict, roles=roles).to_torch()
    b = _spec(model_b, arch=arch, allow_pickle=allow_pickle, strict=strict, roles=roles).to_torch()
    cfg = _shrunk(cfg, config, options, a, b)
    require_same_structure(a, b)  # Lemma G.3 charges weight distances only
    with _small_threads(a.d_model, cfg.seq_len):
        bound_ = perturbation_bound(a, b, **cfg.bound_options())
        low = perturbation_lower(a, b, radius=cfg.radius, metric=cfg.metric, seq_len=cfg.seq_len,
                                 sigma_min=cfg.sigma_min, n_samples=cfg.samples, n_steps=cfg.steps, seed=cfg.seed)
    check_certified(f"output change ||g(A)(X) - g(B)(X)||_{cfg.metric} (Lemma G.3)", bound_.total.value,
                    low.value.value)
    return PerturbResult(a.name, b.name, bound_, low, a.n_layers, tuple(a.warnings) + tuple(b.warnings))


def bound(model=None, config=None, *, arch: str | None = None, allow_pickle: bool = False, strict: bool = False,
          roles=None, reference=None, **options):
    """Certified log covering number at ``eps`` and generalisation bounds at ``n_samples``
    (``transcover bound``; THEORY F9-F12, Lemma G.1).

    ``config``: a :class:`transcover.covering.BoundConfig` (``eps``, ``n_samples``, ``seq_len``,
    ``radius``, ``c_sm``, ``family``, ``sigma_min``, ``loss_lipschitz``, ``loss_bound``, ``delta``,
    with the CLI's defaults); ``options`` override single fields.  ``model`` may also be a
    ``transcover train`` checkpoint folder: ``n_samples`` and ``seq_len`` then default to its
    task's.  ``reference``: a model (path or spec) whose weights the distances are measured from
    instead of 0.  ``arch``, ``allow_pickle``, ``strict`` and ``roles`` read ``model`` and
    ``reference`` as :func:`analyze` does.

    Returns:
        :class:`transcover.covering.ModelBound` (``.log_log_N``, ``.generalisation``, ``.to_dict()``, ``.plot()``).

    Example:
        >>> import transcover
        >>> b = transcover.bound(eps=0.1, n_samples=[1e6])    # doctest: +SKIP
        >>> b.generalisation[0].kind.value                    # doctest: +SKIP
        'certified upper bound'
    """
    from .covering import BoundConfig, model_bound
    from .model import TransformerSpec
    from .train import load_model_task

    if isinstance(model, TransformerSpec):
        spec, n_train = model, None
    else:
        spec, n_train, task_len = load_model_task(model, arch=arch, allow_pickle=allow_pickle, strict=strict,
                                                  roles=roles)
    if n_train is not None:  # a training run: its own n and T unless given
        given = set(options) | ({"n_samples", "seq_len"} if config is not None else set())
        options = {**({} if "n_samples" in given else {"n_samples": (float(n_train),)}),
                   **({} if "seq_len" in given else {"seq_len": task_len}), **options}
    cfg = _shrunk(_config(BoundConfig, config, options), config, options, spec)
    ref = None if reference is None else _spec(reference, arch=arch, allow_pickle=allow_pickle, strict=strict,
                                               roles=roles).to_torch()
    return model_bound(spec.to_torch(), cfg, reference=ref)


from ._api_lab import advise, approx, cover, train  # noqa: E402  (the lab half: same conventions)

for _name in ("analyze", "lipschitz", "perturb", "bound", "cover", "approx", "advise", "train"):
    register_entry(_name, globals()[_name])
del _name

"""The one-call entry points: point at a model, get typed results."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["analyze", "load", "describe"]


def analyze(
    model=None,
    *,
    arch: str | None = None,
    allow_pickle: bool = False,
    strict: bool = False,
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
    from .model import TransformerSpec, load
    from .model._adapters._refused import OutsideDecompositionError
    from .norms import analyze_spec

    try:
        spec = model if isinstance(model, TransformerSpec) else load(model, arch=arch, allow_pickle=allow_pickle,
                                                                     strict=strict)
    except OutsideDecompositionError as err:
        # an architecture no adapter reads: every 2-D weight on its own (issue 15, item 3)
        if model is None or arch is not None or not per_matrix:
            raise
        from .norms._per_matrix import per_matrix_norms

        note = f"{err}; per-matrix norms only" + ("; --fast has no per-matrix route, so these are certified" if fast else "")
        return per_matrix_norms(model, rtol=rtol, note=note)
    return analyze_spec(spec, fast=fast, rtol=rtol, embeddings=embeddings, progress=progress)


def load(source=None, *, arch: str | None = None, allow_pickle: bool = False, strict: bool = False, roles=None):
    """A model's decomposition: :func:`transcover.model.load` (see there for every argument).

    ``strict=True`` refuses a checkpoint holding tensors inside a layer that the architecture does
    not define (they could change the function); by default each is warned about.  ``roles``: a
    mapping file (path or dict) naming the tensors of a layout no adapter knows (docs/architectures.md).
    """
    from .model import load as _load

    return _load(source, arch=arch, allow_pickle=allow_pickle, strict=strict, roles=roles)


def describe(model=None, *, arch: str | None = None, allow_pickle: bool = False, strict: bool = False):
    """Dry run of :func:`analyze`: which checkpoint tensor plays which role, nothing measured.

    Returns:
        :class:`transcover.report.Description` (``print()`` it, or ``.to_dataframe()``).
    """
    from .model import TransformerSpec, load
    from .report._describe import describe_spec

    spec = model if isinstance(model, TransformerSpec) else load(model, arch=arch, allow_pickle=allow_pickle,
                                                                 strict=strict)
    return describe_spec(spec)

"""The result types of ``transcover analyze`` (:class:`AnalysisResult` and its parts), kept apart
from the measurement (``_analyze``) so that each file reads as one thing; ``to_dict()`` of
:class:`AnalysisResult` is the versioned JSON schema."""

from __future__ import annotations

from dataclasses import dataclass, field

from .._results import Interval, Kind, as_dict
from ..model import NormSpec
from ._model import ModelNorms

__all__ = ["MatrixNorms", "HeadNorms", "NormParams", "LayerNorms", "EmbeddingNorms", "AnalysisResult",
           "SCHEMA_VERSION"]

SCHEMA_VERSION = "1.0"


@dataclass(frozen=True)
class MatrixNorms:
    """Spectral, Frobenius and (2,1) norms of one matrix (row-vector convention ``x @ W``)."""

    role: str
    shape: tuple[int, int]
    spectral: Interval
    frobenius: Interval
    l21: Interval
    tensor: str = ""  # the checkpoint tensor it comes from, if known

    def to_dict(self) -> dict[str, object]:
        return as_dict(self)


@dataclass(frozen=True)
class HeadNorms:
    head: int
    B_KQ: Interval  # ||scale W_Q^h W_K^hT||_2 (sup over relative positions with RoPE)
    B_V: Interval  # ||W_V^h W_O^h||_2
    W_V: Interval  # ||W_V^h||_2
    B_KQ_bias: Interval | None = None  # ||scale [W_Q^h; b_Q^h] W_K^hT||_2 on x~ = [x, 1] (Note [attention biases])

    def to_dict(self) -> dict[str, object]:
        return as_dict(self, exclude=("B_KQ_bias",) if self.B_KQ_bias is None else ())


@dataclass(frozen=True)
class NormParams:
    """A normalisation layer's kind and the parameters the Lipschitz bounds need (F14)."""

    kind: str
    gamma_max_abs: float
    beta_norm: float
    eps: float

    @classmethod
    def of(cls, norm: NormSpec | None) -> "NormParams | None":
        if norm is None:
            return None
        return cls(norm.kind.value, norm.gamma_max_abs, norm.beta_norm, norm.eps)

    def to_dict(self) -> dict[str, object]:
        return as_dict(self)


@dataclass(frozen=True)
class LayerNorms:
    index: int
    B_KQ: Interval
    B_V: Interval
    B_W1: Interval
    B_W2: Interval
    B_b1: Interval
    B_b2: Interval
    W_O: Interval
    B_Wgate: Interval | None
    B_b_attn: Interval  # ||b_O + sum_h b_V^h W_O^h||_2, the attention block's effective output bias
    heads: tuple[HeadNorms, ...]
    matrices: dict[str, MatrixNorms]
    norm_attn: NormParams
    norm_ffn: NormParams
    placement: str
    rope: bool = False

    def to_dict(self, *, matrices: bool = True) -> dict[str, object]:
        return as_dict(self, exclude=(() if self.B_Wgate is not None else ("B_Wgate",))
                       + (() if matrices else ("matrices",)))


HEAD_PREFIX = "mlp_head."  # an MLP head's matrix j is named HEAD_PREFIX + str(j)


@dataclass(frozen=True)
class EmbeddingNorms:
    """A matrix outside the seed's decomposition (embedding, un-embedding, pooler, head)."""

    name: str
    norms: MatrixNorms
    max_row_norm: float  # largest ||row||_2, a certified upper bound: for token embeddings, the radius of the input tokens

    def to_dict(self) -> dict[str, object]:
        return as_dict(self, exclude=("norms",), **self.norms.to_dict())

    @property
    def where(self) -> str:
        """"head" for an MLP head's matrix (``analyze_spec`` names them ``mlp_head.j``), else "embeddings": the
        tables' and ``to_dataframe()``'s ``where`` (red team 215: the head was filed under "embeddings")."""
        return "head" if self.name.startswith(HEAD_PREFIX) else "embeddings"


@dataclass(frozen=True)
class AnalysisResult:
    """The output of ``transcover analyze``; ``to_dict()`` is the versioned JSON schema."""

    model: str
    arch: str
    d_model: int
    n_heads: int
    d_head: int
    mode: str  # "certified" or "fast"
    rtol: float
    layers: tuple[LayerNorms, ...]
    embeddings: tuple[EmbeddingNorms, ...] = ()
    final_norm: NormParams | None = None
    seconds: float = 0.0
    notes: tuple[str, ...] = field(default_factory=tuple)
    warnings: tuple[str, ...] = ()  # the loader's (spec.warnings), e.g. unexpected tensors in a layer
    # the certified measurement this result is a view of (None with --fast); not part of the JSON schema
    norms: ModelNorms | None = field(default=None, repr=False, compare=False)

    @property
    def kind(self) -> Kind:
        return Kind.CERTIFIED_INTERVAL if self.mode == "certified" else Kind.ESTIMATE

    def summary(self) -> dict[str, Interval]:
        """Enclosures of the maxima over layers (max of lowers, max of uppers)."""
        out = {}
        for key in ("B_KQ", "B_V", "B_W1", "B_W2", "B_b1", "B_b2"):
            ivs = [getattr(layer, key) for layer in self.layers]
            out[key] = Interval(max(i.lower for i in ivs), max(i.upper for i in ivs), ivs[0].kind, "max over layers")
        return out

    def to_dict(self, *, matrices: bool = True) -> dict[str, object]:
        return {
            "schema": "transcover.analyze",
            "schema_version": SCHEMA_VERSION,
            "model": self.model,
            "arch": self.arch,
            "d_model": self.d_model,
            "n_layers": len(self.layers),
            "n_heads": self.n_heads,
            "d_head": self.d_head,
            "mode": self.mode,
            "kind": self.kind.value,
            "rtol": self.rtol,
            "seconds": self.seconds,
            "summary": {k: v.to_dict() for k, v in self.summary().items()},
            "layers": [layer.to_dict(matrices=matrices) for layer in self.layers],
            "embeddings": [e.to_dict() for e in self.embeddings],
            "final_norm": None if self.final_norm is None else self.final_norm.to_dict(),
            "notes": list(self.notes),
            "warnings": list(self.warnings),
        }

    def to_dataframe(self):
        """One row per matrix with every norm (spectral, Frobenius, (2,1): lower and upper) and its kind."""
        from .._views import render

        return render("analysis.matrices_dataframe", self)

    def layers_dataframe(self):
        """One row per layer: every per-layer quantity (B_Wgate, B_b_attn included), lower and upper."""
        from .._views import render

        return render("analysis.layers_dataframe", self)

    get_summary = layers_dataframe  # the name WeightWatcher users look for

    def plot(self, ax=None):
        """Per-layer x per-head heatmaps of B_KQ and B_V: :class:`transcover.report.AnalysisDisplay`."""
        from .._views import render

        return render("analysis.plot", self, ax=ax)

    def __repr__(self) -> str:
        from .._views import render

        return render("analysis.repr", self)

    def _repr_html_(self) -> str:
        from .._views import render

        return render("analysis.repr_html", self)

    def heads_dataframe(self):
        """One row per (layer, head): B_KQ, B_V and ||W_V^h|| intervals (pandas), with what they are (``kind``: a
        certified interval, or an estimate under ``--fast``; the column was missing, stop 38)."""
        import pandas as pd

        rows = []
        for layer in self.layers:
            for h in layer.heads:
                kinds = {str(getattr(getattr(iv, "kind", None), "value", getattr(iv, "kind", "")))
                         for iv in (h.B_KQ, h.B_V, h.W_V)}
                rows.append({"layer": layer.index, "head": h.head,
                             "B_KQ_lower": h.B_KQ.lower, "B_KQ_upper": h.B_KQ.upper,
                             "B_V_lower": h.B_V.lower, "B_V_upper": h.B_V.upper,
                             "W_V_lower": h.W_V.lower, "W_V_upper": h.W_V.upper, "kind": " / ".join(sorted(kinds))})
        return pd.DataFrame(rows).set_index(["layer", "head"])

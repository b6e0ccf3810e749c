"""What the top-level API functions return when no single lower-package result says it all.

``transcover.lipschitz`` returns the certified bounds *and* the lower estimates measured on their
domains; ``transcover.perturb`` the Lemma G.3 bound and the measured change; ``transcover.cover``
one of four estimates.  Each holds the lower packages' own result objects (so every number keeps
its kind) and gives the same ``to_dict()`` that the CLI writes as the payload of its JSON.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["LipschitzResult", "LocalLipschitzResult", "PerturbResult", "CoverResult", "ApproxResult", "EncodingsResult"]


@dataclass(frozen=True)
class LipschitzResult:
    """Certified upper Lipschitz constants per stage, layer and network, with the empirical lower
    estimates keyed ``(layer, name)`` (``(-2, "network")`` for the whole network)."""

    model: str
    bounds: object  # transcover.lipschitz.NetworkLipschitz
    lower: dict = field(default_factory=dict)
    warnings: tuple[str, ...] = ()

    @property
    def upper(self):
        """The network's certified upper bound (a :class:`~transcover.Quantity`)."""
        return self.bounds.upper

    def to_dict(self) -> dict[str, object]:
        return {"model": self.model, "warnings": list(self.warnings), "bounds": self.bounds.to_dict(),
                "lower": [{"layer": k[0], "name": k[1], **v.to_dict()} for k, v in self.lower.items()]}

    def plot(self, ax=None):
        """Certified upper beside empirical lower per stage, layer and network (``LipschitzDisplay``)."""
        return self.bounds.plot(ax=ax, lower=self.lower)


@dataclass(frozen=True)
class LocalLipschitzResult:
    """Certified local Lipschitz constants at real inputs (THEORY F17): one row per rho, layer and
    component, the max over the sequences, beside the global and domain bounds and the Jacobian
    norm at the data point (an empirical lower bound)."""

    model: str
    n_sequences: int
    rho: tuple[float, ...]
    rho_relative: bool
    rows: tuple = ()

    def to_dict(self) -> dict[str, object]:
        return {"model": self.model, "n_sequences": self.n_sequences, "rho": list(self.rho),
                "rho_relative": self.rho_relative, "rows": [r.to_dict() for r in self.rows]}


@dataclass(frozen=True)
class PerturbResult:
    """Lemma G.3's certified bound on ``sup_X ||g_A(X) - g_B(X)||`` and the change measured by a search."""

    model_a: str
    model_b: str
    bound: object  # transcover.lipschitz.PerturbationBound
    lower: object  # transcover.lipschitz.LowerEstimate
    n_layers: int
    warnings: tuple[str, ...] = ()

    @property
    def ratio(self) -> float | None:
        lw = self.lower.value.value
        return self.bound.total.value / lw if lw > 0 else None

    def to_dict(self) -> dict[str, object]:
        return {"model_a": self.model_a, "model_b": self.model_b, "warnings": list(self.warnings),
                "bound": self.bound.to_dict(), "lower": self.lower.to_dict(), "ratio": self.ratio}

    def plot(self, ax=None):
        return self.bound.plot(ax=ax, lower=self.lower.value.value, n_layers=self.n_layers)


@dataclass(frozen=True)
class CoverResult:
    """An empirical covering-number estimate of one of the CLI's four kinds (``mode``).

    ``finite``: ``estimates`` (one :class:`~transcover.empirical.CoveringEstimate` per eps) and
    ``exact`` (internal covering numbers, or ``None``); ``reference``/``local``: ``monte_carlo``
    (a :class:`~transcover.empirical.MonteCarloCovering`), ``fit`` (its eps growth fit or ``None``,
    with ``fit_error`` saying why); ``uniform``: ``searches`` (one
    :class:`~transcover.empirical.UniformSearchResult` per eps).
    """

    mode: str
    eps: tuple[float, ...]
    q: float
    source: str | None = None  # the outputs file (finite) or the model (local)
    description: str = ""
    shape: tuple[int, ...] = ()  # finite: (M, n, b); reference/local/uniform: (M, n, T)
    estimates: tuple = ()
    exact: tuple | None = None
    monte_carlo: object = None
    fit: object = None
    fit_error: str = ""
    searches: tuple = ()
    warnings: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, object]:
        if self.mode == "finite":
            rows = []
            for i, est in enumerate(self.estimates):
                d = est.to_dict()
                if self.exact is not None:
                    d["exact_internal"] = self.exact[i]
                rows.append(d)
            return {"mode": "finite", "file": str(self.source), "rows": rows}
        if self.mode == "uniform":
            return {"mode": "uniform", "rows": [r.to_dict() for r in self.searches]}
        out: dict[str, object] = {"mode": self.mode, **self.monte_carlo.to_dict()}
        if self.mode == "local":
            out["warnings"] = list(self.warnings)
        if self.fit is not None:
            out["eps_growth_fit"] = self.fit.to_dict()
        return out

    def plot(self, ax=None):
        """log N against eps: certified net sizes beside packing witnesses (``EmpiricalCoveringDisplay``)."""
        from .report import EmpiricalCoveringDisplay

        return EmpiricalCoveringDisplay.from_result(self).plot(ax=ax)


@dataclass(frozen=True)
class ApproxResult:
    """``transcover.approx`` (``what="construct"``): the Lemma H.1 construction with its measured
    error decomposition and capacity, and the parameters that made it (``config``)."""

    construction: object
    target: object
    encoding: object
    decomposition: object
    capacity: object
    config: dict

    def to_dict(self) -> dict[str, object]:
        return {"config": dict(self.config) | {"indices": list(self.target.indices), "delta_exact": self.encoding.delta},
                "decomposition": self.decomposition.to_dict(), "capacity": self.capacity.to_dict()}


@dataclass(frozen=True)
class EncodingsResult:
    """``transcover.approx(what="encodings")``: a positional encoding's exact coherence Δ beside the
    Welch floor and the dimensions a target Δ needs (any design; random signs, THEORY F16b)."""

    encoding: object
    target_delta: float
    welch_bound: float
    welch_dimension: int
    random_sign_dimension: int | None
    failure_prob: float

    def to_dict(self) -> dict[str, object]:
        enc = self.encoding
        return {"family": enc.family, "n": enc.n, "dim": enc.dim, "delta": enc.delta,
                "delta_fraction": None if enc.delta_fraction is None else str(enc.delta_fraction),
                "welch_bound": self.welch_bound, "target_delta": self.target_delta,
                "random_sign_dimension": self.random_sign_dimension, "welch_dimension": self.welch_dimension}

"""Lemma G.3: how far the network's output moves when its weights move (THEORY F6, F7, F8).

Public interface for the covering-number work (issue 4):

    coeffs = perturbation_coefficients(spec, radius=1.0, c_sm=1.0, metric="2,inf")
    # for every pair of parameter sets W, W~ in the class of ``spec`` (see below) and every input X
    # with token norms <= radius:
    #     ||g_L(W)(X) - g_L(W~)(X)|| <= sum_i coeffs.entries[i].coefficient * ||W_i - W~_i||_{entries[i].norm}

Note [the class of a spec]: the coefficients are computed from the spec's per-matrix norms
(``||W_KQ^h||_2``, ``||W_OV^h||_2``, ``||W_V^h||_2``, ``||W_O||_2``, ``||W_1||_2``, ``||W_2||_2``,
bias l2 norms, ``max|gamma|``, ``||beta||_2``).  They hold for *every* pair (W, W~) of parameter sets
of the same architecture whose corresponding norms are all <= the spec's -- the class the
covering argument ranges over (seed 2.1: ``||W_KQ|| <= B_KQ``, ...).  To bound a specific pair,
pass the second one as ``other=``: the class of the elementwise maximum contains both
(:func:`perturbation_bound` does this).

Roles (one entry per matrix the bound charges; ``layer`` is the layer index, -1 for the input norm
and ``n_layers`` for the final norm):

=============  =========================================================  ==========
role           matrix                                                      norm
=============  =========================================================  ==========
``W_KQ.h``     ``scale W_Q^h W_K^hT`` (the score matrix of head h)          spectral
``b_KQ.h``     ``scale b_Q^h W_K^hT`` (query bias, if any)                  l2
``W_OV.h``     ``W_V^h W_O^h`` (the value-to-output map of head h)          spectral
``b_out``      ``b_O + sum_h b_V^h W_O^h`` (attention output bias, if any)  l2
``W_1``, ``W_2``, ``W_gate``   FFN matrices                                spectral
``b_1``, ``b_2``, ``b_gate``   FFN biases                                  l2
``norm_attn.gamma`` / ``.beta`` (also ``norm_ffn``, ``input_norm``, ``final_norm``)   linf / l2
``norm_attn.eps``  two models with different variance floors: charged        eps (``eps_change_bound``)
``W_Q.h``, ``W_K.h``  split scores only (RoPE with q/k biases, q/k norm):      spectral
                      replace ``W_KQ.h``/``b_KQ.h`` (Note [split G.3])
``b_Q.h``, ``b_K.h``  query/key biases of the split scores                     l2
``q_norm.gamma``, ``k_norm.gamma``  the query/key norms' scales (per layer)     linf
=============  =========================================================  ==========

The attention is charged per head through ``W_KQ^h`` and ``W_OV^h`` because the block depends on
the weights only through them (Note [attention biases] in ``model._spec``); this is the
parametrisation in which the seed states its constraints (B_KQ, B_V).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from .._errors import InputError, UnsupportedArchitectureError
from .._results import Kind, Quantity, as_dict
from ..model import TransformerSpec
from ..norms import ModelNorms, measure_model
from ._compose import _assumptions, build_chain
from ._normalisation import eps_change_bound
from ._weights import ROUNDING_PAD, ClassBounds, class_max, spec_norms

__all__ = [
    "CoefficientEntry",
    "PerturbationCoefficients",
    "PerturbationBound",
    "perturbation_coefficients",
    "perturbation_deltas",
    "perturbation_bound",
    "LogCoefficient",
    "LogCoefficients",
    "log_perturbation_coefficients",
    "deltas_from_norms",
]


@dataclass(frozen=True)
class CoefficientEntry:
    """One term ``coefficient * ||W_i - W~_i||_norm`` of Lemma G.3.

    ``coefficient = local * downstream``: ``local`` is the term's factor inside its own stage
    (F6/F7/F14), ``downstream = prod_{later stages} rho`` the Lipschitz factor of everything after
    it (F8).
    """

    layer: int
    role: str
    coefficient: float
    norm: str  # "spectral" | "l2" | "linf"
    local: float
    downstream: float
    stage: str

    @property
    def key(self) -> tuple[int, str]:
        return (self.layer, self.role)


@dataclass(frozen=True)
class PerturbationCoefficients:
    """The coefficients c_i of Lemma G.3 for a class of parameter sets (Note [the class of a spec]).

    ``kind`` is CERTIFIED_UPPER: ``sum_i c_i ||dW_i||`` is a certified upper bound (rounding pad
    included in each c_i) on ``sup_X ||g_L(W)(X) - g_L(W~)(X)||`` in ``metric``.
    """

    entries: tuple[CoefficientEntry, ...]
    metric: str
    radius: float
    c_sm: float
    sigma_min: float
    seq_len: int | None
    assumptions: tuple[str, ...]
    kind: Kind = Kind.CERTIFIED_UPPER

    def coefficient(self, layer: int, role: str) -> float:
        for e in self.entries:
            if e.layer == layer and e.role == role:
                return e.coefficient
        raise KeyError(f"no coefficient for layer={layer}, role={role!r}")

    def bound(self, deltas: Mapping[tuple[int, str], float]) -> float:
        """``sum_i c_i * deltas[(layer, role)]``; a role missing from ``deltas`` counts as unchanged."""
        unknown = set(deltas) - {e.key for e in self.entries}
        if unknown:
            raise InputError(f"perturbation given for matrices the bound does not know: {sorted(unknown)[:3]}")
        return math.fsum(term(e.coefficient, float(deltas.get(e.key, 0.0))) for e in self.entries)

    def by_layer(self) -> dict[int, list[CoefficientEntry]]:
        out: dict[int, list[CoefficientEntry]] = {}
        for e in self.entries:
            out.setdefault(e.layer, []).append(e)
        return out

    def to_dict(self) -> dict[str, object]:
        return as_dict(self)


def term(coefficient: float, delta: float) -> float:
    """One term ``c_i ||dW_i||`` of Lemma G.3: exactly 0 for an unchanged matrix (its two hybrid networks are one
    function), whatever its coefficient; a coefficient that overflowed float64 (``inf``) times a distance of 0 was NaN,
    and one NaN made the whole bound NaN, reported as a certified upper bound with exit 0 (red team 185)."""
    return 0.0 if delta == 0.0 else coefficient * delta


def _coefficients_from_norms(norms: ClassBounds, *, radius: float, c_sm: float, metric: str,
                             seq_len: int | None, sigma_min: float) -> PerturbationCoefficients:
    if any(L.attention_kind == "l2" for L in norms.layers):
        raise UnsupportedArchitectureError(
            "the perturbation lemma is not derived for L2 attention (Kim et al. 2021); "
            "its input-Lipschitz bounds are available through lipschitz_bounds")
    def chain_entries(chain_metric: str) -> list[CoefficientEntry]:
        stages = build_chain(norms, radius=radius, c_sm=c_sm, metric=chain_metric, seq_len=seq_len,
                             sigma_min=sigma_min)
        # sup over X of a row-uniform bound in Frobenius is sqrt(T) times the row bound; so is a (2, inf)
        # bound read in Frobenius (||Y||_F <= sqrt(T) ||Y||_{2,inf}).
        rows = 1.0 if metric == "2,inf" else math.sqrt(seq_len or 1)
        pad = 1.0 + ROUNDING_PAD
        out = []
        for k, st in enumerate(stages):
            downstream = math.prod(s.lipschitz for s in stages[k + 1:])
            for role, local, nm in st.perturbation:
                if nm == "unsupported":  # the role names what the lemma is not derived for
                    raise UnsupportedArchitectureError(
                        f"the perturbation lemma is not derived for {role} (layer {st.layer}); "
                        "input-Lipschitz bounds are available")
                out.append(CoefficientEntry(st.layer, role, local * rows * downstream * pad, nm,
                                            local * rows, downstream, st.name))
        return out

    entries = chain_entries(metric)
    if metric == "fro":
        # THEORY F101: F8's telescoping sum is the same in both metrics (one hybrid network per stage), and
        # each term is at most c_i ||dW_i|| in Frobenius and at most sqrt(T) times its (2, inf) bound, so
        # each coefficient is the smaller of the two (the (2, inf) chain's downstream constants are the
        # smaller ones where a norm's gain or the attention's sqrt(T) score term dominates; red team 37b).
        rowwise = chain_entries("2,inf")
        if [e.key for e in rowwise] != [e.key for e in entries]:
            raise RuntimeError("internal error: the Frobenius and (2, inf) chains charge different matrices")
        entries = [r if r.coefficient < e.coefficient else e for e, r in zip(entries, rowwise)]
    from ..model import NormKind

    has_ln = any(n is not None and n.kind in (NormKind.LAYERNORM, NormKind.RMSNORM)
                 for n in [norms.input_norm, norms.final_norm]
                 + [m for L in norms.layers for m in (L.norm_attn, L.norm_ffn, L.post_norm_attn, L.post_norm_ffn)])
    assumptions = _assumptions(metric, radius, c_sm, sigma_min, seq_len, has_ln, norms.layers) + (
        "both parameter sets lie in the class: every per-matrix norm <= the coefficients' norms",)
    return PerturbationCoefficients(tuple(entries), metric, float(radius), float(c_sm), float(sigma_min),
                                    seq_len, assumptions)


def perturbation_coefficients(spec: TransformerSpec, *, radius: float = 1.0, c_sm: float = 1.0,
                              metric: str = "2,inf", seq_len: int | None = None, sigma_min: float = 0.0,
                              other: TransformerSpec | None = None) -> PerturbationCoefficients:
    r"""Coefficients c_i of the perturbation lemma G.3 for the class of ``spec``.

    .. math::

        \sup_{\|x_t\|\le R}\|g_L(W)(X) - g_L(\tilde W)(X)\| \le \sum_i c_i \|W_i - \tilde W_i\|,\qquad
        c_i = \Big(\prod_{s > s(i)} \rho_s\Big)\, c_i^{\mathrm{local}}

    Local coefficients (per stage, at the stage's propagated input radius r):
    attention ``W_OV.h: r``, ``W_KQ.h: c_sm B_OV^h r^3``, ``b_KQ.h: c_sm B_OV^h r^2``, ``b_out: 1``
    (THEORY F6); FFN ``W_1: L_sigma B_W2 r``, ``b_1: L_sigma B_W2``, ``W_2: B_W1 r + B_b1``, ``b_2: 1``
    (F7); norms ``gamma: sqrt(d)`` (linf), ``beta: 1`` (F14), ``eps: max|gamma| sqrt(d)`` against
    ``eps_change_bound`` when the class spans two variance floors (Note [eps change]); a norm inside a pre-norm branch is
    multiplied by the branch's Lipschitz constant.  ``rho_s`` are the stage input-Lipschitz constants
    of :func:`~transcover.lipschitz.lipschitz_bounds` (F8).  In Frobenius every c_i carries an extra
    ``sqrt(T)`` (the fixed-input terms are row-uniform), and each is the smaller of the Frobenius
    chain's and ``sqrt(T)`` times the (2, inf) chain's (F101).

    Source: THEORY F6, F7, F8, F14 (seed Lemma G.3); derivations in ``_attention`` (Note [F6
    derivation]), ``_ffn`` and ``_normalisation``.
    Assumptions: input tokens have norm <= ``radius``; both parameter sets are in the class of
    ``spec`` (Note [the class of a spec]); LayerNorm inputs have std >= ``sigma_min`` if > 0.

    Args:
        spec: the network whose norms define the class, or its :class:`~transcover.norms.ModelNorms`.
        radius: R, bound on the input tokens' l2 norms (before the input normalisation).
        c_sm: softmax constant >= 1 (1 proven and tight, F5; 2 Edelman et al.).
        metric: ``"2,inf"`` (max over tokens of the l2 norm; T-independent) or ``"fro"``.
        seq_len: T; required for ``"fro"``.
        sigma_min: variance floor assumed for every LayerNorm/RMSNorm input (0: none).
        other: a second network (or its ModelNorms); the class is then the elementwise maximum of both.

    Returns:
        :class:`PerturbationCoefficients` with one :class:`CoefficientEntry` per charged matrix.

    Raises:
        InputError: for a non-positive radius, ``c_sm < 1``, a bad metric, a missing seq_len, or
            ``other`` with a different structure (Note [structural differences] in ``model._compare``).
        UnsupportedArchitectureError: for L2 attention (its perturbation lemma is not derived).

    Example:
        >>> from transcover.model import ReferenceConfig, ReferenceTransformer, reference_spec
        >>> import torch
        >>> _ = torch.manual_seed(0)
        >>> spec = reference_spec(ReferenceTransformer(ReferenceConfig(d_model=8, n_heads=2, n_layers=1, d_ff=16)))
        >>> c = perturbation_coefficients(spec)
        >>> sorted({e.role for e in c.entries})[:3]
        ['W_1', 'W_2', 'W_KQ.0']
    """
    if other is not None and not isinstance(other, ModelNorms):
        from ..model import require_same_structure

        require_same_structure(spec, other)
    norms = spec_norms(spec)
    if other is not None:
        norms = class_max(norms, spec_norms(other))
    return _coefficients_from_norms(norms, radius=radius, c_sm=c_sm, metric=metric, seq_len=seq_len,
                                    sigma_min=sigma_min)


@dataclass(frozen=True)
class LogCoefficient:
    """``ln c_i`` of one Lemma G.3 term (``c_i`` itself overflows on deep models, Note [log space])."""

    layer: int
    role: str
    norm: str
    log_c: float


@dataclass(frozen=True)
class LogCoefficients:
    """Lemma G.3's coefficients in log space, and the radius of the chain's output (metric (2, inf))."""

    entries: tuple[LogCoefficient, ...]
    radius_out: float
    kind: Kind = Kind.CERTIFIED_UPPER


def log_perturbation_coefficients(norms: ClassBounds | ModelNorms | TransformerSpec, *, radius: float = 1.0,
                                  c_sm: float = 1.0, sigma_min: float = 0.0) -> LogCoefficients:
    r"""``ln c_i`` of :func:`perturbation_coefficients` (metric (2, inf)), finite where ``c_i`` overflows.

    .. math:: \ln c_i = \ln c_i^{\mathrm{local}} + \sum_{s > s(i)} \ln \rho_s + \ln(1 + \mathrm{pad})

    Source: THEORY F6, F7, F8, F14 as in :func:`perturbation_coefficients` (the same stage chain,
    summed in log space, Note [log space] in ``_compose``).  Assumptions: as there.

    Raises:
        UnsupportedArchitectureError: L2 attention (its perturbation lemma is not derived).
    """
    bounds = norms if isinstance(norms, ClassBounds) else spec_norms(norms)
    l2 = [k for k, L in enumerate(bounds.layers) if L.attention_kind == "l2"]
    if l2:  # said before the chain, which asked for a seq_len the (2, inf) chain never takes (red team 222)
        raise UnsupportedArchitectureError(
            "the covering bound needs Lemma G.3 (parameter perturbation), which is not derived for L2 attention "
            f"(Kim et al. 2021; layer {l2[0]}); its norms and input-Lipschitz bounds are available (analyze, "
            "lipschitz)")
    stages = build_chain(bounds, radius=radius, c_sm=c_sm, metric="2,inf", seq_len=None, sigma_min=sigma_min)
    log_rho = [s.log_lipschitz for s in stages]
    tail = np.concatenate([np.cumsum(log_rho[::-1])[::-1][1:], [0.0]])  # sum over later stages
    out = []
    for k, st in enumerate(stages):
        for role, local, nm in st.perturbation:
            if nm == "unsupported":
                raise UnsupportedArchitectureError("the covering bound needs Lemma G.3, which is not derived "
                                                   f"for {role} (layer {st.layer})")
            log_local = -math.inf if local == 0 else math.log(local)
            out.append(LogCoefficient(st.layer, role, nm, log_local + float(tail[k]) + math.log1p(ROUNDING_PAD)))
    return LogCoefficients(tuple(out), stages[-1].radius_out)


def _own_eps(norms: ModelNorms, layer: int, prefix: str) -> float:
    if layer == -1:
        return norms.input_norm.eps
    if layer == norms.n_layers:
        return norms.final_norm.eps
    return getattr(norms.layers[layer], prefix).eps


def deltas_from_norms(norms: ModelNorms) -> dict[tuple[int, str], float]:
    """``||W_i - W~_i||`` of every role from a measurement with a reference (``measure_model(a, reference=b)``);
    a changed variance floor becomes its :func:`eps_change_bound` (Note [eps change])."""
    out = {}
    for (layer, role), d in norms.distances.items():
        if d.norm == "eps":
            out[(layer, role)] = eps_change_bound(_own_eps(norms, layer, role.split(".")[0]), d.value)
        else:
            out[(layer, role)] = d.value
    return out


def perturbation_deltas(spec_a: TransformerSpec, spec_b: TransformerSpec) -> dict[tuple[int, str], float]:
    """``||W_i - W~_i||`` in each role's norm (spectral for matrices, l2 biases, linf gamma).

    Either backend (numpy arrays from files, torch tensors from modules).  A bias or normalisation
    scale present in one model only is compared with zeros (ones for gamma), which is what the
    other model's forward pass uses (Note [structural differences] in ``model._compare``).
    Measured by :func:`transcover.norms.measure_model` (Note [distances] there).

    Raises:
        InputError: if the two specs differ structurally (:func:`~transcover.model.structural_differences`).
    """
    return deltas_from_norms(measure_model(spec_a, reference=spec_b))


@dataclass(frozen=True)
class PerturbationBound:
    """Lemma G.3 for a specific pair: the total and each term ``c_i * ||dW_i||``."""

    total: Quantity
    coefficients: PerturbationCoefficients
    deltas: dict[tuple[int, str], float]

    def terms(self) -> list[tuple[CoefficientEntry, float, float]]:
        """(entry, ||dW_i||, c_i ||dW_i||), largest contribution first."""
        rows = [(e, self.deltas.get(e.key, 0.0), term(e.coefficient, self.deltas.get(e.key, 0.0)))
                for e in self.coefficients.entries]
        return sorted(rows, key=lambda r: -r[2])

    def by_layer(self) -> dict[int, float]:
        out: dict[int, float] = {}
        for e, _, c in self.terms():
            out[e.layer] = out.get(e.layer, 0.0) + c
        return dict(sorted(out.items()))

    def plot(self, ax=None, lower: float | None = None, *, n_layers: int | None = None):
        """Per-layer contributions and the total beside ``lower`` (a measured change), as
        :class:`transcover.report.PerturbationDisplay` (returned, ``figure_`` set)."""
        from .._views import render

        return render("perturbation.plot", self, ax=ax, lower=lower, n_layers=n_layers)

    def to_dict(self) -> dict[str, object]:
        return as_dict(self, exclude=("deltas",),
                       terms=[{"layer": e.layer, "role": e.role, "coefficient": e.coefficient, "norm": e.norm,
                               "delta": d, "contribution": c} for e, d, c in self.terms()])


def perturbation_bound(spec_a: TransformerSpec, spec_b: TransformerSpec, *, radius: float = 1.0,
                       c_sm: float = 1.0, metric: str = "2,inf", seq_len: int | None = None,
                       sigma_min: float = 0.0) -> PerturbationBound:
    r"""Certified bound on ``sup_X ||g_L(W_a)(X) - g_L(W_b)(X)||`` (Lemma G.3 for a given pair).

    .. math:: \sum_i c_i\,\|W^a_i - W^b_i\|,\quad c_i \text{ from the class containing both (F8)}

    Source and assumptions: :func:`perturbation_coefficients` with ``other=spec_b``.

    Both specs may hold numpy arrays (read from files) or torch tensors (live modules).

    Raises:
        InputError: structurally different models (:func:`~transcover.model.structural_differences`:
            masking, norm kind / placement / eps, activation, attention kind, RoPE, head count, ...),
            bad radius / metric, ``c_sm < 1``.
    """
    na = measure_model(spec_a, reference=spec_b)  # a's norms and its distances from b, measured once
    deltas = deltas_from_norms(na)
    coeffs = perturbation_coefficients(na, radius=radius, c_sm=c_sm, metric=metric, seq_len=seq_len,
                                       sigma_min=sigma_min, other=measure_model(spec_b))
    known = {e.key for e in coeffs.entries}
    uncharged = sorted(k for k, v in deltas.items() if k not in known and v != 0.0)
    if uncharged:  # a changed matrix the lemma has no coefficient for: the bound would be false
        raise RuntimeError(f"internal error: perturbation lemma has no coefficient for changed {uncharged[:3]}")
    deltas = {k: v for k, v in deltas.items() if k in known}
    total = Quantity(coeffs.bound(deltas), Kind.CERTIFIED_UPPER, "seed Lemma G.3 via THEORY F6, F7, F8, F14",
                     coeffs.assumptions)
    return PerturbationBound(total, coeffs, deltas)

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
=============  =========================================================  ==========

The attention is charged per head through ``W_KQ^h`` and ``W_OV^h`` because the block depends on
the weights only through them (Note [attention biases] in ``model._spec``); this is the
parametrisation in which the seed states its constraints (B_KQ, B_V).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .._errors import InputError, UnsupportedArchitectureError
from .._results import Kind, Quantity
from ..model._arrays import to_tensor
from ..model._spec import NormSpec, TransformerSpec
from ._compose import _assumptions, build_chain
from ._normalisation import eps_change_bound
from ._weights import ROUNDING_PAD, SpecNorms, class_max, spec_norms, spectral, spectral_product

__all__ = [
    "CoefficientEntry",
    "PerturbationCoefficients",
    "PerturbationBound",
    "perturbation_coefficients",
    "perturbation_deltas",
    "perturbation_bound",
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
        return math.fsum(e.coefficient * float(deltas.get(e.key, 0.0)) for e in self.entries)

    def by_layer(self) -> dict[int, list[CoefficientEntry]]:
        out: dict[int, list[CoefficientEntry]] = {}
        for e in self.entries:
            out.setdefault(e.layer, []).append(e)
        return out

    def to_dict(self) -> dict[str, object]:
        return {
            "kind": self.kind.value, "metric": self.metric, "radius": self.radius, "c_sm": self.c_sm,
            "sigma_min": self.sigma_min, "seq_len": self.seq_len, "assumptions": list(self.assumptions),
            "entries": [e.__dict__ | {} for e in self.entries],
        }


def _coefficients_from_norms(norms: SpecNorms, *, radius: float, c_sm: float, metric: str,
                             seq_len: int | None, sigma_min: float) -> PerturbationCoefficients:
    if any(L.attention_kind == "l2" for L in norms.layers):
        raise UnsupportedArchitectureError(
            "the perturbation lemma is not derived for L2 attention (Kim et al. 2021); "
            "its input-Lipschitz bounds are available through lipschitz_bounds")
    stages = build_chain(norms, radius=radius, c_sm=c_sm, metric=metric, seq_len=seq_len, sigma_min=sigma_min)
    # sup over X of a row-uniform bound in Frobenius is sqrt(T) times the row bound.
    rows = 1.0 if metric == "2,inf" else math.sqrt(seq_len or 1)
    pad = 1.0 + ROUNDING_PAD
    entries = []
    for k, st in enumerate(stages):
        downstream = math.prod(s.lipschitz for s in stages[k + 1:])
        for role, local, nm in st.perturbation:
            if nm == "unsupported":  # the role names what the lemma is not derived for
                raise UnsupportedArchitectureError(
                    f"the perturbation lemma is not derived for {role} (layer {st.layer}); "
                    "input-Lipschitz bounds are available")
            entries.append(CoefficientEntry(st.layer, role, local * rows * downstream * pad, nm,
                                            local * rows, downstream, st.name))
    from ..model._spec import NormKind

    has_ln = any(n.kind in (NormKind.LAYERNORM, NormKind.RMSNORM)
                 for n in [norms.input_norm, norms.final_norm]
                 + [m for L in norms.layers for m in (L.norm_attn, L.norm_ffn)])
    assumptions = _assumptions(metric, radius, c_sm, sigma_min, seq_len, has_ln) + (
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
    ``sqrt(T)`` (the fixed-input terms are row-uniform).

    Source: THEORY F6, F7, F8, F14 (seed Lemma G.3); derivations in ``_attention`` (Note [F6
    derivation]), ``_ffn`` and ``_normalisation``.
    Assumptions: input tokens have norm <= ``radius``; both parameter sets are in the class of
    ``spec`` (Note [the class of a spec]); LayerNorm inputs have std >= ``sigma_min`` if > 0.

    Args:
        spec: the network whose norms define the class.
        radius: R, bound on the input tokens' l2 norms (before the input normalisation).
        c_sm: softmax constant >= 1 (1 proven and tight, F5; 2 Edelman et al.).
        metric: ``"2,inf"`` (max over tokens of the l2 norm; T-independent) or ``"fro"``.
        seq_len: T; required for ``"fro"``.
        sigma_min: variance floor assumed for every LayerNorm/RMSNorm input (0: none).
        other: a second network; the class is then the elementwise maximum of both.

    Returns:
        :class:`PerturbationCoefficients` with one :class:`CoefficientEntry` per charged matrix.

    Raises:
        InputError: for a non-positive radius, ``c_sm < 1``, a bad metric, a missing seq_len, or
            ``other`` with a different structure (Note [structural differences] in ``model._compare``).
        UnsupportedArchitectureError: for L2 attention (its perturbation lemma is not derived).

    Example:
        >>> from transcover.model import ReferenceConfig, ReferenceTransformer, reference_spec
        >>> _ = torch.manual_seed(0)
        >>> spec = reference_spec(ReferenceTransformer(ReferenceConfig(d_model=8, n_heads=2, n_layers=1, d_ff=16)))
        >>> c = perturbation_coefficients(spec)
        >>> sorted({e.role for e in c.entries})[:3]
        ['W_1', 'W_2', 'W_KQ.0']
    """
    if other is not None:
        from ..model._compare import require_same_structure

        require_same_structure(spec, other)
    norms = spec_norms(spec)
    if other is not None:
        norms = class_max(norms, spec_norms(other))
    return _coefficients_from_norms(norms, radius=radius, c_sm=c_sm, metric=metric, seq_len=seq_len,
                                    sigma_min=sigma_min)


def _f64(x) -> torch.Tensor:  # noqa: ANN001  (a spec array of either backend, as float64 torch)
    return to_tensor(x, dtype=torch.float64).detach()


def _diff(a, b, what: str, fill: float = 0.0) -> torch.Tensor:  # noqa: ANN001
    """``a - b`` in float64; a missing array stands for the constant ``fill`` (0 for biases and beta,
    1 for gamma), which is what the forward pass computes without it (Note [structural differences])."""
    if a is None and b is None:
        return torch.zeros(1, dtype=torch.float64)
    ta = None if a is None else _f64(a)
    tb = None if b is None else _f64(b)
    ta = torch.full_like(tb, fill) if ta is None else ta
    tb = torch.full_like(ta, fill) if tb is None else tb
    if ta.shape != tb.shape:
        raise InputError(f"{what} has shape {tuple(ta.shape)} in one model and {tuple(tb.shape)} in the other")
    return ta - tb


def _norm_deltas(na: NormSpec | None, nb: NormSpec | None, prefix: str) -> dict[str, float]:
    """``||gamma - gamma~||_inf``, ``||beta - beta~||_2`` and, for different variance floors, the
    :func:`eps_change_bound` of a LayerNorm/RMSNorm (no parameters otherwise)."""
    from ..model._spec import NormKind

    if na is None or nb is None or na.kind not in (NormKind.LAYERNORM, NormKind.RMSNORM):
        return {}
    out = {f"{prefix}.gamma": float(_diff(na.weight, nb.weight, f"{prefix} weight", 1.0).abs().max()),
           f"{prefix}.beta": float(_diff(na.bias, nb.bias, f"{prefix} bias").norm())}
    if float(na.eps) != float(nb.eps):  # Note [eps change] in ``_normalisation``
        out[f"{prefix}.eps"] = eps_change_bound(na.eps, nb.eps)
    return out


def _kq_delta(aa, ab, h: int) -> float:  # noqa: ANN001
    """Certified upper end of ``sup_R ||s W_Q^h R W_K^hT - s~ W~_Q^h R W~_K^hT||_2`` (R = I without RoPE)."""
    s, st = aa.softmax_scale, ab.softmax_scale
    qa, ka, _, _ = (_f64(t) for t in aa.head(h))
    qb, kb, _, _ = (_f64(t) for t in ab.head(h))
    if s == st and qa.shape == qb.shape and torch.equal(qa, qb) and torch.equal(ka, kb):
        return 0.0
    if aa.rope is not None:
        # With RoPE the score matrix is s W_Q R W_K^T for every relative rotation R (||R|| = 1, the same
        # R in both models: same RoPE and d_head, Note [structural differences]), and
        # s Q R K^T - s~ Q~ R K~^T = (s Q - s~ Q~) R K^T + s~ Q~ R (K - K~)^T.
        return spectral(s * qa - st * qb) * spectral(ka) + st * spectral(qb) * spectral(ka - kb)
    # s W_Q W_K^T - s~ W~_Q W~_K^T = [s W_Q, -s~ W~_Q] [W_K, W~_K]^T: rank <= 2 d_head, any head layout
    return spectral_product(torch.cat([s * qa, -st * qb], 1), torch.cat([ka, kb], 1).T)


def _attention_deltas(aa, ab, i: int) -> dict[tuple[int, str], float]:  # noqa: ANN001
    out: dict[tuple[int, str], float] = {}
    s, st = aa.softmax_scale, ab.softmax_scale
    for h in range(aa.n_heads):
        out[(i, f"W_KQ.{h}")] = _kq_delta(aa, ab, h)
        _, ka, va, oa = (_f64(t) for t in aa.head(h))
        _, kb, vb, ob = (_f64(t) for t in ab.head(h))
        same_ov = va.shape == vb.shape and torch.equal(va, vb) and torch.equal(oa, ob)
        out[(i, f"W_OV.{h}")] = 0.0 if same_ov else spectral_product(torch.cat([va, -vb], 1), torch.cat([oa, ob], 0))
        if aa.rope is None and (aa.b_Q is not None or ab.b_Q is not None):
            # b_K cancels in the softmax; s b_Q W_K^T is the query bias's only effect (Note [attention biases])
            ba = torch.zeros(ka.shape[1], dtype=torch.float64) if aa.b_Q is None else _f64(aa.b_Q[h])
            bb = torch.zeros(kb.shape[1], dtype=torch.float64) if ab.b_Q is None else _f64(ab.b_Q[h])
            out[(i, f"b_KQ.{h}")] = float((s * ba @ ka.T - st * bb @ kb.T).norm())
    ea, eb = aa.effective_output_bias(), ab.effective_output_bias()
    if ea is not None or eb is not None:
        out[(i, "b_out")] = float(_diff(ea, eb, f"layer {i} b_out").norm())
    return out


def perturbation_deltas(spec_a: TransformerSpec, spec_b: TransformerSpec) -> dict[tuple[int, str], float]:
    """``||W_i - W~_i||`` in each role's norm (spectral for matrices, l2 biases, linf gamma).

    Either backend (numpy arrays from files, torch tensors from modules).  A bias or normalisation
    scale present in one model only is compared with zeros (ones for gamma), which is what the
    other model's forward pass uses (Note [structural differences] in ``model._compare``).

    Raises:
        InputError: if the two specs differ structurally (:func:`~transcover.model.structural_differences`).
    """
    from ..model._compare import require_same_structure

    require_same_structure(spec_a, spec_b)
    out: dict[tuple[int, str], float] = {}
    L = spec_a.n_layers
    for role, v in _norm_deltas(spec_a.input_norm, spec_b.input_norm, "input_norm").items():
        out[(-1, role)] = v
    for role, v in _norm_deltas(spec_a.final_norm, spec_b.final_norm, "final_norm").items():
        out[(L, role)] = v
    for i, (la, lb) in enumerate(zip(spec_a.layers, spec_b.layers)):
        out.update(_attention_deltas(la.attention, lb.attention, i))
        fa, fb = la.ffn, lb.ffn
        for name in ("W_1", "W_2", "W_gate"):
            if getattr(fa, name) is not None:
                out[(i, name)] = spectral(_diff(getattr(fa, name), getattr(fb, name), f"layer {i} {name}"))
        for name in ("b_1", "b_2", "b_gate"):
            if getattr(fa, name) is not None or getattr(fb, name) is not None:
                out[(i, name)] = float(_diff(getattr(fa, name), getattr(fb, name), f"layer {i} {name}").norm())
        for nm in ("norm_attn", "norm_ffn"):
            for role, v in _norm_deltas(getattr(la, nm), getattr(lb, nm), nm).items():
                out[(i, role)] = v
    return out


@dataclass(frozen=True)
class PerturbationBound:
    """Lemma G.3 for a specific pair: the total and each term ``c_i * ||dW_i||``."""

    total: Quantity
    coefficients: PerturbationCoefficients
    deltas: dict[tuple[int, str], float]

    def terms(self) -> list[tuple[CoefficientEntry, float, float]]:
        """(entry, ||dW_i||, c_i ||dW_i||), largest contribution first."""
        rows = [(e, self.deltas.get(e.key, 0.0), e.coefficient * self.deltas.get(e.key, 0.0))
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
        return {"total": self.total.to_dict(), "coefficients": self.coefficients.to_dict(),
                "terms": [{"layer": e.layer, "role": e.role, "coefficient": e.coefficient, "norm": e.norm,
                           "delta": d, "contribution": c} for e, d, c in self.terms()]}


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
    deltas = perturbation_deltas(spec_a, spec_b)
    coeffs = perturbation_coefficients(spec_a, radius=radius, c_sm=c_sm, metric=metric, seq_len=seq_len,
                                       sigma_min=sigma_min, other=spec_b)
    known = {e.key for e in coeffs.entries}
    uncharged = sorted(k for k, v in deltas.items() if k not in known and v != 0.0)
    if uncharged:  # a changed matrix the lemma has no coefficient for: the bound would be false
        raise RuntimeError(f"internal error: perturbation lemma has no coefficient for changed {uncharged[:3]}")
    deltas = {k: v for k, v in deltas.items() if k in known}
    total = Quantity(coeffs.bound(deltas), Kind.CERTIFIED_UPPER, "seed Lemma G.3 via THEORY F6, F7, F8, F14",
                     coeffs.assumptions)
    return PerturbationBound(total, coeffs, deltas)

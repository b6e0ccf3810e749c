"""From a model's weights to its covering number and generalisation bound (seed 1.1, 2.2, 3).

The one place that reads a :class:`~transcover.model.TransformerSpec`: it takes Lemma G.3's
coefficients from ``transcover.lipschitz`` (THEORY F6-F8, F14), measures each charged matrix's
distance from its reference (0, or the initialisation given as a second model), and hands plain
numbers to the pure bounds of this package (F9, F10, F11, F12).

Note [coefficients in log space]: ``transcover.lipschitz.perturbation_coefficients`` returns
``c_i = local_i * prod_{later stages} rho_s`` as floats, which overflow to ``inf`` on deep models
(MiniLM's are already ~1e108 without a LayerNorm floor).  This module therefore builds the same
stage chain once (``transcover.lipschitz._compose.build_chain``, the chain that function uses)
and forms ``log c_i = log local_i + sum_{s later} log rho_s + log(1 + pad)``; the test
``test_covering_model.py::test_log_coefficients_match_lipschitz_api`` checks equality with the
public API wherever it is finite.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from .._errors import InputError
from .._results import Kind
from ..model._spec import TransformerSpec
from ._bft import SpectralComplexity, bft_spectral_complexity
from ._composite import CompositeCovering, composite_log_covering
from ._generalisation import GeneralisationBound, generalisation_bound, generalisation_gap
from ._mlp import mlp_log_covering, mlp_terms
from ._transformer import NORM_FAMILIES, CoveringCurve, MatrixTerm, TransformerCovering, transformer_log_covering

__all__ = ["ModelBound", "model_terms", "model_bound", "model_covering_curve", "MODEL_FAMILIES"]

# the families of ``transformer_log_covering`` and "auto": all of them, the smallest reported
MODEL_FAMILIES = (*NORM_FAMILIES, "auto")

_PAD = 1e-10  # relative rounding pad on float64 norms (sums of <= 1e6 squares: error < 1e-10)


def _group(role: str) -> str:
    if role.startswith(("W_KQ", "b_KQ", "W_OV", "b_out", "norm_attn")):
        return "attention"
    if role.startswith(("W_1", "W_2", "W_gate", "b_1", "b_2", "b_gate", "norm_ffn")):
        return "ffn"
    return "norm"


def _t(x: torch.Tensor | None) -> torch.Tensor | None:
    """float64 torch tensor of a spec array of either backend (numpy from files, torch from modules)."""
    from ..model._arrays import to_tensor

    return None if x is None else to_tensor(x, dtype=torch.float64).detach()


def _diff(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    if a is None:
        return None
    return a if b is None else a - b


def _mat_norms(D: torch.Tensor) -> tuple[float, float]:
    """(||D||_{2,1} = sum of column norms, ||D||_2): certified upper ends (``transcover.norms``)."""
    from ..norms import l21_interval, spectral_norm_interval

    Dn = D.detach().double().numpy()
    return l21_interval(Dn).upper, spectral_norm_interval(Dn).upper


def _lowrank_norms(P: torch.Tensor, Q: torch.Tensor) -> tuple[list[float], list[float]]:
    """Per head h: certified upper ends of ``||P_h Q_h^T||_{2,1}`` and ``||P_h Q_h^T||_2`` for tall
    (H, d, k) factors, without forming the d x d products (``transcover.norms`` low-rank routes)."""
    from ..norms import product_l21_interval, product_norm_interval

    l21, spec = [], []
    for Ph, Qh in zip(P.detach().double().numpy(), Q.detach().double().numpy()):
        Bt = Qh.T.copy()
        l21.append(product_l21_interval(Ph, Bt).upper)
        spec.append(product_norm_interval(Ph, Bt).upper)
    return l21, spec


def _layer_role_norms(layer, ref) -> dict[str, tuple[tuple[int, int], float, float]]:
    """role -> (shape, distance norm for covering (l21 or vector norm), spectral distance)."""
    out: dict[str, tuple[tuple[int, int], float, float]] = {}
    a = layer.attention
    H, d = a.n_heads, a.d_model
    kv = torch.tensor([a.kv_index(h) for h in range(H)])
    s = a.softmax_scale
    Wq, Wk, Wv, Wo = _t(a.W_Q), _t(a.W_K)[kv], _t(a.W_V)[kv], _t(a.W_O)
    P_kq, Q_kq, P_ov, Q_ov = s * Wq, Wk, Wv, Wo.transpose(-1, -2)
    bKQ = None if a.b_Q is None or a.rope is not None else s * torch.einsum("he,hde->hd", _t(a.b_Q), Wk)
    bout = a.effective_output_bias()
    if ref is not None:
        r = ref.attention
        rs = r.softmax_scale
        rkv = torch.tensor([r.kv_index(h) for h in range(H)])  # the reference's own grouped-query layout
        rq, rk, rv, ro = _t(r.W_Q), _t(r.W_K)[rkv], _t(r.W_V)[rkv], _t(r.W_O)
        # differences of products are products of concatenated factors (rank <= 2 d_head)
        P_kq, Q_kq = torch.cat([P_kq, -rs * rq], -1), torch.cat([Q_kq, rk], -1)
        P_ov, Q_ov = torch.cat([P_ov, -rv], -1), torch.cat([Q_ov, ro.transpose(-1, -2)], -1)
        if bKQ is not None and r.b_Q is not None:
            bKQ = bKQ - rs * torch.einsum("he,hde->hd", _t(r.b_Q), rk)
        rb = r.effective_output_bias()
        if bout is not None and rb is not None:
            bout = bout - rb
    kq_l21, kq_sp = _lowrank_norms(P_kq, Q_kq)
    ov_l21, ov_sp = _lowrank_norms(P_ov, Q_ov)
    for h in range(H):
        out[f"W_KQ.{h}"] = ((d, d), float(kq_l21[h]), float(kq_sp[h]))
        out[f"W_OV.{h}"] = ((d, d), float(ov_l21[h]), float(ov_sp[h]))
        if bKQ is not None:
            v = float(bKQ[h].norm()) * (1 + _PAD)
            out[f"b_KQ.{h}"] = ((1, d), v, v)
    if bout is not None:
        v = float(bout.norm()) * (1 + _PAD)
        out["b_out"] = ((1, d), v, v)
    f, rf = layer.ffn, (None if ref is None else ref.ffn)
    for name in ("W_1", "W_2", "W_gate"):
        W = _t(getattr(f, name))
        if W is not None:
            D = _diff(W, None if rf is None else _t(getattr(rf, name)))
            l21, sp = _mat_norms(D)
            out[name] = (tuple(W.shape), float(l21), float(sp))
    for name in ("b_1", "b_2", "b_gate"):
        b = _t(getattr(f, name))
        if b is not None:
            v = float(_diff(b, None if rf is None else _t(getattr(rf, name))).norm()) * (1 + _PAD)
            out[name] = ((1, b.numel()), v, v)
    for nm in ("norm_attn", "norm_ffn"):
        out.update(_norm_role_norms(getattr(layer, nm), None if ref is None else getattr(ref, nm), nm))
    return out


def _norm_role_norms(n, rn, prefix: str) -> dict[str, tuple[tuple[int, int], float, float]]:
    out = {}
    if n is None:
        return out
    g = _t(n.weight)
    if g is not None:
        v = float(_diff(g, None if rn is None else _t(rn.weight)).abs().max()) * (1 + _PAD)
        out[f"{prefix}.gamma"] = ((1, g.numel()), v, v)
    b = _t(n.bias)
    if b is not None:
        v = float(_diff(b, None if rn is None else _t(rn.bias)).norm()) * (1 + _PAD)
        out[f"{prefix}.beta"] = ((1, b.numel()), v, v)
    return out


def _log_coefficients(spec: TransformerSpec, *, radius: float, c_sm: float, sigma_min: float,
                      other: TransformerSpec | None = None):
    """[(layer, role, norm, log c_i)] and the chain's last radius (Note [coefficients in log space])."""
    from ..lipschitz._compose import build_chain
    from ..lipschitz._weights import ROUNDING_PAD, class_max, spec_norms

    norms = spec_norms(spec)
    if other is not None:
        norms = class_max(norms, spec_norms(other))
    stages = build_chain(norms, radius=radius, c_sm=c_sm, metric="2,inf", seq_len=None,
                         sigma_min=sigma_min)
    log_rho = [math.log(s.lipschitz) for s in stages]
    tail = np.concatenate([np.cumsum(log_rho[::-1])[::-1][1:], [0.0]])  # sum over later stages
    out = []
    for k, st in enumerate(stages):
        for role, local, nm in st.perturbation:
            if nm == "unsupported":
                from .._errors import UnsupportedArchitectureError

                raise UnsupportedArchitectureError("the covering bound needs Lemma G.3, which is not derived "
                                                   f"for {role} (layer {st.layer})")
            log_local = -math.inf if local == 0 else math.log(local)
            out.append((st.layer, role, nm, log_local + float(tail[k]) + math.log1p(ROUNDING_PAD)))
    return out, stages[-1].radius_out


def model_terms(spec: TransformerSpec, *, radius: float = 1.0, c_sm: float = 1.0, sigma_min: float = 0.0,
                reference: TransformerSpec | None = None, other: TransformerSpec | None = None) -> tuple[list[MatrixTerm], float, list[tuple[float, float]]]:
    """The Transformer's covering terms (one per matrix Lemma G.3 charges), the output radius, and
    ``(||W||_2, ||W - M||_{2,1})`` of every matrix for the BFT baseline.

    ``other`` enlarges the class to contain a second model too (its norms, elementwise maximum),
    as ``transcover.lipschitz.perturbation_coefficients(other=...)`` does; used to bound a pair.

    Raises:
        InputError: ``reference`` or ``other`` with a different structure
            (:func:`~transcover.model.structural_differences`).
    """
    spec = spec.to_torch()  # specs loaded from files hold numpy arrays
    reference = None if reference is None else reference.to_torch()
    other = None if other is None else other.to_torch()
    from ..model._compare import require_same_structure

    if reference is not None:  # Note [structural differences] in ``model._compare``
        require_same_structure(spec, reference, message="the reference model differs from the model in")
    if other is not None:
        require_same_structure(spec, other, message="cannot bound a class containing two models that differ in")
    coeffs, out_radius = _log_coefficients(spec, radius=radius, c_sm=c_sm, sigma_min=sigma_min, other=other)
    norms: dict[tuple[int, str], tuple[tuple[int, int], float, float]] = {}
    self_spectral: dict[tuple[int, str], float] = {}
    L = spec.n_layers
    for i, layer in enumerate(spec.layers):
        ref = None if reference is None else reference.layers[i]
        for role, v in _layer_role_norms(layer, ref).items():
            norms[(i, role)] = v
        if ref is not None:
            for role, v in _layer_role_norms(layer, None).items():
                self_spectral[(i, role)] = v[2]
    for layer_idx, nm, attr in ((-1, "input_norm", "input_norm"), (L, "final_norm", "final_norm")):
        rn = None if reference is None else getattr(reference, attr)
        for role, v in _norm_role_norms(getattr(spec, attr), rn, nm).items():
            norms[(layer_idx, role)] = v
    terms, bft_rows = [], []
    for layer_idx, role, nm, log_c in coeffs:
        key = (layer_idx, role)
        if key not in norms:
            raise InputError(f"no weights found for layer {layer_idx} role {role!r} that Lemma G.3 charges")
        shape, dist, sp = norms[key]
        vector = nm != "spectral"
        terms.append(MatrixTerm(layer=layer_idx, role=role, shape=shape, log_c=log_c, l21=dist,
                                spectral=sp, vector=vector, group=_group(role)))
        if not vector:
            bft_rows.append((self_spectral.get(key, sp), dist))
    return terms, out_radius, bft_rows


@dataclass(frozen=True)
class ModelBound:
    """A model's covering bound at ``eps``, its generalisation bounds, the BFT baseline, assumptions."""

    model: str
    arch: str
    n_layers: int
    eps: float
    seq_len: int
    family: str
    covering: TransformerCovering | CompositeCovering
    transformer: TransformerCovering
    generalisation: tuple[GeneralisationBound, ...]
    bft: SpectralComplexity
    bft_generalisation: tuple[GeneralisationBound, ...]
    assumptions: tuple[str, ...]
    kind: Kind = Kind.CERTIFIED_UPPER
    options: dict[str, object] = field(default_factory=dict)
    # (eps, n) -> ln log N of the same class (certified, fast): for plots and sample-size searches
    curve: Callable[[float, float], float] | None = field(default=None, repr=False, compare=False)
    # the cover family whose log N at eps is reported (the smallest of ``routes`` for family="auto")
    route: str = ""
    # family -> ln log N at eps: every certified route, computed for comparison (Note [routes])
    routes: dict[str, float] = field(default_factory=dict)

    @property
    def log_log_N(self) -> float:
        return self.covering.log_log_N

    def __repr__(self) -> str:
        return (f"<ModelBound {self.model!r} ({self.arch}, {self.n_layers} layers): log N(eps={self.eps:g}) <= "
                f"10^{self.log_log_N / math.log(10):.4g} ({self.kind.value}); .to_dict(), .plot()>")

    def plot(self, ax=None):
        """Where log N comes from (by layer, group and matrix): :class:`transcover.report.BoundDisplay`."""
        from .._views import render

        return render("bound.plot", self, ax=ax)

    def to_dict(self) -> dict[str, object]:
        tf = self.transformer
        return {
            "model": self.model, "arch": self.arch, "n_layers": self.n_layers, "eps": self.eps,
            "seq_len": self.seq_len, "family": self.family, "route": self.route or self.family,
            "routes_log10_log_N": {k: v / math.log(10) for k, v in self.routes.items()},
            "kind": self.kind.value, "options": self.options,
            "log10_log_N": self.log_log_N / math.log(10), "ln_log_N": self.log_log_N,
            "with_mlp_head": isinstance(self.covering, CompositeCovering),
            "transformer": {"eps": tf.eps, "n_points": tf.n_points, "ln_log_N": tf.log_log_N,
                            "ln_gamma": tf.log_gamma, "ln_eta": tf.log_eta, "ln_eta_tilde": tf.log_eta_tilde,
                            "contributions": [c.__dict__ for c in tf.contributions]},
            "generalisation": [g.to_dict() for g in self.generalisation],
            "bft": {"log10_R_A": self.bft.log_R / math.log(10), "log10_A": self.bft.log_A / math.log(10),
                    "kind": self.bft.kind.value, "source": self.bft.source,
                    "generalisation": [g.to_dict() for g in self.bft_generalisation]},
            "assumptions": list(self.assumptions),
        }


def _check(name: str, v: float) -> None:
    if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
        raise InputError(f"{name} must be a finite number > 0, but got {name}={v!r}")


def _head_parts(spec: TransformerSpec, head_radius: float):
    from ..lipschitz import activation_lipschitz

    h = spec.head
    shapes = [tuple(W.shape) for W in h.weights]
    from ..norms import spectral_norm_interval

    spectral = [spectral_norm_interval(W).upper for W in h.weights]
    from ..model._arrays import norm2_f64

    biases = [0.0 if b is None else norm2_f64(b) * (1 + _PAD) for b in h.biases]
    return shapes, spectral, biases, activation_lipschitz(h.activation)


def _bft_gap(log_A: float, n: float, D: float, delta: float) -> GeneralisationBound:
    """The gap from BFT's ``A/eps^2`` cover through the same Dudley + concentration steps, in logs.

    F11's closed form ``12 sqrt(A/n) (1 + ln(D sqrt(n) / (3 sqrt(A))))`` when ``alpha* < D``, else
    the trivial ``4D``; ``A`` may be astronomically large or (a chain of tiny matrices) underflow.
    """
    from ._dudley import DudleyBound

    log_s = 0.5 * (log_A - math.log(n))  # ln sqrt(A/n)
    if log_s == -math.inf:
        rad = DudleyBound(0.0, 0.0, -math.inf, method="A = 0")
    elif math.log(3.0) + log_s < math.log(D):
        lv = math.log(12.0) + log_s + math.log1p(math.log(D) - math.log(3.0) - log_s)
        rad = DudleyBound(math.exp(lv) if lv < 709 else math.inf, 3.0 * math.exp(log_s), lv,
                          method="closed form, log N <= A/eps^2")
    else:
        rad = DudleyBound(4.0 * D, D, math.log(4.0 * D), method="alpha = D (class too rich at this n)", trivial=True)
    # BFT's theorem does not cover this chain (residuals, LayerNorm, softmax): a baseline estimate
    return replace(generalisation_gap(rad, n, loss_bound=D, delta=delta), kind=Kind.ESTIMATE)


def model_covering_curve(terms: Sequence[MatrixTerm], *, family: str, seq_len: int, head=None):
    """``(eps, n) -> ln log N`` of the whole class on n sequences of length T (certified, fast).

    With a head ``(shapes, spectral, biases, L_act, input_radius)`` it is Theorem G.5's
    ``log N_MLP(eps/2) + log N_TF(eps/(2C))``.  ``family="auto"``: the pointwise minimum of the
    three families' curves (Note [routes]: each bounds the covering number of the same class).
    """
    if family == "auto":
        curves = [model_covering_curve(terms, family=f, seq_len=seq_len, head=head) for f in NORM_FAMILIES]
        return lambda eps, n: min(c(eps, n) for c in curves)
    tf = CoveringCurve(terms, family=family)
    if head is None:
        return lambda eps, n: tf(eps, max(1, int(round(n * seq_len))))
    shapes, spectral, biases, act_l, r0 = head
    hterms, log_C = mlp_terms(shapes, spectral, biases, input_radius=r0, act_lipschitz=act_l)
    mlp = CoveringCurve(hterms, family="spectral")

    def curve(eps: float, n: float) -> float:
        e_tf = math.nextafter(math.exp(math.log(eps) - math.log(2.0) - log_C) * (1.0 - 1e-15), 0.0)  # rounded down
        v = float(np.logaddexp(mlp(eps / 2.0, 1), tf(e_tf, max(1, int(round(n * seq_len))))))
        return math.nextafter(v + (abs(v) + 1.0) * 1e-15, math.inf)  # rounded up, as in composite_log_covering

    return curve


def model_bound(
    spec: TransformerSpec,
    *,
    eps: float = 0.1,
    n_samples: Sequence[float] = (1e6,),
    seq_len: int = 128,
    radius: float = 1.0,
    c_sm: float = 1.0,
    family: str = "auto",
    sigma_min: float = 0.0,
    reference: TransformerSpec | None = None,
    loss_lipschitz: float = 1.0,
    loss_bound: float = 1.0,
    delta: float = 0.05,
    terms: tuple | None = None,
) -> ModelBound:
    """Covering number at ``eps`` and generalisation gaps at each ``n`` for the class of ``spec``.

    .. math::

        \\log N_\\infty(\\mathcal F, \\varepsilon, n T)\\ \\text{(F9 / F10)}\\ \\to\\
        \\text{gap}(n) \\le 2\\,\\mathrm{Dudley} + 3b\\sqrt{\\ln(2/\\delta)/(2n)}\\ \\text{(F11)}

    The class: every model of this architecture whose per-matrix spectral norms are at most the
    spec's (so Lemma G.3's coefficients hold) and whose distances from the reference (0 or
    ``reference``) are at most the spec's, in the (2,1) norm and the spectral norm.  The matrices
    are covered by F2 (``family="l21"``), F1 on the spectral ball (``"spectral"``), the cheaper of
    the two per matrix inside Lemma G.1 (``"best"``), or all three computed and the smallest
    reported (``"auto"``, the default; ``route`` names the one reported, ``routes`` lists all,
    Note [routes]).  With an MLP head (reference models) the class is ``F_MLP o G_TF``
    (Theorem G.5), otherwise ``G_TF`` with a loss that is ``loss_lipschitz``-Lipschitz in the
    ``max_t ||.||_2`` output norm.  Choices (THEORY section 4): ``c_sm`` (1 tight, 2 Edelman),
    ``sigma_min`` (LayerNorm variance floor; 0 = the global eps-limited constant), ``family``,
    ``reference``; Pi_norm vs LayerNorm is the model's own (its NormSpec), reported in the assumptions.

    ``terms``: the output of :func:`model_terms` for the same spec, radius, c_sm, sigma_min and
    reference, to sweep eps / family / n without re-measuring the weights (the slow part).

    Raises:
        InputError: non-positive eps, sample sizes, seq_len, radius; unknown family; mismatched reference.
    """
    from ..lipschitz._attention import check_c_sm

    check_c_sm(c_sm)
    for name, v in (("eps", eps), ("radius", radius), ("loss_lipschitz", loss_lipschitz),
                    ("loss_bound", loss_bound), ("delta", delta)):
        _check(name, v)
    if not n_samples:
        raise InputError("give at least one sample size")
    for n in n_samples:
        _check("n_samples", n)
    if not isinstance(seq_len, int) or seq_len < 1:
        raise InputError(f"seq_len must be a positive integer, but got seq_len={seq_len!r}")
    if family not in MODEL_FAMILIES:
        raise InputError(f"family must be one of {MODEL_FAMILIES}, but got family={family!r}")
    if not (math.isfinite(sigma_min) and sigma_min >= 0):
        raise InputError(f"sigma_min must be >= 0, but got sigma_min={sigma_min!r}")
    if terms is None:
        terms = model_terms(spec, radius=radius, c_sm=c_sm, sigma_min=sigma_min, reference=reference)
    terms, out_radius, bft_rows = terms
    n0 = max(1, int(round(n_samples[0] * seq_len)))
    head = None
    mlp = None
    if spec.head is not None:
        shapes, spectral, biases, act_l = _head_parts(spec, out_radius)
        head = (shapes, spectral, biases, act_l, out_radius)
        mlp = mlp_log_covering(shapes, spectral, biases, eps / 2.0, input_radius=out_radius, act_lipschitz=act_l)

    def cover(fam: str) -> TransformerCovering | CompositeCovering:
        if mlp is not None:
            return composite_log_covering(terms, mlp, eps, n0, family=fam)
        return transformer_log_covering(terms, eps, n0, family=fam)

    # Note [routes]: every family bounds the covering number of the same class (all matrices whose
    # norms, (2,1) and spectral, are at most the model's), so each is certified and the smallest
    # may be reported; "auto" does that, at eps and pointwise along the Dudley curve.
    covers = {fam: cover(fam) for fam in NORM_FAMILIES}
    routes = {fam: c.log_log_N for fam, c in covers.items()}
    route = min(NORM_FAMILIES, key=lambda f: (routes[f], f != "best")) if family == "auto" else family
    covering = covers[route]
    tf = covering.transformer if isinstance(covering, CompositeCovering) else covering
    curve = model_covering_curve(terms, family=family, seq_len=seq_len, head=head)
    gens = tuple(generalisation_bound(curve, float(n), loss_lipschitz=loss_lipschitz, loss_bound=loss_bound,
                                      delta=delta) for n in n_samples)
    width = max(max(t.shape) for t in terms)
    bft = bft_spectral_complexity([max(s, 1e-300) for s, _ in bft_rows], [b for _, b in bft_rows], width=width,
                                  input_radius=radius)
    bft_gens = tuple(_bft_gap(bft.log_A + 2.0 * math.log(loss_lipschitz), float(n), loss_bound, delta)
                     for n in n_samples)
    norm_kinds = sorted({str(x.kind.value) for x in [spec.input_norm, spec.final_norm] if x is not None}
                        | {str(getattr(ly, nm).kind.value) for ly in spec.layers[:1] for nm in ("norm_attn", "norm_ffn")})
    has_ln = any(k in ("layernorm", "rmsnorm") for k in norm_kinds)
    assumptions = (
        f"input tokens have l2 norm <= R={radius:g}; softmax constant c_sm={c_sm:g}",
        f"normalisation in the model: {', '.join(norm_kinds)}"
        + ("" if not has_ln else f"; LayerNorm inputs have std >= {sigma_min:g}" if sigma_min > 0
           else "; LayerNorm: global max|gamma|/sqrt(eps) constant (no variance floor)"),
        (f"norm family auto (route {route}, the smallest certified log N of {', '.join(NORM_FAMILIES)}): "
         if family == "auto" else f"norm family {family}: matrices covered by ")
        + {"l21": "F2 ((2,1)-norm, 1/eps^2)", "spectral": "F1 (spectral ball, parameter count)",
           "best": "F1 or F2, whichever is cheaper per matrix at its own scale (Lemma G.1 over both)"}[route],
        f"reference matrices: {'the given initialisation' if reference is not None else 'zero'}",
        f"n samples of T={seq_len} tokens; loss in [0, {loss_bound:g}], {loss_lipschitz:g}-Lipschitz in the output; delta={delta:g}",
        "class = all weights with norms <= this model's (bound evaluated at the model's norms, no union over norm grids)",
        "Lemma G.3 coefficients from transcover.lipschitz (THEORY F6-F8, F14)",
    ) + (("Theorem G.5: MLP head covered by parameter count (F1)",) if head else ())
    opts = {"radius": radius, "c_sm": c_sm, "sigma_min": sigma_min, "loss_lipschitz": loss_lipschitz,
            "loss_bound": loss_bound, "delta": delta, "reference": reference is not None}
    return ModelBound(spec.name, spec.arch, spec.n_layers, float(eps), seq_len, family, covering, tf, gens, bft,
                      bft_gens, assumptions, options=opts, curve=curve, route=route, routes=routes)

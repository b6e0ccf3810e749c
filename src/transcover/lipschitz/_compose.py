"""Composition over sub-layers, layers and the whole network (THEORY F8), with radius propagation.

A network is a chain of *stages*: the input norm, then per layer the attention block (with its
residual), its normalisation, the FFN block (with its residual), its normalisation, then the final
norm (pre-norm layers fold each normalisation into its residual block).  Each stage ``s`` has

* an input radius ``r_s`` (every token of every input reaching it has norm ``<= r_s``), propagated
  from the domain radius R through the class bounds of the weights;
* an input-Lipschitz constant ``rho_s`` on that radius;
* a parameter-perturbation term ``delta_s = sum_i c_{s,i} ||dW_i||`` at fixed input.

Then (F8, telescoping ``S(θ;U) - S(θ~;U~) = [S(θ;U) - S(θ;U~)] + [S(θ;U~) - S(θ~;U~)]``)::

    Lip(network) <= prod_s rho_s,      ||g(θ)(X) - g(θ~)(X)|| <= sum_s (prod_{t > s} rho_t) delta_s.

Note [log space]: stage constants are moderate, but their products are not (MiniLM's Lemma G.3
coefficients are ~1e108 without a LayerNorm floor and deeper models overflow float64), so
products over the chain are formed as sums of :attr:`Stage.log_lipschitz`
(:func:`~transcover.lipschitz.log_perturbation_coefficients`).

Note [radius propagation]: bounding each stage on its *own* propagated radius is the tighter
composition; :attr:`NetworkLipschitz.upper_uniform` is the plain product that instead bounds
every radius-dependent stage on the worst radius of the chain.  Both are certified.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .._errors import InputError
from .._printed import up
from .._results import Kind, Quantity
from ..model import NormKind, Placement, sequence_too_long
from ._attention import (
    _check_metric,
    attention_lipschitz,
    check_c_sm,
    attention_output_radius,
    attention_perturbation_coefficients,
    relative_bias_perturbation_coefficients,
)
from ._ffn import ffn_lipschitz, ffn_output_radius, ffn_perturbation_coefficients
from ._l2_attention import l2_attention_lipschitz
from ._parallel import parallel_stage
from ._sandwich import post_normed_branch, sandwich_residual_lipschitz
from ._qknorm import qknorm_layer_kq, split_perturbation_coefficients
from ._normalisation import norm_lipschitz, norm_output_radius, norm_perturbation_coefficients
from ._weights import ROUNDING_PAD, ClassBounds, LayerBounds, NormBounds, check_radius, spec_norms

__all__ = ["Stage", "NetworkLipschitz", "build_chain", "compose", "lipschitz_bounds"]


@dataclass(frozen=True)
class Stage:
    """One link of the chain (see module docstring).  ``layer`` is -1 for the input norm and
    ``n_layers`` for the final norm; ``components`` holds the pieces' own constants."""

    layer: int
    name: str  # "input_norm" | "attention" | "norm_attn" | "ffn" | "norm_ffn" | "parallel" | "final_norm"
    radius_in: float
    radius_out: float
    lipschitz: float
    perturbation: tuple[tuple[str, float, str], ...]
    components: dict[str, float] = field(default_factory=dict)
    source: str = ""
    branch_radius: float = 0.0  # the radius the attention/FFN branch was bounded on

    @property
    def log_lipschitz(self) -> float:
        """``ln rho_s``: the chain composes in log space (Note [log space])."""
        return math.log(self.lipschitz)


@dataclass(frozen=True)
class NetworkLipschitz:
    """Certified input-Lipschitz bounds of a whole network, per stage, per layer and in total."""

    stages: tuple[Stage, ...]
    upper: Quantity  # propagated radii (Note [radius propagation])
    upper_uniform: Quantity  # worst radius everywhere
    metric: str
    radius: float
    c_sm: float
    sigma_min: float
    seq_len: int | None

    @property
    def n_layers(self) -> int:
        return max((s.layer for s in self.stages if s.name != "final_norm"), default=-1) + 1

    def layer_upper(self, index: int) -> Quantity:
        """rho_l: the product of the stage constants of layer ``index``."""
        value = math.prod(s.lipschitz for s in self.stages if s.layer == index) * (1.0 + ROUNDING_PAD)
        return Quantity(value, Kind.CERTIFIED_UPPER, "THEORY F6, F7, F8, F14", self.upper.assumptions)

    def __repr__(self) -> str:
        return (f"<NetworkLipschitz: {self.n_layers} layers, {len(self.stages)} stages, metric {self.metric}, "
                f"R={self.radius:g}; upper {up(self.upper.value, 4)} ({self.upper.kind.value}); .stages, .to_dict()>")

    def plot(self, ax=None, lower: dict | None = None):
        """Certified upper (and, given ``lower`` from ``lipschitz_lower``, empirical lower) per stage,
        layer and network: :class:`transcover.report.LipschitzDisplay` (returned, ``figure_`` set)."""
        from .._views import render

        return render("lipschitz.plot", self, ax=ax, lower=lower)

    def to_dict(self) -> dict[str, object]:
        return {
            "metric": self.metric, "radius": self.radius, "c_sm": self.c_sm,
            "sigma_min": self.sigma_min, "seq_len": self.seq_len,
            "upper": self.upper.to_dict(), "upper_uniform": self.upper_uniform.to_dict(),
            "stages": [
                {"layer": s.layer, "name": s.name, "radius_in": s.radius_in, "radius_out": s.radius_out,
                 "upper": s.lipschitz * (1.0 + ROUNDING_PAD), "components": s.components, "source": s.source}
                for s in self.stages
            ],
        }


def _assumptions(metric: str, radius: float, c_sm: float, sigma_min: float, seq_len: int | None,
                 has_ln: bool, layers: tuple = ()) -> tuple[str, ...]:
    out = [f"input tokens have l2 norm <= R={radius:g}",
           f"metric {'max over tokens of l2 norm (2,inf)' if metric == '2,inf' else f'Frobenius over T={seq_len} tokens'}",
           f"softmax constant c_sm={c_sm:g}"]
    if has_ln:
        out.append(f"every LayerNorm/RMSNorm input has std >= sigma_0={sigma_min:g}" if sigma_min > 0
                   else "LayerNorm/RMSNorm: global constant max|gamma|/sqrt(eps), no variance floor")
    P = min((L.rope_positions for L in layers if L.rope_positions is not None), default=None)
    if P is not None:  # B_KQ is the sup over the relative offsets of such sequences (THEORY F22)
        if seq_len is not None and seq_len > P:
            raise InputError(sequence_too_long(seq_len, P, "the model", "seq_len", rope=True))
        out.append(f"RoPE: sequences of at most max_position={P} tokens")
    return tuple(out)


def _norm_stage(layer: int, name: str, n: NormBounds, d: int, r: float, sigma_min: float) -> Stage:
    coeffs = tuple((f"{name}.{role}", c, nm) for role, c, nm in norm_perturbation_coefficients(n, d))
    L = norm_lipschitz(n, sigma_min)
    return Stage(layer, name, r, norm_output_radius(n, d, r), L, coeffs, {name: L}, "THEORY F14 / section 2")


def _attention_block(L: LayerBounds, r: float, c_sm: float, metric: str, seq_len: int | None) -> tuple[float, float, list]:
    """(Lipschitz of the branch, output radius of the branch, perturbation coefficients) on radius r."""
    if L.attention_kind == "l2":
        if seq_len is None:
            raise InputError("L2 attention's bound depends on the sequence length: give seq_len")
        lip = l2_attention_lipschitz(list(L.B_Q), list(L.B_V), L.B_O, L.d_head, seq_len, metric=metric,
                                     B_OV=list(L.B_OV))
        # ||f_i|| <= sum_h ||A_h W_V^h W_O^h|| ||sum_j P_ij x_j|| and the P-average stays in the r-ball.
        gain = sum(q * q / math.sqrt(L.d_head) * ov for q, ov in zip(L.B_Q, L.B_OV))
        # Parameter perturbation of L2 attention is not derived here; the chain marks it unavailable.
        return lip, r * gain + L.B_bout, [("L2 attention (Kim et al. 2021)", math.inf, "unsupported")]
    B_KQ, B_bKQ = (L.B_KQ, L.B_bKQ) if not (L.has_q_norm or L.has_k_norm) else qknorm_layer_kq(L, r)
    lip = attention_lipschitz(L.B_OV, B_KQ, r, c_sm=c_sm, B_bKQ=B_bKQ, B_V=L.B_V, B_O=L.B_O,
                              metric=metric, seq_len=seq_len)
    rad = attention_output_radius(L.B_OV, r, B_V=L.B_V, B_O=L.B_O, B_bout=L.B_bout)
    coeffs = attention_perturbation_coefficients(L.B_OV, r, c_sm=c_sm, has_query_bias=L.has_query_bias,
                                                 has_output_bias=L.has_output_bias)
    if L.split_scores:  # the scores are not a function of W_Q W_K^T: charged piece by piece (F22, F23)
        coeffs = split_perturbation_coefficients(L, r, c_sm)
    if L.has_pos_bias:  # an input-independent score term: |ds_ij| gains |dB_ij| (THEORY F28)
        coeffs = list(coeffs) + relative_bias_perturbation_coefficients(L.B_OV, r, c_sm=c_sm)
    return lip, rad, coeffs


def _ffn_block(L: LayerBounds, r: float) -> tuple[float, float, list]:
    kw = dict(B_b1=L.B_b1, B_Wg=L.B_Wg, B_bg=L.B_bg)
    lip = ffn_lipschitz(L.B_W1, L.B_W2, L.activation, radius=r, **kw)
    rad = ffn_output_radius(L.B_W1, L.B_W2, L.activation, r, B_b2=L.B_b2, **kw)
    coeffs = ffn_perturbation_coefficients(L.B_W1, L.B_W2, L.activation, r, has_b1=L.has_b1,
                                           has_b2=L.has_b2, has_bg=L.has_bg, **kw)
    return lip, rad, coeffs


def _layer_stages(L: LayerBounds, r: float, c_sm: float, metric: str, seq_len: int | None,
                  sigma_min: float, fixed_radius: float | None) -> list[Stage]:
    d = L.d_model
    rr = (lambda x: fixed_radius) if fixed_radius is not None else (lambda x: x)
    stages: list[Stage] = []
    if L.residual == "parallel":  # x + attn(N_1 x) + ffn(N_2 x): one stage (THEORY F21)
        return [parallel_stage(L, r, rr, _norm_stage, _attention_block, _ffn_block, sigma_min=sigma_min,
                               c_sm=c_sm, metric=metric, seq_len=seq_len)]
    if L.placement is Placement.POST:
        # x -> N_a(x + attn(x)) -> N_f(y + ffn(y))
        lip, rad, co = _attention_block(L, rr(r), c_sm, metric, seq_len)
        stages.append(Stage(L.index, "attention", r, r + rad, 1.0 + lip, tuple(co),
                            {"attention": lip}, "THEORY F6 (+1 residual)", rr(r)))
        stages.append(_norm_stage(L.index, "norm_attn", L.norm_attn, d, r + rad, sigma_min))
        y = stages[-1].radius_out
        lip, rad, co = _ffn_block(L, rr(y))
        stages.append(Stage(L.index, "ffn", y, y + rad, 1.0 + lip, tuple(co), {"ffn": lip},
                            "THEORY F7 (+1 residual)", rr(y)))
        stages.append(_norm_stage(L.index, "norm_ffn", L.norm_ffn, d, y + rad, sigma_min))
        return stages
    # PRE: x -> x + attn(N_a(x)) -> u + ffn(N_f(u)); the norm's perturbation passes through the branch.
    # A branch-output norm (Gemma 2/3, OLMo 2) wraps the branch: x + N_post(attn(N_a x)) (THEORY F26).
    for name, norm, post, block in (("attention", L.norm_attn, L.post_norm_attn, "attn"),
                                    ("ffn", L.norm_ffn, L.post_norm_ffn, "ffn")):
        ns = _norm_stage(L.index, "norm_" + block, norm, d, r, sigma_min)
        rn = ns.radius_out
        if block == "attn":
            lip, rad, co = _attention_block(L, rr(rn), c_sm, metric, seq_len)
        else:
            lip, rad, co = _ffn_block(L, rr(rn))
        co = list(co) + [(role, c * lip, nm) for role, c, nm in ns.perturbation]
        parts = {name: lip, ns.name: ns.lipschitz}
        source = ("THEORY F6" if block == "attn" else "THEORY F7") + " o F14, +1 residual"
        rho = 1.0 + lip * ns.lipschitz
        if post is not None:
            ps = _norm_stage(L.index, "post_norm_" + block, post, d, rad, sigma_min)
            _, rad, co = post_normed_branch(ps, lip * ns.lipschitz, co)
            rho = sandwich_residual_lipschitz(lip, ns.lipschitz, ps.lipschitz)
            parts[ps.name] = ps.lipschitz
            source = "THEORY F26: 1 + F14 o " + source.split(" o ")[0].removeprefix("THEORY ") + " o F14"
        stages.append(Stage(L.index, name, r, r + rad, rho, tuple(co), parts, source, rr(rn)))
        r = r + rad
    return stages


def build_chain(norms: ClassBounds, *, radius: float, c_sm: float, metric: str, seq_len: int | None,
                sigma_min: float, fixed_radius: float | None = None) -> list[Stage]:
    """The stage chain of a network class (see module docstring); ``fixed_radius`` forces one
    radius on every radius-dependent stage (the uniform composition)."""
    check_radius(radius)
    check_c_sm(c_sm)
    if not (sigma_min >= 0 and math.isfinite(sigma_min)):
        raise InputError(f"sigma_min must be >= 0, but got sigma_min={sigma_min!r}")
    _check_metric(metric, seq_len)
    d = norms.d_model
    stages = [_norm_stage(-1, "input_norm", norms.input_norm, d, radius, sigma_min)]
    r = stages[0].radius_out
    for L in norms.layers:
        stages += _layer_stages(L, r, c_sm, metric, seq_len, sigma_min, fixed_radius)
        r = stages[-1].radius_out
    stages.append(_norm_stage(len(norms.layers), "final_norm", norms.final_norm, d, r, sigma_min))
    return stages


def compose(norms: ClassBounds, *, radius: float = 1.0, c_sm: float = 1.0, metric: str = "2,inf",
            seq_len: int | None = None, sigma_min: float = 0.0) -> NetworkLipschitz:
    r"""Certified input-Lipschitz bound of the network, propagated and uniform (THEORY F8).

    .. math::

        \mathrm{Lip}(g_L) \le \prod_s \rho_s(r_s), \qquad r_{s+1} = \text{radius bound of stage } s\text{'s output}

    Assumptions: listed in the returned quantities (domain radius R, metric, c_sm, LayerNorm floor).
    """
    stages = build_chain(norms, radius=radius, c_sm=c_sm, metric=metric, seq_len=seq_len, sigma_min=sigma_min)
    r_max = max(s.branch_radius for s in stages)
    uniform = build_chain(norms, radius=radius, c_sm=c_sm, metric=metric, seq_len=seq_len,
                          sigma_min=sigma_min, fixed_radius=r_max)
    has_ln = any(n is not None and n.kind in (NormKind.LAYERNORM, NormKind.RMSNORM)
                 for n in [norms.input_norm, norms.final_norm]
                 + [m for L in norms.layers for m in (L.norm_attn, L.norm_ffn, L.post_norm_attn, L.post_norm_ffn)])
    assumptions = _assumptions(metric, radius, c_sm, sigma_min, seq_len, has_ln, norms.layers)
    if sigma_min > 0:
        empty = [f"layer {st.layer} {st.name} (inputs of norm <= {st.radius_in:.4g})"
                 for st in empty_domain_stages(norms, stages, sigma_min)]
        if empty:
            assumptions += (f"EMPTY DOMAIN: no input has std >= sigma_0={sigma_min:g} at "
                            + ", ".join(empty[:3]) + (f" and {len(empty) - 3} more" if len(empty) > 3 else "")
                            + ": the bound holds vacuously there",)
    if any(L.attention_kind == "l2" for L in norms.layers):
        assumptions += (f"L2 attention: sequences of N={seq_len} tokens (THEORY F13 corrected, after Kim "
                        "et al. 2021 Thm 3.2; no radius assumption)",)
    pad = 1.0 + ROUNDING_PAD
    up = Quantity(math.prod(s.lipschitz for s in stages) * pad, Kind.CERTIFIED_UPPER,
                  "THEORY F8 with propagated radii (F6, F7, F14)", assumptions)
    uni = Quantity(math.prod(s.lipschitz for s in uniform) * pad, Kind.CERTIFIED_UPPER,
                   f"THEORY F8, every stage on the worst radius {r_max:.4g}", assumptions)
    return NetworkLipschitz(tuple(stages), up, uni, metric, float(radius), float(c_sm), float(sigma_min), seq_len)


def empty_domain_stages(model, stages, sigma_min: float) -> list:  # noqa: ANN001
    """The stages of a chain (``stages``, as ``build_chain``'s) whose certified domain is empty: a norm the stage
    applies to its input needs std (or RMS) >= ``sigma_min``, and a row of norm <= ``radius_in`` has std (and RMS) <=
    ``radius_in / sqrt(d)``.  The bound holds there only vacuously (stop 38 red team: --sigma-min 0.5 at --radius 1,
    d = 16, certified 2.2e11 unremarked), and no witness exists (red team 218: an empirical lower was printed beside
    it).  ``model``: a ``TransformerSpec`` or its ``spec_norms`` (the same norm attributes)."""
    if not sigma_min > 0:
        return []
    out = []
    for st in stages:
        if st.layer in (-1, len(model.layers)):
            ns = [model.input_norm if st.layer == -1 else model.final_norm]
        else:  # a post-norm stage is the norm; a pre-norm branch stage applies its norm to the stage's input
            L = model.layers[st.layer]
            pre = {"attention": [L.norm_attn], "ffn": [L.norm_ffn], "parallel": [L.norm_attn, L.norm_ffn]}
            ns = ([getattr(L, st.name)] if st.name in ("norm_attn", "norm_ffn")
                  else pre.get(st.name, []) if L.placement is not Placement.POST else [])
        if any(n is not None and n.kind in (NormKind.LAYERNORM, NormKind.RMSNORM) for n in ns) \
                and sigma_min * math.sqrt(model.d_model) > st.radius_in:
            out.append(st)
    return out


def lipschitz_bounds(spec, *, radius: float = 1.0, c_sm: float = 1.0, metric: str = "2,inf",
                     seq_len: int | None = None, sigma_min: float = 0.0) -> NetworkLipschitz:
    r"""Certified input-Lipschitz bounds of ``spec``'s Transformer part ``g_L`` (input norm, layers,
    final norm; not the MLP head), per stage, per layer and whole.

    .. math::

        \|g_L(X) - g_L(X')\| \le \Big(\prod_s \rho_s(r_s)\Big)\|X - X'\|,\quad \|x_t\|, \|x'_t\| \le R

    Source: THEORY F8 composing F6 (attention), F7 (FFN), F14 (LayerNorm/RMSNorm), Pi_norm (1),
    residuals (+1), and F13 (corrected Kim et al. 2021 Thm 3.2) for L2 attention.
    Assumptions: token norms <= ``radius``; ``metric`` ``"2,inf"`` (T-independent) or ``"fro"``
    with ``seq_len``; LayerNorm inputs with std >= ``sigma_min`` when ``sigma_min > 0``
    (otherwise the global, eps-limited constant).

    Args:
        spec: a :class:`~transcover.model.TransformerSpec`, or its :class:`~transcover.norms.ModelNorms`
            (measured once, e.g. shared with a covering bound).
        radius: R > 0.
        c_sm: softmax constant >= 1 (F5: 1 is proven and tight; 2 is Edelman et al.'s).
        metric: ``"2,inf"`` or ``"fro"``.
        seq_len: T (required for ``"fro"`` and for L2 attention).
        sigma_min: LayerNorm variance floor sigma_0 >= 0.

    Returns:
        :class:`NetworkLipschitz` (``.upper``: propagated radii; ``.upper_uniform``: worst radius
        everywhere; ``.stages``; ``.layer_upper(i)``).

    Raises:
        InputError: non-positive radius, ``c_sm < 1``, bad metric, missing seq_len, eps = 0 LayerNorm
            without a floor.
    """
    check_radius(radius)
    return compose(spec_norms(spec), radius=radius, c_sm=c_sm, metric=metric, seq_len=seq_len,
                   sigma_min=sigma_min)

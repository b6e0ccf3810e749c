"""The computed centres of the stack route against the exact ones: the LayerNorm/RMSNorm forward's rounding and the
per-stage recursion of the centre error (issue 12; THEORY F64)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..model import NormKind, NormSpec
from ._local_jacobian import pow2_norm
from ._rounding import _gamma

_U = 2.0**-53

# What F17's default centre pad assumes, listed with every local certified result that uses it (THEORY F64).
CENTRE_PAD_ASSUMPTION = ("the float64 forward at the data within 1e-13 max||x_s|| of the exact intermediate values "
                         "(THEORY F64: confirmed on all-MiniLM-L6-v2 against an 80-bit forward with a margin of about "
                         "45; not guaranteed for tokens whose mean exceeds their spread by about 1e3 or more)")


def f17_pad(x: Tensor) -> float:
    """F17's centre pad ``1e-13 max_i ||x_i||`` for the computed ``x`` (the assumption ``CENTRE_PAD_ASSUMPTION``).
    Norms at powers of two (``pow2_norm``, THEORY F96)."""
    return 1e-13 * float(pow2_norm(x, 1).max())


def norm_forward_error(norm: NormSpec, X: Tensor) -> float:
    r"""A bound on ``max_i ||fl(N(x_i)) - N(x_i)||`` for the float64 tokens ``X`` (T, d): ``fl(N)`` the one-pass
    forward of ``NormSpec.__call__`` (``mu = mean x``, ``c = x - mu``, ``var = mean c^2``, ``y = c/sqrt(var + eps)
    gamma + beta``; RMSNorm without the centring), ``N`` the exact map of the same floats.  THEORY F64.

    .. math:: \|\hat y - y^*\| \le \frac{G (E + \sqrt d\, e_s)}{\hat s} + \gamma_3 \| |\hat c||\gamma|/\hat s + |\beta| \|

    with ``E = sqrt(d) gamma_{d+1} max|x| + gamma_1 ||c_hat||`` (``||c_hat - P x||``: the mean's rounding in every
    entry, then the subtraction's; 0 for RMSNorm), ``e_s = E/sqrt(d) + gamma_{d+4} s_hat`` (``|s_hat - s*|``: the
    variance, the ``eps`` addition and the root relative, ``sqrt(c^2/d + eps)`` 1-Lipschitz in ``||c||/sqrt d``),
    ``G = max|gamma|``, ``||c*||/s* <= sqrt d``.  The term ``G E/s_hat ~ G d^{3/2} u max|x| / s`` is the division by
    the spread of a token whose mean dwarfs it.  inf when ``s_hat <= e_s`` (no floor).  Assumes IEEE float64 with
    round to nearest (any summation order, FMA allowed) and ``sqrt`` correctly rounded.
    Norms at powers of two (``pow2_norm``, THEORY F96)."""
    X = X.detach().double()
    T, d = X.shape
    lay = norm.kind is NormKind.LAYERNORM
    g = torch.ones(d, dtype=torch.float64) if norm.weight is None else norm.weight.detach().double().reshape(d)
    b = torch.zeros(d, dtype=torch.float64) if norm.bias is None else norm.bias.detach().double().reshape(d)
    if lay:
        c = X - X.mean(dim=-1, keepdim=True)
        E = math.sqrt(d) * _gamma(d + 1) * X.abs().amax(dim=-1) + _gamma(1) * pow2_norm(c, -1)
    else:
        c, E = X, torch.zeros(T, dtype=torch.float64)
    s = torch.sqrt((c * c).mean(dim=-1) + float(norm.eps))
    # the forward's squares below 2^-1022 round absolutely (within 2^-1075 each, their mean within 2^-1073), which moves
    # the root by at most 2^-536.5: not in relative terms (F96; the same floats wherever s > 2^-430)
    es = E / math.sqrt(d) + _gamma(d + 4) * s + 2.0**-536
    G = float(g.abs().max())
    main = G * (E + math.sqrt(d) * es) / (s - es)  # 1/s* <= 1/(s_hat - e_s)
    tail = _gamma(3) * pow2_norm((c.abs() * g.abs()) / s[:, None] + b.abs(), -1)
    out = torch.where(s > es, main * (1 + _gamma(d + 8)) + tail * (1 + _gamma(d + 8)), math.inf)
    return float(torch.nan_to_num(out, nan=math.inf).max()) * (1 + 1e-12)


def centre_errors(loc: list[float], balls: list[float], e0: float = 0.0) -> list[float]:
    r"""Per stage ``s`` a bound ``e_s >= max_i ||xhat_{s,i} - x_{s,i}(X)||`` on the computed centres (``e_0 = e0``, 0 for
    the stored input),
    ``e_{s+1} = loc_s + B_s e_s`` (``loc_s`` the stage's own rounding at ``xhat_s``, ``B_s`` a (2,inf) Lipschitz
    bound of the stage on a ball around ``xhat_s`` of radius at least ``e_s``: the mean-value inequality on the
    segment from ``x_s`` to ``xhat_s``).  THEORY F64.  Only ``balls[:len(loc)]`` are read; 0 times inf is 0."""
    out = [e0]
    for lo, B in zip(loc, balls):
        out.append((lo + (B * out[-1] if out[-1] > 0 else 0.0)) * (1 + 1e-12))
    return out


# THEORY F64: assumed accuracy of float64 exp / erf / tanh (libm-quality, within 4 ulps), so an activation's
# evaluation errs by at most ACT_REL |z| (GELU: x/sqrt 2, erf, 1 + erf, the halving and the product)
ACT_REL = 16 * _U


def _absmm(A: Tensor, B: Tensor) -> Tensor:
    return A.abs() @ B.abs()


def ffn_forward_error(ffn, H: Tensor) -> float | None:  # noqa: ANN001
    r"""A bound on ``max_i ||fl(h + F(h)) - (h + F(h))||`` (``F(h) = act(h W_1 + b_1) W_2 + b_2``, ``ffn_forward``,
    not gated) at the float64 tokens ``H``; None for a gated FFN or a mixture.  THEORY F64.

    .. math:: \|e_y\| + \|W_2\|_F \|L_\sigma e_z + r_\sigma (|\hat z| + e_z)\| + \gamma_1 \|\hat o\|,\quad
              e_z = \gamma_{d+1}(|h||W_1| + |b_1|),\ e_y = \gamma_{d_{ff}+1}(|\hat a||W_2| + |b_2|)

    (Higham's ``gamma_n`` of each product with its bias, the activation's Lipschitz constant ``L_sigma`` and its
    evaluation error ``ACT_REL |z|``, then the residual sum), the abs products padded by ``gamma`` of their length.
    Norms at powers of two (``pow2_norm``, THEORY F96)."""
    from ..model import FFNSpec
    from ._activations import activation_lipschitz

    if not isinstance(ffn, FFNSpec) or ffn.gated:
        return None
    H = H.detach().double()
    d, dff = ffn.W_1.shape
    W1, W2 = ffn.W_1.detach().double(), ffn.W_2.detach().double()
    b1 = torch.zeros(dff, dtype=torch.float64) if ffn.b_1 is None else ffn.b_1.detach().double()
    b2 = torch.zeros(d, dtype=torch.float64) if ffn.b_2 is None else ffn.b_2.detach().double()
    z = H @ W1 + b1
    ez = _gamma(d + 1) * (_absmm(H, W1) + b1.abs()) / (1 - _gamma(d + 2))
    ea = activation_lipschitz(ffn.activation) * ez + ACT_REL * (z.abs() + ez)
    a = ffn.activation(z)
    ey = _gamma(dff + 1) * (_absmm(a, W2) + b2.abs()) / (1 - _gamma(dff + 2))
    out = H + a @ W2 + b2
    tot = pow2_norm(ey, -1) + float(pow2_norm(W2)) * pow2_norm(ea, -1) + _gamma(1) * pow2_norm(out, -1)
    return float(torch.nan_to_num(tot, nan=math.inf).max()) * (1 + _gamma(d + dff + 8))


def attention_forward_error(attn, X: Tensor) -> float | None:  # noqa: ANN001
    r"""A bound on ``max_i ||fl(x + A(x)) - (x + A(x))||_i`` (``attention_forward``: per head ``softmax(c q k^T) X W_OV^h``,
    ``q = [X, 1][W_Q; b_Q]``, ``k = X W_K``, ``W_OV^h = fl(W_V^h W_O^h)``, plus the folded bias) at the float64 tokens
    ``X``; None where the attention is not plain dot attention without masks (causal, window, RoPE, q/k norms,
    soft-cap, position bias).  THEORY F64.

    Scores: ``|s_hat - s| <= Delta = gamma_{2d+d_h+4} c |q~||k~|`` (abs products).  Softmax: the exact
    ``P_ij/P(s_hat)_ij`` is within ``e^{+-2 Delta_i}`` (``Delta_i = max_j Delta_ij``) and the computed one within
    ``e^{+-(2u range_i + 2 gamma_{T+12})}`` of ``P(s_hat)`` (the shift's rounding ``u |s_j - max|``, exp within 4 ulps, the
    sum and the division), so ``|P_hat - P| <= (e^{t_i} - 1) P_hat``.  Head output: ``(e^{t_i} - 1) sum_j P_hat_ij ||x_j||
    ||W_V^h||_F ||W_O^h||_F`` plus ``gamma_{T+d+d_h+2}`` times the abs evaluation ``|P_hat||X||W_V^h||W_O^h|``; the bias
    ``gamma_{H d_h+H+1}(|b_O| + sum_h |b_V^h||W_O^h|)``; the sum of ``H + 2`` terms ``gamma_{H+2}`` times its abs value.
    Norms at powers of two (``pow2_norm``, THEORY F96)."""
    if attn.kind != "dot" or attn.causal or any(getattr(attn, a, None) is not None for a in
                                                   ("window", "rope", "q_norm", "k_norm", "softcap", "position_bias")):
        return None
    X = X.detach().double()
    T, d = X.shape
    Xa = torch.cat([X, torch.ones_like(X[:, :1])], dim=-1)
    c = abs(float(attn.softmax_scale))
    tot = torch.zeros(T, dtype=torch.float64)
    absval = X.abs()
    for h in range(attn.n_heads):
        Wq, Wk, Wv, Wo = (w.detach().double() for w in attn.head(h))
        dh = Wq.shape[-1]
        Wqa = attn.W_Q_augmented(h).detach().double()
        s = attn.softmax_scale * ((Xa @ Wqa) @ (X @ Wk).T)
        Delta = (_gamma(2 * d + dh + 4) * c * (_absmm(Xa, Wqa) @ _absmm(X, Wk).T) / (1 - _gamma(2 * d + dh + 6))).amax(dim=-1)
        P = torch.softmax(s, dim=-1)
        rng = (s.amax(dim=-1) - s.amin(dim=-1))
        t = 2 * Delta + 2 * _U * rng * (1 + 4 * _U) + 2 * _gamma(T + 12)
        WOV = Wv @ Wo
        o = (P @ X) @ WOV
        eo = torch.expm1(t) * (P @ pow2_norm(X, -1)) * float(pow2_norm(Wv)) * float(pow2_norm(Wo))
        ab = _gamma(T + d + dh + 2) * (P.abs() @ X.abs() @ _absmm(Wv, Wo)) / (1 - _gamma(T + 2 * d + dh + 4))
        tot = tot + eo * (1 + _gamma(T + d + 4)) + pow2_norm(ab, -1)
        absval = absval + o.abs()
    bias = attn.effective_output_bias()
    if bias is not None:
        bsum = torch.zeros(d, dtype=torch.float64) if attn.b_O is None else attn.b_O.detach().double().abs()
        if attn.b_V is not None:
            for h in range(attn.n_heads):
                bsum = bsum + attn.b_V[attn.kv_index(h)].detach().double().abs() @ attn.head(h)[3].detach().double().abs()
        nb = attn.n_heads * (attn.head(0)[0].shape[-1] + 1) + 1
        tot = tot + _gamma(nb) * float(pow2_norm(bsum)) / (1 - _gamma(nb + 2))
        absval = absval + bias.detach().double().abs()
    tot = tot + _gamma(attn.n_heads + 2) * pow2_norm(absval, -1) / (1 - _gamma(attn.n_heads + 4))
    return float(torch.nan_to_num(tot, nan=math.inf).max()) * (1 + 1e-12)


def stage_forward_error(st, layer) -> float | None:  # noqa: ANN001
    """The stack sub-stage ``st``'s own rounding at its computed input (``norm_forward_error`` for a norm stage,
    ``ffn_forward_error`` for a post-LN FFN, ``attention_forward_error`` for a post-LN attention of ``layer``); None
    where none is derived (pre-LN stages: a norm inside).  THEORY F64."""
    from ..model import Placement
    from ._local_stack_maps import _NormLin

    if isinstance(st.lin, _NormLin):
        return norm_forward_error(st.lin.norm, st.x)
    if st.ffn is not None:
        return ffn_forward_error(st.ffn, st.x)
    if layer is not None and layer.placement is Placement.POST and st.name == f"layer {layer.index} attention":
        return attention_forward_error(layer.attention, st.x)
    return None

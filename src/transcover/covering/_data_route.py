"""The seed's own route, made non-vacuous: a covering (Dudley chaining) margin bound for a trained sparse Transformer.

THEORY F19 (docs/theory.md derives every constant).  For a small ``ReferenceTransformer`` (no
normalisation, dot-product attention, ReLU FFN, one linear head) the class is fixed by a *support*
``S`` (which weights may be non-zero) and a box ``|theta_j| <= B_W`` per tensor; everything else is
zero.  Then:

1. **Output sensitivity (a G.3 for this class, end to end).**  For two parameter sets whose
   per-piece norms are ``<= N`` and whose differences are ``<= D`` (spectral for matrices, l2 for
   vectors, max row norm for the positions), and every input with token norms ``<= xi``,

   .. math:: \\sup_x \\max_{a \\ne b} |\\Delta (z_a - z_b)(x)| \\le \\mathrm{propagate}(N, D),

   a bound linear in ``D`` (:func:`margin_change_bound`).  On the box, ``N_W = B_W a_W`` and
   ``D_W = r_W a_W`` with ``a_W = sqrt(max row count * max column count)`` of the support's 0/1
   matrix (``||W||_2 <= || |W| ||_2 <= B ||1_S||_2``, Perron-Frobenius, and Schur's test), so the
   margin moves by at most ``sum_W kappa_W r_W`` when every weight moves by at most ``r_W``.
2. **Parametric cover of the support only.**  A grid of spacing ``2 r_W`` on each of the ``p_W``
   free coordinates of ``W`` (``ceil(B_W / r_W)`` points each) is an ``t``-cover in sup norm of the
   margins when ``sum_W kappa_W r_W <= t``; with ``r_W = t p_W / (P kappa_W)`` (``P = sum p_W``),
   ``ln N_inf(t) <= sum_W p_W ln ceil(B_W kappa_W P / (p_W t))``.
3. **Chaining.**  The ramp loss ``l_gamma`` is ``1/gamma``-Lipschitz, so the shifted loss class
   (range ``[-1/2, 1/2]``) has ``ln N(eps, L2(P_n)) <= ln N_inf(gamma eps)``.  Dudley chaining with
   nested parents at ``eps_j = 2^{-(j+1)}`` and Massart's lemma on at most ``N(eps_j)`` increments of
   norm ``<= 3 eps_j``:

   .. math:: \\mathfrak R_n \\le \\min_J \\Big[\\varepsilon_J + \\frac{3\\sqrt 2}{\\sqrt n}
             \\sum_{j=1}^J \\varepsilon_j \\sqrt{\\ln N(\\varepsilon_j)}\\Big].

   The cover is in sup norm over the whole input domain, so this bounds the *expected* Rademacher
   complexity too.
4. **Generalisation.**  With probability ``>= 1 - delta``, for every support, box and margin in the
   countable menu (prior ``pi``; :func:`class_prior_nats`),

   .. math:: \\Pr[\\text{error}] \\le \\hat{\\mathbb E}\\, l_\\gamma + 2\\mathfrak R_n
             + \\sqrt{\\frac{\\ln(1/\\delta) + \\ln(1/\\pi)}{2n}}

   (symmetrisation + McDiarmid; Bartlett & Mendelson 2002, Mohri et al. 2018 Thm 3.3 with the
   expected complexity).  Nothing here depends on the quantisation grid: the box contains the
   trained float model as well as the quantised one, as long as both live on the support.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .._errors import InputError, WeightError, check_number, check_positive_int
from .._results import Kind

__all__ = [
    "check_supported", "margin_change_bound", "pair_norms", "box_sensitivities", "margin_log_cover",
    "chaining_rademacher", "class_prior_nats", "DataRouteBound", "covering_margin_bound", "margins",
]

_PAD = 1.0 + 1e-9  # covers the float64 rounding of the few hundred positive operations below (each <= 2^-53)
_RAMP_PAD = 1e-6  # float64 forward pass vs exact margin, divided by gamma (margins here are << 1e3)


def check_supported(cfg) -> None:  # noqa: ANN001  (a ReferenceConfig)
    """The class this module's constants are derived for; anything else is refused."""
    bad = []
    if cfg.norm != "none":
        bad.append(f"norm={cfg.norm!r} (needs 'none')")
    if cfg.attention != "dot":
        bad.append(f"attention={cfg.attention!r} (needs 'dot')")
    if cfg.activation != "relu":
        bad.append(f"activation={cfg.activation!r} (needs 'relu': 1-Lipschitz and |relu(u)| <= |u|)")
    if tuple(cfg.head_hidden):
        bad.append(f"head_hidden={cfg.head_hidden!r} (needs one linear head)")
    if cfg.d_input is None or cfg.max_len is None:
        bad.append("an embedding and learned positions")
    if bad:
        raise InputError("the covering margin route supports small ReferenceTransformers only; got " + ", ".join(bad))


# -- 1. sensitivity ------------------------------------------------------------------------------
def margin_change_bound(cfg, N: Mapping, D: Mapping, xi: float) -> float:  # noqa: ANN001
    """Upper bound on ``sup_x max_{a != b} |(z_a - z_b)(x; theta') - (z_a - z_b)(x; theta)|``.

    ``N[key]`` bounds the norm of a piece in both parameter sets, ``D[key]`` the norm of its
    difference; keys: ``"embed"`` (spectral), ``"pos"`` (max row l2), ``("blocks.l.W_Q", h)`` ...
    ``("blocks.l.W_O", h)`` (spectral of head h's slice), ``"blocks.l.W_1"``, ``"blocks.l.W_2"``
    (spectral), ``"blocks.l.b_1"``, ``"blocks.l.b_2"`` (l2), ``"head.w"`` (max over class pairs of
    ``||A_a - A_b||_2``), ``"head.b"`` (max over pairs of ``|c_a - c_b|``).  Missing keys are 0.
    Input tokens have l2 norm ``<= xi``.  Derivation: docs/theory.md F19 (residual stream radius
    ``R`` and deviation ``e`` per layer; softmax moves by ``||P' - P||_1 <= max_u |ds_u|``).

    Checked (red team 204): ``xi`` a finite number > 0 and every ``N``/``D`` value a finite number >= 0, else
    :class:`InputError`.  The recursion is a sum of products of these, so a negative ``xi`` gave a negative
    "bound" and a NaN (the norms of NaN weights) a NaN one, both reported as certified.
    """
    xi = check_number(xi, "xi", low=0.0, strict=True)
    for which, norms in (("N", N), ("D", D)):
        for key, value in norms.items():
            check_number(value, f"{which}[{key!r}]", low=0.0)
    n = lambda k: float(N.get(k, 0.0))  # noqa: E731
    d = lambda k: float(D.get(k, 0.0))  # noqa: E731
    R = xi * n("embed") + n("pos")
    e = xi * d("embed") + d("pos")
    scale = 1.0 / math.sqrt(cfg.head_dim)
    for layer in range(cfg.n_layers):
        p = f"blocks.{layer}."
        att_n, att_d = 0.0, 0.0
        for h in range(cfg.n_heads):
            q, k, v = (n((p + w, h)) * R for w in ("W_Q", "W_K", "W_V"))
            dq, dk, dv = (d((p + w, h)) * R + n((p + w, h)) * e for w in ("W_Q", "W_K", "W_V"))
            ds = (dq * k + q * dk) * scale
            dhead = dv + ds * v  # sum_u P'(v' - v) + sum_u (P' - P) v
            att_n += n((p + "W_O", h)) * v
            att_d += d((p + "W_O", h)) * v + n((p + "W_O", h)) * dhead
        R, e = R + att_n, e + att_d
        u = n(p + "W_1") * R + n(p + "b_1")
        du = d(p + "W_1") * R + n(p + "W_1") * e + d(p + "b_1")
        R, e = R + n(p + "W_2") * u + n(p + "b_2"), e + d(p + "W_2") * u + n(p + "W_2") * du + d(p + "b_2")
    return (d("head.w") * R + n("head.w") * e + d("head.b")) * _PAD


def _spectral_upper(W: Tensor) -> float:
    """``min(||W||_F, sqrt(||W||_1 ||W||_inf)) >= ||W||_2``, rounded up (float64, small matrices)."""
    W = W.detach().double().reshape(W.shape[0], -1) if W.dim() != 2 else W.detach().double()
    fro = float(W.pow(2).sum().sqrt())
    schur = math.sqrt(float(W.abs().sum(0).max()) * float(W.abs().sum(1).max()))
    return min(fro, schur) * _PAD


def _pieces(cfg, state: Mapping[str, Tensor]) -> dict:  # noqa: ANN001
    """Every piece of the parameters that :func:`margin_change_bound` charges, as a tensor."""
    out: dict = {"embed": state["embed.weight"], "pos": state["pos"]}
    for layer in range(cfg.n_layers):
        p = f"blocks.{layer}."
        for w in ("W_Q", "W_K", "W_V", "W_O"):
            for h in range(cfg.n_heads):
                out[(p + w, h)] = state[p + w][h]
        for w in ("W_1", "W_2", "b_1", "b_2"):
            if p + w in state:
                out[p + w] = state[p + w]
    out["head.w"], out["head.b"] = state["head.0.weight"], state["head.0.bias"]
    return out


def _piece_norm(key, T: Tensor) -> float:  # noqa: ANN001
    T = T.detach().double()
    if key == "pos":
        return float(T.pow(2).sum(1).sqrt().max()) * _PAD
    if key == "head.w":
        c = T.shape[0]
        return max(float((T[a] - T[b]).pow(2).sum().sqrt()) for a in range(c) for b in range(c) if a != b) * _PAD
    if key == "head.b":
        return float(T.max() - T.min()) * _PAD
    if T.dim() == 1:
        return float(T.pow(2).sum().sqrt()) * _PAD
    return _spectral_upper(T)


def pair_norms(cfg, state_a: Mapping[str, Tensor], state_b: Mapping[str, Tensor]) -> tuple[dict, dict]:  # noqa: ANN001
    """``(N, D)`` for two specific parameter sets: ``N`` the larger norm of each piece, ``D`` the norm of the difference."""
    pa, pb = _pieces(cfg, state_a), _pieces(cfg, state_b)
    N = {k: max(_piece_norm(k, pa[k]), _piece_norm(k, pb[k])) for k in pa}
    D = {k: _piece_norm(k, pb[k] - pa[k]) for k in pa}
    return N, D


def _support_norm(key, S: Tensor, B: float) -> float:  # noqa: ANN001
    """The largest norm of a piece with ``|entries| <= B`` on the 0/1 support ``S`` (exact integers, then ``* B``)."""
    S = (S != 0).long()
    if key == "pos":
        return B * math.sqrt(int(S.sum(1).max()))
    if key == "head.w":
        c, cnt = S.shape[0], S.sum(1).tolist()
        return B * max(math.sqrt(cnt[a]) + math.sqrt(cnt[b]) for a in range(c) for b in range(c) if a != b) * _PAD
    if key == "head.b":
        top = sorted(S.tolist(), reverse=True)
        return B * (top[0] + top[1])
    if S.dim() == 1:
        return B * math.sqrt(int(S.sum()))
    return B * math.sqrt(int(S.sum(0).max()) * int(S.sum(1).max())) * _PAD


def _tensor_of(key) -> str:  # noqa: ANN001
    if isinstance(key, tuple):
        return key[0]
    return {"embed": "embed.weight", "pos": "pos", "head.w": "head.0.weight", "head.b": "head.0.bias"}.get(key, key)


def box_sensitivities(cfg, supports: Mapping[str, Tensor], boxes: Mapping[str, float], xi: float) -> dict[str, float]:  # noqa: ANN001
    """``kappa_W``: the margin moves by at most ``sum_W kappa_W r_W`` between any two parameter sets
    in the box class (support ``supports[W]``, ``|theta| <= boxes[W]``) whose entries differ by ``<= r_W``.

    Linear in the ``D``s (see :func:`margin_change_bound`), so ``kappa_W`` is the bound with unit
    entry differences on ``W``'s support and none elsewhere.
    """
    pieces = _pieces(cfg, supports)
    N = {k: _support_norm(k, S, boxes.get(_tensor_of(k), 0.0)) for k, S in pieces.items()}
    kappa = {}
    for name in supports:
        if not bool(supports[name].any()):
            continue
        D = {k: _support_norm(k, S, 1.0) for k, S in pieces.items() if _tensor_of(k) == name}
        kappa[name] = margin_change_bound(cfg, N, D, xi)
    return kappa


# -- 2. cover and 3. chaining ----------------------------------------------------------------------
def margin_log_cover(t: float, kappa: Mapping[str, float], p: Mapping[str, int], boxes: Mapping[str, float]) -> float:
    """``ln N_inf(t)`` of the margins of the box class: ``sum_W p_W ln ceil(B_W kappa_W P / (p_W t))`` (F19)."""
    if not t > 0:
        raise InputError(f"t must be > 0, but got t={t!r}")
    P = sum(p[w] for w in kappa)
    total = 0.0
    for w, k in kappa.items():
        if p[w] and k > 0 and boxes[w] > 0:
            points = math.ceil(boxes[w] * k * P / (p[w] * t) * _PAD)
            total += p[w] * math.log(points)
    return total * _PAD


def chaining_rademacher(log_cover: Callable[[float], float], n: int, levels: int = 40) -> tuple[float, int]:
    """``min_J eps_J + 3 sqrt(2/n) sum_{j<=J} eps_j sqrt(ln N(eps_j))``, ``eps_j = 2^-(j+1)``, rounded up; and the best J.

    ``log_cover(eps)`` is ``ln N(eps)`` of a class with values in ``[-1/2, 1/2]`` in ``L2(P_n)``
    (Dudley chaining with nested parents; Massart's lemma; F19 step 3)."""
    best, best_J, acc = 0.5, 0, 0.0
    for J in range(1, levels + 1):
        eps = 2.0 ** -(J + 1)
        acc += eps * math.sqrt(max(0.0, log_cover(eps)))
        value = (eps + 3.0 * math.sqrt(2.0 / n) * acc) * _PAD
        if value < best:
            best, best_J = value, J
    return best, best_J


# -- 4. the bound -----------------------------------------------------------------------------------
def _gamma_bits(k: int) -> int:
    """Elias gamma length of ``zigzag(k) + 1`` (the prior over an integer exponent)."""
    z = 2 * k if k >= 0 else -2 * k - 1
    return 2 * (z + 1).bit_length() - 1


def class_prior_nats(menu_size: int, supports: Mapping[str, Tensor], box_exponents: Mapping[str, int],
                     gamma_exponent: int) -> float:
    """``ln(1/pi)``: the architecture, each tensor's non-zero count and pattern, the box exponents, the margin.

    ``pi = (1/|menu|) prod_W [1/(p_W + 1)] [1/C(p_W, s_W)] 2^{-gamma(b_W)} * 2^{-gamma(g)}`` sums to at
    most 1 over the countable menu (each factor is a probability over its own choice).

    ``menu_size`` must be an ``int`` >= 1 (:class:`InputError` otherwise; red team 204): a size below 1 made
    ``ln |menu|`` negative (a smaller "certified" bound) or a math domain error, and a float size is no menu."""
    nats = math.log(check_positive_int(menu_size, "menu_size"))
    for name, S in supports.items():
        p, s = S.numel(), int((S != 0).sum())
        nats += math.log(p + 1) + math.log(math.comb(p, s))
        if s:
            nats += _gamma_bits(box_exponents[name]) * math.log(2.0)
    nats += _gamma_bits(gamma_exponent) * math.log(2.0)
    return nats * _PAD + 1e-12


@torch.no_grad()
def margins(model, X: Tensor, y: Tensor, batch: int = 8192) -> Tensor:  # noqa: ANN001
    """``z_y - max_{j != y} z_j`` per sample (float64 forward)."""
    out = []
    for s in range(0, X.shape[0], batch):
        z = model(X[s : s + batch].double())
        yy = y[s : s + batch]
        zy = z.gather(1, yy[:, None])[:, 0]
        other = z.scatter(1, yy[:, None], -math.inf).max(1).values
        out.append(zy - other)
    return torch.cat(out)


@dataclass(frozen=True)
class DataRouteBound:
    """The covering/Dudley margin bound (F19) for one model on its support: a certified upper bound on the test error."""

    value: float
    ramp_loss: float  # empirical ramp loss at gamma (exact up to the float64 pad)
    rademacher: float  # the chaining bound on the Rademacher complexity (x2 in value)
    concentration: float
    prior_nats: float
    gamma: float
    chaining_levels: int
    nonzeros: int
    n: int
    delta: float
    xi: float
    kappa: dict[str, float] = field(default_factory=dict)
    boxes: dict[str, float] = field(default_factory=dict)
    kind: Kind = Kind.CERTIFIED_UPPER

    def to_dict(self) -> dict:
        return {"value": self.value, "kind": self.kind.value,
                "source": "THEORY F19: parametric cover of the support + Dudley chaining + ramp loss",
                "ramp_loss": self.ramp_loss, "two_rademacher": 2 * self.rademacher,
                "concentration": self.concentration, "prior_nats": self.prior_nats, "gamma": self.gamma,
                "chaining_levels": self.chaining_levels, "nonzeros": self.nonzeros, "n": self.n,
                "delta": self.delta, "input_token_norm": self.xi, "kappa": self.kappa, "boxes": self.boxes}


def covering_margin_bound(model, X: Tensor, y: Tensor, *, menu_size: int, xi: float, delta: float = 0.05,
                          gamma_exponents: range = range(-24, 17)) -> DataRouteBound:  # noqa: ANN001
    """F19 for ``model`` (its non-zero weights are the support) on the ``n`` training samples ``(X, y)``.

    The box of tensor W is ``2^{b_W}`` with ``b_W = ceil(log2 max|W|)``; the margin ``gamma = 2^{g/4}``
    is chosen on the grid to minimise the bound (both paid in the prior).  Assumptions: samples
    i.i.d. and the menu fixed before them; input tokens of l2 norm ``<= xi``; the architecture
    passes :func:`check_supported`.

    Checked up front, each refused with a one-line :class:`InputError` (red team 204): ``delta`` a number in
    (0, 1) (``delta >= 1`` made ``ln(1/delta) <= 0`` and so a *smaller* "certified" value, NaN returned 1.0, 0
    divided by zero); ``menu_size`` an ``int`` >= 1 (see :func:`class_prior_nats`); ``X`` of shape
    ``(n, T, d_input)`` with ``1 <= T <= max_len`` and ``y`` integer class ids in ``[0, n_outputs)`` (these
    failed as raw RuntimeErrors deep in the forward pass or :func:`margins`); finite weights (a NaN
    weight gave NaN margins, read as a vacuous 1.0 rather than refused: :class:`WeightError`).
    """
    cfg = model.cfg
    check_supported(cfg)
    xi = check_number(xi, "xi", low=0.0, strict=True)
    delta = check_number(delta, "delta", low=0.0, strict=True, below=1.0)
    check_positive_int(menu_size, "menu_size")
    shape = f"(n, T, d_input={cfg.d_input}) with 1 <= T <= max_len={cfg.max_len}"
    if not isinstance(X, Tensor) or X.dim() != 3 or X.shape[2] != cfg.d_input:
        got = tuple(X.shape) if isinstance(X, Tensor) else type(X).__name__
        raise InputError(f"X must be a tensor of shape {shape}, but got {got}")
    if not 1 <= X.shape[1] <= cfg.max_len:
        raise InputError(f"X has T={X.shape[1]} tokens per sample, but the model takes {shape}")
    if not isinstance(y, Tensor) or y.dim() != 1 or y.dtype.is_floating_point or y.dtype.is_complex \
            or y.dtype == torch.bool:
        got = f"{y.dtype} of shape {tuple(y.shape)}" if isinstance(y, Tensor) else type(y).__name__
        raise InputError(f"y must be a 1-D tensor of integer class ids, but got {got}")
    n = int(X.shape[0])
    if n == 0 or y.shape[0] != n:
        raise InputError(f"need as many labels as samples (> 0), but got {n} samples and {y.shape[0]} labels")
    low, high = int(y.min()), int(y.max())
    if low < 0 or high >= cfg.n_outputs:
        raise InputError(f"labels must be class ids in [0, {cfg.n_outputs - 1}] (n_outputs={cfg.n_outputs}), "
                         f"but got labels from {low} to {high}")
    y = y.long()
    for name, v in model.state_dict().items():
        if v.is_floating_point() and not bool(v.isfinite().all()):
            raise WeightError(f"model weight {name} has NaN or infinite entries; the covering bound needs finite "
                              "weights")
    # the sensitivities assume every token's norm <= xi; a sample that breaks it breaks the bound on the very
    # points it is stated for (tokens of norm 50 with xi = 1 certified 0.119 against 0.172; red team 37j)
    tokens = X.detach().double()
    largest = float(tokens.norm(dim=-1).max())
    if not largest <= xi * (1 + 1e-12):  # the computed norm's rounding (digits' all-ones token is sqrt(8) = xi)
        raise InputError(f"a training token has l2 norm {largest:.6g} > xi={xi!r}: the data route's sensitivities "
                         "assume every input token's norm is at most xi")
    state = {k: v.detach().double() for k, v in model.state_dict().items()}
    supports = {k: (v != 0) for k, v in state.items()}
    exps = {k: math.frexp(float(v.abs().max()))[1] for k, v in state.items() if bool(v.any())}
    # frexp: max = f 2^e with f in [0.5, 1), so 2^e >= max; e - 1 when max is an exact power of two
    exps = {k: (e - 1 if float(state[k].abs().max()) == 2.0 ** (e - 1) else e) for k, e in exps.items()}
    boxes = {k: 2.0 ** e for k, e in exps.items()}
    kappa = box_sensitivities(cfg, supports, boxes, xi)
    p = {k: int(S.sum()) for k, S in supports.items()}
    m = margins(model, X, y)
    best = None
    for g in gamma_exponents:
        gamma = 2.0 ** (g / 4)
        ramp = float(torch.clamp(1.0 - m / gamma, 0.0, 1.0).sum()) / n * _PAD + _RAMP_PAD / gamma
        rad, J = chaining_rademacher(lambda eps: margin_log_cover(gamma * eps, kappa, p, boxes), n)
        prior = class_prior_nats(menu_size, supports, exps, g)
        conc = math.sqrt((-math.log(delta) + prior) / (2 * n)) * _PAD  # 1 / 5e-324 overflowed to inf
        value = min(1.0, (ramp + 2 * rad + conc) * _PAD)
        if best is None or value < best.value:
            best = DataRouteBound(value, ramp, rad, conc, prior, gamma, J, sum(p.values()), n, delta, xi,
                                  dict(kappa), dict(boxes))
    return best

"""An attacker's toolkit for the certified Lipschitz and perturbation bounds (test helper).

Written independently of ``transcover.lipschitz._empirical`` and of the project's forward passes:

* ``ref_*``: the forward semantics of a :class:`~transcover.model.TransformerSpec` re-implemented
  from the spec's documented conventions (raw biases, RoPE through complex rotations, GQA through
  explicit head indices, activations in closed form), always in float64.  ``ref_network`` also
  returns the smallest spread (std for LayerNorm, RMS for RMSNorm) seen by any normalisation, so a
  witness can be checked against a variance floor.  The tests cross-check these with the
  project's forward once, so a bug shared by the forward and the bound cannot hide a violation.
* :func:`attack_pairs`: projected Adam ascent on ``log ||f(X) - f(Y)|| / ||X - Y||`` over pairs
  inside the domain, parametrised as ``Y = X + exp(s) U`` (log-distance ``s``, unit direction ``U``)
  so one run moves freely between the Jacobian regime and far pairs; restarts from near pairs,
  far pairs, repeated tokens, small tokens; then full-Jacobian power iteration in the metric
  ((2,inf): alternating row-block maximisation; Frobenius: the exact top singular vector), whose
  directions are turned into explicit pairs.  Both points of a pair go through the map in one batch (one forward and
  one backward a step), and the Jacobians of all points come from one batched backward: the map must act on each
  batch element alone, which the first step checks.  Every reported value is a ratio at an explicit pair
  of points of the domain -- a true lower bound up to the float64 rounding of two forward passes,
  which :func:`slack` accounts for.
* :func:`attack_gap`: the same ascent for ``sup_X ||g_A(X) - g_B(X)||`` (Lemma G.3).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

torch.set_num_threads(1)

F64 = torch.float64
EPS64 = torch.finfo(F64).eps


def _f(w) -> Tensor | None:  # noqa: ANN001  (a spec array as exact float64)
    if w is None:
        return None
    return torch.as_tensor(w).detach().to(F64)


# -- independent forward passes ----------------------------------------------------------------
def _act(name: str, u: Tensor) -> Tensor:
    if name == "relu":
        return u.clamp_min(0.0)
    if name == "gelu":
        return 0.5 * u * (1.0 + torch.erf(u / math.sqrt(2.0)))
    if name == "gelu_tanh":
        return 0.5 * u * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (u + 0.044715 * u**3)))
    if name == "silu":
        return u / (1.0 + torch.exp(-u))
    assert name == "identity", name
    return u


def ref_norm(n, X: Tensor, spreads: list | None = None) -> Tensor:  # noqa: ANN001
    """LayerNorm / RMSNorm / Pi_norm / identity on the last dimension, from the formulas."""
    kind = "none" if n is None else n.kind.value
    if kind == "none":
        return X
    if kind == "ball":
        r = torch.linalg.vector_norm(X, dim=-1, keepdim=True)
        return torch.where(r > 1.0, X / r, X)
    if kind == "layernorm":
        c = X - X.mean(-1, keepdim=True)
        s2 = (c * c).mean(-1, keepdim=True)
    else:
        c = X
        s2 = (X * X).mean(-1, keepdim=True)
    if spreads is not None:
        spreads.append(s2.sqrt().amin(dim=(-2, -1)))
    y = c / torch.sqrt(s2 + float(n.eps))
    if n.weight is not None:
        y = y * _f(n.weight)
    if n.bias is not None:
        y = y + _f(n.bias)
    return y


def _rope(x: Tensor, theta: float, rotary_dim: int | None, inv_freq: tuple | None = None) -> Tensor:
    """Rotate (x_k, x_{k+half}) as the complex number x_k + i x_{k+half} by pos * theta^(-2k/rd)
    (or by pos * inv_freq[k] for scaled RoPE)."""
    T, dh = x.shape[-2], x.shape[-1]
    rd = rotary_dim or dh
    half = rd // 2
    inv = theta ** (-2.0 * torch.arange(half, dtype=F64) / rd) if inv_freq is None else torch.tensor(inv_freq, dtype=F64)
    ang = torch.arange(T, dtype=F64)[:, None] * inv[None, :]
    z = torch.complex(x[..., :half], x[..., half:rd]) * torch.polar(torch.ones_like(ang), ang)
    return torch.cat([z.real, z.imag, x[..., rd:]], dim=-1)


def ref_attention(a, X: Tensor) -> Tensor:  # noqa: ANN001
    """Multi-head attention without residual: dot-product (biases, GQA, RoPE, causal) or L2 (Kim)."""
    H, Hkv, dh = a.W_Q.shape[0], a.W_K.shape[0], a.W_Q.shape[2]
    T = X.shape[-2]
    out = torch.zeros_like(X)
    for h in range(H):
        g = h * Hkv // H
        Wq, Wo = _f(a.W_Q[h]), _f(a.W_O[h])
        if a.kind == "l2":
            q = X @ Wq
            dist2 = ((q[..., :, None, :] - q[..., None, :, :]) ** 2).sum(-1)
            P = torch.softmax(-dist2 / math.sqrt(dh), dim=-1)
            out = out + P @ X @ (Wq @ Wq.T / math.sqrt(dh)) @ _f(a.W_V[h]) @ Wo
            continue
        q = X @ Wq + (0.0 if a.b_Q is None else _f(a.b_Q[h]))
        k = X @ _f(a.W_K[g]) + (0.0 if a.b_K is None else _f(a.b_K[g]))
        v = X @ _f(a.W_V[g]) + (0.0 if a.b_V is None else _f(a.b_V[g]))
        for n, which in ((a.q_norm, "q"), (a.k_norm, "k")):  # per-head RMSNorm before RoPE (Qwen3)
            if n is not None:
                u = q if which == "q" else k
                u = _f(n.weight) * u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + n.eps)
                q, k = (u, k) if which == "q" else (q, u)
        if a.rope is not None:
            fr = getattr(a.rope, "inv_freq_values", None)
            q, k = _rope(q, a.rope.theta, a.rope.rotary_dim, fr), _rope(k, a.rope.theta, a.rope.rotary_dim, fr)
        scale = a.scale if a.scale is not None else 1.0 / math.sqrt(dh)
        s = scale * q @ k.transpose(-1, -2)
        if getattr(a, "softcap", None) is not None:  # Gemma 2's logit soft-capping
            s = a.softcap * torch.tanh(s / a.softcap)
        if a.causal:
            s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf)
        out = out + torch.softmax(s, dim=-1) @ v @ Wo
    return out if a.b_O is None else out + _f(a.b_O)


def ref_ffn(m, X: Tensor) -> Tensor:  # noqa: ANN001
    u = X @ _f(m.W_1) + (0.0 if m.b_1 is None else _f(m.b_1))
    if m.W_gate is not None:
        gate = X @ _f(m.W_gate) + (0.0 if m.b_gate is None else _f(m.b_gate))
        hidden = _act(m.activation.value, gate) * u
    else:
        hidden = _act(m.activation.value, u)
    return hidden @ _f(m.W_2) + (0.0 if m.b_2 is None else _f(m.b_2))


def _post(layer, block: str, Y: Tensor, spreads: list | None) -> Tensor:  # noqa: ANN001
    """The branch-output norm ``post_norm_<block>`` applied to a branch's output (identity if absent)."""
    n = getattr(layer, f"post_norm_{block}", None)
    return Y if n is None else ref_norm(n, Y, spreads)


def ref_layer(layer, X: Tensor, spreads: list | None = None) -> Tensor:  # noqa: ANN001
    if layer.residual.value == "parallel":  # GPT-NeoX: both branches read the block's input
        return (X + ref_attention(layer.attention, ref_norm(layer.norm_attn, X, spreads))
                + ref_ffn(layer.ffn, ref_norm(layer.norm_ffn, X, spreads)))
    if layer.placement.value == "pre":  # branch-output norms (Gemma 2/3, OLMo 2): x + N_post(f(N_pre x))
        X = X + _post(layer, "attn", ref_attention(layer.attention, ref_norm(layer.norm_attn, X, spreads)), spreads)
        return X + _post(layer, "ffn", ref_ffn(layer.ffn, ref_norm(layer.norm_ffn, X, spreads)), spreads)
    X = ref_norm(layer.norm_attn, X + ref_attention(layer.attention, X), spreads)
    return ref_norm(layer.norm_ffn, X + ref_ffn(layer.ffn, X), spreads)


def ref_network(spec, X: Tensor, spreads: list | None = None) -> Tensor:  # noqa: ANN001
    X = ref_norm(spec.input_norm, X, spreads)
    for layer in spec.layers:
        X = ref_layer(layer, X, spreads)
    return ref_norm(spec.final_norm, X, spreads)


def ref_stage(spec, layer_index: int, name: str) -> Callable[[Tensor, list | None], Tensor]:  # noqa: ANN001
    """The map of one stage of ``lipschitz_bounds``'s chain (names as in ``Stage.name``), or of a
    whole layer (``"layer"``) / the network (``"network"``)."""
    if name == "network":
        return lambda X, s: ref_network(spec, X, s)
    if name == "input_norm":
        return lambda X, s: ref_norm(spec.input_norm, X, s)
    if name == "final_norm":
        return lambda X, s: ref_norm(spec.final_norm, X, s)
    lay = spec.layers[layer_index]
    if name in ("layer", "parallel"):  # a parallel-residual layer is one stage of the chain
        return lambda X, s: ref_layer(lay, X, s)
    if name in ("norm_attn", "norm_ffn"):
        return lambda X, s: ref_norm(getattr(lay, name), X, s)
    pre = lay.placement.value == "pre"
    if name == "attention":
        if pre:
            return lambda X, s: X + _post(lay, "attn", ref_attention(lay.attention, ref_norm(lay.norm_attn, X, s)), s)
        return lambda X, s: X + ref_attention(lay.attention, X)
    assert name == "ffn", name
    if pre:
        return lambda X, s: X + _post(lay, "ffn", ref_ffn(lay.ffn, ref_norm(lay.norm_ffn, X, s)), s)
    return lambda X, s: X + ref_ffn(lay.ffn, X)


# -- the domain ----------------------------------------------------------------------------------
def mnorm(Y: Tensor, metric: str) -> Tensor:
    """Per batch element: max_t ||y_t|| for (2,inf), ||Y||_F for fro."""
    if metric == "2,inf":
        return torch.linalg.vector_norm(Y, dim=-1).amax(dim=-1)
    return torch.linalg.vector_norm(Y.flatten(-2), dim=-1)


@dataclass(frozen=True)
class Domain:
    """Rows with ||x_t|| <= radius; optionally every normalisation input with spread >= floor.

    ``floor_kind`` ("std" or "rms") also projects the *input* onto the floor (the component tests of
    a normalisation map, whose certified domain is exactly that set); deeper floors are checked on
    the recorded spreads and pairs that break them are discarded.
    """

    radius: float
    floor: float = 0.0
    floor_kind: str | None = None

    def project(self, Z: Tensor) -> Tensor:
        if self.floor_kind == "std":
            mu = Z.mean(-1, keepdim=True)
            s = (Z - mu).pow(2).mean(-1, keepdim=True).sqrt()
            Z = mu + (Z - mu) * torch.clamp(self.floor * (1 + 1e-9) / s.clamp_min(1e-300), min=1.0)
        elif self.floor_kind == "rms":
            s = Z.pow(2).mean(-1, keepdim=True).sqrt()
            Z = Z * torch.clamp(self.floor * (1 + 1e-9) / s.clamp_min(1e-300), min=1.0)
        r = torch.linalg.vector_norm(Z, dim=-1, keepdim=True)
        return Z * torch.clamp(self.radius * (1 - 1e-12) / r.clamp_min(1e-300), max=1.0)

    def valid(self, Z: Tensor, spreads: list) -> Tensor:
        ok = torch.linalg.vector_norm(Z, dim=-1).amax(-1) <= self.radius
        if self.floor > 0:
            for s in spreads:
                ok = ok & (s >= self.floor)
        return ok


def slack(fx: Tensor, fy: Tensor, dist: Tensor, metric: str, n_ops: int = 64) -> Tensor:
    """Float64 rounding of a measured ratio: each output entry carries an absolute error of about
    ``n_ops * eps * |value|``; divided by the pair distance it bounds the error of the ratio."""
    scale = mnorm(fx.abs() + fy.abs(), metric)
    return n_ops * EPS64 * scale / dist.clamp_min(1e-300)


@dataclass
class Witness:
    """The best explicit pair found: ratio, its rounding slack, and how it was found."""

    ratio: float = 0.0
    slack: float = 0.0
    how: str = ""

    def offer(self, ratio: Tensor, sl: Tensor, ok: Tensor, how: str) -> None:
        r = torch.where(ok & torch.isfinite(ratio), ratio, torch.zeros_like(ratio))
        i = int(r.argmax())
        if float(r[i]) > self.ratio:
            self.ratio, self.slack, self.how = float(r[i]), float(sl[i]), how


def _starts(g: torch.Generator, n: int, T: int, d: int, dom: Domain) -> tuple[Tensor, Tensor, Tensor]:
    """(X, unit direction U, log-distance s) for n restarts of five kinds."""
    R = dom.radius
    X = torch.randn(n, T, d, generator=g, dtype=F64)
    X = X / torch.linalg.vector_norm(X, dim=-1, keepdim=True) * R
    kind = torch.arange(n) % 5
    X[kind == 1] *= torch.rand(int((kind == 1).sum()), T, 1, generator=g, dtype=F64)  # inside the ball
    X[kind == 2] = X[kind == 2][:, :1].expand(-1, T, -1).clone()  # one token repeated, at norm R
    X[kind == 3] *= 0.05  # small tokens (near the centre, where softmax is flat)
    # nearly constant rows: a LayerNorm's constant is approached at inputs of tiny spread
    k4 = int((kind == 4).sum())
    X[kind == 4] = 0.5 * R * torch.rand(k4, T, 1, generator=g, dtype=F64) / math.sqrt(d) + 1e-3 * R / math.sqrt(
        d) * torch.randn(k4, T, d, generator=g, dtype=F64)
    U = torch.randn(n, T, d, generator=g, dtype=F64)
    U = U / torch.linalg.vector_norm(U.flatten(-2), dim=-1)[:, None, None]
    logd = torch.where(torch.arange(n) % 3 == 0, math.log(R), math.log(1e-4 * R))  # far or near pairs
    logd = logd + 0.5 * torch.randn(n, generator=g, dtype=F64)
    return dom.project(X), U, logd.to(F64)


def _check_batched(f, Z: Tensor, out: Tensor) -> None:  # noqa: ANN001
    """``f`` on the last element alone gives the batch's last output: the pairs' two points go through ``f`` as one
    batch (a map that mixed the batch elements would be attacked at the wrong points)."""
    with torch.no_grad():
        alone = f(Z[-1:].detach(), None)
    ref, got = alone[0], out[-1].detach()
    both = torch.isfinite(ref) & torch.isfinite(got)
    assert torch.equal(torch.isfinite(ref), torch.isfinite(got)), "not batched"
    assert torch.allclose(got[both], ref[both], rtol=1e-9, atol=1e-12 * float(ref[both].abs().max() if both.any()
                                                                              else 0.0) + 1e-300), "not batched"


def _ratio(f, X: Tensor, Y: Tensor, dom: Domain, metric: str, check: bool = False):  # noqa: ANN001, ANN202
    """(ratio, slack, valid) per pair, ``f`` evaluated once on ``X`` and ``Y`` stacked (each spread split back per
    point); ``check``: first ``_check_batched``."""
    B = X.shape[0]
    sp: list = []
    Z = torch.cat([X, Y])
    out = f(Z, sp)
    if check:
        _check_batched(f, Z, out)
    fx, fy = out[:B], out[B:]
    sx, sy = [t[:B] for t in sp], [t[B:] for t in sp]
    dist = mnorm(Y - X, metric)
    ratio = mnorm(fy - fx, metric) / dist
    ok = dom.valid(X, sx) & dom.valid(Y, sy) & (dist > 0)
    return ratio, slack(fx.detach(), fy.detach(), dist.detach(), metric), ok


def _jacobian_directions_loop(f, X: Tensor, metric: str, g: torch.Generator, n_iter: int = 30) -> Tensor:  # noqa: ANN001
    """For each X[b]: the input direction V (T, d) maximising ||J V|| / ||V|| in the metric, one point and restart at
    a time (``jacobian_directions``' fallback where an iterate is NaN)."""
    B, T, d = X.shape
    out = []
    for b in range(B):
        J = torch.autograd.functional.jacobian(lambda Z: f(Z[None], None)[0], X[b].detach(), vectorize=True)
        if not bool(torch.isfinite(J).all()):  # overflowed scores: no direction from here
            out.append(torch.randn(T, d, generator=g, dtype=F64))
            continue
        Tout, dout = J.shape[0], J.shape[1]
        Jt = J.reshape(Tout, dout, T * d)  # output token, output coordinate, flattened input
        if metric == "fro":
            _, _, Vh = torch.linalg.svd(Jt.reshape(Tout * dout, T * d), full_matrices=False)
            out.append(Vh[0].reshape(T, d))
            continue
        best, bestV = -1.0, None
        for _ in range(3):  # restarts of the alternating maximisation (monotone, like power iteration)
            V = torch.randn(T, d, generator=g, dtype=F64)
            V = V / torch.linalg.vector_norm(V, dim=-1, keepdim=True)
            for _ in range(n_iter):
                JV = Jt @ V.reshape(-1)  # (Tout, dout)
                rows = torch.linalg.vector_norm(JV, dim=-1)
                t = int(rows.argmax())
                if float(rows[t]) > best:
                    best, bestV = float(rows[t]), V.clone()
                G = (JV[t] / rows[t].clamp_min(1e-300)) @ Jt[t]
                V = G.reshape(T, d)
                V = V / torch.linalg.vector_norm(V, dim=-1, keepdim=True).clamp_min(1e-300)
        out.append(bestV if bestV is not None else torch.randn(T, d, generator=g, dtype=F64))
    return torch.stack(out)


def jacobians(f, X: Tensor) -> Tensor:  # noqa: ANN001
    """``J[b] = torch.autograd.functional.jacobian(lambda Z: f(Z[None], None)[0], X[b])`` for every b, shape
    (B, Tout, dout, T, d), from one forward and one backward of ``B * Tout * dout`` copies of the points."""
    B, T, d = X.shape
    with torch.no_grad():
        shape = f(X[:1].detach(), None).shape[1:]
    K = math.prod(shape)
    Z = X.detach()[:, None].expand(B, K, T, d).reshape(B * K, T, d).clone().requires_grad_(True)
    with torch.enable_grad():
        Y = f(Z, None).reshape(B, K, K)
        eye = torch.eye(K, dtype=Y.dtype).expand(B, K, K)
        (G,) = torch.autograd.grad(Y, Z, eye)
    return G.reshape(B, *shape, T, d)


def jacobian_directions(f, X: Tensor, metric: str, g: torch.Generator, n_iter: int = 30) -> tuple[Tensor, Tensor]:  # noqa: ANN001
    """(point index, direction) pairs, each direction V (T, d) an ascent of ``||J V|| / ||V||`` in the metric at its
    point: Frobenius, the exact top singular vector; (2,inf), the alternating row-block maximisation (monotone, like
    power iteration) from three random unit starts per point, 30 steps, the best iterate of *each* start kept (which
    of the starts wins turns on the last bit where they converge to the same value: all three are tried).  The
    points' Jacobians come from one forward and one backward (``jacobians``) and every start is iterated in one
    batch; where an iterate is NaN the loop (``_jacobian_directions_loop``) runs instead, from the same draws."""
    B, T, d = X.shape
    state = g.get_state()
    J = jacobians(f, X.detach())
    Tout, dout = J.shape[1], J.shape[2]
    Jt = J.reshape(B, Tout, dout, T * d)
    finite = [bool(torch.isfinite(J[b]).all()) for b in range(B)]
    idx, out, starts, who = [], [], [], []
    for b in range(B):  # the draws in _attack's order
        if not finite[b]:
            idx.append(b)
            out.append(torch.randn(T, d, generator=g, dtype=F64))
        elif metric == "fro":
            idx.append(b)
            out.append(torch.linalg.svd(Jt[b].reshape(Tout * dout, T * d), full_matrices=False)[2][0].reshape(T, d))
        else:
            for _ in range(3):
                V = torch.randn(T, d, generator=g, dtype=F64)
                starts.append(V / torch.linalg.vector_norm(V, dim=-1, keepdim=True))
            who.append(b)
    if who:
        P = len(who)
        Jw = Jt[torch.tensor(who)][:, None].expand(P, 3, Tout, dout, T * d)
        V = torch.stack(starts).reshape(P, 3, T, d)
        vals, Vs = [], []
        for _ in range(n_iter):
            JV = (Jw @ V.reshape(P, 3, 1, T * d, 1))[..., 0]  # (P, 3, Tout, dout)
            rows = torch.linalg.vector_norm(JV, dim=-1)
            t = rows.argmax(dim=-1)  # (P, 3)
            top = rows.gather(-1, t[..., None])[..., 0]
            vals.append(top)
            Vs.append(V)
            w = JV.gather(2, t[..., None, None].expand(-1, -1, 1, dout))[:, :, 0] / top.clamp_min(1e-300)[..., None]
            Jrow = Jw.gather(2, t[..., None, None, None].expand(-1, -1, 1, dout, T * d))[:, :, 0]  # (P, 3, dout, n)
            V = (w[:, :, None, :] @ Jrow)[:, :, 0].reshape(P, 3, T, d)
            V = V / torch.linalg.vector_norm(V, dim=-1, keepdim=True).clamp_min(1e-300)
        vals_t = torch.stack(vals, dim=2)  # (P, 3, n_iter)
        if bool(torch.isnan(vals_t).any()):  # the loop's NaN handling (and its fallback draw): run it as it is
            g.set_state(state)
            return torch.arange(B), _jacobian_directions_loop(f, X, metric, g, n_iter)
        k = vals_t.argmax(dim=-1)  # per restart the first largest value, as a strict > keeps it
        Vs_t = torch.stack(Vs, dim=2)  # (P, 3, n_iter, T, d)
        for j, b in enumerate(who):
            for r in range(3):
                idx.append(b)
                out.append(Vs_t[j, r, int(k[j, r])])
    return torch.tensor(idx), torch.stack(out)


def attack_pairs(f, *, T: int, d: int, dom: Domain, metric: str, restarts: int = 12, steps: int = 60,  # noqa: ANN001
                 seed: int = 0, n_jacobian: int = 4) -> Witness:
    """Largest ``||f(X) - f(Y)|| / ||X - Y||`` found over pairs of the domain (see module docstring)."""
    g = torch.Generator().manual_seed(seed)
    w = Witness()
    R = dom.radius
    X0, U0, s0 = _starts(g, restarts, T, d, dom)
    X, U, s = (t.clone().requires_grad_(True) for t in (X0, U0, s0))
    opt = torch.optim.Adam([{"params": [X], "lr": 0.03 * R}, {"params": [U], "lr": 0.3 / math.sqrt(T * d)},
                            {"params": [s], "lr": 0.2}])
    for step in range(steps + 1):
        with torch.no_grad():
            X.copy_(dom.project(X))
            U.copy_(U / torch.linalg.vector_norm(U.flatten(-2), dim=-1).clamp_min(1e-300)[:, None, None])
            s.clamp_(math.log(1e-7 * R), math.log(4 * R))
        Y = dom.project(X + torch.exp(s)[:, None, None] * U)
        ratio, sl, ok = _ratio(f, X, Y, dom, metric, check=step == 0)
        w.offer(ratio.detach(), sl, ok, f"ascent step {step}")
        if step == steps:
            break
        opt.zero_grad()
        loss = -torch.log(ratio[torch.isfinite(ratio) & (ratio > 0)]).sum()
        if loss.requires_grad:
            loss.backward()
            opt.step()
    # Jacobian regime: power iteration at the best ascent points and at fresh random points, then
    # the direction made into an explicit pair at a small distance.
    with torch.no_grad():
        Xa = dom.project(X.detach())
    Xj = torch.cat([Xa[: n_jacobian // 2], _starts(g, n_jacobian - n_jacobian // 2, T, d, dom)[0]])
    if Xj.shape[0]:
        at, V = jacobian_directions(f, Xj, metric, g)
        Xj = Xj[at]
        with torch.no_grad():
            for h in (1e-5, 1e-3):
                Y = dom.project(Xj + h * R * V / mnorm(V, metric)[:, None, None])
                ratio, sl, ok = _ratio(f, Xj, Y, dom, metric)
                w.offer(ratio, sl, ok, f"jacobian power iteration, step {h:g} R")
    return w


def attack_output_radius(f, *, T: int, d: int, dom: Domain, restarts: int = 8, steps: int = 40,  # noqa: ANN001
                         seed: int = 0) -> float:
    """Largest token norm of f(X) over the domain (checks the propagated radii of the chain)."""
    g = torch.Generator().manual_seed(seed)
    X = _starts(g, restarts, T, d, dom)[0].requires_grad_(True)
    opt = torch.optim.Adam([X], lr=0.03 * dom.radius)
    best = 0.0
    for step in range(steps + 1):
        with torch.no_grad():
            X.copy_(dom.project(X))
        sp: list = []
        r = torch.linalg.vector_norm(f(X, sp), dim=-1).amax(-1)
        ok = dom.valid(X, sp) & torch.isfinite(r)
        if bool(ok.any()):
            best = max(best, float(r.detach()[ok].max()))
        if step == steps:
            break
        opt.zero_grad()
        (-r.sum()).backward()
        opt.step()
    return best


def attack_gap(fa, fb, *, T: int, d: int, dom: Domain, metric: str, restarts: int = 8, steps: int = 60,  # noqa: ANN001
               seed: int = 0) -> Witness:
    """Largest ``||f_a(X) - f_b(X)||`` over X in the domain (Lemma G.3's left-hand side).

    Half the restarts move one token repeated T times (attention then averages identical rows,
    where the fixed-input terms of G.3 are attained), the others move every token freely.
    """
    g = torch.Generator().manual_seed(seed)
    X0 = _starts(g, restarts, T, d, dom)[0]
    tied = max(restarts // 2, 1)
    Xf = X0[tied:].clone().requires_grad_(True)
    Xt = X0[:tied, :1].clone().requires_grad_(True)
    w = Witness()
    for step in range(steps + 1):
        X = torch.cat([Xt.expand(-1, T, -1), Xf])
        sa: list = []
        sb: list = []
        ya, yb = fa(X, sa), fb(X, sb)
        gap = mnorm(ya - yb, metric)
        ok = dom.valid(X, sa) & dom.valid(X, sb)
        w.offer(gap.detach(), slack(ya.detach(), yb.detach(), torch.ones_like(gap), metric), ok, f"step {step}")
        if step == steps:
            break
        Xf.grad = Xt.grad = None
        gap.sum().backward()
        # projected normalised-gradient ascent, step from R/2 down to R/200: large steps act like power
        # iteration on the (nearly linear) fixed-input terms, small ones refine
        eta = dom.radius * 0.5 * 0.01 ** (step / max(steps - 1, 1))
        with torch.no_grad():
            for P in (Xf, Xt):
                if P.grad is not None and P.numel():
                    gn = torch.linalg.vector_norm(P.grad.flatten(1), dim=-1).clamp_min(1e-300)[:, None, None]
                    P.copy_(dom.project(P + eta * P.grad / gn))
    return w


def violates(w: Witness, bound: float) -> bool:
    """A measured ratio above the certified bound by more than its own float64 rounding."""
    return w.ratio - w.slack > bound


# -- random specs of every supported kind -------------------------------------------------------
def fuzz_spec(seed: int, *, d: int = 6, H: int = 2, Hkv: int | None = None, dh: int = 4, dff: int = 8,
              L: int = 1, norm: str = "ball", placement: str = "post", act: str = "relu", gated: bool = False,
              biases: bool = False, causal: bool = False, rope: bool = False, kind: str = "dot",
              scale: float = 1.0, eps: float = 0.05, input_norm: bool = True, final_norm: bool = False,
              dtype: torch.dtype = F64, qk_scale: float = 1.0, residual: str = "sequential",
              rope_biases: bool = False, rotary_dim: int | None = None, qk_norm: bool = False,
              qk_eps: float = 1e-3, softcap: float | None = None, post_norm: bool = False):
    """A small random TransformerSpec; weights stored in ``dtype`` (the spec's exact values).

    L2 attention (Kim et al.) ties ``W_K = W_Q`` and has no biases, mask or RoPE; GQA uses ``Hkv``
    key/value heads.  ``qk_scale`` multiplies W_Q and W_K only (sharp softmax: where a bound with
    the wrong exponent in ||W_Q|| shows, issue 10 item 1).  ``residual="parallel"`` builds pre-norm
    parallel-residual layers (GPT-NeoX); ``rope_biases`` keeps the query/key biases under RoPE (also
    GPT-NeoX) and ``rotary_dim`` rotates only that many leading coordinates of each head (partial rotary).
    ``qk_norm`` adds Qwen3's per-head RMSNorm (variance floor ``qk_eps``) on queries and keys;
    ``softcap`` Gemma 2's ``c tanh(s / c)`` on the scores (key biases dropped: the bounds refuse them).
    ``post_norm`` adds an RMSNorm on each branch's output, ``x + N_post(f(N_pre x))`` (Gemma 2/3's
    sandwich, OLMo 2's post-norm; THEORY F26; pre-norm sequential layers only).
    """
    from transcover.model import (
        Activation, AttentionSpec, FFNSpec, LayerSpec, NormKind, NormSpec, Placement, RopeSpec, TransformerSpec,
    )

    g = torch.Generator().manual_seed(seed)
    Hkv = H if (Hkv is None or kind == "l2") else Hkv

    def rnd(*shape, s=1.0):
        return (torch.randn(*shape, generator=g, dtype=F64) * s * scale / math.sqrt(shape[-2] if len(shape) > 1
                                                                                    else shape[-1])).to(dtype)

    def nrm(k: str):
        if k in ("ball", "none"):
            return NormSpec(NormKind(k))
        w = (1.0 + 0.5 * torch.randn(d, generator=g, dtype=F64)).to(dtype)
        b = (0.1 * torch.randn(d, generator=g, dtype=F64)).to(dtype) if k == "layernorm" else None
        return NormSpec(NormKind(k), w, b, eps)

    layers = []
    for i in range(L):
        Wq = (rnd(H, d, dh).double() * qk_scale).to(dtype)
        bias = biases and kind == "dot"
        attn = AttentionSpec(
            W_Q=Wq, W_K=Wq.clone() if kind == "l2" else (rnd(Hkv, d, dh).double() * qk_scale).to(dtype), W_V=rnd(Hkv, d, dh), W_O=rnd(H, dh, d),
            b_Q=rnd(H, dh) if bias else None, b_K=rnd(Hkv, dh) if bias and (rope_biases or not rope) else None,
            b_V=rnd(Hkv, dh) if bias else None, b_O=rnd(d) if bias else None,
            causal=causal and kind == "dot",
            rope=RopeSpec(theta=10.0, rotary_dim=rotary_dim) if rope and kind == "dot" else None, kind=kind)
        if attn.rope is not None and attn.b_Q is not None and not rope_biases:  # G.3 refuses RoPE with q/k biases
            attn = AttentionSpec(**{**attn.__dict__, "b_Q": None})
        if qk_norm and kind == "dot":
            def qkn():
                return NormSpec(NormKind.RMSNORM, (1.0 + 0.5 * torch.randn(dh, generator=g, dtype=F64)).to(dtype),
                                None, qk_eps)
            attn = AttentionSpec(**{**attn.__dict__, "q_norm": qkn(), "k_norm": qkn()})
        if softcap is not None and kind == "dot":
            attn = AttentionSpec(**{**attn.__dict__, "softcap": softcap, "b_K": None})
        ffn = FFNSpec(W_1=rnd(d, dff), W_2=rnd(dff, d), activation=Activation(act),
                      b_1=rnd(dff) if biases else None, b_2=rnd(d) if biases else None,
                      W_gate=rnd(d, dff) if gated else None, b_gate=rnd(dff) if gated and biases else None)
        post = {k: nrm("rmsnorm") for k in ("post_norm_attn", "post_norm_ffn")} if post_norm else {}
        layers.append(LayerSpec(i, attn, ffn, nrm(norm), nrm(norm), Placement(placement), residual=residual, **post))
    return TransformerSpec(arch="fuzz", name=f"fuzz{seed}", d_model=d, layers=layers,
                           input_norm=nrm(norm) if input_norm else None,
                           final_norm=nrm(norm) if final_norm else None)

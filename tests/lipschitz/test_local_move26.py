"""F77 (F73c + F76a): the move's rest by its own linear recursion at the data, each stage's own Taylor rest rows
(THEORY F77).

Attacks (2-layer post-LN GELU stacks, T = 3, d = 8: plain, near-flat tokens with eps = 1e-12, sharp causal heads
``W_Q x 8``, saturated GELU ``W_1 x 6``, tiny gamma): one batched float64 projected Adam with restarts over the
network's input ball, one ascent per (quantity, stage, token), of the move's rest ``||e_{s,i}||`` at every sub-stage
input (``e_s = x_s(X + delta) - x_s(X) - P_s(X) delta``, a LayerNorm's input centred) against its rows ``E_s``, and of
each stage's own rest ``||R_{s,i}||`` (``R_s = x_{s+1}(X + delta) - x_{s+1}(X) - J_s(x_s) Delta_s``, ``Delta_s`` the
stage input's actual move) against its rows; the whole bound never above ``move_rest=False``'s and never below the
network's adversary; homogeneity in the last norm; the products' rounding carried into ``E``.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

import transcover.lipschitz._local_stack as ls
from lipschitz_testkit import assert_stack_never_looser, chain, clip_rows, last_norm_doubled, stack_substage_maps
from test_local_stack15 import assert_network_below
from test_local_stack19 import _spec
from transcover.lipschitz._local_stack import stack_local

# (spec arguments, xscale, rho fraction of the median token norm, gamma scale of layer 0's first norm)
CASES = [(dict(seed=3), 1.0, 5e-3, 1.0), (dict(seed=5, eps=1e-12), 0.05, 5e-3, 1.0),
         (dict(seed=7, qscale=8.0, causal=True), 1.0, 5e-3, 1.0), (dict(seed=11, w1scale=6.0), 1.0, 3e-3, 1.0),
         (dict(seed=13), 1.0, 5e-3, 1e-2)]


def _case(case: tuple) -> tuple:
    kw, xscale, frac, gscale = case
    spec = _spec(**kw)
    n1 = spec.layers[0].norm_attn
    spec = dataclasses.replace(spec, layers=[dataclasses.replace(spec.layers[0], norm_attn=dataclasses.replace(
        n1, weight=gscale * n1.weight, bias=gscale * n1.bias)), *spec.layers[1:]])
    X = torch.randn(3, 8, generator=torch.Generator().manual_seed(kw["seed"]), dtype=torch.float64) * xscale
    return spec, X, frac * float(X.norm(dim=1).median()), kw["seed"]


def _captured(spec, X: torch.Tensor, rho: float, monkeypatch) -> tuple:  # noqa: ANN001
    """``stack_local`` on ``B(X, rho)`` with its rows ``E_s`` (per sub-stage input) and ``R_s`` (per stage), and the
    products ``{(a, s): (N, e)}``."""
    E, R, P, move, rest, run = [], [], [], ls._move_rest, ls._stage_rest, ls.substage_products
    monkeypatch.setattr(ls, "_move_rest", lambda *a: E.append(move(*a)) or E[-1])
    monkeypatch.setattr(ls, "_stage_rest", lambda *a: R.append(rest(*a)) or R[-1])
    monkeypatch.setattr(ls, "substage_products", lambda *a: P.append(run(*a)) or P[-1])
    res = stack_local(spec, X, [rho], move_rest=True)[0]
    monkeypatch.undo()
    return res, torch.stack(E), torch.stack(R), P[0]


@functools.lru_cache(maxsize=None)
def _shared_run(k: int) -> tuple:
    """``_captured`` of ``CASES[k]`` and every ``norm_rest_rows`` call's pair (its rows, F73c's ``stage_rest_rows`` of
    the same arguments), computed once per worker (several tests read them; nothing mutates them), under pass-through
    recorders only (each returns the recorded function's own value; no test patches anything else before reading)."""
    spec, X, rho, _ = _case(CASES[k])
    seen, own = [], ls.norm_rest_rows
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ls, "norm_rest_rows", lambda *a: seen.append((own(*a), ls.stage_rest_rows(*a[:4], True))) or seen[-1][0])
        return _captured(spec, X, rho, mp), seen


def _shared_captured(k: int) -> tuple:
    """``_captured`` of ``CASES[k]`` (``_shared_run``)."""
    return _shared_run(k)[0]


@functools.lru_cache(maxsize=None)
def _shared_stack(k: int, move_rest: bool):  # noqa: ANN202
    """``stack_local(spec, X, [rho], move_rest=move_rest)[0]`` of ``CASES[k]``, unpatched, computed once per worker."""
    spec, X, rho, _ = _case(CASES[k])
    return stack_local(spec, X, [rho], move_rest=move_rest)[0]


def _attained(spec, X: torch.Tensor, rho: float, seed: int, *, starts: int = 2, steps: int = 30) -> tuple:  # noqa: ANN001
    """(stages, T) the largest ``||e_{s,i}||`` and ``||R_{s,i}||`` float64 projected Adam finds over network moves
    (every row within rho), one ascent per (quantity, stage, token) and start, all in one batch; each ascent maximises
    its own entry."""
    maps = stack_substage_maps(spec)
    xs = [x.detach() for x in chain(maps, X)]
    n, (T, d) = len(maps), X.shape
    flat = lambda f, x: torch.autograd.functional.jacobian(lambda v: f(v.reshape(T, d)).reshape(-1), x.reshape(-1))  # noqa: E731
    Pj = torch.autograd.functional.jacobian(lambda v: torch.stack(chain(maps, v.reshape(T, d))).reshape(n + 1, -1),
                                            X.reshape(-1))  # (n + 1, T d, T d): every prefix at X
    Jj = torch.stack([flat(f, x) for f, x in zip(maps, xs)])  # (n, T d, T d): every stage at its input

    def values(D: torch.Tensor) -> torch.Tensor:  # (B, T, d) -> (B, 2, n, T): ||e_{s,i}|| (s < n) and ||R_{s,i}||
        ys = torch.stack(chain(maps, X + D))  # (n + 1, B, T, d)
        mv = ys - torch.stack(xs)[:, None]
        e = mv.reshape(n + 1, -1, T * d) - torch.einsum("spq,bq->sbp", Pj, D.reshape(-1, T * d))
        R = mv[1:].reshape(n, -1, T * d) - torch.einsum("spq,sbq->sbp", Jj, mv[:-1].reshape(n, -1, T * d))
        return torch.stack([e[:-1].reshape(n, -1, T, d).norm(dim=-1), R.reshape(n, -1, T, d).norm(dim=-1)]).permute(2, 0, 1, 3)

    K = 2 * n * T
    g = torch.Generator().manual_seed(seed)
    D = clip_rows(torch.randn(starts * K, T, d, generator=g, dtype=torch.float64), rho).requires_grad_(True)
    opt = torch.optim.Adam([D], lr=0.1 * rho)
    best = torch.zeros(K, dtype=torch.float64)
    for _ in range(steps):
        with torch.no_grad():
            D.copy_(clip_rows(D, rho))
        own = values(D).reshape(starts, K, K).diagonal(dim1=1, dim2=2)  # start s, ascent k: its own entry k
        best = torch.maximum(best, own.detach().amax(dim=0))
        opt.zero_grad()
        (-own.sum()).backward()
        opt.step()
    return best.reshape(2, n, T)


@pytest.mark.parametrize("case", CASES)
def test_move_and_stage_rests_are_never_beaten(case):
    """Per sub-stage input and token, Adam's ``||e_{s,i}||`` stays below ``E_s`` (``E_0 = 0``: the input moves by
    ``delta``), and per stage its own rest ``||R_{s,i}||`` below its rows; both attacks reach at least 0.1 % of the
    rows somewhere (they are not idle)."""
    spec, X, rho, seed = _case(case)
    _, E, R, _ = _shared_captured(CASES.index(case))
    e, r = _attained(spec, X, rho, seed)
    assert E.shape == R.shape == e.shape and bool((E[0] == 0).all())
    assert bool((e[1:] <= E[1:]).all()), (e, E)
    # the attack's own float64 rounding: ``f(x + D) - f(x) - J D`` is formed from values of size ``|y|``, each entry
    # within a few ulps per term of its T d products (a stage linear in a token, e.g. a causal query seeing only
    # itself, has the exact rest 0 and a certified row 0)
    ys = torch.stack([y.norm(dim=-1).amax() for y in chain(stack_substage_maps(spec), X)[1:]])
    tol = 8 * X.numel() * 2.0**-53 * (1 + ys)[:, None]
    assert bool((r <= R + tol).all()), (r, R)
    assert float((e[1:] / E[1:]).max()) >= 1e-3 and float((r / R).max()) >= 1e-3, ((e / E).max(), (r / R).max())


def test_bound_is_never_above_main_nor_below_the_adversary():
    """The whole bound with the move's rest (``move_rest=True``) never above the old one on its own and binds (some
    prefix drift row strictly smaller), every radius at most the old; and never below the network's adversary
    (near-flat tokens, eps = 1e-12: the bound 1.1e11 -> 7.2e4 at 5e-3)."""
    spec, X, rho, seed = _case(CASES[1])
    new, old = _shared_stack(1, True), _shared_stack(1, False)
    assert_stack_never_looser(new, old)
    assert new.upper < old.upper, (new.upper, old.upper)
    assert_network_below(spec, X, rho, new, seed=seed)


def test_norm_curvature_rest_halves_f73c(monkeypatch):
    """Every norm stage's rest row at most half F73c's (``stage_rest_rows``: ``rho reach + dj E`` with ``reach = dj nu``,
    and the radius ``r <= rho nu + E`` up to the centre pad, so ``1/2 dj r`` is about half of it; THEORY F76b), with
    every ``E_s`` at most what F73c's norm rows alone give, and some norm row strictly below that."""
    spec, X, rho, _ = _case(CASES[0])
    (_, E, _, _), seen = _shared_run(0)  # recorded there: each norm_rest_rows call's (rows, F73c's rows)
    assert len(seen) == 5 and all(bool((R <= 0.5 * R0 * (1 + 1e-9)).all()) for R, R0 in seen), seen
    monkeypatch.setattr(ls, "norm_rest_rows", lambda rho, reach, dj, E, r: ls.stage_rest_rows(rho, reach, dj, E, True))
    _, Eo, _, _ = _captured(spec, X, rho, monkeypatch)
    assert bool((E <= Eo).all()) and bool((E < Eo).any())


def test_homogeneity_in_the_last_norm(monkeypatch):
    """The last norm's gamma and beta x 2 (no final norm): every ``E_s`` (all before it) and every other stage's rest
    unchanged, the last stage's rest rows and the network output's rows ``E_n`` (the products to the end, degree 1)
    x 2."""
    spec, X, rho, _ = _case(CASES[0])
    (_, Ea, Ra, Pa), (_, Eb, Rb, Pb) = _shared_captured(0), _captured(last_norm_doubled(spec), X, rho, monkeypatch)
    assert torch.equal(Ea, Eb) and torch.equal(Ra[:-1], Rb[:-1])
    assert torch.allclose(Rb[-1], 2.0 * Ra[-1], rtol=1e-12, atol=0.0)
    outa, outb = (ls.move_rest_rows(p, list(R), len(R), X.shape[0]) for p, R in ((Pa, Ra), (Pb, Rb)))
    assert torch.allclose(outb, 2.0 * outa, rtol=1e-9, atol=0.0), (outa, outb)


def test_rounding_is_carried():
    """Each product's rounding ``e_{a -> s}`` at least the last step's own error (``M_{s -> s} = I``) and positive; a
    product known only to within its rounding (computed blocks 0) still carries ``e max_k R_{m,k}`` into ``E_s``."""
    spec, X, _, _ = _case(CASES[3])
    steps: list = []
    err = ls._local_error
    prods = ls.substage_products(ls._stages(spec, X)[0], lambda K: ls.certified_block_norms(ls._col_blocks(K), 4),
                                 lambda st, K: steps.append(err(st, K, cols=True)) or steps[-1],
                                 lambda st, K: ls._chunked(st.lin.apply, K))
    n = max(s for _, s in prods)
    order = [(a, s) for a in range(n - 1, -1, -1) for s in range(a + 1, n + 1)]
    assert len(order) == len(steps) and all(prods[key][1] >= own > 0 for key, own in zip(order, steps))
    T = X.shape[0]
    zero = {key: (torch.zeros(T, T, dtype=torch.float64), e) for key, (_, e) in prods.items()}
    R = [torch.rand(T, generator=torch.Generator().manual_seed(m), dtype=torch.float64) for m in range(n)]
    for s in range(2, n + 1):
        E = ls.move_rest_rows(zero, R, s, T)
        floor = sum(zero[(m + 1, s)][1] * float(R[m].max()) for m in range(s - 1))
        assert bool((E - R[s - 1] >= floor * (1 - 1e-12)).all()) and floor > 0, (s, E, floor)


def test_table_plumbs_the_switch():
    """``lipschitz --data --whole-network stack --move-rest`` (``local_table(move_rest=True)``): the whole-network row
    is ``stack_local(move_rest=True)``'s, never above the row without it, and below it here (near-flat tokens)."""
    from transcover.lipschitz._local_report import local_table

    spec, X, rho, _ = _case(CASES[1])
    rows = local_table(spec, [X], [rho / float(X.norm(dim=1).median())], lower=False, whole="stack", move_rest=True)
    on = next(r for r in rows if r.layer == -1).local_upper
    new, old = _shared_stack(1, True).upper, _shared_stack(1, ls.MOVE_REST).upper  # (the default: off)
    assert on == pytest.approx(new, rel=1e-9) and new < old, (on, new, old)

"""The covering curve's fast paths against the plain ones they replace, side by side in one process (CPU seconds).

    PYTHONPATH=src HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 python benchmarks/bench_curve.py [--repeat 3]

On the bundled MiniLM's matrix terms (sigma_min 0.1, T = 32):

* Dudley's integral at n = 1e4 (family auto): the curve's ``many`` on the 800-point grid (Note [curve on a grid])
  against the same curve called point by point (a plain function of eps, as before), anchors warm in both;
* one anchor allocation per family at eps = 0.1: ``kkt_split`` with the replayed bisection (Note [replayed
  bisection]) and the float pre-check of the budget (Note [budget in floats]) against the plain bisection and the
  exact 40-digit check alone;
* the power iteration of ``jacobian_operator_norm`` (MiniLM layer 2, T = 16, 15 steps, metric (2,inf)) on one
  forward graph (Note [one forward graph]) against ``torch.autograd.functional.jvp``/``vjp`` per step.

Each pair is checked to give the same floats before it is timed.  Prints best-of-``repeat`` seconds and the ratio.
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transcover.covering import _allocation as A  # noqa: E402
from transcover.covering._generalisation import generalisation_bound  # noqa: E402
from transcover.covering._model_bound import model_covering_curve, model_terms  # noqa: E402
from transcover.covering._transformer import transformer_log_covering  # noqa: E402
from transcover.lipschitz import jacobian_operator_norm  # noqa: E402
from transcover.model import load  # noqa: E402
from transcover.model._functional import layer_forward  # noqa: E402


def _best(fn, repeat: int) -> tuple[float, object]:  # noqa: ANN001
    out, best = None, math.inf
    for _ in range(repeat):
        t = time.process_time()
        out = fn()
        best = min(best, time.process_time() - t)
    return best, out


def _plain_power(fn, X, n_iter: int, seed: int):  # noqa: ANN001, ANN202
    """The (2,inf) power iteration as it stood before: functional jvp / vjp, each re-running ``fn``."""
    from torch.autograd.functional import jvp, vjp

    X = X.detach().double()
    V = torch.randn(X.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    V = V / V.norm(dim=-1, keepdim=True)
    best = 0.0
    for _ in range(n_iter):
        JV = jvp(fn, X, V)[1]
        rows = JV.norm(dim=-1)
        t = int(rows.argmax())
        best = max(best, float(rows[t]))
        w = torch.zeros_like(JV)
        w[t] = JV[t] / max(float(rows[t]), 1e-300)
        G = vjp(fn, X, w)[1]
        V = G / torch.clamp(G.norm(dim=-1, keepdim=True), min=1e-300)
    return best, V


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(1)
    spec = load(None)
    terms, _, _ = model_terms(spec, radius=1.0, c_sm=1.0, sigma_min=0.1)
    rows = []

    curve = model_covering_curve(terms, family="auto", seq_len=32)
    point_by_point = lambda e, n: curve(e, n)  # noqa: E731  (no ``many``: Dudley evaluates the grid point by point)
    generalisation_bound(curve, 1e4)  # anchors warm for both
    t_new, g_new = _best(lambda: generalisation_bound(curve, 1e4), a.repeat)
    t_old, g_old = _best(lambda: generalisation_bound(point_by_point, 1e4), a.repeat)
    assert (g_new.gap, g_new.log_gap, g_new.rademacher) == (g_old.gap, g_old.log_gap, g_old.rademacher)
    rows.append(("Dudley at n=1e4, family auto (800-point grid)", t_old, t_new))

    plain_bisect = lambda excess, size, n: A.bisect_log_multiplier(excess)  # noqa: E731
    replayed, pre_check = A.replayed_bisection, A._float_sum_below
    for fam in ("l21", "spectral", "best"):
        def anchor(fam=fam):  # noqa: ANN001, ANN202
            return transformer_log_covering(terms, 0.1, 10**6, family=fam)

        t_new, c_new = _best(anchor, a.repeat)
        A.replayed_bisection, A._float_sum_below = plain_bisect, (lambda *args: False)
        try:
            t_old, c_old = _best(anchor, a.repeat)
        finally:
            A.replayed_bisection, A._float_sum_below = replayed, pre_check
        assert c_new.log_log_N == c_old.log_log_N
        assert [t.log_eps_i for t in c_new.contributions] == [t.log_eps_i for t in c_old.contributions]
        rows.append((f"one anchor allocation, family {fam}", t_old, t_new))

    ts = load(None).to_torch(torch.float64)
    L = ts.layers[2]
    X = torch.randn(16, ts.d_model, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 2.0
    f = lambda Z: layer_forward(L, Z)  # noqa: E731
    t_new, p_new = _best(lambda: jacobian_operator_norm(f, X, metric="2,inf", n_iter=15, seed=1), a.repeat)
    t_old, p_old = _best(lambda: _plain_power(f, X, 15, 1), a.repeat)
    assert p_new[0] == p_old[0] and torch.equal(p_new[1], p_old[1])
    rows.append(("power iteration, MiniLM layer, T=16, 15 steps", t_old, t_new))

    print(f"{'what':52s} {'before s':>9s} {'after s':>9s} {'ratio':>7s}")
    for name, old, new in rows:
        print(f"{name:52s} {old:9.3f} {new:9.3f} {old / max(new, 1e-9):7.2f}x")
    print("(CPU seconds, best of", a.repeat, "; each pair gave the same floats)")


if __name__ == "__main__":
    main()

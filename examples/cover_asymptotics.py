"""Asymptotics of the Monte-Carlo covering estimate: growth in eps, norm radius, n, depth, width.

    python examples/cover_asymptotics.py [--functions 1000] [--eps 0.05] [--json out/cover_asymptotics.json]

For each axis the other settings stay at the base (d=16, H=2, d_ff=32, L=2, radii 1, n=8, T=4).
Printed: the estimate log |net(eps)| (a lower estimate of log P(F, eps), ``_montecarlo``) at each
value and the fitted exponent beta of log N ~ x^beta; for eps, alpha of log N ~ eps^-alpha
(norm-based bounds: alpha = 2) and P_eff of log N ~ P_eff log(1/eps) (parameter counting:
P_eff = number of parameters).  Saturated points (net > M/2) are reported and left out of fits.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--functions", type=int, default=1000)
    p.add_argument("--eps", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args()

    from transcover.empirical import (
        NormRadii, fit_eps_growth, fit_power_growth, monte_carlo_covering, random_inputs,
        sample_reference_class, usable_points,
    )
    from transcover.model import ReferenceConfig

    base = dict(d_model=16, n_heads=2, n_layers=2, d_ff=32, head_hidden=(16,))
    M = args.functions

    def log_n(cfg_kw: dict, scale: float = 1.0, n: int = 8, eps: float = args.eps) -> tuple[float, bool]:
        cfg = ReferenceConfig(**cfg_kw)
        s = sample_reference_class(cfg, NormRadii().scaled(scale), M, seed=args.seed)
        X = random_inputs(n, 4, cfg.d_model, seed=args.seed + 1)
        mc = monte_carlo_covering(s, X, eps)
        return math.log(mc.net_sizes[0][-1]), mc.saturated(0)

    axes = {
        "radius": ([0.25, 0.5, 1.0, 2.0], lambda x: log_n(base, scale=x)),
        "n": ([2, 4, 8, 16, 32], lambda x: log_n(base, n=x)),
        "depth": ([1, 2, 3, 4], lambda x: log_n({**base, "n_layers": x})),
        "width": ([8, 16, 32], lambda x: log_n({**base, "d_model": x, "d_ff": 2 * x, "head_hidden": (x,)})),
    }
    report: dict[str, object] = {"functions": M, "eps": args.eps}
    for name, (xs, f) in axes.items():
        vals = [f(x) for x in xs]
        keep = [(x, v) for x, (v, sat) in zip(xs, vals) if not sat and v > 0]
        line = ", ".join(f"{x}: {v:.2f}{' (sat)' if sat else ''}" for x, (v, sat) in zip(xs, vals))
        try:
            fit = fit_power_growth([k[0] for k in keep], [k[1] for k in keep])
            beta = f"beta = {fit.slope:.2f} (R2 {fit.r2:.2f})"
            report[name] = {"x": xs, "log_N": [v for v, _ in vals], "beta": fit.slope, "r2": fit.r2}
        except Exception as err:  # too few unsaturated points
            beta = f"no fit ({err})"
            report[name] = {"x": xs, "log_N": [v for v, _ in vals], "beta": None}
        print(f"{name:>6}: log N(eps={args.eps}) = {line}; {beta}")
    # eps axis, base class
    cfg = ReferenceConfig(**base)
    s = sample_reference_class(cfg, NormRadii(), M, seed=args.seed)
    mc = monte_carlo_covering(s, random_inputs(8, 4, 16, seed=args.seed + 1), np.geomspace(0.01, 0.5, 12))
    n_params = sum(t.numel() for t in (s.W_Q[0], s.W_K[0], s.W_V[0], s.W_O[0], s.W_1[0], s.W_2[0], s.b_1[0],
                                       s.b_2[0], *(w[0] for w in s.head_W)))
    fit = fit_eps_growth(*usable_points(mc), n_parameters=n_params)
    print(f"   eps: alpha = {fit.alpha:.2f} (R2 {fit.power.r2:.2f}; norm-based bound 2); "
          f"P_eff = {fit.p_eff:.2f} (R2 {fit.counting.r2:.2f}; parameter count {n_params}); "
          f"{fit.power.n_points} unsaturated points")
    report["eps_fit"] = fit.to_dict()
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

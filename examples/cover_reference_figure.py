"""Figure: estimated log N(eps) of the norm-bounded reference class beside the covering bound.

    python examples/cover_reference_figure.py [out/cover_reference.png] [--functions 3000]

Two depths (L = 1, 2) x two norm radii (every seed-2.1 radius = 0.5 or 1): M functions are drawn
from each class (``sample_reference_class``, radial law "volume"), evaluated on n = 16 sequences of
T = 4 tokens in the unit ball, and the greedy net (Monte-Carlo estimate, a lower bound on the
class's eps-packing number) and the strict 2eps-packing (a lower bound on N_ext(eps)) are plotted
against eps.  The bound is ``transcover.covering.model_bound(..., family="spectral")`` evaluated on
a member drawn on the boundary of every spectral ball: its class (all models of this architecture
whose per-matrix spectral norms are at most the radii) contains the sampled class, so it is a
certified upper bound for it.  Right panel: net size against the number M of sampled functions,
which shows how far the estimate is from levelling off.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", nargs="?", default="out/cover_reference.png")
    p.add_argument("--functions", type=int, default=3000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from transcover.empirical import (
        NormRadii, fit_eps_growth, monte_carlo_covering, random_inputs, sample_reference_class, usable_points,
    )
    from transcover.model import ReferenceConfig, reference_spec

    try:
        from transcover.covering import model_bound
    except ImportError:  # the covering-bounds package is optional for this figure
        model_bound = None

    n, T, d = 16, 4, 16
    eps = np.geomspace(0.004, 0.5, 16)
    X = random_inputs(n, T, d, seed=args.seed + 1)
    fig, (ax, ax_m) = plt.subplots(1, 2, figsize=(13, 5.2), gridspec_kw={"width_ratios": [1.5, 1]})
    colors = iter(plt.rcParams["axes.prop_cycle"].by_key()["color"])
    for L in (1, 2):
        for scale in (0.5, 1.0):
            cfg = ReferenceConfig(d_model=d, n_heads=2, n_layers=L, d_ff=32, head_hidden=(16,))
            radii = NormRadii().scaled(scale)
            sample = sample_reference_class(cfg, radii, args.functions, seed=args.seed)
            mc = monte_carlo_covering(sample, X, eps)
            c = next(colors)
            label = f"L={L}, radii={scale:g}"
            net = np.array([s[-1] for s in mc.net_sizes], float)
            pack = np.array([s[-1] for s in mc.packing_sizes], float)
            # log N = 0 (one ball) has no place on a log axis; a net holding more than half the
            # sampled functions measures M, not the class: drawn as faint crosses.
            sat = net > 0.5 * args.functions
            log_net = np.where(net > 1, np.log(net), np.nan)
            ax.plot(eps, np.where(sat, np.nan, log_net), "o-", color=c, label=f"{label}: net (MC estimate)")
            ax.plot(eps, np.where(sat, log_net, np.nan), "x", color=c, alpha=0.4)
            ax.plot(eps, np.where(pack > 1, np.log(np.maximum(pack, 1)), np.nan), "v--", color=c, alpha=0.6,
                    label=f"{label}: 2eps-packing (lower)")
            try:
                fit = fit_eps_growth(*usable_points(mc))
                print(f"{label}: fitted log N ~ eps^-{fit.alpha:.2f} (R2 {fit.power.r2:.2f}); "
                      f"log N ~ {fit.p_eff:.2f} log(1/eps) (R2 {fit.counting.r2:.2f}); "
                      f"points used {fit.power.n_points}")
            except Exception as err:  # too few unsaturated points: say so, keep plotting
                print(f"{label}: no fit ({err})")
            print(f"{label}: eps {np.round(eps, 4).tolist()}\n  net {net.astype(int).tolist()}\n"
                  f"  packing {pack.astype(int).tolist()}")
            if model_bound is not None:
                edge = sample_reference_class(cfg, radii, 1, radial="boundary", seed=args.seed + 99)
                spec = reference_spec(edge.model(0))
                logN = [math.exp(model_bound(spec, eps=float(e), n_samples=(n,), seq_len=T,
                                             family="spectral").log_log_N) for e in eps]
                ax.plot(eps, logN, ":", color=c, lw=2.5, label=f"{label}: bound (covering, spectral)")
                print(f"  bound log N {np.round(logN, 0).tolist()}")
            k = int(np.argmax(net <= 0.2 * args.functions))  # smallest eps whose net is <= M/5
            ax_m.plot(mc.checkpoints, mc.net_sizes[k], "o-", color=c, label=f"{label}, eps={eps[k]:.3g}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("eps")
    ax.set_ylabel("log N(eps)   (natural log; log-scale axis)")
    title = "reference class, d=16, H=2, d_ff=32, head 16; n=16 sequences x T=4; output metric |.| (b=1)"
    if model_bound is None:
        title += "\n(transcover.covering not available: no bound plotted)"
    title += "\nx: saturated (net > M/2, estimate limited by M); log N = 0 points omitted"
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=6.5, ncol=2, loc="center left")
    ax.grid(True, which="both", alpha=0.3)
    ax_m.set_xscale("log")
    ax_m.set_yscale("log")
    ax_m.set_xlabel("M (sampled functions)")
    ax_m.set_ylabel("greedy net size")
    ax_m.plot(mc.checkpoints, mc.checkpoints, "k:", lw=1, label="net size = M")
    ax_m.set_title("Monte-Carlo estimate against M (still rising = lower estimate)", fontsize=9)
    ax_m.legend(fontsize=7)
    ax_m.grid(True, which="both", alpha=0.3)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

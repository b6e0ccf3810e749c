"""Rate checks of Lemma H.1 (seed 4.2): attention error vs R (several n, Δ) and MLP error vs d_m.

    python examples/approx_rates.py [--out out/]

Writes approx_attention_rate.png, approx_attention_rate_lemma.png, approx_mlp_rate.png and
approx_rates.json, and prints the fitted rates next to theory.
"""

import argparse
import json
from pathlib import Path

from matplotlib.figure import Figure

from transcover.approx import attention_rate_sweep, mlp_rate_sweep


def save(display, path, size=(8, 5.5)):
    fig = Figure(figsize=size)
    display.plot(fig.add_subplot())
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print("wrote", path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default="out")
    out = Path(p.parse_args().out)
    out.mkdir(parents=True, exist_ok=True)
    Rs = [2, 4, 6, 8, 10, 12, 16, 20, 24, 30, 36]
    att = attention_rate_sweep(Rs, ns=(8, 64), deltas=(0.0, 0.2, 0.4))
    lem = attention_rate_sweep(Rs, ns=(16,), deltas=(0.0, 0.1, 0.2, 0.3), lemma_worst_case=True)
    mlp = mlp_rate_sweep([(0.5, 1), (1.0, 1), (2.0, 1), (0.5, 2), (1.0, 2), (2.0, 2), (1.0, 3)],
                         grids={1: (4, 8, 16, 32, 64, 128, 256), 2: (4, 6, 8, 12, 16, 24, 32), 3: (2, 3, 4, 5, 6, 7)})
    print("attention decay rate in R (fitted vs gap coefficient vs lemma 1-2Δ):")
    for f in att.fits + lem.fits:
        print(f"  n={f['n']:3d} Δ={f['delta']:.2f} λ={f['key_leak']:.2f}: fitted {f['fitted_rate']:.4f}  "
              f"gap {f['gap_rate']:.4f}  lemma {f['lemma_rate']:.4f}")
    rows = att.rows + lem.rows
    print(f"  max measured/bound: {max(r['measured'] / r['bound'] for r in rows):.7f}, "
          f"max measured - bound: {max(r['measured'] - r['bound'] for r in rows):.1e} (float64 rounding)")
    print("MLP error exponent in d_m (fitted over all grids vs -β/s):")
    for f in mlp.fits:
        print(f"  β={f['beta']:g} s={f['s']}: fitted vs d_m {f['fitted_exponent']:.3f}, vs cells N^s "
              f"{f['fitted_exponent_cells']:.3f}; theory {f['theory_exponent']:.3f}")
    print(f"  max measured/bound: {max(r['measured'] / r['bound'] for r in mlp.rows):.3f}; "
          f"network vs reference: {max(r['net_vs_reference'] for r in mlp.rows):.1e}")
    save(att, out / "approx_attention_rate.png")
    save(lem, out / "approx_attention_rate_lemma.png")
    save(mlp, out / "approx_mlp_rate.png")
    (out / "approx_rates.json").write_text(json.dumps(
        {"attention": att.to_dict(), "attention_lemma_worst_case": lem.to_dict(), "mlp": mlp.to_dict()}, indent=1))


if __name__ == "__main__":
    main()

"""Design advice (seed 5.1): the approximation/estimation trade-off against d_m for several N.

    python examples/approx_advice.py [--out out/]
"""

import argparse
from pathlib import Path

from matplotlib.figure import Figure

from transcover.approx import advise


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default="out")
    out = Path(p.parse_args().out)
    out.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=(13, 4.5))
    for k, (s, beta) in enumerate([(1, 2.0), (2, 1.0), (3, 0.5)]):
        ax = fig.add_subplot(1, 3, k + 1)
        for N in (10**6, 10**9, 10**12):
            a = advise(s, beta, 64, N)
            print(f"s={s} β={beta:g} N={N:.0e}: d_m={a.d_m} (grid {a.grid}), R={a.R:.1f}, "
                  f"approx {a.approx_error:.3g}, estimation {a.estimation_error:.3g}")
            d = [c["d_m"] for c in a.curve]
            line, = ax.loglog(d, [c["total"] for c in a.curve], label=f"total, N={N:.0e}")
            ax.loglog(d, [c["estimation"] for c in a.curve], ":", color=line.get_color())
            ax.axvline(a.d_m, color=line.get_color(), ls="--", lw=0.8)
        ax.loglog(d, [c["approx"] for c in a.curve], "k-", lw=2, label="approximation")
        ax.set_title(f"s={s}, β={beta:g}, n=64 (dotted: estimation)")
        ax.set_xlabel("MLP width d_m")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "approx_advice.png", dpi=120)
    print("wrote", out / "approx_advice.png")


if __name__ == "__main__":
    main()

"""Dot-product vs L2 self-attention: Lipschitz constant against the input radius R (Kim et al. 2021).

Same weights for both (L2 attention ties W_K = W_Q).  For each R: the certified upper bound
(THEORY F6 for dot-product attention on token norms <= R; THEORY F13 corrected, after Kim et al.
Thm 3.2, for L2 attention, no radius assumption) and the empirical lower bound (power iteration + projected ascent over input
pairs), in the Frobenius metric on N-token sequences (the metric of Kim et al.'s Lip_2).

Usage: python benchmarks/lipschitz_vs_radius.py [out/lipschitz_vs_radius.png] [--quick]
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

from transcover.lipschitz import (
    attention_lipschitz, function_lipschitz_lower, l2_attention_forward, l2_attention_lipschitz,
)
from transcover.lipschitz._weights import layer_norms, spectral
from transcover.model import AttentionSpec, attention_forward


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", default="out/lipschitz_vs_radius.png")
    ap.add_argument("--quick", action="store_true", help="fewer radii and search steps")
    args = ap.parse_args()
    torch.set_num_threads(1)  # tiny maps: the thread pool only adds overhead
    d, H, dh, N = 16, 2, 8, 8
    g = torch.Generator().manual_seed(0)
    W_Q, W_K, W_V = (torch.randn(H, d, dh, generator=g, dtype=torch.float64) / math.sqrt(d) for _ in range(3))
    W_O = torch.randn(H, dh, d, generator=g, dtype=torch.float64) / math.sqrt(H * dh)
    attn = AttentionSpec(W_Q=W_Q, W_K=W_K, W_V=W_V, W_O=W_O)
    from transcover.model import Activation, FFNSpec, LayerSpec, NormSpec, NormKind, Placement

    dummy_ffn = FFNSpec(torch.zeros(d, 1, dtype=torch.float64), torch.zeros(1, d, dtype=torch.float64), Activation.RELU)
    n = layer_norms(LayerSpec(0, attn, dummy_ffn, NormSpec(NormKind.NONE), NormSpec(NormKind.NONE), Placement.POST))
    l2_upper = l2_attention_lipschitz([spectral(w) for w in W_Q], [spectral(w) for w in W_V],
                                      spectral(W_O.reshape(-1, d)), dh, N, metric="fro", B_OV=list(n.B_OV))
    radii = [0.25, 1, 4, 16] if args.quick else [0.125, 0.25, 0.5, 1, 2, 4, 8, 16, 32]
    steps, samples = (15, 3) if args.quick else (40, 6)
    rows = []
    t0 = time.time()
    for R in radii:
        dot_up = attention_lipschitz(n.B_OV, n.B_KQ, R, B_V=n.B_V, B_O=n.B_O, metric="fro", seq_len=N)
        dot_lo = function_lipschitz_lower(lambda X: attention_forward(attn, X), seq_len=N, d_model=d, radius=R,
                                          metric="fro", n_samples=samples, n_steps=steps).value.value
        l2_lo = function_lipschitz_lower(lambda X: l2_attention_forward(X, W_Q, W_V, W_O), seq_len=N, d_model=d,
                                         radius=R, metric="fro", n_samples=samples, n_steps=steps).value.value
        rows.append((R, dot_lo, dot_up, l2_lo, l2_upper))
        assert dot_lo <= dot_up and l2_lo <= l2_upper, "a measured value above a certified bound is a bug"
    print(f"N={N} tokens, d={d}, H={H}, Frobenius metric ({time.time() - t0:.1f}s)")
    print(f"{'R':>7} {'dot lower':>11} {'dot upper':>11} {'up/low':>8} {'L2 lower':>10} {'L2 upper':>10} {'up/low':>8}")
    for R, a, b, c, e in rows:
        print(f"{R:7.3g} {a:11.4g} {b:11.4g} {b / a:8.3g} {c:10.4g} {e:10.4g} {e / c:8.3g}")
    print(f"dot lower grows x{rows[-1][1] / rows[0][1]:.3g} from R={radii[0]} to R={radii[-1]}; "
          f"L2 lower x{rows[-1][3] / rows[0][3]:.3g} (max {max(r[3] for r in rows):.3g} <= bound {l2_upper:.3g})")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    R = [r[0] for r in rows]
    ax.loglog(R, [r[2] for r in rows], "--", color="C0", label="dot-product: certified upper (F6)")
    ax.loglog(R, [r[1] for r in rows], "o-", color="C0", label="dot-product: empirical lower")
    ax.loglog(R, [r[4] for r in rows], "--", color="C3", label="L2 (tied $W_Q=W_K$): certified upper (F13)")
    ax.loglog(R, [r[3] for r in rows], "s-", color="C3", label="L2: empirical lower")
    ax.set_xlabel("input radius R (token l2 norm)")
    ax.set_ylabel(f"Lipschitz constant (Frobenius, N={N})")
    ax.set_title("Dot-product attention is not globally Lipschitz; L2 attention is")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

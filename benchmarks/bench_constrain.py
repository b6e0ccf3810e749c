"""Training-step time: transcover's spectral constraints vs unconstrained vs torch's spectral_norm.

Model: ReferenceTransformer, d_model 256, 4 layers, 4 heads, d_ff 1024, batch 64 x 32 tokens, AdamW.
Variants (same model, same data, one process, interleaved rounds, median per variant):

* ``unconstrained``;
* ``transcover spectral``: every matrix capped by :func:`transcover.constrain.constrain` with
  ``method="spectral"`` -- per-head W_KQ and W_OV *products*, W1, W2, the head, and the bias
  norms -- one warm-started power iteration per step;
* ``torch spectral_norm``: ``torch.nn.utils.parametrizations.spectral_norm`` on every weight
  tensor (W_Q, W_K, W_V, W_O flattened to matrices by torch, W1, W2, head), one iteration each;
* ``transcover project``: exact SVD projection after each step (float64), for reference.

Usage: python benchmarks/bench_constrain.py [--rounds 5] [--steps 10] [--threads 1]
Target (issue 7): transcover spectral <= 1.15 x unconstrained.

Threads: 1 by default.  On a shared 2-core machine two torch threads per process oversubscribe the
cores and every small kernel (a power-iteration mat-vec) pays a thread synchronisation, which
inflates every parametrization (ours and torch's) several-fold; one thread measures the arithmetic.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn
from torch.nn.utils.parametrizations import spectral_norm

from transcover.constrain import ConstraintConfig, constrain
from transcover.model import ReferenceConfig, ReferenceTransformer

RADII = {"all": 1.0}


def make(variant: str):
    torch.manual_seed(0)
    model = ReferenceTransformer(ReferenceConfig(d_model=256, n_heads=4, n_layers=4, d_ff=1024, n_outputs=10,
                                                 head_hidden=(256,)))
    cons = None
    if variant == "transcover spectral":
        cons = constrain(model, ConstraintConfig(method="spectral", radii=RADII))
    elif variant == "transcover project":
        cons = constrain(model, ConstraintConfig(method="project", radii=RADII))
    elif variant == "torch spectral_norm":
        for blk in model.blocks:
            for name in ("W_Q", "W_K", "W_V", "W_O", "W_1", "W_2"):
                spectral_norm(blk, name)
        for lin in model.head:
            spectral_norm(lin)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt, cons


def step(model, opt, cons, X, y):
    loss = nn.functional.cross_entropy(model(X), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    if cons is not None:
        cons.after_step()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(1)
    X = torch.randn(64, 32, 256, generator=g)
    y = torch.randint(0, 10, (64,), generator=g)
    variants = ["unconstrained", "transcover spectral", "torch spectral_norm", "transcover project"]
    built = {v: make(v) for v in variants}
    for v in variants:  # warm-up
        for _ in range(2):
            step(*built[v], X, y)
    times: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(args.rounds):
        for v in variants:
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step(*built[v], X, y)
            times[v].append((time.perf_counter() - t0) / args.steps)
    base = statistics.median(times["unconstrained"])
    print(f"training step, d_model 256, 4 layers, batch 64 x 32, threads={args.threads}, "
          f"median of {args.rounds} rounds x {args.steps} steps")
    for v in variants:
        m = statistics.median(times[v])
        print(f"  {v:22s} {1000 * m:8.1f} ms   {m / base:5.3f} x unconstrained")
    ratio = statistics.median(times["transcover spectral"]) / base
    print(f"transcover spectral / unconstrained = {ratio:.3f} (target <= 1.15): {'PASS' if ratio <= 1.15 else 'FAIL'}")
    print(f"transcover spectral / torch spectral_norm = "
          f"{statistics.median(times['transcover spectral']) / statistics.median(times['torch spectral_norm']):.3f}")


if __name__ == "__main__":
    main()

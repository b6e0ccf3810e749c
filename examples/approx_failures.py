"""When Lemma H.1's assumptions fail (seed 7.2): one figure per failure mode.

    python examples/approx_failures.py [--out out/] [--steps 1500]

Writes approx_failure_weak.png, approx_failure_delta.png, approx_failure_shift.png (the shift
figure includes a trained 1-layer model) and approx_failures.json.
"""

import argparse
import json
from pathlib import Path

from matplotlib.figure import Figure

from transcover.approx import (
    build_construction, delta_to_half_curve, equiangular_encoding, shift_curve, train_sparse_model,
    weak_dependence_curve,
)


def save(display, path):
    fig = Figure(figsize=(7.5, 5))
    display.plot(fig.add_subplot())
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print("wrote", path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default="out")
    p.add_argument("--steps", type=int, default=1500)
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    weak = weak_dependence_curve([0.0, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0])
    half = delta_to_half_curve([0.0, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.45, 0.48, 0.495], n=16, R=10.0)
    model, target = train_sparse_model("holder", seq_len=8, sparsity=2, steps=a.steps, n_samples=4096, seed=0)
    c = build_construction(target, equiangular_encoding(8, 0.2), R=20.0, grid=16)
    shift = shift_curve([0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0], c, trained=model, trained_target=target,
                        margin_gamma=0.75)
    for curve in (weak, half, shift):
        print(curve.name)
        for r in curve.rows:
            print("   " + "  ".join(f"{k}={v:.4g}" for k, v in r.items()))
    save(weak, out / "approx_failure_weak.png")
    save(half, out / "approx_failure_delta.png")
    save(shift, out / "approx_failure_shift.png")
    (out / "approx_failures.json").write_text(json.dumps([x.to_dict() for x in (weak, half, shift)], indent=1))


if __name__ == "__main__":
    main()

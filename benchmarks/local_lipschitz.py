"""Local certified Lipschitz constants of all-MiniLM-L6-v2 at real sentences (issue 12, item 1).

    PYTHONPATH=src HF_HUB_OFFLINE=1 python benchmarks/local_lipschitz.py [--n 150] [--whole-n 20]

For each rho in {1e-5, ..., 1e-1} x (median token norm of the layer's input): per-layer certified
local upper bound (the smaller of the product and Jacobian routes, max over sentences), the
Jacobian route at the point (rho -> 0), the measured lower estimate (the (2,inf) Jacobian norm at
the data points, max over sentences) and their ratio; the whole network's composed bound against
its Jacobian norm on ``--whole-n`` sentences; time per layer.  Writes out/local_lipschitz.json and
out/local_lipschitz_ratio.png (atomic writes).
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transcover.lipschitz._empirical import jacobian_operator_norm  # noqa: E402
from transcover.lipschitz._local import layer_local, network_local  # noqa: E402
from transcover.model import load  # noqa: E402
from transcover.model._data import load_inputs, sklearn_sentences  # noqa: E402
from transcover.model._functional import layer_forward, transformer_forward  # noqa: E402
from transcover.report import atomic_write_bytes, atomic_write_text  # noqa: E402
from transcover._results import check_certified  # noqa: E402

RHOS = (1e-5, 1e-4, 1e-3, 1e-2, 1e-1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=150)
    ap.add_argument("--whole-n", type=int, default=20)
    ap.add_argument("--max-len", type=int, default=32)
    ap.add_argument("--lower-iter", type=int, default=15)
    ap.add_argument("--out", default="out")
    ap.add_argument("--rhos", default=",".join(f"{r:g}" for r in RHOS), help="factors of the median token norm")
    a = ap.parse_args()
    torch.set_num_threads(2)
    spec = load(None).to_torch(torch.float64)
    layers = list(spec.layers)
    print(f"{len(sklearn_sentences())} sentences in sklearn's descriptions; using {a.n}, <= {a.max_len} tokens")
    seqs = load_inputs(spec, "sklearn-descr", max_len=a.max_len, limit=a.n)
    X = [spec.input_norm(s) for s in seqs]
    per_layer_inputs = []
    for layer in layers:
        per_layer_inputs.append(X)
        X = [layer_forward(layer, x).detach() for x in X]
    rows, times = [], {}
    lowers = {}
    for i, layer in enumerate(layers):
        t = time.perf_counter()
        lowers[i] = max(jacobian_operator_norm(lambda Z, lay=layer: layer_forward(lay, Z), x, metric="2,inf",
                                               n_iter=a.lower_iter)[0] for x in per_layer_inputs[i])
        times[("lower", i)] = time.perf_counter() - t
    cache: dict = {}
    rhos = [float(r) for r in a.rhos.split(",")]
    for f in rhos:
        for i, layer in enumerate(layers):
            t = time.perf_counter()
            up = pt = prod = 0.0
            for x in per_layer_inputs[i]:
                ll = layer_local(layer, x, f * float(x.norm(dim=1).median()), cache=cache)
                up, pt, prod = max(up, ll.upper), max(pt, ll.jacobian_point), max(prod, ll.product)
            times[(f, i)] = time.perf_counter() - t
            check_certified(f"local constant of layer {i}", up, lowers[i])
            rows.append({"rho": f, "layer": i, "upper": up, "point": pt, "product": prod, "lower": lowers[i],
                         "ratio": up / lowers[i], "point_ratio": pt / lowers[i], "seconds": times[(f, i)]})
            print(f"rho {f:.0e} layer {i}: local upper {up:.4g} (product {prod:.4g}, Jacobian at point {pt:.4g}) "
                  f"lower {lowers[i]:.4g} ratio {up / lowers[i]:.4g}  [{times[(f, i)]:.1f}s for {len(seqs)} seqs]",
                  flush=True)
    whole = []
    sub = seqs[: a.whole_n]
    t = time.perf_counter()
    wl = max(jacobian_operator_norm(lambda Z: transformer_forward(spec, Z, with_head=False), s, metric="2,inf",
                                    n_iter=a.lower_iter)[0] for s in sub)
    t_low = time.perf_counter() - t
    for f in rhos:
        t = time.perf_counter()
        up = max(network_local(spec, s, f * float(s.norm(dim=1).median()), cache=cache).upper for s in sub)
        dt = time.perf_counter() - t
        check_certified("local constant of the network", up, wl)
        whole.append({"rho": f, "upper": up, "lower": wl, "ratio": up / wl, "seconds": dt})
        print(f"rho {f:.0e} whole network ({len(sub)} seqs): upper {up:.4g} lower {wl:.4g} ratio {up / wl:.4g} "
              f"[{dt:.1f}s]", flush=True)
    os.makedirs(a.out, exist_ok=True)
    atomic_write_text(os.path.join(a.out, "local_lipschitz.json"), json.dumps(
        {"n": len(seqs), "whole_n": len(sub), "layers": rows, "network": whole, "lower_seconds_network": t_low},
        indent=2))
    _figure(rows, whole, os.path.join(a.out, "local_lipschitz_ratio.png"))


def _figure(rows, whole, path) -> None:  # noqa: ANN001
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for i in sorted({r["layer"] for r in rows}):
        rs = [r for r in rows if r["layer"] == i]
        ax.loglog([r["rho"] for r in rs], [r["ratio"] for r in rs], marker="o", label=f"layer {i}")
    ax.loglog([w["rho"] for w in whole], [w["ratio"] for w in whole], "k--", marker="s", label="whole network")
    ax.set_xlabel("rho / median token norm")
    ax.set_ylabel("certified local upper / measured lower")
    ax.legend(fontsize=7)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120, bbox_inches="tight")
    atomic_write_bytes(path, buf.getvalue())
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

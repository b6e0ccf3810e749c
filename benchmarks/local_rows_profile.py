"""Time (and optionally profile) the per-layer rows certification on one sentence (issue 12, speed).

    PYTHONPATH=src HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 python benchmarks/local_rows_profile.py \
        [--sentence K] [--layers 0,1,...] [--repeat N] [--profile out.prof] [--dump out.json]

For sentence K of the scikit-learn .rst descriptions (<= 32 tokens), runs ``layer_jacobians(...,
route="rows", lower=4)`` (as ``local_lipschitz.py``) for the benchmark's five radii (or ``--rhos``) on the chosen layers, prints the CPU seconds
per layer (best of ``--repeat``) and, with ``--dump``, writes every certified value (point, ball,
parts, stage radii) so two versions of the code can be compared number by number.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transcover.lipschitz._local_attention import head_norms  # noqa: E402
from transcover.lipschitz._local_jacobian import _weight_norms, layer_jacobians  # noqa: E402
from transcover.model import load  # noqa: E402
from transcover.model._data import load_inputs  # noqa: E402
from transcover.model._functional import layer_forward  # noqa: E402

from local_lipschitz import _tune_malloc  # noqa: E402  (the benchmark's process settings, F32 item 6)

RHOS = (1e-5, 1e-4, 1e-3, 1e-2, 1e-1)


def _values(lj) -> dict:  # noqa: ANN001
    return {"point": lj.point, "ball": lj.ball, "drift": float(lj.drift_rows.max()), "parts": lj.parts,
            "ball_rows": lj.ball_rows.tolist(), "stage": {k: v.tolist() for k, v in lj.stage_radii.items()}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sentence", type=int, nargs="+", default=[0])
    ap.add_argument("--layers", default="0,1,2,3,4,5")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--profile", default=None)
    ap.add_argument("--dump", default=None)
    ap.add_argument("--rhos", default=",".join(f"{f:g}" for f in RHOS),
                    help="factors of the median token norm (default: the benchmark's five radii)")
    ap.add_argument("--lower", type=int, default=4, help="row_lower tokens, as the benchmark (its point lower)")
    ap.add_argument("--no-tiers", dest="tiers", action="store_false",
                    help="without F45's N2 tier (the library default; the benchmark uses it)")
    a = ap.parse_args()
    _tune_malloc()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    spec = load(None).to_torch(torch.float64)
    want = [int(x) for x in a.layers.split(",")]
    factors = [float(f) for f in a.rhos.split(",")]
    seqs = load_inputs(spec, "sklearn-descr", max_len=32, limit=max(a.sentence) + 1)
    layers = list(spec.layers)
    norms = [(_weight_norms(L), head_norms(L.attention)) for L in layers]
    for L, (n, _) in zip(layers, norms):  # the per-model constants, as after a benchmark's first sentence
        layer_jacobians(L, spec.input_norm(seqs[0].double())[:2], [1e-5], norms=n, route="rows", tiers=a.tiers)
    dump, total = {}, 0.0
    prof = cProfile.Profile(time.process_time) if a.profile else None  # CPU seconds: the machine is shared
    for k in a.sentence:
        X = spec.input_norm(seqs[k].double())
        for li, L in enumerate(layers[: max(want) + 1]):
            if li in want:
                med = float(X.norm(dim=1).median())
                best = float("inf")
                for _ in range(a.repeat):
                    if prof:
                        prof.enable()
                    c = time.process_time()
                    ljs = layer_jacobians(L, X, [f * med for f in factors], norms=norms[li][0],
                                          head_norms_=norms[li][1], route="rows", lower=a.lower, tiers=a.tiers)
                    best = min(best, time.process_time() - c)
                    if prof:
                        prof.disable()
                total += best
                dump[f"{k}/{li}"] = [_values(lj) for lj in ljs]
                print(f"sentence {k} (T={X.shape[0]}) layer {li}: {best:.2f}s cpu; ball "
                      + " ".join(f"{lj.ball:.4g}" for lj in ljs), flush=True)
            X = layer_forward(L, X).detach()
    print(f"total {total:.2f}s cpu", flush=True)
    if prof:
        prof.dump_stats(a.profile)
    if a.dump:
        with open(a.dump, "w") as f:
            json.dump(dump, f)


if __name__ == "__main__":
    main()

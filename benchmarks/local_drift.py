"""The attention sublayer's Jacobian drift on a ball at real sentences: certified against attained
(issue 12; THEORY F17d, F35).

    nice -n 10 env PYTHONPATH=src HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 python benchmarks/local_drift.py \
        [--n 1] [--skip 0] [--rhos 1e-4,1e-3,1e-2] [--layers 0,1,2,3,4,5] [--out /tmp/drift]

Per MiniLM layer and sentence, and each radius ``r = f x`` (median token norm of the attention's input):
the certified ``max_i nu_i(J_A(Y) - J_A(X))`` over ``Y in B(X, r)`` for the attention sublayer (all heads
through ``W_O``, no residual) by F17d (``attention_drift_f17d``; the heads combined as before), by F35a-c
(``attention_drift_hessian``, the same combination) and as the routes now form it (the per-head minimum,
the heads through ``W_O`` jointly, F35d), against the attained value of ``drift_lower`` (alternating maximisation over the unit
rows and ascent over ``Y``, restarts, float64) on the two queries with the largest certified rows.
Writes local_drift.json under ``--out`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transcover._results import check_certified  # noqa: E402
from transcover.lipschitz._local_drift import attention_drift_hessian, heads_joint, output_block_norms  # noqa: E402
from transcover.lipschitz._local_jacobian import _head_data, _weight_norms  # noqa: E402
from transcover.lipschitz._local_lower import drift_lower  # noqa: E402
from transcover.lipschitz._local_rows import (  # noqa: E402
    _head_output_norms, _heads_combined, _HeadMoments, attention_drift_f17d, attention_drift_rows,
)
from transcover.model import Placement, attention_forward, load  # noqa: E402
from transcover.model._data import load_inputs  # noqa: E402
from transcover.model._functional import layer_forward  # noqa: E402


def layer_drift(L, X: torch.Tensor, rhos, restarts: int, steps: int) -> list[dict]:  # noqa: ANN001
    attn = L.attention
    Xin = X if L.placement is Placement.POST or L.norm_attn is None else L.norm_attn(X).detach()
    T = Xin.shape[0]
    norms = _weight_norms(L)
    heads = _head_data(attn, Xin)
    mom = _HeadMoments(heads, attn.softmax_scale)
    Oh, _ = _head_output_norms(None, None, heads, T)
    Oall = torch.full((T,), float(norms["O"]), dtype=torch.float64)
    C = output_block_norms(heads)
    med = float(Xin.norm(dim=1).median())
    out = []
    for f in rhos:
        r = f * med
        t = time.process_time()
        old = _heads_combined(Oh, Oall, attention_drift_f17d(mom, r, norms))
        t_old = time.process_time() - t
        t = time.process_time()
        new = _heads_combined(Oh, Oall, attention_drift_hessian(mom, r, norms))
        t_new = time.process_time() - t
        dZ = attention_drift_rows(mom, r, norms)  # per-head minimum and the heads jointly (F35d), as the routes
        both = _heads_combined(Oh, Oall, dZ, heads_joint(C, dZ))
        top = both.topk(min(2, T)).indices.tolist()
        t = time.process_time()
        low, _ = drift_lower(lambda Z: attention_forward(attn, Z), Xin, r, tokens=top, restarts=restarts, steps=steps)
        t_low = time.process_time() - t
        check_certified("attention drift (F17d/F35)", float(both.max()), float(low.max()))
        out.append({"rho": f, "r": r, "T": T, "F17d": float(old.max()), "F35": float(new.max()),
                    "min": float(both.max()), "ascent": float(low.max()),
                    "ratio_before": float(old.max() / low.max()), "ratio_after": float(both.max() / low.max()),
                    "cpu_F17d": t_old, "cpu_F35": t_new, "cpu_ascent": t_low})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1)
    ap.add_argument("--skip", type=int, default=0)
    ap.add_argument("--max-len", type=int, default=32)
    ap.add_argument("--rhos", default="1e-4,1e-3,1e-2")
    ap.add_argument("--layers", default="0,1,2,3,4,5")
    ap.add_argument("--restarts", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", default="/tmp/drift")
    a = ap.parse_args()
    torch.set_num_threads(1)
    spec = load(None).to_torch(torch.float64)
    seqs = load_inputs(spec, "sklearn-descr", max_len=a.max_len, limit=a.skip + a.n)[a.skip:]
    rhos = [float(r) for r in a.rhos.split(",")]
    want = {int(k) for k in a.layers.split(",")}
    rows = []
    print("| sentence | T | layer | rho | F17d | F35a-c | route (min, F35d) | ascent | before | after |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for k, s in enumerate(seqs, start=a.skip):
        X = spec.input_norm(s.double())
        for li, L in enumerate(spec.layers):
            if li in want:
                for row in layer_drift(L, X, rhos, a.restarts, a.steps):
                    row.update(sentence=k, layer=li)
                    rows.append(row)
                    print(f"| {k} | {row['T']} | {li} | {row['rho']:g} | {row['F17d']:.4g} | {row['F35']:.4g} | "
                          f"{row['min']:.4g} | {row['ascent']:.4g} | {row['ratio_before']:.3g} | "
                          f"{row['ratio_after']:.3g} |", flush=True)
            X = layer_forward(L, X).detach()
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "local_drift.json"), "w") as fh:
        json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()

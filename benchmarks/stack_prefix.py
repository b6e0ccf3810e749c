"""The whole-stack route (``stack_local``) on the first L layers of MiniLM for one sentence: certified upper bound,
prefix drift at every layer cut and CPU seconds, per radius factor (THEORY F71, F77, F77b).

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 PYTHONPATH=src python benchmarks/stack_prefix.py --sentence 14 --layers 4 \
        --rhos 1e-6,1e-5,1e-4 --move-rest on

prints the table of docs/theory.md F77b (sentence 14, 4 layers: 101.82 / 112.45 / 1820.1 with ``--move-rest on``,
101.83 / 113.89 / 12439 with ``off``).  ``--profile OUT``: cProfile of the ``stack_local`` call in CPU time
(``time.process_time``, so the machine's load does not inflate it), its stats written to OUT and the top functions by
cumulative time printed (THEORY F83's table).  No lower estimates: ``benchmarks/local_stack.py`` runs the whole network
with them.  ``--layers`` below the model's depth drops the final norm.
"""

from __future__ import annotations

import argparse
import cProfile
import math
import pstats
import time
from dataclasses import replace

import torch

from transcover.lipschitz._local_stack import SEGMENT_AUX, stack_local
from transcover.model import load
from transcover.model._data import load_inputs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sentence", type=int, default=14, help="index among the first 20 scikit-learn sentences")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rhos", default="1e-6,1e-5,1e-4", help="factors of the median embedded-token norm")
    ap.add_argument("--aux", default=",".join(f"{f:g}" for f in SEGMENT_AUX),
                    help="THEORY F71c: auxiliary radii, fractions of the largest ('' for none)")
    ap.add_argument("--move-rest", choices=("on", "off"), default="on", help="THEORY F77-F79")
    ap.add_argument("--profile", default="", help="write a CPU-time cProfile of the stack_local call here (THEORY F83)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    spec = load(None).to_torch(torch.float64)
    X = load_inputs(spec, "sklearn-descr", max_len=32, limit=20)[a.sentence].double()
    if a.layers < len(spec.layers):
        spec = replace(spec, layers=spec.layers[: a.layers], final_norm=None)
    med = float(X.norm(dim=1).median())
    factors = [float(f) for f in a.rhos.split(",")]
    aux = tuple(float(f) for f in a.aux.split(",") if f)
    prof = cProfile.Profile(time.process_time) if a.profile else None
    c = time.process_time()
    if prof is not None:
        prof.enable()
    res = stack_local(spec, X, [f * med for f in factors], segment=True, aux=aux, move_rest=a.move_rest == "on")
    if prof is not None:
        prof.disable()
        prof.dump_stats(a.profile)
        pstats.Stats(a.profile).sort_stats("cumulative").print_stats(30)
    print(f"sentence {a.sentence} (T = {X.shape[0]}), {a.layers} layers, aux {aux}, move_rest {a.move_rest}: "
          f"{time.process_time() - c:.1f} s CPU")
    for f, r in zip(factors, res):
        drift = [float(r.spans[(0, b)].max()) if (0, b) in r.spans else math.inf for b in range(1, len(r.cuts))]
        print(f"  {f:g}: certified upper {r.upper:.5g} (stack {r.stack:.5g}, product {r.product:.4g}); "
              f"prefix drift at the cuts {' '.join(f'{v:.3g}' for v in drift)}")


if __name__ == "__main__":
    main()

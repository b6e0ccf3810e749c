"""The whole-stack route (``stack_local``) on the first L layers of MiniLM for one sentence: certified upper bound,
prefix drift at every layer cut and CPU seconds, per radius factor (THEORY F71, F77, F77b).

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 PYTHONPATH=src python benchmarks/stack_prefix.py --sentence 14 --layers 4 \
        --rhos 1e-6,1e-5,1e-4 --move-rest on

prints the table of docs/theory.md F77b (sentence 14, 4 layers: 101.82 / 112.45 / 1820.1 with ``--move-rest on``,
101.83 / 113.89 / 12439 with ``off``).  ``--profile OUT``: cProfile of the ``stack_local`` call in CPU time
(``time.process_time``, so the machine's load does not inflate it), its stats written to OUT and the top functions by
cumulative time printed (THEORY F83's table).  No lower estimates: ``benchmarks/local_stack.py`` runs the whole network
with them.  ``--layers`` below the model's depth drops the final norm.  ``--trace``: per sub-stage and radius the
largest move-rest row ``E_s`` at its input, its own Taylor rest ``R_s`` and its radius (``_stage_rest``'s arguments
and result, THEORY F77).  ``--whatif-attn-rest C``: every attention stage's rest multiplied by C — a what-if, NOT a
bound (docs/results/local_stack.md, stop 20: C = 0.1 / 0.03 give the whole network at 1e-4 39 196 / 27 376).
``--whatif-rest attention=C1,norm=C2,ffn=C3``: the same for each kind of stage (what-if, not a bound).
"""

from __future__ import annotations

import argparse
import cProfile
import math
import pstats
import time
from dataclasses import replace

import torch

import transcover.lipschitz._local_stack as _ls
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
    ap.add_argument("--trace", action="store_true", help="print E_s, R_s and the radius of every sub-stage (F77)")
    ap.add_argument("--whatif-attn-rest", type=float, default=1.0,
                    help="multiply every attention stage's rest by this: a what-if, not a bound")
    ap.add_argument("--whatif-rest", default="",
                    help="KIND=C,... with KIND in attention, norm, ffn: multiply that kind's rests by C (what-if, not a bound)")
    a = ap.parse_args()
    scales = {"attention": a.whatif_attn_rest}
    for item in filter(None, a.whatif_rest.split(",")):
        kind, _, c = item.partition("=")
        if kind not in ("attention", "norm", "ffn"):
            ap.error(f"--whatif-rest: unknown kind {kind!r} (attention, norm, ffn)")
        scales[kind] = float(c)
    whatif = {k: c for k, c in scales.items() if c != 1.0}
    log = _hook_stage_rest(whatif) if a.trace or whatif else []
    torch.set_num_threads(1)
    spec, X, med = sentence_spec(a.sentence, a.layers)
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
    if whatif:
        print("  WHAT-IF, not a bound: rests scaled " + ", ".join(f"{k} x {c:g}" for k, c in whatif.items()))
    if a.trace:
        print("  sub-stage, kind, radius index, rho, max E_s, max R_s, max radius")
        for row in log:
            print("   ", " ".join(f"{v:.3g}" if isinstance(v, float) else str(v) for v in row))


def sentence_spec(sentence: int, layers: int) -> tuple:
    """``(spec, X, med)``: MiniLM in float64 cut to its first ``layers`` layers (without the final norm when cut), the
    embedded ``sentence`` (index among the first 20 scikit-learn sentences, at most 32 tokens) and its median token
    norm, the unit of the radius factors."""
    spec = load(None).to_torch(torch.float64)
    X = load_inputs(spec, "sklearn-descr", max_len=32, limit=20)[sentence].double()
    if layers < len(spec.layers):
        spec = replace(spec, layers=spec.layers[:layers], final_norm=None)
    return spec, X, float(X.norm(dim=1).median())


def stage_kind(st) -> str:  # noqa: ANN001
    """A sub-stage's kind as ``_stage_rest`` dispatches on it: norm, attention, ffn or other."""
    return "norm" if isinstance(st.lin, _ls._NormLin) else "attention" if st.attn is not None else \
        "ffn" if st.ffn is not None else "other"


def _hook_stage_rest(scales: dict) -> list:
    """Wrap ``_local_stack._stage_rest`` to record each call (and scale each kind's rests by ``scales[kind]``)."""
    log, inner = [], _ls._stage_rest

    def traced(st, s, rho, reach, dj, E, r, pad, cap, PL, k, at):  # noqa: ANN001, ANN202
        R = inner(st, s, rho, reach, dj, E, r, pad, cap, PL, k, at)
        kind = stage_kind(st)
        R = R * scales.get(kind, 1.0)
        log.append((s, kind, k, rho, float(E.max()), float(R.max()), float(r.max())))
        return R

    _ls._stage_rest = traced
    return log


if __name__ == "__main__":
    main()

"""Where the whole-stack route's gap sits at one radius: per sub-stage, the certified rows of the move's rest ``E_s``
(THEORY F73c, F77) and of the stage's own Taylor rest ``R_s`` (F76a, F78-F90) beside what a float64 projected Adam
attains for the same quantities over the network's input ball (THEORY F91).

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 PYTHONPATH=src python benchmarks/stack_rest_gap.py --sentence 14 --layers 6 \
        --rho 1e-4

runs ``stack_local`` (move rest on, F71c's auxiliary radii) on MiniLM cut to ``--layers`` layers for the embedded
sentence, radius ``rho`` x its median token norm, recording every sub-stage's ``E_s`` and ``R_s`` rows at that radius
(and, for an attention stage, F84's row with the move's rest set to 0: the part of the first-order move alone), then per
sub-stage and token ascends ``||R_{s,i}||`` and ``||e_{s,i}||`` (``e_s = x_s(X + D) - x_s(X) - P_s(X) D``, the
stage input's move less its first order; a LayerNorm's input centred, as the stack reads it) over moves ``D`` with every
row within the radius (``--starts`` starts x ``--steps`` Adam steps, lr 0.1 rho, one ascent per token). The attained
values are empirical LOWER estimates of the sups the certified rows bound; the ratio column is the largest over tokens
of certified / attained. Nothing here is a bound."""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

import transcover.lipschitz._local_stack as _ls
from stack_prefix import sentence_spec, stage_kind  # this script's folder is on sys.path
from transcover.lipschitz._local_stack import SEGMENT_AUX, stack_local

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "lipschitz"))
from lipschitz_testkit import chain, clip_rows, stack_substage_maps  # noqa: E402  (the adversaries' own maps)


def certified_rows(spec, X: torch.Tensor, rho: float) -> tuple:  # noqa: ANN001
    """``({s: (kind, E_s, R_s, R_s with E = 0 or None)}, result)`` at radius ``rho`` from one ``stack_local`` run."""
    rows, cur = {}, {}
    rest, psd = _ls._stage_rest, _ls.psd_rest_rows

    def stage_rest(st, s, r, reach, dj, E, rad, pad, cap, PL, k, at):  # noqa: ANN001, ANN202
        cur["s"], cur["top"] = s, r == rho
        R = rest(st, s, r, reach, dj, E, rad, pad, cap, PL, k, at)
        if r == rho:
            rows[s] = (stage_kind(st), E.clone(), R.clone(), rows.get(s, (None, None, None, None))[3])
        return R

    def psd_rows(data, heads, Wqa, Xs, Qs, eQ, r, E, eP, pad, *a, **kw):  # noqa: ANN001, ANN202
        out = psd(data, heads, Wqa, Xs, Qs, eQ, r, E, eP, pad, *a, **kw)
        if cur.get("top"):
            kw0 = dict(kw, images=None, heads_rest=None)
            rows[cur["s"]] = (None, None, None, psd(data, heads, Wqa, Xs, Qs, eQ, r, E * 0, 0.0, pad, *a, **kw0))
        return out

    _ls._stage_rest, _ls.psd_rest_rows = stage_rest, psd_rows
    try:
        res = stack_local(spec, X, [rho], segment=True, aux=SEGMENT_AUX, move_rest=True)[0]
    finally:
        _ls._stage_rest, _ls.psd_rest_rows = rest, psd
    return rows, res


def attained(maps: list, X: torch.Tensor, s: int, rho: float, starts: int, steps: int, seed: int) -> tuple:
    """(T,) each the largest ``||R_{s,i}||`` and ``||e_{s,i}||`` Adam finds, one ascent per token and start."""
    T, d = X.shape
    xs = [x.detach() for x in chain(maps[:s + 1], X)]
    g = torch.Generator().manual_seed(seed)
    D = clip_rows(torch.randn(2 * starts * T, T, d, generator=g, dtype=torch.float64), rho).requires_grad_(True)
    opt = torch.optim.Adam([D], lr=0.1 * rho)
    best = torch.zeros(2, T, dtype=torch.float64)
    for _ in range(steps):
        with torch.no_grad():
            D.copy_(clip_rows(D, rho))
        ys = chain(maps[:s + 1], X + D)
        _, lin = torch.func.jvp(lambda Z: chain(maps[:s], Z)[-1], (X.expand_as(D).clone(),), (D,))
        e = (ys[s] - xs[s] - lin).norm(dim=-1)
        Dl = ys[s] - xs[s]
        _, jl = torch.func.jvp(maps[s], (xs[s].expand_as(Dl).clone(),), (Dl,))
        R = (ys[s + 1] - xs[s + 1] - jl).norm(dim=-1)
        vals = torch.stack([R, e]).reshape(2, 2, starts, T, T)  # quantity, which ascent's half, start, ascent, token
        own = torch.stack([vals[0, 0].diagonal(dim1=1, dim2=2), vals[1, 1].diagonal(dim1=1, dim2=2)])  # (2, starts, T)
        best = torch.maximum(best, own.detach().amax(dim=1))
        opt.zero_grad()
        (-own.sum()).backward()
        opt.step()
    return best[0], best[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sentence", type=int, default=14)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--rho", type=float, default=1e-4, help="factor of the median embedded-token norm")
    ap.add_argument("--starts", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    a = ap.parse_args()
    torch.set_num_threads(1)
    spec, X, med = sentence_spec(a.sentence, a.layers)
    rho = a.rho * med
    c = time.process_time()
    rows, res = certified_rows(spec, X, rho)
    print(f"sentence {a.sentence} (T = {X.shape[0]}), {a.layers} layers, rho {a.rho:g} x {med:.4g}: certified upper "
          f"{res.upper:.5g} ({time.process_time() - c:.0f} s CPU)")
    print("stage kind       R cert     R att   R ratio   R(E=0)     E cert     e att   E ratio")
    maps = stack_substage_maps(spec)
    c = time.process_time()
    for s in sorted(rows):
        kind, E, R, R0 = rows[s]
        if kind is None:
            continue
        Ra, ea = attained(maps, X, s, rho, a.starts, a.steps, seed=s)
        rr = float((R / Ra.clamp(min=1e-300)).max())
        er = float((E / ea.clamp(min=1e-300)).max()) if float(E.max()) > 0 else math.nan
        r0 = f"{float(R0.max()):.3e}" if R0 is not None else "        -"
        print(f"{s:5d} {kind:9s} {float(R.max()):.3e} {float(Ra.max()):.3e} {rr:8.1f} {r0} {float(E.max()):.3e} "
              f"{float(ea.max()):.3e} {er:8.1f}", flush=True)
    print(f"attacks: {time.process_time() - c:.0f} s CPU")


if __name__ == "__main__":
    main()

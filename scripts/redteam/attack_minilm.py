"""Attack the per-layer ball bound (layer_rows total_rows and stage radii) and, when the snapshot has it,
the attention drift (F35) on MiniLM's real layers: short sklearn sentences, rho = f x median token norm.
Matrix-free: alternating maximisation of nu_i by vjp/jvp, Adam over Y on u^T (J(Y) V)_i (double backward).
Usage: PYTHONPATH=<snap>/src:attacks python attacks/attack_minilm.py SNAP_KIND (joint|drift) [layers]"""
from __future__ import annotations

import sys
import time

import torch
from harness import clip

from transcover.lipschitz._local_jacobian import _weight_norms
from transcover.lipschitz._local_rows import layer_rows
from transcover.model import attention_forward, load
from transcover.model._data import load_inputs
from transcover.model._functional import layer_forward


def jvp(f, Y, V, create_graph=False):
    return torch.autograd.functional.jvp(f, Y, V, create_graph=create_graph)[1]


def vjp(f, Y, U):
    return torch.autograd.functional.vjp(f, Y, U)[1]


def nu_at(f, Y, i, u, X=None, iters=12):
    """Alternating maximisation of ||((J(Y) [- J(X)]) V)_i|| over unit rows V from cotangent u."""
    for _ in range(iters):
        U = torch.zeros_like(Y); U[i] = u
        W = vjp(f, Y, U) - (0 if X is None else vjp(f, X, U))
        V = W / W.norm(dim=1, keepdim=True).clamp(min=1e-300)
        z = jvp(f, Y, V)[i] - (0 if X is None else jvp(f, X, V)[i])
        u = z / z.norm()
    return float(z.norm()), u, V


def ascend(f, X, r, i, g, restarts=3, steps=25, drift=False):
    best = 0.0
    for k in range(restarts):
        E = torch.randn(X.shape, generator=g, dtype=torch.float64)
        E = (r * E / E.norm(dim=1, keepdim=True)).requires_grad_(True)
        u = torch.randn(X.shape[1], generator=g, dtype=torch.float64); u = u / u.norm()
        opt = torch.optim.Adam([E], lr=0.2 * r)
        for s in range(steps):
            Y = (X + E).detach()
            val, u, V = nu_at(f, Y, i, u, X if drift else None, iters=6 if s else 15)
            best = max(best, val)
            obj = u @ jvp(f, X + E, V, create_graph=True)[i]
            opt.zero_grad(); (-obj).backward(); opt.step()
            with torch.no_grad():
                E.copy_(clip(E, r))
        best = max(best, nu_at(f, (X + E).detach(), i, u, X if drift else None, iters=30)[0])
    return best


def main(kind, layers=(0, 1), factors=(1e-4, 1e-3, 1e-2)):
    spec = load(None).to_torch(torch.float64)
    seqs = load_inputs(spec, "sklearn-descr", max_len=32, limit=40)
    seq = min(seqs, key=lambda s: s.shape[0])  # the shortest sentence
    X = spec.input_norm(seq.double())
    print("T =", X.shape[0], flush=True)
    g = torch.Generator().manual_seed(0)
    for li, L in enumerate(spec.layers):
        if li > max(layers):
            break
        if li in layers:
            med = float(X.norm(dim=1).median())
            f = lambda Z, L=L: layer_forward(L, Z)  # noqa: E731
            ljs = layer_rows(L, X, [c * med for c in factors])
            for c, lj in zip(factors, ljs):
                r = c * med
                toks = lj.total_rows.topk(2).indices.tolist()
                rat = max(ascend(f, X, r, i, g) / float(lj.total_rows[i]) for i in toks)
                ref = f(X).detach()
                mv = torch.zeros(X.shape[0])
                for _ in range(2):  # the output move
                    E = clip(torch.randn(X.shape, generator=g, dtype=torch.float64) * r, r).requires_grad_(True)
                    opt = torch.optim.Adam([E], lr=0.2 * r)
                    for _ in range(25):
                        v = (f(X + E) - ref).norm(dim=1)
                        mv = torch.maximum(mv, v.detach())
                        opt.zero_grad(); (-v.sum()).backward(); opt.step()
                        with torch.no_grad():
                            E.copy_(clip(E, r))
                orat = float((mv / lj.output_radii).max())
                line = f"layer {li} rho={c:g}*med ball={lj.ball:.4g} nu-ratio={rat:.4f} out-move-ratio={orat:.4f}"
                if kind == "drift":
                    from transcover.lipschitz._local_drift import heads_joint, output_block_norms
                    from transcover.lipschitz._local_jacobian import _head_data
                    from transcover.lipschitz._local_rows import _head_output_norms, _heads_combined, _HeadMoments, attention_drift_rows
                    heads = _head_data(L.attention, X)
                    dZ = attention_drift_rows(_HeadMoments(heads, L.attention.softmax_scale), r, _weight_norms(L))
                    Oh, _ = _head_output_norms(None, None, heads, X.shape[0])
                    Oall = torch.full((X.shape[0],), float(_weight_norms(L)["O"]))
                    comb = _heads_combined(Oh, Oall, dZ, heads_joint(output_block_norms(heads), dZ))
                    fa = lambda Z, L=L: attention_forward(L.attention, Z)  # noqa: E731
                    i = int(comb.argmax())
                    dr = max(ascend(fa, X, r, j, g, drift=True) / float(comb[j]) for j in {i, 0})
                    line += f" attn-drift-ratio={dr:.4f} (bound {float(comb.max()):.4g})"
                print(line, flush=True)
        X = layer_forward(L, X).detach()


if __name__ == "__main__":
    t = time.process_time()
    main(sys.argv[1], tuple(int(a) for a in sys.argv[2:]) or (0, 1))
    print(f"cpu {time.process_time() - t:.1f}s")

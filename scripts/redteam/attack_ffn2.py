"""Attack F38 directly (ffn_taylor_drift): per token, sup over ||dh|| <= rh of ||P (F'(h + dh) - F'(h))||_2
(F' the FFN Jacobian, P the centring a following LayerNorm applies) by Adam on u^T M(dh) v with the top
singular pair of M(dh) recomputed each step, many restarts; small sharp FFNs and MiniLM's layer-0 FFN."""
import math
import sys
import torch
from transcover.lipschitz._local_ffn2 import ffn_hadamard, ffn_second_norms, ffn_taylor_drift

torch.set_default_dtype(torch.float64)


def slope(z):
    return torch.special.ndtr(z) + z * torch.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)


def attack(ffn, Hs, radii, centred=True, restarts=6, steps=60, label=""):
    W1, W2 = ffn.W_1.double(), ffn.W_2.double()
    b1 = 0 if ffn.b_1 is None else ffn.b_1.double()
    W2c = W2 - W2.mean(dim=1, keepdim=True) if centred else W2
    const = ffn_hadamard(ffn, centred=centred)
    z = Hs @ W1 + b1
    n2 = ffn_second_norms(const, z)
    n1 = W1.norm(dim=0)
    g = torch.Generator().manual_seed(0)
    for rh in radii:
        full, half = ffn_taylor_drift(const, n2, z, n1, torch.full((Hs.shape[0],), rh))
        worst = 0.0
        for t in range(Hs.shape[0]):
            M = lambda dh: W2c.T @ torch.diag(slope(z[t] + dh @ W1) - slope(z[t])) @ W1.T  # noqa: E731
            best = 0.0
            for k in range(restarts):
                dh = torch.randn(W1.shape[0], generator=g)
                if k == 0:  # along the top singular direction of the first-order tensor's largest unit
                    dh = W1[:, int((torch.exp(-0.5 * z[t] ** 2) * (2 - z[t] ** 2)).abs().argmax())].clone()
                dh = (rh * dh / dh.norm()).requires_grad_(True)
                opt = torch.optim.Adam([dh], lr=0.1 * rh)
                for s in range(steps):
                    Md = M(dh)
                    U, S, Vt = torch.linalg.svd(Md.detach())
                    best = max(best, float(S[0]))
                    opt.zero_grad(); (-(U[:, 0] @ Md @ Vt[0])).backward(); opt.step()
                    with torch.no_grad():
                        n = dh.norm()
                        if n > rh:
                            dh.mul_(rh / n)
            worst = max(worst, best / float(full[t]))
        print(f"{label} rh={rh:g} max found/certified (F38 full) = {worst:.4f}", flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["minilm"]:
        from transcover.model import attention_forward, load
        from transcover.model._data import load_inputs
        spec = load(None).to_torch(torch.float64)
        seq = min(load_inputs(spec, "sklearn-descr", max_len=32, limit=40), key=lambda s: s.shape[0])
        X = spec.input_norm(seq.double())
        L = spec.layers[0]
        H = L.norm_attn(X + attention_forward(L.attention, X)).detach()
        attack(L.ffn, H[:3], (1e-2, 1e-1, 1.0), restarts=3, steps=30, label="minilm-l0")
    else:
        sys.path.insert(0, "tests/lipschitz")
        from lipschitz_testkit import random_spec
        import dataclasses
        for seed, w1 in ((1, 1.0), (2, 6.0), (3, 15.0)):
            ffn = random_spec(seed, act="gelu", norm="layernorm", d=8, dff=16, biases=True).layers[0].ffn
            ffn = dataclasses.replace(ffn, W_1=ffn.W_1 * w1)
            Hs = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed)) * 1.0
            for c in (True, False):
                attack(ffn, Hs, (1e-3, 1e-2, 0.1, 0.5), centred=c, label=f"seed{seed} W1x{w1} centred={c}")

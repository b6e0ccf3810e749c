"""F35 per head at small radii (the second derivative at X decides): dense ascent, many starts."""
import sys
import torch
from attack_drift import CASES, bounds, head_fn
from attack_rows import make
from harness import adversarial_starts, ascend_nu, jac, random_starts

case = sys.argv[1]
L, X = make(CASES[case])
g = torch.Generator().manual_seed(5)
for r in (1e-5, 1e-4):
    dZ, _ = bounds(L, X, r)
    for h in range(L.attention.n_heads):
        f = head_fn(L.attention, h)
        J0 = jac(f, X)
        worst = (0.0, -1)
        for i in range(X.shape[0]):
            starts = random_starts(X, r, 4, g) + adversarial_starts(L, X, r, g)[:6]
            val, _ = ascend_nu(f, X, r, i, starts, steps=25, J0=J0, lr=0.3)
            worst = max(worst, (val / float(dZ[h, i]), i))
        print(f"{case} r={r:g} head{h} worst ratio {worst[0]:.4f} at query {worst[1]}", flush=True)

"""Focused probe: causal layer, token 0 depends on x_0 only, so nu_0(J) = ||J_00||_2 exactly; sup over the
ball by dense ascent of the spectral norm of the 8x8 block (many restarts), against point_rows, drift_rows,
total_rows of layer_rows."""
import sys
import torch
from attack_rows import CASES, make
from transcover.lipschitz._local_rows import layer_rows
from transcover.model._functional import layer_forward

case = sys.argv[1] if len(sys.argv) > 1 else "post_causal_q30"
L, X = make(CASES[case])
tok = 0
for r in (1e-3, 1e-2):
    lj = layer_rows(L, X, [r])[0]
    f0 = lambda x: layer_forward(L, torch.cat([x[None], X[1:]]))[0]  # noqa: E731
    J0 = torch.autograd.functional.jacobian(f0, X[0])
    s0 = float(torch.linalg.matrix_norm(J0, 2))
    g = torch.Generator().manual_seed(0)
    best = s0
    for k in range(6):
        e = torch.randn(X.shape[1], generator=g); e = r * e / e.norm()
        e.requires_grad_(True)
        opt = torch.optim.Adam([e], lr=0.1 * r)
        for s in range(50):
            J = torch.autograd.functional.jacobian(f0, X[0] + e, create_graph=True)
            v = torch.linalg.matrix_norm(J, 2)
            best = max(best, float(v))
            opt.zero_grad(); (-v).backward(); opt.step()
            with torch.no_grad():
                n = e.norm()
                if n > r: e.mul_(r / n)
    print(f"r={r:g} exact||J00(X)||={s0:.10g} point={float(lj.point_rows[tok]):.10g} drift={float(lj.drift_rows[tok]):.4g} "
          f"total={float(lj.total_rows[tok]):.10g} sup_found={best:.10g} ratio={best/float(lj.total_rows[tok]):.6f} "
          f"found-drift/drift={(best-s0)/float(lj.drift_rows[tok]):.4f}", flush=True)

"""One fuzz case: a random spec of a drawn kind, every certified claim on it, and the attack on each
(shared by ``test_lipschitz_fuzz`` and ``benchmarks/fuzz_certificates.py``).

A *check* is ``(kind, measured, slack, bound)``: the independent attack's best value at an explicit
witness of the certified domain, its float64 rounding slack, and the certified number; a violation
is ``measured - slack > bound``.  Kinds: ``attention[dot]`` / ``attention[l2]`` (the branch alone,
F6 / F13), ``ffn[<activation>]`` (F7), ``norm[<kind>]`` (F14, Pi_norm), ``stage`` (a link of the
chain: residual, pre-norm and a branch-output norm included), ``radius`` (the propagated token-norm bound of a stage's
output), ``layer``, ``network`` (F8), ``G.3`` (perturbation bound of a same-architecture pair).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from _attack import Domain, attack_gap, attack_output_radius, attack_pairs, fuzz_spec, ref_attention, ref_ffn, ref_stage
from transcover import UnsupportedArchitectureError
from transcover.lipschitz import lipschitz_bounds, perturbation_bound


@dataclass(frozen=True)
class Case:
    seed: int
    kind: str = "dot"  # attention kind
    norm: str = "ball"  # layernorm | rmsnorm | ball | none
    placement: str = "post"
    act: str = "relu"
    gated: bool = False
    biases: bool = False
    causal: bool = False
    rope: bool = False
    gqa: bool = False
    metric: str = "2,inf"
    radius: float = 1.0
    scale: float = 1.0
    sigma_min: float = 0.0
    L: int = 1
    final_norm: bool = False
    perturb: float = 1e-2
    dtype: str = "float64"  # float64 | float32 | bfloat16: how the weights are stored
    T: int = 3
    qk: float = 1.0  # extra factor on W_Q and W_K
    residual: str = "sequential"  # "parallel": x + attn(N_1 x) + ffn(N_2 x) (THEORY F21)
    rope_biases: bool = False  # query/key biases kept under RoPE (GPT-NeoX); G.3 splits the scores (F22)
    rotary_dim: int | None = None  # partial rotary: only the first rotary_dim coordinates rotate
    qk_norm: bool = False  # Qwen3's per-head RMSNorm of queries and keys (THEORY F23)
    softcap: float | None = None  # Gemma 2's attention-logit soft-capping c tanh(s / c) (THEORY F24)
    post_norm: bool = False  # an RMSNorm on each branch's output, x + N_post(f(N_pre x)) (THEORY F26; pre only)

    def spec(self):
        return fuzz_spec(self.seed, H=4 if self.gqa else 2, Hkv=2 if self.gqa else None, L=self.L, norm=self.norm,
                         placement=self.placement, act=self.act, gated=self.gated, biases=self.biases,
                         causal=self.causal, rope=self.rope, kind=self.kind, scale=self.scale,
                         eps=0.05 if self.sigma_min == 0 else 1e-4, final_norm=self.final_norm,
                         dtype=getattr(torch, self.dtype), qk_scale=self.qk, residual=self.residual,
                         rope_biases=self.rope_biases, rotary_dim=self.rotary_dim, qk_norm=self.qk_norm,
                         softcap=self.softcap, post_norm=self.post_norm)


def perturbed(spec, seed: int, size: float):
    """Every weight moved by ``size`` times a standard normal (kept in the weight's dtype)."""
    g = torch.Generator().manual_seed(seed)

    def mv(t):
        if t is None:
            return None
        return (t.double() + size * torch.randn(t.shape, generator=g, dtype=torch.float64)).to(t.dtype)

    def norm(n):
        return n if n is None or n.weight is None else replace(n, weight=mv(n.weight), bias=mv(n.bias))

    layers = []
    for lay in spec.layers:
        a, m = lay.attention, lay.ffn
        Wq = mv(a.W_Q)
        attn = replace(a, W_Q=Wq, W_K=Wq.clone() if a.kind == "l2" else mv(a.W_K), W_V=mv(a.W_V), W_O=mv(a.W_O),
                       b_Q=mv(a.b_Q), b_K=mv(a.b_K), b_V=mv(a.b_V), b_O=mv(a.b_O), q_norm=norm(a.q_norm),
                       k_norm=norm(a.k_norm))
        ffn = replace(m, W_1=mv(m.W_1), W_2=mv(m.W_2), b_1=mv(m.b_1), b_2=mv(m.b_2), W_gate=mv(m.W_gate),
                      b_gate=mv(m.b_gate))
        layers.append(replace(lay, attention=attn, ffn=ffn, norm_attn=norm(lay.norm_attn), norm_ffn=norm(lay.norm_ffn),
                              post_norm_attn=norm(lay.post_norm_attn), post_norm_ffn=norm(lay.post_norm_ffn)))
    return replace(spec, layers=layers, input_norm=norm(spec.input_norm), final_norm=norm(spec.final_norm))


def _floor_kind(norm: str) -> str | None:
    return {"layernorm": "std", "rmsnorm": "rms"}.get(norm)


def run_case(c: Case, *, restarts: int = 4, steps: int = 20) -> list[tuple[str, float, float, float]]:
    """Every check of case ``c`` (see module docstring)."""
    spec = c.spec()
    T, d, m = c.T, spec.d_model, c.metric
    kw = dict(metric=m, restarts=restarts, steps=steps)
    bounds = lipschitz_bounds(spec, radius=c.radius, metric=m, seq_len=T if (m == "fro" or c.kind == "l2") else None,
                              sigma_min=c.sigma_min)
    out = []
    seed = c.seed

    def dom(r, norm_stage=False):
        if c.sigma_min > 0 and norm_stage:
            return Domain(r, c.sigma_min, _floor_kind(c.norm))
        return Domain(r, c.sigma_min)

    for k, st in enumerate(bounds.stages):
        f = ref_stage(spec, st.layer, st.name)
        is_norm = st.name in ("input_norm", "final_norm", "norm_attn", "norm_ffn")
        w = attack_pairs(f, T=T, d=d, dom=dom(st.radius_in, is_norm), seed=seed + k, **kw)
        out.append((f"norm[{c.norm}]" if is_norm else "stage", w.ratio, w.slack, st.lipschitz))
        r = attack_output_radius(f, T=T, d=d, dom=dom(st.radius_in, is_norm), restarts=restarts, steps=steps,
                                 seed=seed + k)
        out.append(("radius", r, 64 * 2.2e-16 * r, st.radius_out))
        if st.name in ("attention", "ffn") and c.sigma_min == 0:
            lay = spec.layers[st.layer]
            if st.name == "attention":
                g, name = (lambda X, s, a=lay.attention: ref_attention(a, X)), f"attention[{c.kind}]"
            else:
                g, name = (lambda X, s, m_=lay.ffn: ref_ffn(m_, X)), f"ffn[{c.act}{'-gated' if c.gated else ''}]"
            w = attack_pairs(g, T=T, d=d, dom=Domain(st.branch_radius), seed=seed + 100 + k, **kw)
            out.append((name, w.ratio, w.slack, st.components[st.name]))
    for i in range(spec.n_layers):
        r0 = next(s.radius_in for s in bounds.stages if s.layer == i)
        w = attack_pairs(ref_stage(spec, i, "layer"), T=T, d=d, dom=dom(r0), seed=seed + 200 + i, **kw)
        out.append(("layer", w.ratio, w.slack, bounds.layer_upper(i).value))
    w = attack_pairs(ref_stage(spec, 0, "network"), T=T, d=d, dom=dom(c.radius), seed=seed + 300, **kw)
    out.append(("network", w.ratio, w.slack, bounds.upper.value))
    if c.perturb > 0:
        other = perturbed(spec, seed + 1, c.perturb)
        try:
            pb = perturbation_bound(spec, other, radius=c.radius, metric=m, seq_len=T if m == "fro" else None,
                                    sigma_min=c.sigma_min)
        except UnsupportedArchitectureError:
            assert c.kind == "l2"  # G.3 is not derived for L2 attention and says so
        else:
            w = attack_gap(ref_stage(spec, 0, "network"), ref_stage(other, 0, "network"), T=T, d=d,
                           dom=dom(c.radius), metric=m, restarts=restarts, steps=steps, seed=seed + 400)
            out.append(("G.3", w.ratio, w.slack, pb.total.value))
    return out


def violations(checks) -> list:
    return [ch for ch in checks if ch[1] - ch[2] > ch[3] or not math.isfinite(ch[3])]

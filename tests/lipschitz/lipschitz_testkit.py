"""Random small Transformer specs of every component the Lipschitz bounds support (test helper)."""

from __future__ import annotations

import torch

from transcover.model import (
    Activation, AttentionSpec, FFNSpec, LayerSpec, NormKind, NormSpec, Placement, RopeSpec, TransformerSpec,
)

# The models here are tiny: torch's intra-op thread pool only adds contention on a shared 2-core
# runner (a 6x3x3 softmax went from 0.4 ms to 30 ms with the default pool under load).
torch.set_num_threads(1)

NORMS = ("ball", "layernorm", "rmsnorm", "none")
ACTS = ("relu", "gelu", "gelu_tanh", "silu", "identity")


def _norm(kind: str, d: int, g: torch.Generator, eps: float) -> NormSpec:
    if kind == "ball":
        return NormSpec(NormKind.BALL)
    if kind == "none":
        return NormSpec(NormKind.NONE)
    w = 1.0 + 0.5 * torch.randn(d, generator=g, dtype=torch.float64)
    b = 0.1 * torch.randn(d, generator=g, dtype=torch.float64)
    return NormSpec(NormKind.LAYERNORM if kind == "layernorm" else NormKind.RMSNORM, w,
                    b if kind == "layernorm" else None, eps)


def random_spec(seed: int, *, d: int = 6, H: int = 2, dh: int = 3, dff: int = 8, L: int = 2,
                norm: str = "ball", placement: str = "post", act: str = "relu", gated: bool = False,
                biases: bool = False, causal: bool = False, scale: float = 1.0, eps: float = 0.05,
                input_norm: bool = True, final_norm: bool = False, rope: bool = False) -> TransformerSpec:
    g = torch.Generator().manual_seed(seed)
    if rope:  # rotary pairs need an even head dimension; RoPE models carry no query/key biases here
        dh = 4

    def rnd(*shape, s=1.0):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * s * scale / shape[-2] ** 0.5

    layers = []
    for i in range(L):
        attn = AttentionSpec(
            W_Q=rnd(H, d, dh), W_K=rnd(H, d, dh), W_V=rnd(H, d, dh), W_O=rnd(H, dh, d),
            b_Q=rnd(H, dh, 1)[..., 0] if biases and not rope else None,
            b_K=rnd(H, dh, 1)[..., 0] if biases and not rope else None,
            b_V=rnd(H, dh, 1)[..., 0] if biases else None, b_O=rnd(d, 1)[..., 0] if biases else None,
            causal=causal, rope=RopeSpec(theta=10.0) if rope else None,
        )
        ffn = FFNSpec(W_1=rnd(d, dff), W_2=rnd(dff, d), activation=Activation(act),
                      b_1=rnd(dff, 1)[..., 0] if biases else None, b_2=rnd(d, 1)[..., 0] if biases else None,
                      W_gate=rnd(d, dff) if gated else None,
                      b_gate=rnd(dff, 1)[..., 0] if (gated and biases) else None)
        layers.append(LayerSpec(i, attn, ffn, _norm(norm, d, g, eps), _norm(norm, d, g, eps),
                                Placement(placement)))
    return TransformerSpec(
        arch="test", name=f"random{seed}", d_model=d, layers=layers,
        input_norm=_norm(norm, d, g, eps) if input_norm else None,
        final_norm=_norm(norm, d, g, eps) if final_norm else None,
    )

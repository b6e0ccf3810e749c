"""GPT-J in the seed's decomposition: parallel residual with one LayerNorm, interleaved partial rotary.

transformers ``models/gptj/modeling_gptj.py``: ``GPTJBlock`` computes
``Z = X + Attn(LN_1 X) + MLP(LN_1 X)`` -- the parallel residual of THEORY F21 with both branches
reading the same ``ln_1`` (the spec's ``norm_attn`` and ``norm_ffn`` are that one norm), causal,
scale ``d_head ** -0.5``, separate bias-free ``q_proj``/``k_proj``/``v_proj``/``out_proj``, and
``fc_out(gelu_new(fc_in(x)))`` with biases; ``ln_f`` follows the last block.

Note [interleaved rotary].  GPT-J rotates the first ``rotary_dim`` coordinates of each head in
*adjacent* pairs ``(2k, 2k+1)`` (``rotate_every_two``) by ``pos * 10000^(-2k/rotary_dim)``; the spec
(Llama's ``rotate_half``) rotates the pairs ``(k, k + rotary_dim/2)`` by the same angles.  The two
agree after the permutation ``new[k] = old[2k]``, ``new[k + rotary_dim/2] = old[2k+1]`` of those
coordinates.  Every score is ``q . k`` over a head's coordinates, which is unchanged when the same
permutation is applied to the columns of ``W_Q`` and of ``W_K``; so the adapter permutes those
columns (exactly; no arithmetic) and the spec computes GPT-J's function.
"""

from __future__ import annotations

import numpy as np

from ..._errors import UnsupportedArchitectureError
from .._arrays import contiguous
from .._sources import TensorSource
from .._spec import AttentionSpec, LayerSequence, LayerSpec, RopeSpec, TransformerSpec
from ._common import (
    activation_from_name, find_prefix, heads_in, heads_out, layer_count, layer_norm, linear_weight, lm_embeddings,
    require, shared_norm_parallel_layer, summary, unexpected_layer_tensors,
)

__all__ = ["build_gptj"]

_LAYER_KEYS = {
    "W_Q": "attn.q_proj.weight", "W_K": "attn.k_proj.weight", "W_V": "attn.v_proj.weight",
    "W_O": "attn.out_proj.weight", "W_1": "mlp.fc_in.weight", "b_1": "mlp.fc_in.bias",
    "W_2": "mlp.fc_out.weight", "b_2": "mlp.fc_out.bias", "norm.weight": "ln_1.weight", "norm.bias": "ln_1.bias",
}


def _half_split(W, rd: int):  # noqa: ANN001, ANN202
    """Columns of each head ``(H, d, d_head)`` reordered from adjacent to half-split rotary pairs."""
    dh = W.shape[-1]
    order = np.concatenate([np.arange(0, rd, 2), np.arange(1, rd, 2), np.arange(rd, dh)])
    return contiguous(W[..., order.tolist()])  # a list indexes numpy arrays and torch tensors alike


def build_gptj(src: TensorSource, config: dict, name: str) -> TransformerSpec:
    arch = "gptj"
    config = dict(config)
    for short, long in (("n_embd", "hidden_size"), ("n_head", "num_attention_heads"), ("n_layer", "num_hidden_layers")):
        if config.get(short) is None and config.get(long) is not None:
            config[short] = config[long]
    d = int(require(config, "n_embd", arch=arch, name=name))
    H = int(require(config, "n_head", arch=arch, name=name))
    dh = d // H
    d_ff = int(config.get("n_inner") or 4 * d)
    eps = float(config.get("layer_norm_epsilon", 1e-5))
    act = activation_from_name(config.get("activation_function", "gelu_new"), arch=arch)
    rd = int(config.get("rotary_dim") or dh)
    if rd < 2 or rd % 2 or rd > dh:
        raise UnsupportedArchitectureError(f"{arch}: rotary_dim={rd} must be even, >= 2 and <= d_head={dh}")
    rope = RopeSpec(theta=10000.0, rotary_dim=None if rd == dh else rd,
                    max_position=int(config.get("n_positions") or 2048))
    found = find_prefix(src, ["h.0.attn.q_proj.weight", "wte.weight"])
    prefix = found[0] if found else ""
    n = layer_count(config, "n_layer", src, prefix, "h", name)

    def layer(i: int) -> LayerSpec:
        names = {role: f"{prefix}h.{i}.{key}" for role, key in _LAYER_KEYS.items()}
        attn = AttentionSpec(
            W_Q=_half_split(heads_in(linear_weight(src, names["W_Q"], d, d), H), rd),  # Note [interleaved rotary]
            W_K=_half_split(heads_in(linear_weight(src, names["W_K"], d, d), H), rd),
            W_V=heads_in(linear_weight(src, names["W_V"], d, d), H),
            W_O=heads_out(linear_weight(src, names["W_O"], d, d), H), causal=True, rope=rope,
        )
        return shared_norm_parallel_layer(src, names, i, attn, d=d, d_ff=d_ff, act=act, eps=eps)

    embeddings = lm_embeddings(src, prefix, "transformer.", "wte.weight")
    final_norm = layer_norm(src, prefix + "ln_f.weight", prefix + "ln_f.bias", d, eps)
    out = summary(config, src, n, H, H, dh, d_ff, act.value, prefix, embeddings.names)
    out.update(rotary_dim=rd, residual="parallel")
    return TransformerSpec(
        arch=arch, name=name, d_model=d, layers=LayerSequence(n, layer), final_norm=final_norm,
        embeddings=embeddings,  # type: ignore[arg-type]  # a read-on-access Mapping
        config=out,
        warnings=unexpected_layer_tensors(src, prefix, "h", n, _LAYER_KEYS.values(),
                                          (r"attn\.(masked_)?bias", r"attn\.embed_positions"), arch=arch, name=name),
    )

"""Mixture-of-experts decoders (Mixtral, Qwen2-MoE, Qwen3-MoE): Llama's blocks with a routed FFN.

transformers 5 (``modeling_mixtral``, ``modeling_qwen2_moe``, ``modeling_qwen3_moe``): the attention,
norms and RoPE are Llama's (Qwen3-MoE adds Qwen3's per-head query/key RMSNorm), so the Llama
adapter reads them; the FFN ``mlp`` of an expert layer is a sparse MoE block:

* ``mlp.gate.weight`` ``(E, d)``: router logits ``x W_r^T``, softmax over the E experts, top k kept
  (``num_experts_per_tok``), renormalised to sum 1 (Mixtral always, Qwen-MoE when ``norm_topk_prob``);
* ``mlp.experts.gate_up_proj`` ``(E, 2 d_ff, d)``: per expert ``[gate; up]`` stacked, ``chunk(2)``;
  ``mlp.experts.down_proj`` ``(E, d, d_ff)``; expert e is ``down(act(gate x) * up x)``;
* Qwen2-MoE adds ``mlp.shared_expert`` (a dense gated MLP) weighted by
  ``sigmoid(mlp.shared_expert_gate(x))``; layers listed in ``mlp_only_layers`` (or off the
  ``decoder_sparse_step`` grid) keep a dense ``mlp``.

The spec's :class:`~transcover.model.MoESpec` holds them; ``transformer_forward`` routes exactly as
the module does.  Every bound that needs a Lipschitz constant refuses (THEORY F25: top-k routing is
discontinuous); ``analyze`` reports the per-expert and router norms.
"""

from __future__ import annotations

import re
from dataclasses import replace

import numpy as np

from ..._errors import InputError, UnsupportedArchitectureError
from .._arrays import concat, permute
from .._sources import StateDictSource, TensorSource
from .._spec import FFNSpec, LayerSequence, MoESpec, TransformerSpec
from ._common import activation_from_name, find_prefix, linear_weight, require
from ._llama import build_llama

__all__ = ["build_moe"]

_DENSE = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
_MOE_KEYS = re.compile(r"(mlp|block_sparse_moe)\.(gate\.weight|experts\.|shared_expert)")


class _DenseStandIn(TensorSource):
    """``src`` with zero-cost stand-ins for a dense MLP where an expert layer has none, so that the
    Llama adapter reads the attention and norms; the stand-ins are replaced by the MoE before use."""

    def __init__(self, src: TensorSource, fake: dict[str, tuple[int, ...]]):
        self.inner, self.fake, self.name = src, fake, src.name

    def keys(self) -> list[str]:
        return [*self.inner.keys(), *self.fake]

    def where(self, key: str) -> str:
        return self.inner.where(key)

    def shape(self, key: str) -> tuple[int, ...]:
        return self.fake[key] if key in self.fake else self.inner.shape(key)

    def _dtype(self, key: str) -> str | None:
        return None if key in self.fake else self.inner._dtype(key)

    def _raw(self, key: str):  # noqa: ANN202
        if key not in self.fake:
            return self.inner._raw(key)
        if isinstance(self.inner, StateDictSource):
            import torch

            return torch.zeros((), dtype=torch.float32).expand(self.fake[key])
        return np.broadcast_to(np.float32(0.0), self.fake[key])

    def _read_bytes(self, key: str) -> int:
        return 0 if key in self.fake else self.inner._read_bytes(key)

    def metadata(self) -> dict[str, str]:
        return self.inner.metadata()

    def storage_dtype(self) -> str:
        return self.inner.storage_dtype()

    def stored_dtypes(self) -> str:
        return self.inner.stored_dtypes()


def _router_key(src: TensorSource, p: str) -> str | None:
    """Layer prefix ``p``'s router: ``mlp.gate.weight`` (Qwen-MoE; transformers 5 Mixtral modules) or
    ``block_sparse_moe.gate.weight`` (Mixtral checkpoints); None for a dense layer."""
    return next((p + k for k in ("mlp.gate.weight", "block_sparse_moe.gate.weight") if p + k in src), None)


def _experts(src: TensorSource, p: str, E: int, d: int, d_ff: int) -> tuple:
    """(W_gate, W_1, W_2) stacked ``(E, d, d_ff)``, ``(E, d, d_ff)``, ``(E, d_ff, d)`` in the x @ W
    orientation, from whichever of the three layouts layer prefix ``p`` stores:

    * transformers 5 modules: ``mlp.experts.gate_up_proj`` ``(E, 2 d_ff, d)`` (rows ``[0, d_ff)`` the
      gate, ``[d_ff, 2 d_ff)`` the up projection) and ``mlp.experts.down_proj`` ``(E, d, d_ff)``;
    * Qwen-MoE checkpoints: ``mlp.experts.<e>.{gate,up,down}_proj.weight`` (``nn.Linear`` each);
    * Mixtral checkpoints: ``block_sparse_moe.experts.<e>.w1`` (gate), ``w3`` (up), ``w2`` (down).
    """
    if p + "mlp.experts.gate_up_proj" in src:
        gu = src.get(p + "mlp.experts.gate_up_proj", (E, 2 * d_ff, d))
        down = src.get(p + "mlp.experts.down_proj", (E, d, d_ff))
        return permute(gu[:, :d_ff, :], 0, 2, 1), permute(gu[:, d_ff:, :], 0, 2, 1), permute(down, 0, 2, 1)
    if p + "mlp.experts.0.down_proj.weight" in src:
        names = (p + "mlp.experts.{e}.gate_proj.weight", p + "mlp.experts.{e}.up_proj.weight",
                 p + "mlp.experts.{e}.down_proj.weight")
    elif p + "block_sparse_moe.experts.0.w2.weight" in src:
        names = tuple(p + f"block_sparse_moe.experts.{{e}}.{w}.weight" for w in ("w1", "w3", "w2"))
    else:
        raise UnsupportedArchitectureError(f"no expert tensors under {p!r} beside its router; the layouts read are "
                                           "mlp.experts.gate_up_proj, mlp.experts.<e>.*_proj and "
                                           "block_sparse_moe.experts.<e>.w1/w2/w3")
    shapes = ((d, d_ff), (d, d_ff), (d_ff, d))
    return tuple(concat([linear_weight(src, key.format(e=e), *shape)[None] for e in range(E)], axis=0)
                 for key, shape in zip(names, shapes))


def _normalize_topk(config: dict, arch: str, name: str) -> bool:
    """Whether the top-k routing weights are renormalised to sum 1, as transformers 5.25 decides per model type:
    Mixtral always (``MixtralTopKRouter``); Qwen2-MoE and Qwen3-MoE when ``norm_topk_prob`` (default False
    in 4.x and 5.x).  ``num_local_experts`` says nothing: transformers 5 saves Qwen3-MoE's ``num_experts``
    under that name (its ``attribute_map``), and reading it as "Mixtral" renormalised a model that does
    not (red team 168)."""
    model_type = config.get("model_type")
    if model_type == "mixtral":
        return True
    if model_type in ("qwen2_moe", "qwen3_moe") or "norm_topk_prob" in config:
        v = config.get("norm_topk_prob", False)
        if not isinstance(v, bool):
            raise InputError(f"{arch} configuration of {name}: norm_topk_prob must be true or false, "
                             f"but got norm_topk_prob={v!r}")
        return v
    raise InputError(f"{arch} configuration of {name} names no model_type (mixtral, qwen2_moe or qwen3_moe) and "
                     "no norm_topk_prob, so whether the top-k routing weights are renormalised is unknown; "
                     f"but got model_type={model_type!r}")


def build_moe(src: TensorSource, config: dict, name: str) -> TransformerSpec:
    arch = str(config.get("model_type") or "moe")
    d = int(require(config, "hidden_size", arch=arch, name=name))
    E = int(config.get("num_local_experts") or require(config, "num_experts", arch=arch, name=name))
    top_k = int(require(config, "num_experts_per_tok", arch=arch, name=name))
    d_ff = int(config.get("moe_intermediate_size") or require(config, "intermediate_size", arch=arch, name=name))
    act = activation_from_name(config.get("hidden_act", "silu"), arch=arch)
    normalize = _normalize_topk(config, arch, name)
    found = find_prefix(src, ["layers.0.self_attn.q_proj.weight"])
    prefix = found[0] if found else ""
    n = int(require(config, "num_hidden_layers", arch=arch, name=name))
    routers = [_router_key(src, f"{prefix}layers.{i}.") for i in range(n)]
    if not any(routers):
        raise UnsupportedArchitectureError(f"{arch}: no router (layers.<i>.mlp.gate.weight or "
                                           f"block_sparse_moe.gate.weight) in {name}")
    d_dense = int(config.get("intermediate_size") or d_ff)
    fake = {f"{prefix}layers.{i}.{key}": shape for i in range(n) if routers[i]
            for key, shape in zip(_DENSE, ((d_dense, d), (d_dense, d), (d, d_dense)))}
    base = build_llama(_DenseStandIn(src, fake), {**config, "intermediate_size": d_dense}, name)

    def moe(i: int) -> MoESpec:
        p = f"{prefix}layers.{i}."
        W_gate, W_1, W_2 = _experts(src, p, E, d, d_ff)
        shared = shared_gate = None
        if p + "mlp.shared_expert.down_proj.weight" in src:
            d_sh = int(require(config, "shared_expert_intermediate_size", arch=arch, name=name))
            s = p + "mlp.shared_expert."
            shared = FFNSpec(W_1=linear_weight(src, s + "up_proj.weight", d, d_sh),
                             W_2=linear_weight(src, s + "down_proj.weight", d_sh, d),
                             W_gate=linear_weight(src, s + "gate_proj.weight", d, d_sh), activation=act)
            # Qwen2MoeSparseMoeBlock builds shared_expert_gate with every shared expert (Note [missing biases])
            shared_gate = src.get(p + "mlp.shared_expert_gate.weight", (1, d))[0]
        return MoESpec(W_router=linear_weight(src, routers[i], d, E), W_gate=W_gate, W_1=W_1, W_2=W_2,
                       activation=act, top_k=top_k, normalize_topk=normalize, shared=shared, shared_gate=shared_gate)

    def layer(i: int):  # noqa: ANN202
        lay = base.layers[i]
        if not routers[i]:
            return lay
        names = {k: v for k, v in lay.names.items() if v not in fake}
        names["router"] = routers[i]
        return replace(lay, ffn=moe(i), names=names)

    warnings = tuple(w for w in base.warnings if not _MOE_KEYS.search(w))  # the MoE tensors are read here
    out = {**base.config, "n_experts": E, "top_k": top_k, "expert_d_ff": d_ff}
    return replace(base, arch="moe", layers=LayerSequence(n, layer), config=out, warnings=warnings)

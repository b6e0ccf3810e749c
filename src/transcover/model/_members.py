"""Member stacks: many models of one structure as one spec, evaluated by one batched forward pass.

A stack's every array carries a leading member axis ``M`` (Note [member stacks] in
``_functional``): ``transformer_forward(stack, X[None])`` evaluates all members on the same inputs
at once, ``transformer_forward(stack, X)`` with ``X`` of shape ``(M, batch..., T, d)`` each member on
its own inputs.  The Monte-Carlo classes of ``transcover.empirical`` build their stacks directly
from their stacked draws; :func:`stack_members` stacks given specs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields, replace
from typing import Any

from .._errors import InputError
from ._arrays import is_tensor, to_tensor
from ._spec import AttentionSpec, LayerSpec, MLPHeadSpec, NormSpec, TransformerSpec

__all__ = ["stack_members"]


def _is_array(v: Any) -> bool:
    return is_tensor(v) or hasattr(v, "__array__") and hasattr(v, "shape")


def _stack_arrays(values: list[Any], where: str) -> Any:
    import torch

    if all(v is None for v in values):
        return None
    if any(v is None for v in values):
        raise InputError(f"cannot stack the members: {where} is present in some and absent in others")
    first = to_tensor(values[0])
    shapes = {tuple(v.shape) for v in values}
    if len(shapes) > 1:
        raise InputError(f"cannot stack the members: {where} has shapes {sorted(shapes)}")
    return torch.stack([to_tensor(v, first) for v in values])


def _stack_dataclass(items: list[Any], where: str, **override: Any) -> Any:
    """One instance of ``type(items[0])`` whose array fields are stacked and whose other fields
    agree across the members (else InputError naming the field)."""
    values: dict[str, Any] = {}
    for f in fields(items[0]):
        if f.name in override:
            continue
        vals = [getattr(x, f.name) for x in items]
        if any(_is_array(v) for v in vals):
            values[f.name] = _stack_arrays(vals, f"{where} {f.name}")
        elif any(v != vals[0] for v in vals[1:]):
            raise InputError(f"cannot stack the members: {where} {f.name} differs ({vals[0]!r} vs others)")
    return replace(items[0], **values, **override)


def _stack_norm(norms: list[NormSpec | None], where: str) -> NormSpec | None:
    if all(n is None for n in norms):
        return None
    if any(n is None for n in norms):
        raise InputError(f"cannot stack the members: {where} is present in some and absent in others")
    return _stack_dataclass(norms, where)


def _stack_attention(attns: list[AttentionSpec], where: str) -> AttentionSpec:
    over = {}
    biases = [a.position_bias for a in attns]
    if any(b is not None for b in biases):  # T5's tables are arrays of their own: stacked (M, buckets, H)
        if any(b is None for b in biases):
            raise InputError(f"cannot stack the members: {where} relative position bias is present in some only")
        over["position_bias"] = _stack_dataclass(biases, f"{where} position_bias")
    if attns[0].kind == "l2":  # W_K is W_Q (Note [L2 attention fields]): one stacked array for both
        W_Q = _stack_arrays([a.W_Q for a in attns], f"{where} W_Q")
        return _stack_dataclass(attns, where, W_Q=W_Q, W_K=W_Q, **over)
    return _stack_dataclass(attns, where, **over)


def _stack_layer(layers: list[LayerSpec], i: int) -> LayerSpec:
    where = f"layer {i}"
    if any(lay.placement is not layers[0].placement for lay in layers):
        raise InputError(f"cannot stack the members: {where} placement differs")
    return replace(layers[0], attention=_stack_attention([lay.attention for lay in layers], f"{where} attention"),
                   ffn=_stack_dataclass([lay.ffn for lay in layers], f"{where} FFN"),
                   norm_attn=_stack_norm([lay.norm_attn for lay in layers], f"{where} norm_attn"),
                   norm_ffn=_stack_norm([lay.norm_ffn for lay in layers], f"{where} norm_ffn"),
                   post_norm_attn=_stack_norm([lay.post_norm_attn for lay in layers], f"{where} post_norm_attn"),
                   post_norm_ffn=_stack_norm([lay.post_norm_ffn for lay in layers], f"{where} post_norm_ffn"))


def _stack_head(heads: list[MLPHeadSpec | None]) -> MLPHeadSpec | None:
    if all(h is None for h in heads):
        return None
    if any(h is None for h in heads) or len({len(h.weights) for h in heads}) > 1:
        raise InputError("cannot stack the members: their MLP heads differ in depth or presence")
    if any((h.activation, h.readout) != (heads[0].activation, heads[0].readout) for h in heads):
        raise InputError("cannot stack the members: their MLP heads differ in activation or read-out")
    n = len(heads[0].weights)
    return MLPHeadSpec(
        weights=tuple(_stack_arrays([h.weights[j] for h in heads], f"head weight {j}") for j in range(n)),
        biases=tuple(_stack_arrays([h.biases[j] for h in heads], f"head bias {j}") for j in range(n)),
        activation=heads[0].activation, readout=heads[0].readout)


def stack_members(specs: Sequence[TransformerSpec]) -> TransformerSpec:
    """One spec holding ``specs`` as members along a leading axis of every array (torch tensors,
    in the first member's dtypes).

    ``transformer_forward(stack, X[None])[m]`` is member ``m`` on ``X`` (Note [member stacks]).
    Embeddings are not stacked (the forward takes embedded inputs).

    Raises:
        InputError: no members, or members that differ in anything but their arrays' values
            (layer count, shapes, norm kinds, masks, activations, biases present or absent).
    """
    specs = list(specs)
    if not specs:
        raise InputError("cannot stack zero members")
    if len({s.n_layers for s in specs}) > 1 or len({s.d_model for s in specs}) > 1:
        raise InputError("cannot stack the members: they differ in depth or width")
    layers = [_stack_layer([s.layers[i] for s in specs], i) for i in range(specs[0].n_layers)]
    return TransformerSpec(
        arch=specs[0].arch, name=f"stack of {len(specs)} members", d_model=specs[0].d_model, layers=layers,
        input_norm=_stack_norm([s.input_norm for s in specs], "input_norm"),
        final_norm=_stack_norm([s.final_norm for s in specs], "final_norm"),
        head=_stack_head([s.head for s in specs]), config=dict(specs[0].config))

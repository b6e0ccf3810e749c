"""``as_torch(spec)``: the same decomposition with every array a torch tensor (imports torch).

Models read from files carry numpy arrays (Note [no torch on the file path] in ``_arrays``); the
stages that compute with torch (Lipschitz estimates, covering, training, constraints) call
:meth:`TransformerSpec.to_torch` at their entry points.  The conversion is lazy, layer by layer, and
shares memory with the numpy arrays where torch allows it (no copy of a writable float array).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from typing import Any

from ._arrays import to_tensor
from ._spec import FFNSpec, LayerSequence, LayerSpec, MLPHeadSpec, MoESpec, NormSpec, TransformerSpec

__all__ = ["as_torch"]


def _t(x: Any, dtype: Any) -> Any:
    return None if x is None else to_tensor(x, dtype=dtype)


def _norm(n: NormSpec | None, dtype: Any) -> NormSpec | None:
    return None if n is None else replace(n, weight=_t(n.weight, dtype), bias=_t(n.bias, dtype))


def _ffn(f: FFNSpec | MoESpec, dtype: Any) -> FFNSpec | MoESpec:
    if isinstance(f, MoESpec):
        return replace(f, **{k: _t(getattr(f, k), dtype) for k in ("W_router", "W_1", "W_2", "W_gate", "shared_gate")},
                       shared=None if f.shared is None else _ffn(f.shared, dtype))
    return replace(f, **{k: _t(getattr(f, k), dtype) for k in ("W_1", "W_2", "b_1", "b_2", "W_gate", "b_gate")})


def _layer(layer: LayerSpec, dtype: Any) -> LayerSpec:
    a = layer.attention
    attn = replace(a, **{f: _t(getattr(a, f), dtype) for f in
                         ("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O")},
                   q_norm=_norm(a.q_norm, dtype), k_norm=_norm(a.k_norm, dtype),
                   position_bias=None if a.position_bias is None else replace(
                       a.position_bias, table=_t(a.position_bias.table, dtype)))
    ffn = _ffn(layer.ffn, dtype)
    return replace(layer, attention=attn, ffn=ffn, norm_attn=_norm(layer.norm_attn, dtype),
                   norm_ffn=_norm(layer.norm_ffn, dtype), post_norm_attn=_norm(layer.post_norm_attn, dtype),
                   post_norm_ffn=_norm(layer.post_norm_ffn, dtype))


class _MappedTensors(Mapping[str, Any]):
    """A read-on-access view of ``embeddings`` with each value converted when read."""

    def __init__(self, inner: Mapping[str, Any], convert: Callable[[Any], Any]):
        self._inner = inner
        self._convert = convert
        names = getattr(inner, "names", None)
        if names is not None:
            self.names = names

    def __getitem__(self, key: str) -> Any:
        return self._convert(self._inner[key])

    def __iter__(self) -> Iterator[str]:
        return iter(self._inner)

    def __len__(self) -> int:
        return len(self._inner)


def as_torch(spec: TransformerSpec, dtype: Any = None) -> TransformerSpec:
    """``spec`` with torch tensors in place of numpy arrays (``dtype``: also cast, e.g. ``torch.float64``).

    Layers are converted when accessed, so a large checkpoint is still read one layer at a time;
    tensors already of the right kind are kept as they are (no copy).
    """
    src_layers = spec.layers
    layers = LayerSequence(len(src_layers), lambda i: _layer(src_layers[i], dtype))
    head = spec.head
    if head is not None:
        head = MLPHeadSpec(weights=tuple(_t(w, dtype) for w in head.weights),
                           biases=tuple(_t(b, dtype) for b in head.biases),
                           activation=head.activation, readout=head.readout)
    return replace(spec, layers=layers, input_norm=_norm(spec.input_norm, dtype),
                   final_norm=_norm(spec.final_norm, dtype), head=head,
                   embeddings=_MappedTensors(spec.embeddings, lambda t: _t(t, dtype)))

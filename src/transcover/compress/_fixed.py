"""The fixed-length model code: the comparison code of the "what moves the bound" check (issue 12).

The same fields as :func:`transcover.compress.encode` (code version, architecture index, the
per-tensor headers), then every integer ``Q + m`` of a tensor with ``m > 0`` in
``ceil(log2(2m + 1))`` bits, in ``state_dict`` order, and no payload mode bit.  It is prefix-free
for the same reason (every field's width is fixed by the fields before it), so it is a prior of
its own; its length is :func:`transcover.compress.fixed_length_bits`.  Sparsity helps it only
through whole zero tensors (``m = 0``): this is the code "without an entropy code".
"""

from __future__ import annotations

import math

import torch

from ..model import ReferenceConfig
from ._codes import BitWriter, fixed_width
from ._describe import ModelDescription, QuantisedTensor, read_preamble, write_preamble

__all__ = ["encode_fixed", "decode_fixed"]


def encode_fixed(desc: ModelDescription) -> BitWriter:
    """The fixed-length codeword of ``desc`` (see the module docstring)."""
    w = write_preamble(desc)
    for t in desc.tensors:
        if t.m:
            width = fixed_width(2 * t.m + 1)
            for q in (t.Q + t.m).flatten().tolist():
                w.fixed(q, width)
    return w


def decode_fixed(bits: list[int], menu: tuple[ReferenceConfig, ...]) -> ModelDescription:
    """Inverse of :func:`encode_fixed` for the same menu; raises ``ValueError`` on a malformed word."""
    r, version, arch, shapes, headers = read_preamble(bits, menu)
    tensors = []
    for (name, shape), (m, k) in zip(shapes, headers):
        if m == 0:
            tensors.append(QuantisedTensor(name, 0, 0, torch.zeros(shape, dtype=torch.int64)))
            continue
        width = fixed_width(2 * m + 1)
        ints = [r.fixed(width) for _ in range(math.prod(shape))]
        if max(ints) > 2 * m:
            raise ValueError(f"{name}: integer {max(ints)} outside the {2 * m + 1} levels")
        tensors.append(QuantisedTensor(name, m, k, torch.tensor(ints, dtype=torch.int64).reshape(shape) - m))
    if r.pos != len(bits):
        raise ValueError(f"{len(bits) - r.pos} bits left after the last tensor")
    return ModelDescription(menu, arch, tuple(tensors))

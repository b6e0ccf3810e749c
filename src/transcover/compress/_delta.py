"""A code for a quantised model *relative to a reference* fixed before the bound's samples (data-dependent prior).

THEORY F20.  Split the training set into ``A`` and ``B``.  Everything learned from ``A`` alone (a
quantised reference model ``R``: architecture, grids, integers) is fixed before ``B`` is looked at,
so a code built from ``R`` is a legitimate prior for an Occam bound on ``B`` (Ambroladze et al.
2007; Parrado-Hernandez et al. 2012; Dziugaite et al. 2021; Perez-Ortiz et al. 2021).  The codeword
of a model ``M`` is one flag bit, then

* flag 1: ``M`` on ``R``'s grids (same architecture, ``m_W``, ``k_W``), written as its differences to
  ``R``: the number ``c`` of changed integers (Elias gamma of ``c + 1``), which ``c`` of the ``P``
  integers changed (their rank among the ``C(P, c)`` subsets, in ``ceil(log2 C(P, c))`` bits), and
  each changed integer's new value among the ``2 m_W`` values of ``{-m_W..m_W}`` other than ``R``'s
  (``ceil(log2(2 m_W))`` bits; a zero tensor of ``R`` (``m_W = 0``) cannot change);
* flag 0: any model, in the full code of :mod:`._describe` (the bound then pays ``1 + L`` bits).

Both branches are prefix-free, so the whole code is, and Kraft gives the prior ``2^{-L}``.  With
``c = 0`` the model is ``R`` itself and costs ``1 + 1 + 0`` bits: the bound on ``B`` is then a
held-out bound for ``R`` (which never saw ``B``); fine-tuning on ``A + B`` pays per changed integer.
"""

from __future__ import annotations

from math import comb

import torch

from ._codes import BitReader, BitWriter, fixed_width, gamma_length, sequence_rank, sequence_unrank
from ._describe import ModelDescription, QuantisedTensor, decode, description_bits, encode

__all__ = ["delta_bits", "encode_delta", "decode_delta", "changed_entries"]


def _flat(desc: ModelDescription) -> tuple[torch.Tensor, list[int]]:
    """All integers in ``state_dict`` order, and each one's ``m``."""
    Q = torch.cat([t.Q.flatten() for t in desc.tensors])
    m = [t.m for t in desc.tensors for _ in range(t.Q.numel())]
    return Q, m


def _same_grids(model: ModelDescription, ref: ModelDescription) -> bool:
    return model.arch == ref.arch and len(model.tensors) == len(ref.tensors) and all(
        a.name == b.name and a.Q.shape == b.Q.shape and a.m == b.m and (a.m == 0 or a.k == b.k)
        for a, b in zip(model.tensors, ref.tensors))


def changed_entries(model: ModelDescription, ref: ModelDescription) -> list[int] | None:
    """Flat indices where ``model`` differs from ``ref``; None when they are not on the same grids."""
    if not _same_grids(model, ref):
        return None
    Qm, _ = _flat(model)
    Qr, _ = _flat(ref)
    return torch.nonzero(Qm != Qr).flatten().tolist()


def _relative_length(ref: ModelDescription, idx: list[int]) -> int:
    _, m = _flat(ref)
    P, c = len(m), len(idx)
    return 1 + gamma_length(c + 1) + fixed_width(comb(P, c)) + sum(fixed_width(2 * m[i]) for i in idx)


def _branch(model: ModelDescription, ref: ModelDescription) -> tuple[int, list[int] | None]:
    """``(length, changed indices)`` of the shorter branch; indices None for the full code (flag 0)."""
    full = 1 + description_bits(model)
    idx = changed_entries(model, ref)
    if idx is None:
        return full, None
    rel = _relative_length(ref, idx)
    return (rel, idx) if rel <= full else (full, None)


def delta_bits(model: ModelDescription, ref: ModelDescription) -> int:
    """The exact length of :func:`encode_delta` ``(model, ref)``: the shorter branch."""
    return _branch(model, ref)[0]


def encode_delta(model: ModelDescription, ref: ModelDescription) -> BitWriter:
    """The codeword of ``model`` given the reference ``ref`` (see the module docstring)."""
    _, idx = _branch(model, ref)
    w = BitWriter()
    if idx is None:
        w.fixed(0, 1)
        w.bits.extend(encode(model).bits)
        return w
    Qm, _ = _flat(model)
    Qr, m = _flat(ref)
    P, c = len(m), len(idx)
    w.fixed(1, 1)
    w.gamma(c + 1)
    chosen = set(idx)
    w.fixed(sequence_rank([1 if i in chosen else 0 for i in range(P)], [P - c, c]), fixed_width(comb(P, c)))
    for i in idx:
        new, old = int(Qm[i]), int(Qr[i])
        w.fixed(new + m[i] - (1 if new > old else 0), fixed_width(2 * m[i]))  # the 2m values other than old
    return w


def decode_delta(bits: list[int], ref: ModelDescription) -> ModelDescription:
    """Inverse of :func:`encode_delta` for the same reference; raises ``ValueError`` on a malformed word."""
    r = BitReader(bits)
    if r.fixed(1) == 0:
        return decode(bits[1:], ref.menu)
    c = r.gamma() - 1
    Qr, m = _flat(ref)
    P = len(m)
    if c > P:
        raise ValueError(f"{c} changes of {P} integers")
    mask = sequence_unrank(r.fixed(fixed_width(comb(P, c))), [P - c, c])
    if len(mask) != P:
        raise ValueError("corrupt change set")
    Q = Qr.clone()
    for i in (j for j, b in enumerate(mask) if b):
        if m[i] == 0:
            raise ValueError("a change in a tensor the reference has at zero")
        slot, old = r.fixed(fixed_width(2 * m[i])), int(Qr[i])
        new = slot - m[i] + (1 if slot - m[i] >= old else 0)
        if not -m[i] <= new <= m[i]:
            raise ValueError("changed integer outside its grid")
        Q[i] = new
    if r.pos != len(bits):
        raise ValueError(f"{len(bits) - r.pos} bits left after the last change")
    tensors, start = [], 0
    for t in ref.tensors:
        size = t.Q.numel()
        tensors.append(QuantisedTensor(t.name, t.m, t.k, Q[start : start + size].reshape(t.Q.shape)))
        start += size
    return ModelDescription(ref.menu, ref.arch, tuple(tensors))

"""A prefix-free description of a quantised reference Transformer, and its exact length in bits.

The code (fixed before any data is seen; THEORY F18) is, in this order:

0. the code version in 2 bits: the models were tuned on the same data while up to four designs
   of this code (menus, grids, headers) were tried, so the bound pays for a union over four codes
   rather than pretending the final one was fixed in advance.  Versions 2 and 3 are decodable and
   differ only in step 2; the encoder writes the shorter (:data:`CODE_VERSIONS`);
1. the architecture: its index in a finite menu of :class:`~transcover.model.ReferenceConfig`
   (``ceil(log2 |menu|)`` bits, a uniform prior over the menu);
2. for every parameter tensor of that architecture, in ``state_dict`` order (the shapes are known
   from step 1), its header: the level count ``m >= 0`` as Elias gamma of ``m + 1`` (``m = 0``: the
   tensor is zero) and, if ``m > 0``, the scale index ``k`` of ``s_k = 2^{k/8}`` as Elias gamma of
   ``zigzag(k) + 1`` (version 2); version 3 codes both as differences to the previous tensor's
   (Elias gamma of ``zigzag(m - m_prev) + 1`` with ``m_prev = 1`` before the first tensor, and of
   ``zigzag(k - k_prev) + 1`` with ``k_prev`` the last non-zero tensor's scale, 0 before the
   first): neighbouring matrices share their grid and a similar scale, so a header costs a few
   bits instead of ~16 (the "fewer, shared per-matrix scales" of issue 12);
3. one bit choosing how the integers are coded, then the integers ``Q + m`` (alphabet ``2m + 1``)
   in the two-part enumerative code of ``transcover.compress._codes``: bit 0, each tensor with its
   own composition; bit 1, one composition per level count ``m``, shared by the concatenation of
   every tensor with that ``m`` (a histogram costs about ``(2m) log2 p`` bits, which small tensors
   should not pay one by one).  The encoder takes the shorter.

Every field is self-delimiting or has a length fixed by fields before it, so the code is
prefix-free and Kraft's inequality gives the prior ``2^{-L}``.  Sparsity is paid for only through
the enumerative code: a tensor that is mostly 0 costs about ``p H(counts / p)`` bits, not
``p log2(2m + 1)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..model import ReferenceConfig, ReferenceTransformer
from ._codes import (
    BitReader,
    BitWriter,
    enumerative_length,
    fixed_width,
    gamma_length,
    read_enumerative,
    unzigzag,
    write_enumerative,
    zigzag,
)
from ._quantise import dequantise

__all__ = ["CODE_VERSION", "VERSION_BITS", "QuantisedTensor", "ModelDescription", "parameter_shapes", "encode", "decode", "description_bits",
           "materialise", "fixed_length_bits"]


# 0: a 4-entry menu; 1: 8 entries, per-tensor compositions only; 2: absolute headers; 3: delta headers.
# No more are possible in 2 bits (step 0 above).
CODE_VERSIONS = (2, 3)
CODE_VERSION = 3  # the newest; kept for callers that name one
VERSION_BITS = 2


def _header_fields(tensors, version: int) -> list[list[int]]:  # noqa: ANN001
    """Per tensor, the integers >= 1 its header writes in Elias gamma (see the module docstring)."""
    out, prev_m, prev_k = [], 1, 0
    for t in tensors:
        if version == 2:
            out.append([t.m + 1] + ([zigzag(t.k) + 1] if t.m else []))
            continue
        fields = [zigzag(t.m - prev_m) + 1]
        if t.m:
            fields.append(zigzag(t.k - prev_k) + 1)
            prev_k = t.k
        prev_m = t.m
        out.append(fields)
    return out


@dataclass(frozen=True)
class QuantisedTensor:
    """One parameter tensor: ``s_k Q`` with ``Q`` in ``{-m..m}`` (``m = 0``: all zero)."""

    name: str
    m: int
    k: int
    Q: Tensor  # int64, the parameter's shape

    def __post_init__(self) -> None:
        for field_name in ("m", "k"):  # True is not 1 here: a bool m was charged as the integer 1 (stop 38)
            v = getattr(self, field_name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"{self.name}: {field_name} must be an integer, but got {v!r}")
        if self.Q.dtype != torch.int64 or self.Q.numel() == 0:
            raise ValueError(f"{self.name}: Q must be a non-empty int64 tensor, but got {self.Q.dtype} of shape "
                             f"{tuple(self.Q.shape)}")
        # compared, not abs(): abs(-2^63) overflows to a negative number and passed the range check (stop 38)
        if self.m < 0 or (self.m and bool(((self.Q < -self.m) | (self.Q > self.m)).any())):
            raise ValueError(f"{self.name}: integers must lie in [-m, m] with m >= 0, but m={self.m}")
        if self.m == 0 and bool(self.Q.any()):
            raise ValueError(f"{self.name}: m=0 describes a zero tensor, but Q has non-zeros")

    @property
    def nonzeros(self) -> int:
        return int((self.Q != 0).sum())

    def header_bits(self) -> int:
        return gamma_length(self.m + 1) + (gamma_length(zigzag(self.k) + 1) if self.m else 0)

    def payload_bits(self) -> int:
        if self.m == 0:
            return 0
        K = 2 * self.m + 1
        counts = torch.bincount((self.Q + self.m).flatten(), minlength=K).tolist()
        return enumerative_length(counts)

    def bits(self) -> int:
        return self.header_bits() + self.payload_bits()


@dataclass(frozen=True)
class ModelDescription:
    """A quantised model: an architecture from a menu and one :class:`QuantisedTensor` per parameter."""

    menu: tuple[ReferenceConfig, ...]
    arch: int
    tensors: tuple[QuantisedTensor, ...]

    def header_bits(self, version: int | None = None) -> list[int]:
        """Each tensor's header length in code ``version`` (default: the one the encoder writes)."""
        version = self.version() if version is None else version
        return [sum(gamma_length(f) for f in fields) for fields in _header_fields(self.tensors, version)]

    def version(self) -> int:
        """The code version with the shorter headers (3 on ties)."""
        return min(CODE_VERSIONS, key=lambda v: (sum(self.header_bits(v)), -v))

    def architecture_bits(self) -> int:
        """The code version and the architecture's index in the menu."""
        return VERSION_BITS + fixed_width(len(self.menu))

    def groups(self) -> dict[int, list[int]]:
        """Indices of the tensors with each level count ``m > 0``, ``m`` ascending."""
        out: dict[int, list[int]] = {}
        for i, t in enumerate(self.tensors):
            if t.m:
                out.setdefault(t.m, []).append(i)
        return dict(sorted(out.items()))

    def shared_payload_bits(self) -> dict[int, int]:
        """Per level count m: the enumerative code length of all its tensors' integers together."""
        out = {}
        for m, idx in self.groups().items():
            Q = torch.cat([self.tensors[i].Q.flatten() for i in idx]) + m
            out[m] = enumerative_length(torch.bincount(Q, minlength=2 * m + 1).tolist())
        return out

    def shared(self) -> bool:
        """Whether the shared-composition payload (mode bit 1) is the shorter one."""
        return sum(self.shared_payload_bits().values()) < sum(t.payload_bits() for t in self.tensors)

    def bits_per_tensor(self) -> dict[str, int]:
        """Every part of the codeword but the version and architecture, in bits; they sum exactly.

        Each tensor's entry is its header, plus its own payload when the per-tensor mode is chosen;
        in the shared mode the payloads appear as one entry per level count."""
        shared = self.shared()
        out = {t.name: h + (0 if shared else t.payload_bits()) for t, h in zip(self.tensors, self.header_bits())}
        out["(payload mode bit)"] = 1
        if shared:
            for m, bits in self.shared_payload_bits().items():
                out[f"(integers of every {2 * m + 1}-level tensor, one code)"] = bits
        return out


def parameter_shapes(config: ReferenceConfig) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, shape)`` of every parameter of the architecture, in ``state_dict`` order."""
    with torch.random.fork_rng():
        model = ReferenceTransformer(config)
    return [(name, tuple(v.shape)) for name, v in model.state_dict().items()]


def description_bits(desc: ModelDescription) -> int:
    """The exact length of :func:`encode` ``(desc)``, counted without encoding."""
    return desc.architecture_bits() + sum(desc.bits_per_tensor().values())


def fixed_length_bits(desc: ModelDescription) -> int:
    """Length of the same model under a code without entropy coding: each integer in
    ``ceil(log2(2m + 1))`` bits (headers and architecture as in :func:`encode`); for comparison."""
    total = desc.architecture_bits() + sum(desc.header_bits())
    for t in desc.tensors:
        total += t.Q.numel() * fixed_width(2 * t.m + 1) if t.m else 0
    return total


def write_preamble(desc: ModelDescription) -> BitWriter:
    """A writer holding the part every model code shares: version, architecture index and the
    tensors' ``(m, k)`` headers (the payload that follows is the code's own)."""
    shapes = parameter_shapes(desc.menu[desc.arch])
    if [(t.name, tuple(t.Q.shape)) for t in desc.tensors] != shapes:
        raise ValueError("the tensors do not match the architecture's parameters (names, shapes, order)")
    w = BitWriter()
    version = desc.version()
    w.fixed(version, VERSION_BITS)
    w.fixed(desc.arch, fixed_width(len(desc.menu)))
    for fields in _header_fields(desc.tensors, version):
        for f in fields:
            w.gamma(f)
    return w


def read_preamble(bits: list[int], menu: tuple[ReferenceConfig, ...]):  # noqa: ANN201
    """Inverse of :func:`write_preamble`: ``(reader, version, arch, shapes, headers)``, the reader
    positioned at the payload; raises ``ValueError`` on a malformed preamble."""
    r = BitReader(bits)
    version = r.fixed(VERSION_BITS)
    if version not in CODE_VERSIONS:
        raise ValueError(f"code version {version} is not one of this decoder's {CODE_VERSIONS}")
    arch = r.fixed(fixed_width(len(menu)))
    if arch >= len(menu):
        raise ValueError(f"architecture index {arch} outside the menu of {len(menu)}")
    shapes = parameter_shapes(menu[arch])
    return r, version, arch, shapes, read_headers(r, len(shapes), version)


def encode(desc: ModelDescription) -> BitWriter:
    """The codeword of ``desc`` (see the module docstring)."""
    w = write_preamble(desc)
    shared = desc.shared()
    w.fixed(int(shared), 1)
    if shared:
        for m, idx in desc.groups().items():
            symbols = torch.cat([desc.tensors[i].Q.flatten() for i in idx]) + m
            write_enumerative(w, symbols.tolist(), 2 * m + 1)
    else:
        for t in desc.tensors:
            if t.m:
                write_enumerative(w, (t.Q + t.m).flatten().tolist(), 2 * t.m + 1)
    return w


def read_headers(r: BitReader, count: int, version: int) -> list[tuple[int, int]]:
    """``(m, k)`` of ``count`` tensors as :func:`_header_fields` wrote them in code ``version``."""
    headers, prev_m, prev_k = [], 1, 0
    for _ in range(count):
        if version == 2:
            m = r.gamma() - 1
            headers.append((m, unzigzag(r.gamma() - 1) if m else 0))
            continue
        m = prev_m + unzigzag(r.gamma() - 1)
        if m < 0:
            raise ValueError(f"negative level count m={m} in a header")
        k = prev_k + unzigzag(r.gamma() - 1) if m else 0
        headers.append((m, k))
        prev_m, prev_k = m, (k if m else prev_k)
    return headers


def decode(bits: list[int], menu: tuple[ReferenceConfig, ...]) -> ModelDescription:
    """Inverse of :func:`encode` for the same menu; raises ``ValueError`` on a malformed codeword."""
    r, version, arch, shapes, headers = read_preamble(bits, menu)
    sizes = [math.prod(shape) for _, shape in shapes]
    integers: list[list[int] | None] = [None] * len(shapes)
    if r.fixed(1):
        for m in sorted({m for m, _ in headers if m}):
            idx = [i for i, (mi, _) in enumerate(headers) if mi == m]
            symbols = read_enumerative(r, sum(sizes[i] for i in idx), 2 * m + 1)
            for i in idx:
                integers[i], symbols = symbols[: sizes[i]], symbols[sizes[i] :]
    else:
        for i, (m, _) in enumerate(headers):
            if m:
                integers[i] = read_enumerative(r, sizes[i], 2 * m + 1)
    tensors = []
    for (name, shape), (m, k), ints in zip(shapes, headers, integers):
        if m == 0:
            tensors.append(QuantisedTensor(name, 0, 0, torch.zeros(shape, dtype=torch.int64)))
        else:
            tensors.append(QuantisedTensor(name, m, k, torch.tensor(ints, dtype=torch.int64).reshape(shape) - m))
    if r.pos != len(bits):
        raise ValueError(f"{len(bits) - r.pos} bits left after the last tensor")
    return ModelDescription(menu, arch, tuple(tensors))


def materialise(desc: ModelDescription, dtype: torch.dtype = torch.float64) -> ReferenceTransformer:
    """The model the description denotes: architecture ``menu[arch]``, weights ``s_k Q``, in ``dtype``.

    This is the function whose training error and test error the finite-class bound is about.
    """
    with torch.random.fork_rng():
        model = ReferenceTransformer(desc.menu[desc.arch]).to(dtype)
    state = {t.name: dequantise(t.Q, t.k, dtype) for t in desc.tensors}
    model.load_state_dict(state)
    return model.eval()

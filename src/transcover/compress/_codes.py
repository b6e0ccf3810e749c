"""Prefix-free codes with exact lengths: Elias gamma, fixed width, and the two-part enumerative code.

These are real coders (bits in, bits out); their lengths are what the finite-class bound of
THEORY F18 pays, so a test checks ``len(encode(x)) == code_length(x)`` and ``decode(encode(x)) == x``.

* Elias gamma (Elias 1975) codes an integer ``k >= 1`` in ``2 floor(log2 k) + 1`` bits.
* The enumerative code (Cover 1973, "Enumerative source encoding") of a sequence of ``p`` symbols
  from an alphabet of size ``K``: first the composition (the symbol counts) as its rank among the
  ``C(p + K - 1, K - 1)`` compositions of ``p`` into ``K`` parts, then the sequence as its rank
  among the ``p! / prod_a c_a!`` sequences with those counts, each in a fixed number of bits
  determined by what was decoded before.  Its length is within 2 bits of the Laplace-mixture
  (adaptive arithmetic code) length ``-log2 prod_i (c_{x_i}^{(i)} + 1)/(i + K)``, and it makes a
  sparse sequence (mostly one symbol) cheap: entropy coding without a probability model to pay for.
"""

from __future__ import annotations

from math import comb

__all__ = [
    "BitWriter", "BitReader", "gamma_length", "fixed_width", "composition_count", "multinomial",
    "enumerative_length", "zigzag", "unzigzag", "write_enumerative", "read_enumerative",
    "composition_rank", "composition_unrank", "sequence_rank", "sequence_unrank",
]


class BitWriter:
    """An append-only bit string (a list of 0/1; the models coded here are a few kbit)."""

    def __init__(self) -> None:
        self.bits: list[int] = []

    def __len__(self) -> int:
        return len(self.bits)

    def fixed(self, value: int, width: int) -> None:
        """``value`` in ``width`` bits, most significant first (``0 <= value < 2**width``)."""
        if width < 0 or not 0 <= value < (1 << width):
            raise ValueError(f"value={value} does not fit in width={width} bits")
        self.bits.extend((value >> (width - 1 - i)) & 1 for i in range(width))

    def gamma(self, k: int) -> None:
        """Elias gamma code of ``k >= 1``: ``floor(log2 k)`` zeros, then ``k`` in binary."""
        if k < 1:
            raise ValueError(f"Elias gamma codes integers >= 1, but got k={k}")
        width = k.bit_length()
        self.bits.extend([0] * (width - 1))
        self.fixed(k, width)

    def to_bytes(self) -> bytes:
        out = bytearray((len(self.bits) + 7) // 8)
        for i, b in enumerate(self.bits):
            out[i >> 3] |= b << (7 - (i & 7))
        return bytes(out)


class BitReader:
    """Reads what :class:`BitWriter` wrote; raises on reading past the end."""

    def __init__(self, bits: list[int]) -> None:
        self.bits = bits
        self.pos = 0

    def fixed(self, width: int) -> int:
        if self.pos + width > len(self.bits):
            raise ValueError("bit string ended inside a field")
        value = 0
        for b in self.bits[self.pos : self.pos + width]:
            value = (value << 1) | b
        self.pos += width
        return value

    def gamma(self) -> int:
        zeros = 0
        while self.fixed(1) == 0:
            zeros += 1
        return (1 << zeros) | self.fixed(zeros)


def gamma_length(k: int) -> int:
    """Length in bits of the Elias gamma code of ``k >= 1``."""
    if k < 1:
        raise ValueError(f"Elias gamma codes integers >= 1, but got k={k}")
    return 2 * (k.bit_length() - 1) + 1


def fixed_width(count: int) -> int:
    """Bits needed to index one of ``count >= 1`` equally likely items: ``ceil(log2 count)``."""
    if count < 1:
        raise ValueError(f"need count >= 1, but got count={count}")
    return (count - 1).bit_length()


def zigzag(k: int) -> int:
    """Signed -> unsigned: 0, -1, 1, -2, 2, ... -> 0, 1, 2, 3, 4, ..."""
    return 2 * k if k >= 0 else -2 * k - 1


def unzigzag(u: int) -> int:
    return u // 2 if u % 2 == 0 else -(u + 1) // 2


def composition_count(p: int, K: int) -> int:
    """Number of compositions of ``p`` into ``K`` non-negative parts: ``C(p + K - 1, K - 1)``."""
    return comb(p + K - 1, K - 1)


def multinomial(counts: list[int]) -> int:
    """``(sum c)! / prod c!`` as an exact integer."""
    total, out = 0, 1
    for c in counts:
        total += c
        out *= comb(total, c)
    return out


def composition_rank(counts: list[int]) -> int:
    """Rank of a composition among all compositions of ``sum(counts)`` into ``len(counts)`` parts.

    Stars and bars: the composition is the set of bar positions ``b_j = c_0 + ... + c_j + j`` in a
    string of ``p + K - 1`` symbols, ranked in the combinatorial number system ``sum_j C(b_j, j + 1)``.
    """
    rank, position = 0, -1
    for j, c in enumerate(counts[:-1]):
        position += c + 1
        rank += comb(position, j + 1)
    return rank


def composition_unrank(rank: int, p: int, K: int) -> list[int]:
    bars = []
    for j in range(K - 2, -1, -1):  # largest bar first: the greatest b with C(b, j + 1) <= rank
        b = j
        while comb(b + 1, j + 1) <= rank:
            b += 1
        bars.append(b)
        rank -= comb(b, j + 1)
    bars.reverse()
    counts, previous = [], -1
    for b in bars:
        counts.append(b - previous - 1)
        previous = b
    counts.append(p + K - 1 - previous - 1)
    return counts


def sequence_rank(symbols: list[int], counts: list[int]) -> int:
    """Lexicographic rank of ``symbols`` among the sequences with these symbol ``counts``.

    With ``N`` sequences of the remaining counts, ``N c_a / r`` of them start with symbol ``a``
    (``r`` symbols remain); the rank adds those of every smaller symbol, position by position.
    """
    remaining = list(counts)
    r = sum(remaining)
    N = multinomial(remaining)
    rank = 0
    for x in symbols:
        for a in range(x):
            if remaining[a]:
                rank += N * remaining[a] // r
        N = N * remaining[x] // r
        remaining[x] -= 1
        r -= 1
    return rank


def sequence_unrank(rank: int, counts: list[int]) -> list[int]:
    remaining = list(counts)
    r = sum(remaining)
    N = multinomial(remaining)
    out = []
    while r:
        for a, c in enumerate(remaining):
            if not c:
                continue
            block = N * c // r
            if rank < block:
                out.append(a)
                N = block
                remaining[a] -= 1
                r -= 1
                break
            rank -= block
    return out


def enumerative_length(counts: list[int]) -> int:
    """Bits of the two-part enumerative code of a sequence with these symbol counts."""
    p, K = sum(counts), len(counts)
    return fixed_width(composition_count(p, K)) + fixed_width(multinomial(counts))


def write_enumerative(writer: BitWriter, symbols: list[int], K: int) -> None:
    """Append the enumerative code of ``symbols`` (each in ``range(K)``); the reader must know p and K."""
    counts = [0] * K
    for x in symbols:
        counts[x] += 1
    writer.fixed(composition_rank(counts), fixed_width(composition_count(len(symbols), K)))
    writer.fixed(sequence_rank(symbols, counts), fixed_width(multinomial(counts)))


def read_enumerative(reader: BitReader, p: int, K: int) -> list[int]:
    counts = composition_unrank(reader.fixed(fixed_width(composition_count(p, K))), p, K)
    if sum(counts) != p or min(counts) < 0:
        raise ValueError("corrupt composition index")
    return sequence_unrank(reader.fixed(fixed_width(multinomial(counts))), counts)

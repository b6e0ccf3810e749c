"""The model code of THEORY F18: real coders, exact lengths, round trips, Kraft's inequality."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from transcover.compress import (
    BitReader,
    BitWriter,
    ModelDescription,
    QuantisedTensor,
    decode,
    decode_delta,
    decode_fixed,
    delta_bits,
    dequantise,
    description_bits,
    encode,
    encode_delta,
    encode_fixed,
    enumerative_length,
    fake_quantise,
    fixed_length_bits,
    gamma_length,
    materialise,
    parameter_shapes,
    quantise,
    scale_of,
)
from transcover.compress._codes import (
    composition_count,
    composition_rank,
    composition_unrank,
    multinomial,
    read_enumerative,
    unzigzag,
    write_enumerative,
    zigzag,
)
from transcover.model import ReferenceConfig

MENU = (
    ReferenceConfig(d_model=4, n_heads=1, n_layers=1, d_ff=4, head_hidden=(), d_input=1, max_len=6, n_outputs=2,
                    norm="none"),
    ReferenceConfig(d_model=4, n_heads=2, n_layers=2, d_ff=3, d_head=2, head_hidden=(3,), d_input=2, max_len=5,
                    n_outputs=3, norm="none", readout="first"),
    ReferenceConfig(d_model=2, n_heads=1, n_layers=1, d_ff=2, head_hidden=(), d_input=1, max_len=4, n_outputs=2,
                    norm="ball"),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 10**12), min_size=1, max_size=20))
def test_gamma_round_trip_and_length(values):
    w = BitWriter()
    for v in values:
        w.gamma(v)
    assert len(w) == sum(gamma_length(v) for v in values) == sum(2 * math.floor(math.log2(v)) + 1 for v in values)
    r = BitReader(w.bits)
    assert [r.gamma() for _ in values] == values and r.pos == len(w)


def test_gamma_is_prefix_free_and_kraft():
    words = []
    for k in range(1, 200):
        w = BitWriter()
        w.gamma(k)
        words.append("".join(map(str, w.bits)))
    assert not any(a != b and b.startswith(a) for a, b in itertools.permutations(words, 2))
    assert sum(Fraction(1, 2 ** len(x)) for x in words) <= 1


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 5), st.data())
def test_enumerative_round_trip_and_exact_length(K, data):
    seq = data.draw(st.lists(st.integers(0, K - 1), max_size=60))
    w = BitWriter()
    write_enumerative(w, seq, K)
    counts = [seq.count(a) for a in range(K)]
    assert len(w) == enumerative_length(counts)
    assert len(w) == math.ceil(math.log2(composition_count(len(seq), K))) + math.ceil(math.log2(multinomial(counts)))
    r = BitReader(w.bits)
    assert read_enumerative(r, len(seq), K) == seq and r.pos == len(w)


@pytest.mark.parametrize("p,K", [(0, 3), (1, 1), (4, 3), (6, 2), (5, 4)])
def test_enumerative_code_is_a_bijection_with_kraft_sum_at_most_one(p, K):
    """Brute force over every sequence: distinct codewords, none a prefix of another, Kraft <= 1."""
    words = set()
    kraft = Fraction(0)
    for seq in itertools.product(range(K), repeat=p):
        w = BitWriter()
        write_enumerative(w, list(seq), K)
        words.add("".join(map(str, w.bits)))
        kraft += Fraction(1, 2 ** len(w))
    assert len(words) == K**p and kraft <= 1
    assert not any(a != b and b.startswith(a) for a, b in itertools.permutations(words, 2))


@pytest.mark.parametrize("p,K", [(0, 1), (3, 1), (5, 3), (7, 4)])
def test_composition_rank_is_a_bijection(p, K):
    comps = [list(c) for c in itertools.product(range(p + 1), repeat=K) if sum(c) == p]
    ranks = sorted(composition_rank(c) for c in comps)
    assert ranks == list(range(composition_count(p, K)))
    assert all(composition_unrank(composition_rank(c), p, K) == c for c in comps)


def test_zigzag():
    assert [zigzag(k) for k in (0, -1, 1, -2, 2)] == [0, 1, 2, 3, 4]
    assert all(unzigzag(zigzag(k)) == k for k in range(-50, 50))


def test_sparse_tensors_are_cheap_under_the_entropy_code():
    # 1 % non-zeros among 1000 ternary symbols: far below 1000 log2(3) bits
    assert enumerative_length([990, 5, 5]) < 0.15 * 1000 * math.log2(3)


def _random_description(arch: int, seed: int, density: float = 0.3) -> ModelDescription:
    g = torch.Generator().manual_seed(seed)
    tensors = []
    for name, shape in parameter_shapes(MENU[arch]):
        m = int(torch.randint(0, 4, (1,), generator=g))
        Q = torch.randint(-m, m + 1, shape, generator=g) * (torch.rand(shape, generator=g) < density)
        if m == 0 or not Q.any():
            tensors.append(QuantisedTensor(name, 0, 0, torch.zeros(shape, dtype=torch.int64)))
        else:
            tensors.append(QuantisedTensor(name, m, int(torch.randint(-40, 10, (1,), generator=g)), Q))
    return ModelDescription(MENU, arch, tuple(tensors))


@pytest.mark.parametrize("arch", range(len(MENU)))
@pytest.mark.parametrize("seed", range(4))
def test_model_code_round_trip_and_counted_length_is_the_real_length(arch, seed):
    desc = _random_description(arch, seed)
    word = encode(desc)
    assert len(word) == description_bits(desc)
    assert len(word) == desc.architecture_bits() + sum(desc.bits_per_tensor().values())
    back = decode(word.bits, MENU)
    assert back.arch == arch
    for a, b in zip(desc.tensors, back.tensors, strict=True):
        assert (a.name, a.m) == (b.name, b.m) and torch.equal(a.Q, b.Q) and (a.m == 0 or a.k == b.k)
    X = torch.randn(3, MENU[arch].max_len, MENU[arch].d_input, dtype=torch.float64)
    assert torch.equal(materialise(desc)(X), materialise(back)(X))
    assert fixed_length_bits(desc) >= 0


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_both_payload_modes_round_trip_with_exact_lengths(shared, seed, monkeypatch):
    desc = _random_description(1, seed, density=0.5)
    per_tensor = sum(t.payload_bits() for t in desc.tensors)
    together = sum(desc.shared_payload_bits().values())
    assert desc.shared() == (together < per_tensor)
    monkeypatch.setattr(ModelDescription, "shared", lambda self: shared)
    word = encode(desc)
    headers = sum(desc.header_bits())
    assert len(word) == description_bits(desc) == desc.architecture_bits() + headers + 1 + (
        together if shared else per_tensor)
    back = decode(word.bits, MENU)
    for a, b in zip(desc.tensors, back.tensors, strict=True):
        assert a.m == b.m and torch.equal(a.Q, b.Q)


def test_decode_rejects_malformed_words():
    word = encode(_random_description(0, 0)).bits
    # each refusal names its reason: a bare ValueError also caught any numpy or torch error a bug raised (stop 40)
    with pytest.raises(ValueError, match="1 bits left after the last tensor"):
        decode(word + [0], MENU)
    with pytest.raises(ValueError, match="bit string ended inside a field"):
        decode(word[:-3], MENU)
    with pytest.raises(ValueError, match="architecture index 3 outside the menu of 3"):
        decode(word[:2] + [1, 1] + word[4:], MENU)
    with pytest.raises(ValueError, match=r"code version \d is not one of this decoder's"):
        decode([1 - word[0]] + word[1:], MENU)


def test_encode_rejects_tensors_that_do_not_match_the_architecture():
    desc = _random_description(0, 1)
    with pytest.raises(ValueError, match="do not match the architecture's parameters"):
        encode(ModelDescription(MENU, 1, desc.tensors))
    with pytest.raises(ValueError, match=r"integers must lie in \[-m, m\]"):
        QuantisedTensor("w", 1, 0, torch.tensor([2]))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 7), st.integers(-30, 10), st.integers(0, 2**31 - 1))
def test_quantiser_error_and_straight_through_gradient(m, k, seed):
    W = torch.randn(5, 7, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale_of(k) * m / 2
    Q = quantise(W, m, k)
    assert int(Q.abs().max()) <= m
    inside = W.abs() <= m * scale_of(k)
    err = (W - dequantise(Q, k)).abs()
    assert bool((err[inside] <= scale_of(k) / 2 * (1 + 1e-12)).all())
    W.requires_grad_(True)
    out = fake_quantise(W, m, k)
    assert torch.equal(out.detach(), dequantise(Q, k))
    out.sum().backward()
    assert torch.equal(W.grad, torch.ones_like(W))


@pytest.mark.parametrize("version", [2, 3])
@pytest.mark.parametrize("seed", range(3))
def test_both_header_versions_round_trip_with_exact_lengths(version, seed, monkeypatch):
    desc = _random_description(1, seed, density=0.5)
    monkeypatch.setattr(ModelDescription, "version", lambda self: version)
    word = encode(desc)
    assert word.bits[:2] == [version >> 1, version & 1]
    assert len(word) == description_bits(desc) == desc.architecture_bits() + sum(desc.header_bits(version)) + 1 + (
        sum(desc.shared_payload_bits().values()) if desc.shared() else sum(t.payload_bits() for t in desc.tensors))
    back = decode(word.bits, MENU)
    for a, b in zip(desc.tensors, back.tensors, strict=True):
        assert (a.m, a.m and a.k) == (b.m, b.m and b.k) and torch.equal(a.Q, b.Q)


def test_delta_headers_are_chosen_when_shorter_and_pay_little_for_shared_grids():
    # every tensor on the same grid and nearby scales (what QAT produces): version 3 costs 1 bit for
    # m and a few for k per tensor, version 2 pays m and the absolute k every time
    desc = _random_description(1, 0, density=0.5)
    tensors = tuple(QuantisedTensor(t.name, 7, -20 + (i % 3), torch.clamp(t.Q, -7, 7))
                    for i, t in enumerate(desc.tensors))
    same = ModelDescription(desc.menu, desc.arch, tensors)
    assert same.version() == 3
    assert sum(same.header_bits(3)) < sum(same.header_bits(2)) - 8 * len(tensors)
    assert description_bits(same) == len(encode(same))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("changes", [0, 1, 7, 60])
def test_delta_code_round_trips_with_exact_length(seed, changes):
    ref = _random_description(1, seed, density=0.5)
    g = torch.Generator().manual_seed(seed + 100)
    tensors = []
    for t in ref.tensors:
        Q = t.Q.clone().flatten()
        if t.m:
            for i in torch.randperm(Q.numel(), generator=g)[: changes // 4 + (changes > 0)].tolist():
                Q[i] = int(torch.randint(-t.m, t.m + 1, (1,), generator=g))
        tensors.append(QuantisedTensor(t.name, t.m, t.k, Q.reshape(t.Q.shape)))
    model = ModelDescription(ref.menu, ref.arch, tuple(tensors))
    word = encode_delta(model, ref)
    assert len(word) == delta_bits(model, ref) <= 1 + description_bits(model)
    back = decode_delta(word.bits, ref)
    for a, b in zip(model.tensors, back.tensors, strict=True):
        assert a.m == b.m and torch.equal(a.Q, b.Q)
    if changes == 0:  # the reference itself: flag, gamma(1), the empty subset
        assert word.bits == [1, 1]


def test_delta_code_falls_back_to_the_full_code_off_the_reference_grid():
    ref = _random_description(1, 0, density=0.5)
    other = _random_description(1, 1, density=0.5)
    word = encode_delta(other, ref)
    assert word.bits[0] == 0 and len(word) == 1 + description_bits(other)
    assert all(torch.equal(a.Q, b.Q) for a, b in zip(other.tensors, decode_delta(word.bits, ref).tensors))
    with pytest.raises(ValueError, match="1 bits left after the last tensor"):
        decode_delta(word.bits + [1], ref)


@pytest.mark.parametrize("arch", range(len(MENU)))
@pytest.mark.parametrize("seed", range(3))
def test_fixed_length_code_round_trips_with_its_counted_length_and_is_prefix_free(arch, seed):
    desc = _random_description(arch, seed)
    word = encode_fixed(desc)
    assert len(word) == fixed_length_bits(desc)
    back = decode_fixed(word.bits, MENU)
    for a, b in zip(desc.tensors, back.tensors, strict=True):
        assert (a.name, a.m) == (b.name, b.m) and torch.equal(a.Q, b.Q) and (a.m == 0 or a.k == b.k)
    # the decoder reads field by field and stops where the word ends: no codeword extends another
    with pytest.raises(ValueError, match="left after"):
        decode_fixed(word.bits + [0], MENU)
    with pytest.raises(ValueError, match="bit string ended inside a field"):
        decode_fixed(word.bits[:-1], MENU)


def test_fixed_length_code_pays_for_every_integer_and_the_entropy_code_for_the_non_zeros():
    desc = _random_description(1, 0, density=0.05)
    full = sum(t.Q.numel() * math.ceil(math.log2(2 * t.m + 1)) for t in desc.tensors if t.m)
    assert fixed_length_bits(desc) == desc.architecture_bits() + sum(desc.header_bits()) + full


def test_bad_tensors_are_refused_at_the_door():
    """Stop 38 red team: NaN weights quantised to -2^63 (whose abs() overflows negative, so the range check passed)
    and failed inside the code's bincount; an empty tensor failed in torch's max(); m=True was charged as 1."""
    import pytest
    import torch

    from transcover import InputError
    from transcover.compress._describe import QuantisedTensor
    from transcover.compress._quantise import best_scale_index, quantise

    for W in (torch.tensor([1.0, float("nan")]), torch.tensor([float("inf"), 0.0]), torch.zeros(0)):
        with pytest.raises(InputError):
            quantise(W, 3, 0)
        with pytest.raises(InputError):
            best_scale_index(W, 3)
    with pytest.raises(ValueError, match="must lie in"):
        QuantisedTensor("w", 3, 0, torch.tensor([-(2**63)], dtype=torch.int64))
    with pytest.raises(ValueError, match="non-empty int64"):
        QuantisedTensor("w", 3, 0, torch.zeros(0, dtype=torch.int64))
    for m, k in ((True, 0), (3, 1.5)):
        with pytest.raises(ValueError, match="must be an integer"):
            QuantisedTensor("w", m, k, torch.zeros(2, dtype=torch.int64))
    assert QuantisedTensor("w", 3, -2, torch.tensor([-3, 0, 3])).m == 3


def _refused(call, text):
    """``call()`` raises InputError with a one-line message containing ``text``."""
    from transcover import InputError

    with pytest.raises(InputError) as info:
        call()
    message = str(info.value)
    assert text in message and "\n" not in message, message


def test_quantise_refuses_bad_levels_and_scale_indices():
    """Red team 204: quantise(W, 1, 10**6) and dequantise(Q, 10**5) raised OverflowError, k = -10**6 gave scale 0 and
    quantised every weight to +-m, best_scale_index(W, -1) was a "math domain error", and a negative or float m was
    accepted (m = -1 clamped every weight to -1)."""
    from transcover.compress import best_scale_index, scale_of

    W = torch.tensor([0.3, -0.7], dtype=torch.float64)
    Q = torch.tensor([1, -1])
    k_text = "scale index k must be an integer in [-8176, 8191] (scale 2^(k/8) a normal float64), but got k="
    for k in (10**6, -(10**6), 8192, -8177, 1.5, True, 10**400):
        _refused(lambda: quantise(W, 1, k), k_text + repr(k))
        _refused(lambda: dequantise(Q, k), k_text + repr(k))
        _refused(lambda: scale_of(k), k_text + repr(k))
        _refused(lambda: fake_quantise(W, 1, k), k_text + repr(k))
    m_text = "level count m must be an integer in [0, 2**53] (2m + 1 levels, exact in float64), but got m="
    for m in (-1, 1.5, True, 2**53 + 1):
        _refused(lambda: quantise(W, m, 0), m_text + repr(m))
        _refused(lambda: best_scale_index(W, m), m_text + repr(m))
        _refused(lambda: fake_quantise(W, m, 0), m_text + repr(m))
    _refused(lambda: best_scale_index(W, 1, span=-1), "span must be an integer >= 0, but got span=-1")
    # the edges of the grid still work, and best_scale_index stays on it at the extremes of float64
    assert scale_of(-8176) == 2.0**-1022 and math.isfinite(scale_of(8191))
    assert torch.equal(quantise(W, 1, -8176), torch.tensor([1, -1])) and quantise(W, 2**53, 0).tolist() == [0, -1]
    for top in (1e-320, 1e-300, 1e308, 1.7e308):
        for m in (1, 7, 2**53):
            k = best_scale_index(torch.tensor([top, -top / 3], dtype=torch.float64), m)
            assert -8176 <= k <= 8191 and math.isfinite(scale_of(k))

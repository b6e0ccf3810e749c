"""Local certified constants on balls around data (issue 12): soundness, homogeneity, bad input.

The adversary: float64 projected gradient ascent on ``||f(X+A) - f(X+B)||_(2,inf) / ||A - B||_(2,inf)``
with both points inside ``B(X, rho)`` (every token moved by <= rho), several restarts, started
from the Jacobian's (2,inf) power-iteration direction; plus the Jacobian norm at random points of
the ball.  It must never exceed the certified local constant.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lipschitz_testkit import random_spec
from transcover._errors import InputError
from transcover.lipschitz._empirical import jacobian_operator_norm
from transcover.lipschitz._local import layer_local, network_local, norm_local
from transcover.lipschitz._local_attention import attention_local_bound
from transcover.model._functional import attention_forward, layer_forward, transformer_forward

def _n24(Y: torch.Tensor) -> torch.Tensor:
    return Y.norm(dim=-1).max(dim=-1).values


def _clip(D: torch.Tensor, rho: float) -> torch.Tensor:
    n = D.norm(dim=-1, keepdim=True)
    return D * torch.clamp(rho * (1 - 1e-12) / n.clamp(min=1e-300), max=1.0)


def adversary(fn, X: torch.Tensor, rho: float, *, restarts: int = 4, steps: int = 40, seed: int = 0) -> float:
    """Best ratio over pairs in B(X, rho) and Jacobian norms at points of the ball.  Per restart k: a start C_k drawn
    from the seeded generator, the (2,inf) power iteration at X + C_k (``jacobian_operator_norm``, 10 iterations, seed
    ``seed + k``), then Adam on the pair (A, B) from (C_k, C_k + 1e-3 rho V_k).  The restarts run as one batch where
    ``fn`` acts on a leading batch axis (checked on the starts: each its own value), one after another otherwise;
    the same starts, iterations and steps either way (``_adversary_loop``, the reference): ``adversaries`` of the one
    radius."""
    return adversaries(fn, X, [rho], restarts=restarts, steps=steps, seed=seed)[0]


def _acts_batched(fn, Xs: torch.Tensor) -> bool:  # noqa: ANN001
    """Whether ``fn`` on the stacked points (K, T, d) gives each point's own value (its value alone, to rounding)."""
    try:
        with torch.no_grad():
            out = fn(Xs)
            alone = [fn(Xs[k]) for k in (0, Xs.shape[0] - 1)]
    except Exception:  # noqa: BLE001 -- a map of (T, d) alone: the loop
        return False
    return out.shape == (Xs.shape[0], *alone[0].shape) and all(
        torch.allclose(out[k], a, rtol=1e-9, atol=1e-12 * float(a.abs().max()), equal_nan=True)
        for k, a in zip((0, Xs.shape[0] - 1), alone))


def _power_2inf_batched(fn, Xs: torch.Tensor, seeds: list, n_iter: int) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    """``jacobian_operator_norm(fn, Xs[k], metric="2,inf", n_iter=n_iter, seed=seeds[k])`` for every k at once (its
    alternating maximisation, step for step: the Jacobian of a batched map is block diagonal over the batch, so the
    batched jvp / vjp are each point's own): per k the best row value and the last direction V."""
    from torch.autograd.functional import jvp, vjp

    Xs = Xs.detach().double()
    V = torch.stack([torch.randn(Xs.shape[1:], generator=torch.Generator().manual_seed(s), dtype=torch.float64)
                     for s in seeds])
    V = V / V.norm(dim=-1, keepdim=True)
    best = torch.zeros(Xs.shape[0], dtype=torch.float64)
    k = torch.arange(Xs.shape[0])
    for _ in range(n_iter):
        _, JV = jvp(fn, Xs, V)
        rows = JV.norm(dim=-1)
        t = rows.argmax(dim=-1)
        top = rows[k, t]
        best = torch.maximum(best, top)
        w = torch.zeros_like(JV)
        w[k, t] = JV[k, t] / top.clamp(min=1e-300)[:, None]
        G = vjp(fn, Xs, w)[1]
        V = G / torch.clamp(G.norm(dim=-1, keepdim=True), min=1e-300)
    return best, V


def adversaries(fn, X: torch.Tensor, rhos, *, restarts: int = 4, steps: int = 40, seed: int = 0) -> list:  # noqa: ANN001
    """``[adversary(fn, X, rho, restarts=, steps=, seed=) for rho in rhos]``, every restart of every radius in one
    batch where ``fn`` acts on a leading batch axis: per radius the same starts (a fresh generator seeded ``seed``),
    the same power iterations (seeds ``seed + k``) and the same Adam steps (each radius its own param group, lr
    ``0.05 rho``; Adam acts entrywise, each pair's ratio depends on its own entries only), and the two points of every
    pair through ``fn`` in one call; ``_adversary_loop`` one radius after another otherwise."""
    rhos = [float(r) for r in rhos]
    Cs = []
    for rho in rhos:
        g = torch.Generator().manual_seed(seed)
        Cs.append(torch.stack([_clip(torch.randn(X.shape, generator=g, dtype=torch.float64) * rho, rho)
                               for _ in range(restarts)]))
    C = torch.cat(Cs)
    if restarts < 2 or not _acts_batched(fn, X + C):
        return [_adversary_loop(fn, X, rho, restarts=restarts, steps=steps, seed=seed) for rho in rhos]
    m, K = len(rhos), restarts
    jn, V = _power_2inf_batched(fn, X + C, [seed + k for k in range(K)] * m, 10)
    best = jn.reshape(m, K).amax(dim=1).tolist()
    As = [c.clone().requires_grad_(True) for c in Cs]
    Bs = [_clip(c + 1e-3 * rho * v, rho).clone().requires_grad_(True) for c, v, rho in zip(Cs, V.split(K), rhos)]
    opt = torch.optim.Adam([{"params": [a, b], "lr": 0.05 * rho} for a, b, rho in zip(As, Bs, rhos)])
    rho_t = torch.tensor(rhos, dtype=torch.float64).repeat_interleave(K)
    for _ in range(steps):
        with torch.no_grad():
            for a, b, rho in zip(As, Bs, rhos):
                a.copy_(_clip(a, rho))
                b.copy_(_clip(b, rho))
        A, B = torch.cat(As), torch.cat(Bs)
        Y = fn(X + torch.cat([A, B]))
        num = _n24(Y[: m * K] - Y[m * K:])
        den = _n24(A - B)
        r = num / den
        ok = torch.isfinite(r) & (den > 1e-9 * rho_t)
        rr = torch.where(ok, r.detach(), -torch.inf).reshape(m, K).amax(dim=1).tolist()
        best = [max(b, v) for b, v in zip(best, rr)]
        opt.zero_grad()
        (-r.sum()).backward()
        opt.step()
    return best


def _adversary_loop(fn, X: torch.Tensor, rho: float, *, restarts: int = 4, steps: int = 40, seed: int = 0) -> float:  # noqa: ANN001
    """``adversary`` one restart after another (the reference of the batched form; maps that do not batch)."""
    g = torch.Generator().manual_seed(seed)
    best = 0.0
    for k in range(restarts):
        C = _clip(torch.randn(X.shape, generator=g, dtype=torch.float64) * rho, rho)
        jn, V = jacobian_operator_norm(fn, X + C, metric="2,inf", n_iter=10, seed=seed + k)
        best = max(best, jn)
        A = C.clone().requires_grad_(True)
        B = _clip(C + 1e-3 * rho * V, rho).clone().requires_grad_(True)
        opt = torch.optim.Adam([A, B], lr=0.05 * rho)
        for _ in range(steps):
            with torch.no_grad():
                A.copy_(_clip(A, rho))
                B.copy_(_clip(B, rho))
            num = _n24(fn(X + A) - fn(X + B))
            den = _n24(A - B)
            r = num / den
            if torch.isfinite(r) and den > 1e-9 * rho:
                best = max(best, float(r.detach()))
            opt.zero_grad()
            (-r).backward()
            opt.step()
    return best


CASES = [dict(norm=n, placement=p, biases=b, causal=c)
         for n in ("layernorm", "rmsnorm") for p in ("post", "pre") for b in (False, True) for c in (False, True)]


@pytest.mark.parametrize("case", CASES[::3] + CASES[1::5])
def test_attention_local_bound_is_never_beaten(case):
    spec = random_spec(3, act="gelu", scale=1.5, **case)
    att = spec.layers[0].attention
    X = torch.randn(4, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    rhos = (1e-3, 0.3)
    los = adversaries(lambda Z: attention_forward(att, Z), X, rhos)  # both radii's adversaries in one batch
    for rho, lo in zip(rhos, los):
        ub = attention_local_bound(att, X, rho).upper
        assert 0 < lo <= ub, (case, rho, lo, ub)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), case=st.sampled_from(CASES), rho=st.sampled_from([1e-3, 3e-2, 0.2]))
def test_layer_local_bound_is_never_beaten(seed, case, rho):
    spec = random_spec(seed, act="gelu", **case)
    layer = spec.layers[0]
    X = torch.randn(4, 6, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    ll = layer_local(layer, X, rho)
    (lo,) = adversaries(lambda Z: layer_forward(layer, Z), X, [rho], restarts=3, steps=30, seed=seed)
    assert lo <= ll.product * (1 + 1e-12), (lo, ll)
    assert lo <= ll.jacobian_ball * (1 + 1e-12), (lo, ll)
    assert ll.jacobian_point <= ll.jacobian_ball
    # the certified output ball: every output within upper * rho of the centre (sampled points)
    g = torch.Generator().manual_seed(seed + 1)
    for _ in range(5):
        D = _clip(torch.randn(X.shape, generator=g, dtype=torch.float64), rho)
        assert float(_n24(layer_forward(layer, X + D) - ll.out)) <= ll.upper * rho * (1 + 1e-9)


def test_network_local_bound_is_never_beaten():
    spec = random_spec(5, act="gelu", norm="layernorm", placement="post", L=2)
    X = torch.randn(4, 6, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    nl = network_local(spec, X, 1e-2)
    (lo,) = adversaries(lambda Z: transformer_forward(spec, Z, with_head=False), X, [1e-2], restarts=3)
    assert lo <= nl.upper


def test_norm_local_floor_matches_the_exact_jacobian_and_is_sound():
    spec = random_spec(7, norm="layernorm", eps=1e-6)
    n = spec.layers[0].norm_attn
    X = torch.randn(5, 6, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    rho = 0.2
    lip, _ = norm_local(n, X, rho)
    (lo,) = adversaries(lambda Z: n(Z), X, [rho])
    assert lo <= float(lip.max())
    # rho -> 0 with constant gamma: the floor bound is the exact Jacobian norm 1/s (F14)
    n1 = dataclasses.replace(n, weight=torch.ones(6, dtype=torch.float64))
    lip0, s0 = norm_local(n1, X, 1e-12)
    jn, _ = jacobian_operator_norm(lambda Z: n1(Z), X, metric="2,inf", n_iter=30)
    assert abs(jn / float(lip0.max()) - 1) < 1e-6


def test_homogeneity_in_W_V_and_the_point_limit():
    spec = random_spec(11, act="gelu", norm="layernorm")
    att = spec.layers[0].attention
    X = torch.randn(4, 6, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    base = attention_local_bound(att, X, 1e-2)
    for lam in (0.5, 3.0):
        scaled = dataclasses.replace(att, W_V=att.W_V * lam)
        b = attention_local_bound(scaled, X, 1e-2)
        # every term of L_{h,i} carries one W_V: the whole bound is linear in lambda
        assert b.upper == pytest.approx(lam * base.upper, rel=1e-8)
        assert b.linear == pytest.approx(lam * base.linear, rel=1e-8)
    # rho -> 0: continuous, and equal to the block bound at the point
    pt = attention_local_bound(att, X, 0.0).upper
    assert attention_local_bound(att, X, 1e-10).upper == pytest.approx(pt, rel=1e-7)
    assert attention_local_bound(att, X, 1e-2).upper >= pt
    ll0 = layer_local(spec.layers[0], X, 1e-12)
    assert ll0.jacobian_ball == pytest.approx(ll0.jacobian_point, rel=1e-6)


def test_bad_rho_is_refused():
    spec = random_spec(1, norm="layernorm")
    X = torch.randn(3, 6, dtype=torch.float64)
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(InputError):
            network_local(spec, X, bad)


# -- real inputs and the CLI ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def minilm():
    from transcover.model import load

    return load(None).to_torch(torch.float64)


BAD_DATA = [
    (lambda: np.zeros((2, 4, 7)), "shape"),
    (lambda: np.array([[1, 2, 40000]]), "vocabulary"),
    (lambda: np.array([[-1, 2]]), "vocabulary"),
    (lambda: np.zeros((0, 3), dtype=np.int64), "empty"),
    (lambda: np.ones((1, 600), dtype=np.int64), "positions"),
    (lambda: np.ones((1, 600, 384)), "positions"),
    (lambda: np.array([["a", "b"]]), "dtype"),
    (lambda: np.full((1, 3, 384), np.nan), "nan"),
    (lambda: np.ones((1, 3, 384), dtype=np.longdouble), "float16/32/64"),  # an internal TypeError (stop 38)
    (lambda: np.array([[2.0, 50.0, 3.0]]), "token ids must be an integer array"),  # was "embeddings must have shape"
    (lambda: np.full((1, 3, 384), 1e307), "too large"),  # was "radius must be a finite number > 0, but got radius=inf"
]


@pytest.mark.parametrize("make, needle", BAD_DATA)
def test_bad_data_is_refused_with_a_clear_line(tmp_path, minilm, make, needle):
    from transcover.model._data import load_inputs

    path = tmp_path / "d.npy"
    np.save(path, make())
    with pytest.raises(InputError) as e:
        load_inputs(minilm, str(path))
    assert needle in str(e.value).lower() and "\n" not in str(e.value)


def test_trailing_pads_are_not_tokens(tmp_path, minilm):
    """Rows of different lengths in one (n, T) id array: trailing -1 entries are dropped (a pad id had been embedded
    and certified as a token the model attends to); a -1 inside a row, or a row of pads only, is refused."""
    from transcover.model._data import embed_ids, load_inputs

    np.save(tmp_path / "p.npy", np.array([[101, 2023, 2003, 102, -1, -1], [101, 2742, 102, -1, -1, -1]]))
    got = load_inputs(minilm, str(tmp_path / "p.npy"))
    want = embed_ids(minilm, [np.array([101, 2023, 2003, 102]), np.array([101, 2742, 102])])
    assert [g.shape[0] for g in got] == [4, 3] and all(torch.equal(g, w) for g, w in zip(got, want))
    for bad, needle in (([[101, -1, 2003, 102]], "vocabulary"), ([[101, 102], [-1, -1]], "sequence 1 .*empty")):
        np.save(tmp_path / "b.npy", np.array(bad))
        with pytest.raises(InputError, match=needle):
            load_inputs(minilm, str(tmp_path / "b.npy"))


def test_trailing_nan_rows_pad_float_embeddings(tmp_path, minilm):
    """Float embeddings of different lengths (stop 41's list: a float array could not express them): rows of NaN at
    the end of a sequence are padding, dropped as -1 in token ids are; a NaN elsewhere, or a sequence of padding only,
    is refused naming the sequence."""
    from transcover.model._data import embed_ids, load_inputs

    E = embed_ids(minilm, [np.array([101, 2023, 2003, 102]), np.array([101, 2742, 102])])
    arr = np.full((2, 4, 384), np.nan)
    arr[0], arr[1, :3] = E[0].numpy(), E[1].numpy()
    np.save(tmp_path / "f.npy", arr)
    got = load_inputs(minilm, str(tmp_path / "f.npy"))
    assert [g.shape[0] for g in got] == [4, 3] and all(torch.equal(g, w) for g, w in zip(got, E))
    inner = arr.copy()
    inner[1, 1, 5] = np.nan
    empty = arr.copy()
    empty[1] = np.nan
    gap = arr.copy()
    gap[0, 1] = np.nan  # a NaN row followed by a token: not padding
    tail = arr.copy()
    tail[0, 3] = np.nan  # every sequence ends in NaN: nothing was padded (an overflow upstream; red team 186)
    for bad, needle in ((inner, "sequence 1 contains NaN"), (empty, "sequence 1 .*padding only"),
                        (gap, "sequence 0 contains NaN"), (tail, "every sequence of the data ends in rows of NaN"),
                        (arr[1:], "every sequence")):
        np.save(tmp_path / "b.npy", bad)
        with pytest.raises(InputError, match=needle):
            load_inputs(minilm, str(tmp_path / "b.npy"))


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, np.uint64])
def test_pads_wrapped_by_an_unsigned_dtype_are_refused(tmp_path, minilm, dtype):
    """Stop 39's list: a -1 pad stored as uint8 became 255 and was certified as token 255 (a real id of MiniLM's
    vocabulary).  An unsigned array holding its dtype's largest value is refused, naming the place; other unsigned
    arrays are read as before."""
    from transcover.model._data import embed_ids, load_inputs

    np.save(tmp_path / "u.npy", np.array([[101, 200, 102, -1]]).astype(dtype))
    with pytest.raises(InputError, match=r"sequence 0 holds \d+ at position 3.*signed") as e:
        load_inputs(minilm, str(tmp_path / "u.npy"))
    assert "\n" not in str(e.value)
    np.save(tmp_path / "ok.npy", np.array([[101, 200, 102]], dtype=dtype))
    got = load_inputs(minilm, str(tmp_path / "ok.npy"))[0]
    assert torch.equal(got, embed_ids(minilm, [np.array([101, 200, 102])])[0])


def test_texts_empty_missing_and_mismatched_tokenizer(tmp_path, minilm):
    from transcover.model._data import load_inputs, tokenize_texts

    (tmp_path / "e.txt").write_text("\n  \n")
    for data in (str(tmp_path / "e.txt"), str(tmp_path / "nope.npy"), str(tmp_path / "x.csv")):
        with pytest.raises(InputError):
            load_inputs(minilm, data)
    small = dataclasses.replace(minilm, embeddings={**dict(minilm.embeddings),
                                                    "token_embedding": minilm.embeddings["token_embedding"][:1000]})
    with pytest.raises(InputError, match="do not match"):
        tokenize_texts(small, ["a sentence"])
    (tmp_path / "t.txt").write_text("The iris dataset has three classes.\nAnother line of text here.\n")
    seqs = load_inputs(minilm, str(tmp_path / "t.txt"))
    assert len(seqs) == 2 and seqs[0].shape[1] == 384 and seqs[0].shape[0] < 20  # no padding to 128


@pytest.mark.parametrize("max_len", [1, 2])
def test_a_max_len_that_leaves_no_word_is_refused(minilm, capsys, tmp_path, max_len):
    """Red team 213: below the special tokens' count the tokenizers library ignores the limit (``--max-len 1`` kept
    all 6 tokens of a line and certified them); at it only ``[CLS] [SEP]`` is left, certified without a word."""
    from transcover.cli import main
    from transcover.model._data import tokenize_texts

    with pytest.raises(InputError, match="leaves no token of a text beside the tokenizer's 2 special") as e:
        tokenize_texts(minilm, ["Wine quality data."], max_len=max_len)
    assert "\n" not in str(e.value)
    assert [len(x) for x in tokenize_texts(minilm, ["Wine quality data."], max_len=3)] == [3]
    (tmp_path / "t.txt").write_text("Wine quality data.\n")
    out = tmp_path / "o.json"
    assert main(["lipschitz", "--data", str(tmp_path / "t.txt"), "--max-len", str(max_len), "--json", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--max-len" in err and not out.exists()


def test_limit_counts_sequences_for_one_sequence_arrays(tmp_path, minilm):
    """Stop 38 red team: a (T,) id array or a (T, d) embedding was cut to its first ``limit`` tokens, not sequences."""
    from transcover.model._data import load_inputs

    np.save(tmp_path / "ids.npy", np.array([101, 2023, 2003, 1037, 102]))
    np.save(tmp_path / "emb.npy", np.random.default_rng(0).normal(size=(5, 384)))
    for name in ("ids.npy", "emb.npy"):
        seqs = load_inputs(minilm, str(tmp_path / name), limit=1)
        assert len(seqs) == 1 and seqs[0].shape == (5, 384)


def test_large_but_finite_token_norms_are_accepted(tmp_path, minilm):
    """Stop 38 red team: the overflow check squared unscaled and refused norms ~1e200 that float64 holds."""
    from transcover.model._data import load_inputs

    np.save(tmp_path / "e.npy", np.full((1, 3, 384), 1e200))
    (X,) = load_inputs(minilm, str(tmp_path / "e.npy"))
    assert float(X.abs().max()) == 1e200


def test_corrupt_tokenizer_is_one_line(tmp_path, minilm):
    """Stop 38 red team: a malformed tokenizer.json ended in the tokenizers library's bare Exception (exit 1)."""
    import shutil

    from transcover.model import bundled_model_dir
    from transcover.model._data import tokenize_texts

    folder = tmp_path / "m"
    shutil.copytree(bundled_model_dir(), folder)
    (folder / "tokenizer.json").write_text('{"version": 1, 3: 4}')
    spec = dataclasses.replace(minilm, name=str(folder))
    with pytest.raises(InputError, match="cannot read .*tokenizer.json"):
        tokenize_texts(spec, ["a sentence"])


@pytest.mark.parametrize("data, rho, needle", [("sklearn-descr", "-1e-3", "--rho"), ("sklearn-descr", "inf", "--rho"),
                                               ("sklearn-descr", "1e-3,1e-3", "twice"),
                                               ("bad.npy", "1e-3", "vocabulary")])
def test_cli_bad_input_one_line_exit_2_nothing_written(tmp_path, data, rho, needle, capsys, monkeypatch):
    """``transcover lipschitz`` in this process (``main``, what ``python -m transcover.cli`` runs and exits with; a
    fresh interpreter only re-imported torch for each case): exit 2, one stderr line, nothing written.  Every warning
    the run raises is shown on that stderr (pytest's filters show even DeprecationWarnings), so none hides from the
    one-line check."""
    from transcover.cli import main

    if data == "bad.npy":
        np.save(tmp_path / data, np.array([[1, 2, 40000]]))
    monkeypatch.chdir(tmp_path)  # the relative bad.npy, as the subprocess's cwd had it
    out = tmp_path / "out.json"
    capsys.readouterr()
    rc = main(["lipschitz", "--data", data, f"--rho={rho}", "--json", str(out), "--limit", "1"])
    captured = capsys.readouterr()
    assert rc == 2, captured.err
    lines = [x for x in captured.err.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and needle.lower() in lines[0].lower(), captured.err
    assert not out.exists()


def test_real_minilm_sentences_one_layer_sound(minilm):
    from transcover.model._data import load_inputs, sklearn_sentences

    assert len(sklearn_sentences()) >= 150
    spec = minilm
    seqs = load_inputs(spec, "sklearn-descr", max_len=8, limit=2)
    assert all(s.shape[0] <= 8 and s.shape[1] == 384 for s in seqs)
    layer = spec.layers[0]
    cache: dict = {}  # the layer's weight-only constants, computed for the first sequence, read for the second
    for X in seqs:
        Y = spec.input_norm(X)
        rho = 1e-4 * float(Y.norm(dim=1).median())
        ll = layer_local(layer, Y, rho, cache=cache)
        (lo,) = adversaries(lambda Z: layer_forward(layer, Z), Y, [rho], restarts=2, steps=15)
        assert lo > 1.0  # the search found a real slope on real text
        assert lo <= ll.upper  # and the certified local bound holds against it
        assert ll.jacobian_point < 30 * lo  # the Jacobian route at the point is within ~10x on real text


def test_all_zero_embeddings_are_answered_and_no_lower_gives_no_ratio(minilm):
    """All-zero embeddings (every token of norm 0) are a valid input: the global column's radius is the largest token
    norm, which no radius check accepts at 0, so it takes the smallest normal float (a radius at least every token's
    norm is all the column needs); before, ``transcover lipschitz --data zeros.npy`` stopped on "radius must be a finite
    number > 0".  Without a lower search the ratio is NaN (none), not infinite."""
    from transcover.lipschitz._local_report import local_table

    spec = dataclasses.replace(minilm, layers=list(minilm.layers)[:1])
    rows = local_table(spec, [torch.zeros(3, 384, dtype=torch.float64)], [1e-3], lower=False)
    assert rows and all(math.isfinite(r.global_upper) and r.local_upper > 0 for r in rows)
    assert all(math.isnan(r.lower) and math.isnan(r.ratio) for r in rows)
    # relative to a median token norm of 0 there is no ball: one line naming the median, not "rho=0.0" (red team 174)
    with pytest.raises(InputError, match=r"median token norm of layer 0's input of sequence 0 is 0"):
        local_table(dataclasses.replace(spec, input_norm=None), [torch.zeros(3, 384, dtype=torch.float64)], [1e-3],
                    lower=False, relative=True)


def test_network_domain_column_covers_the_input_norm_and_huge_rho_gives_inf(minilm):
    """Stop 38 red team: the network row's domain column took sigma_0 from the layers' norms only; on text whose
    embedding LayerNorm inputs have std 0.03 it read 1.35 beside an empirical lower of 30.3 at the same data. And a
    radius with no finite certificate ended in KeyError: 'attention' instead of inf rows.  A factor 1e6 has one since
    red team 221 (every component's global constant on its ball, THEORY F112); 1e305 has none: its inner radii
    overflow."""
    from transcover.lipschitz._local_report import local_table

    spec = dataclasses.replace(minilm, layers=list(minilm.layers)[:1])
    g = torch.Generator().manual_seed(0)
    X = 0.03 * torch.randn(3, 384, generator=g, dtype=torch.float64)  # std 0.03 at the input norm
    rows = local_table(spec, [X], [1e-3], lower_iter=5, whole="auto")
    net = [r for r in rows if r.layer == -1]
    assert net and net[0].lower <= net[0].domain_upper and net[0].lower <= net[0].local_upper
    huge = local_table(spec, [X], [1e6], lower=False)
    assert huge and all(math.isfinite(r.local_upper) and r.local_from_global for r in huge)
    huge = local_table(spec, [X], [1e305], lower=False)
    assert huge and all(r.local_upper == math.inf for r in huge)


@pytest.mark.parametrize("call", ["network_empty", "layer_1d", "network_3d", "network_width", "table_empty",
                                  "table_generator", "layer_int", "network_complex"])
def test_malformed_centres_are_one_line_in_the_api(call):
    """Stop 39 red team: these were an IndexError, ValueErrors, a RuntimeError and a max() of an empty sequence."""
    from transcover.lipschitz import layer_local, local_table, network_local
    from transcover.model import ReferenceConfig, ReferenceTransformer, reference_spec

    spec = reference_spec(ReferenceTransformer(ReferenceConfig(d_model=8, n_heads=2, n_layers=1, d_ff=8)))
    spec = spec.to_torch(torch.float64)
    X = torch.randn(4, 8, dtype=torch.float64)
    calls = {"network_empty": lambda: network_local(spec, X[:0], 1e-3),
             "layer_1d": lambda: layer_local(spec.layers[0], X[0], 1e-3),
             "network_3d": lambda: network_local(spec, X[None], 1e-3),
             "network_width": lambda: network_local(spec, torch.randn(4, 16, dtype=torch.float64), 1e-3),
             "table_empty": lambda: local_table(spec, [], [1e-3]),
             "table_generator": lambda: local_table(spec, (x for x in []), [1e-3]),
             "layer_int": lambda: layer_local(spec.layers[0], X.long(), 1e-3),
             "network_complex": lambda: network_local(spec, X.to(torch.complex128), 1e-3)}
    with pytest.raises(InputError) as e:
        calls[call]()
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("rho", [0.0, -1e-3, math.nan, math.inf, "abc", None])
def test_every_local_entry_point_refuses_the_same_radii(rho):
    """Stop 39's list: ``layer_local`` and ``local_table`` certified a ball of radius 0 that ``network_local`` refused.
    Each public local entry point refuses rho <= 0 or non-finite in the same line."""
    from transcover.lipschitz import layer_local, local_table, network_local
    from transcover.model import ReferenceConfig, ReferenceTransformer, reference_spec

    spec = reference_spec(ReferenceTransformer(ReferenceConfig(d_model=8, n_heads=2, n_layers=1, d_ff=8)))
    spec = spec.to_torch(torch.float64)
    X = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for call in (lambda: layer_local(spec.layers[0], X, rho), lambda: network_local(spec, X, rho),
                 lambda: local_table(spec, [X], [rho], lower=False)):
        with pytest.raises(InputError, match=r"rho must be a finite number > 0, but got rho=") as e:
            call()
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("extra", [["--metric", "fro"], ["--radius", "5"], ["--c-sm", "2"], ["--sigma-min", "0.5"],
                                   ["--seq-len", "3"], ["--samples", "3"]])
def test_global_options_are_refused_with_data(extra, capsys):
    """Red team 167: with --data these options changed nothing (byte-identical CSV), and --metric fro printed the (2,inf)
    constants without a word; each is refused in one line, exit 2."""
    from transcover.cli import main

    assert main(["lipschitz", "--data", "sklearn-descr", "--limit", "1", "--no-lower", "--quiet", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{extra[0]} does not apply with --data" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("norm,placement,act,gated", [("rmsnorm", "pre", "silu", True),
                                                      ("layernorm", "post", "gelu", False)])
def test_components_take_the_global_constant_where_its_domain_holds_their_ball(norm, placement, act, gated):
    """Red team 221: a float16 Llama's layer 0 FFN read 1.328e11 local beside 1.5e7 global (a gated FFN's F107 constant
    on a ball the inner radii had compounded), and a bfloat16 BERT's norm_attn 2468750.0027 local beside
    2468750.000000002 global (no floor left, times the data pads).  A LayerNorm/RMSNorm's global constant holds
    everywhere, and a pre-norm branch's, or a post-norm FFN's, on its norm's whole image: there the local value is at
    most the global one (the same floats where it is taken), says so in ``local_from_global``, and the smaller value
    flows into the layer's product and the network's product route.  The layer's constant stays sound (adversary)."""
    from transcover.lipschitz import lipschitz_bounds, local_table

    spec = random_spec(3, d=8, H=2, dh=4, dff=12, norm=norm, placement=placement, act=act, gated=gated, eps=1e-6,
                       scale=2.0)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randn(5, 8, generator=g, dtype=torch.float64) for _ in range(2)]
    rows = local_table(spec, seqs, [0.3], lower=False)
    held = ("norm_attn", "ffn", "norm_ffn") if placement == "post" else ("attention", "ffn")  # everywhere
    for r in rows:
        if r.component in held:
            assert r.local_upper <= r.global_upper, r
    took = {(r.layer, r.component): r.local_from_global for r in rows}
    assert took[(0, "ffn")] == ("ffn" if placement == "post" else "norm_ffn, ffn")
    ffn0 = next(r for r in rows if (r.layer, r.component) == (0, "ffn"))
    assert ffn0.local_upper == ffn0.global_upper
    assert "ffn" in took[(0, "layer")] and all(r.to_dict()["local_from_global"] == r.local_from_global for r in rows)
    # the network's product route composes the smaller constants
    X = seqs[0]
    nl = network_local(spec, X, 0.3, route="product")
    glob = lipschitz_bounds(spec, radius=float(X.norm(dim=1).max()) + 0.3)
    assert "layer 0 ffn" in nl.global_parts
    if placement == "pre":  # every stage's global constant holds everywhere: so does their product
        assert nl.product <= glob.upper.value * (1 + 1e-9)
    # sound on the ball where the global constants were taken
    layer = spec.layers[0]
    Z = spec.input_norm(X)
    ll = layer_local(layer, Z, 0.3)
    assert "ffn" in ll.global_parts
    (lo,) = adversaries(lambda W: layer_forward(layer, W), Z, [0.3], restarts=3, steps=30)
    assert 0 < lo <= ll.upper, (lo, ll.upper)

"""Shared helpers for the adapter tests: tolerances from dtype and size, tiny HF models."""

from __future__ import annotations

import pytest
import torch


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, n: int, dtype: torch.dtype = torch.float64,
                  what: str = "") -> None:
    """|actual - expected| <= 100 * n * eps(dtype) * (1 + max|expected|), elementwise, rtol=0.

    ``n`` is the longest inner-product length in the computation (d or d_ff); ``dtype`` is the
    lowest precision the *reference* computes in (HF computes some pieces in float32 on purpose).
    """
    # A spec read from files holds numpy arrays; compare them as tensors (no copy, no rounding).
    actual, expected = torch.as_tensor(actual), torch.as_tensor(expected)
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    scale = 1.0 + float(expected.abs().max())
    tol = 100 * n * torch.finfo(dtype).eps * scale
    err = float((actual.double() - expected.double()).abs().max())
    assert err <= tol, f"{what}: max error {err:.3e} > tolerance {tol:.3e}"


def as_tensor(x) -> torch.Tensor:
    """A spec array as a tensor: specs read from files hold numpy arrays, modules' specs tensors."""
    return torch.as_tensor(x)


def tensors_equal(a, b) -> bool:
    """``torch.equal`` for numpy arrays and tensors alike (same shape, dtype and values)."""
    return torch.equal(as_tensor(a), as_tensor(b))


@pytest.fixture
def assert_close():
    return _assert_close


@pytest.fixture(scope="session")
def transformers_mod():
    """transformers, imported once (about 3 s); HF never downloads in these tests."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


def causal_mask(T: int) -> torch.Tensor:
    """The additive (1, 1, T, T) causal mask HF's eager attention expects, in float64."""
    return torch.full((T, T), float("-inf"), dtype=torch.float64).triu(1)[None, None]


@pytest.fixture
def make_causal_mask():
    return causal_mask


def randomize(model: torch.nn.Module, seed: int = 0, std: float = 0.3) -> torch.nn.Module:
    """Every parameter random (norm scales around 1): HF initialises biases to 0 and LayerNorm to
    (1, 0), under which a wrongly mapped bias or scale would go unnoticed."""
    g = torch.Generator().manual_seed(seed)
    scales = {
        id(m.weight) for m in model.modules()
        if (isinstance(m, torch.nn.LayerNorm) or type(m).__name__.endswith("RMSNorm"))
        and getattr(m, "weight", None) is not None
    }
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype) * std
            p.copy_(1.0 + noise if id(p) in scales else noise)
    return model


@pytest.fixture
def randomized():
    return randomize


def rope_heads_enclose_svd(view, layer, tol: float) -> None:
    """Every head of ``analyze``'s layer ``view`` encloses the float64 truth of ``layer`` (a float64 torch
    spec layer with RoPE): ``B_KQ`` the max over *every* relative offset ``|delta| < max_position`` of
    ``||s W_Q R_delta W_K^T||_2`` (rotation by the model's ``apply_rope``), ``B_V`` ``||W_V W_O||_2``;
    relative tolerance ``tol`` (from the caller's dtype and size)."""
    from transcover.model import apply_rope

    a = layer.attention
    P = a.rope.max_position
    for h, hn in enumerate(view.heads):
        Wq, Wk, Wv, Wo = (t.double() for t in a.head(h))
        vals = [a.softmax_scale * torch.linalg.matrix_norm(
            apply_rope(Wq, a.rope, torch.full((Wq.shape[0],), float(dl), dtype=torch.float64)) @ Wk.T, 2).item()
            for dl in range(-(P - 1), P)]
        assert hn.B_KQ.lower <= max(vals) * (1 + tol) and max(vals) <= hn.B_KQ.upper * (1 + tol), h
        ov = torch.linalg.matrix_norm(Wv @ Wo, 2).item()
        assert hn.B_V.lower <= ov * (1 + tol) and ov <= hn.B_V.upper * (1 + tol), h

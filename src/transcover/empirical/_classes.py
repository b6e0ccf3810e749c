"""Norm-bounded Transformer classes (seed 2.1) as finite random samples of their members.

The class of the reference model (seed 1.2, :class:`~transcover.model.ReferenceTransformer`) with,
for every layer and head ``h``,

.. math::

    \\|W_{KQ}^h\\|_2 = \\|W_Q^h W_K^{hT}\\|_2/\\sqrt{d_h} \\le B_{KQ},\\quad
    \\|W_{OV}^h\\|_2 = \\|W_V^h W_O^h\\|_2 \\le B_V,\\quad
    \\|W_1\\|_2 \\le B_{W1},\\ \\|W_2\\|_2 \\le B_{W2},\\ \\|b_1\\|_2 \\le B_{b1},\\ \\|b_2\\|_2 \\le B_{b2},

and every MLP-head matrix ``||W||_2 <= B_head`` (head biases ``||b||_2 <= B_head_bias``).  A member
is drawn by taking Gaussian matrices and rescaling them so the constrained norm equals
``radius * rho``: for the products ``W_KQ`` and ``W_OV`` both factors are multiplied by
``sqrt(radius * rho / ||product||)``.  The radial factor ``rho`` is

* ``"boundary"``: 1 (on the sphere of the spectral ball, where the class is most spread);
* ``"uniform"``: ``U``, ``U ~ Uniform(0, 1)``;
* ``"volume"``: ``U^{1/p}`` with ``p`` the number of entries of the constrained matrix, the radial
  law of the uniform distribution on a p-dimensional ball (so mostly near the boundary).

Every draw satisfies the constraints (up to float rounding of the rescaling), so any packing of
the drawn functions is a packing of the class: this is what makes the Monte-Carlo numbers
*lower* estimates of the class's packing and covering numbers (``_montecarlo``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

import torch
from torch import Tensor

from .._errors import InputError, check_positive_int
from ..model import (
    Activation,
    AttentionSpec,
    FFNSpec,
    LayerSpec,
    MLPHeadSpec,
    NormKind,
    NormSpec,
    Placement,
    ReferenceConfig,
    ReferenceTransformer,
    TransformerSpec,
    transformer_forward,
)

__all__ = ["NormRadii", "RADIAL_LAWS", "ReferenceClassSample", "sample_reference_class", "random_inputs",
           "MAX_SEED", "check_seed"]

RADIAL_LAWS = ("volume", "uniform", "boundary")

# The largest |seed| of a Monte-Carlo draw.  Seeds are mixed into torch seeds as ``seed * 1_000_003 + j`` (local
# members), ``seed * 7919 + r`` (uniform pools) and ``seed + 1`` (samples), all inside int64 below this bound; a seed
# of 1e16 overflowed there as an internal error (red team 191).
MAX_SEED = 2**32 - 1


def check_seed(seed, name: str = "seed", limit: int = MAX_SEED) -> int:  # noqa: ANN001  (refused unless an int)
    """``int(seed)``, or :class:`InputError` unless it is an integer with ``|seed| <= limit``."""
    if isinstance(seed, bool) or not isinstance(seed, int) or abs(seed) > limit:
        raise InputError(f"{name} must be an integer between -{limit} and {limit}, but got {name}={seed!r}")
    return int(seed)


@dataclass(frozen=True)
class NormRadii:
    """The radii of seed 2.1 (per layer and per head), plus the MLP head's."""

    B_KQ: float = 1.0
    B_V: float = 1.0
    B_W1: float = 1.0
    B_W2: float = 1.0
    B_b1: float = 1.0
    B_b2: float = 1.0
    B_head: float = 1.0  # spectral norm of each MLP-head matrix (F_MLP of seed 3.1)
    B_head_bias: float = 0.0  # l2 norm of each head bias; 0 keeps the head linear-homogeneous

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            ok = isinstance(v, (int, float)) and math.isfinite(v)
            positive = f.name.startswith("B_b") or f.name == "B_head_bias"
            if not ok or (v < 0 if positive else v <= 0):
                need = ">= 0" if positive else "> 0"
                raise InputError(f"radius {f.name} must be a finite number {need}, but got {f.name}={v!r}")

    def scaled(self, c: float) -> "NormRadii":
        """All radii multiplied by ``c`` (the 'norm radius' axis of the asymptotics).  A product that leaves the float64
        range is refused under both names (it was reported as the radius itself: "B_KQ=inf" for scale 1e308 x 10)."""
        if not (isinstance(c, (int, float)) and not isinstance(c, bool) and math.isfinite(c) and c > 0):
            raise InputError(f"radius scale must be a finite number > 0, but got scale={c!r}")
        out = {}
        for k, v in asdict(self).items():
            out[k] = v * c
            if not math.isfinite(out[k]) or (v > 0 and out[k] == 0):
                what = "overflows" if not math.isfinite(out[k]) else "underflows to 0"
                raise InputError(f"radius scale x {k} {what} in float64: scale={c!r} x {k}={v!r} = {out[k]!r}")
        return NormRadii(**out)

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def _check_radial(radial: str) -> str:
    if radial not in RADIAL_LAWS:
        raise InputError(f"radial must be one of {RADIAL_LAWS}, but got radial={radial!r}")
    return radial


def _rho(shape: tuple[int, ...], p: int, radial: str, gen: torch.Generator) -> Tensor:
    if radial == "boundary":
        return torch.ones(shape, dtype=torch.float64)
    U = torch.rand(shape, generator=gen, dtype=torch.float64)
    return U if radial == "uniform" else U ** (1.0 / p)


def _spectral(W: Tensor) -> Tensor:
    return torch.linalg.matrix_norm(W.double(), ord=2)


# Note [inside the class]: a member drawn on the boundary (radial="boundary") was rescaled to norm radius * rho
# in float64, and the rescaled matrix's exact norm came out up to 4.4e-16 relative *above* it (red team 37f): a
# packing could hold a point outside F.  Each rescale below therefore aims a little inside: the computed norm
# (SVD or 2-norm: within (n + 2)u relative of the exact one, n the entries), the quotient and the product
# (2u) and, for factor pairs, the rounding of ``A @ B`` (at most (e + 2)u ||A| |B||_F absolute, e the inner
# size) are all charged, four times over.
_U = 2.0**-53


def _matrix_on_sphere(shape, radius: float, radial: str, gen) -> Tensor:
    """Gaussian (..., r, c) rescaled so each matrix's spectral norm is radius * rho (just inside)."""
    W = torch.randn(shape, generator=gen, dtype=torch.float64)
    rho = _rho(shape[:-2], shape[-2] * shape[-1], radial, gen)
    inside = 1.0 - 4.0 * (shape[-2] * shape[-1] + 4) * _U
    return W * (radius * rho * inside / _spectral(W))[..., None, None]


def _vector_on_sphere(shape, radius: float, radial: str, gen) -> Tensor:
    v = torch.randn(shape, generator=gen, dtype=torch.float64)
    rho = _rho(shape[:-1], shape[-1], radial, gen)
    inside = 1.0 - 4.0 * (shape[-1] + 4) * _U
    return v * (radius * rho * inside / v.norm(dim=-1))[..., None]


def _product_on_sphere(shape_a, shape_b, radius: float, scale: float, radial: str, gen):
    """Factors A (..., d, e), B (..., e, k) rescaled so ||scale * A @ B||_2 = radius * rho (just inside)."""
    A = torch.randn(shape_a, generator=gen, dtype=torch.float64)
    B = torch.randn(shape_b, generator=gen, dtype=torch.float64)
    rho = _rho(shape_a[:-2], shape_a[-2] * shape_b[-1], radial, gen)
    s = _spectral(scale * A @ B)
    # the product's rounding against its norm, and the factors' own rounding after scaling (each side by f)
    kappa = torch.linalg.matrix_norm(A.abs() @ B.abs()) * abs(scale) / s
    n = shape_a[-2] * shape_b[-1]
    inside = 1.0 - 4.0 * ((n + 4) + (shape_a[-1] + 4) * (1.0 + kappa)) * _U
    f = torch.sqrt(radius * rho * inside / s)[..., None, None]
    return A * f, B * f


def _check_config(cfg: ReferenceConfig) -> None:
    problems = []
    if cfg.attention != "dot":
        problems.append(f"attention={cfg.attention!r} (only 'dot')")
    if cfg.norm not in ("ball", "none"):
        problems.append(f"norm={cfg.norm!r} (only 'ball' or 'none')")
    if cfg.d_input is not None or cfg.max_len is not None:
        problems.append("embeddings (d_input/max_len must be None: inputs are d_model rows)")
    if problems:
        raise InputError("the Monte-Carlo reference class does not support " + ", ".join(problems))


@dataclass(frozen=True)
class ReferenceClassSample:
    """M members of the norm-bounded reference class, weights stacked along a leading axis.

    Shapes (m = n_functions, L layers): ``W_Q, W_K, W_V`` (m, L, H, d, dh); ``W_O`` (m, L, H, dh, d);
    ``W_1`` (m, L, d, dff); ``W_2`` (m, L, dff, d); ``b_1`` (m, L, dff); ``b_2`` (m, L, d);
    ``head_W[i]`` (m, a_i, a_{i+1}); ``head_b[i]`` (m, a_{i+1}).
    """

    config: ReferenceConfig
    radii: NormRadii
    radial: str
    seed: int
    W_Q: Tensor
    W_K: Tensor
    W_V: Tensor
    W_O: Tensor
    W_1: Tensor
    W_2: Tensor
    b_1: Tensor
    b_2: Tensor
    head_W: tuple[Tensor, ...]
    head_b: tuple[Tensor, ...]
    output: str = "head"  # "head": the MLP's outputs (F_MLP o G_TF); "features": g_L(X), token rows

    @property
    def n_functions(self) -> int:
        return self.W_Q.shape[0]

    @property
    def description(self) -> str:
        c = self.config
        return (f"reference class L={c.n_layers} d={c.d_model} H={c.n_heads} d_ff={c.d_ff} "
                f"head={c.head_hidden}, radii {self.radii.to_dict()}, radial={self.radial}, output={self.output}")

    def model(self, j: int) -> ReferenceTransformer:
        """Member ``j`` as a :class:`ReferenceTransformer` (for checks and for users)."""
        m = ReferenceTransformer(self.config).double()
        with torch.no_grad():
            for l, blk in enumerate(m.blocks):
                for name in ("W_Q", "W_K", "W_V", "W_O", "W_1", "W_2"):
                    getattr(blk, name).copy_(getattr(self, name)[j, l])
                if blk.b_1 is not None:
                    blk.b_1.copy_(self.b_1[j, l])
                    blk.b_2.copy_(self.b_2[j, l])
            for lin, W, b in zip(m.head, self.head_W, self.head_b):
                lin.weight.copy_(W[j].T)
                lin.bias.copy_(b[j])
        return m

    def evaluate(self, X: Tensor, *, chunk_size: int | None = None) -> Tensor:
        """All members on the samples ``X`` (n, T, d): outputs (M, n, b), float64.

        With output="features" the result is ``(M, n * T, d)``: each token position counts as a
        sample, so ``q = 2`` gives the metric ``max_t ||g(X)_t - g'(X)_t||_2`` over all ``n T``
        positions that the covering bounds of ``transcover.covering`` use (THEORY section 2).
        """
        X = _check_inputs(X, self.config.d_model)
        n, T, d = X.shape
        cfg = self.config
        width = max(d, cfg.d_ff, cfg.n_heads * T, *(cfg.head_hidden or (1,)))
        if chunk_size is None:  # keep the per-chunk activations near 2**24 floats
            chunk_size = max(1, (1 << 24) // max(1, n * T * width * max(1, cfg.n_heads)))
        outs = [self._forward(slice(s, s + chunk_size), X) for s in range(0, self.n_functions, chunk_size)]
        return torch.cat(outs, dim=0)

    def output_shape(self, X: Tensor) -> tuple[int, int]:
        """``(rows, width)`` of one member's outputs on the samples ``X`` (n, T, d), without evaluating."""
        n, T = X.shape[0], X.shape[1]
        return (n * T, self.config.d_model) if self.output == "features" else (n, self.config.n_outputs)

    def stacked_spec(self, members: slice = slice(None)) -> TransformerSpec:
        """The members ``members`` as one member-stacked spec (Note [member stacks] in
        ``transcover.model``): the reference model's decomposition with a leading member axis."""
        cfg = self.config
        act = Activation(cfg.activation)
        kind = NormKind.BALL if cfg.norm == "ball" else NormKind.NONE
        layers = [LayerSpec(
            index=l,
            attention=AttentionSpec(W_Q=self.W_Q[members, l], W_K=self.W_K[members, l], W_V=self.W_V[members, l],
                                    W_O=self.W_O[members, l], causal=cfg.causal),
            ffn=FFNSpec(W_1=self.W_1[members, l], W_2=self.W_2[members, l], activation=act,
                        b_1=self.b_1[members, l], b_2=self.b_2[members, l]),
            norm_attn=NormSpec(kind), norm_ffn=NormSpec(kind), placement=Placement.POST,
        ) for l in range(cfg.n_layers)]
        head = MLPHeadSpec(weights=tuple(W[members] for W in self.head_W),
                           biases=tuple(b[members] for b in self.head_b), activation=act, readout=cfg.readout)
        return TransformerSpec(arch="reference", name=self.description, d_model=cfg.d_model, layers=layers,
                               input_norm=NormSpec(kind) if kind is NormKind.BALL else None, head=head)

    def _forward(self, sl: slice, X: Tensor) -> Tensor:
        """Members ``sl`` on ``X`` (n, T, d): one batched forward pass over the member axis."""
        Z = transformer_forward(self.stacked_spec(sl), X[None], with_head=self.output == "head")
        if self.output == "features":  # every token position is a sample: the bounds' metric
            return Z.reshape(Z.shape[0], -1, Z.shape[-1])
        return Z


def _check_inputs(X: Tensor, d: int) -> Tensor:
    X = torch.as_tensor(X)
    if X.ndim != 3 or X.shape[-1] != d or min(X.shape) == 0:
        raise InputError(f"samples must have shape (n, T, d_model={d}), but got {tuple(X.shape)}")
    if not bool(torch.isfinite(X).all()):
        raise InputError("samples contain NaN or Inf")
    return X.to(torch.float64)


def sample_reference_class(config: ReferenceConfig, radii: NormRadii, n_functions: int, *,
                           radial: str = "volume", seed: int = 0,
                           output: str = "head") -> ReferenceClassSample:
    """Draw ``n_functions`` members of the norm-bounded reference class (module docstring).

    Args:
        config: shape of the reference model (dot attention, Pi_norm or no norm, no embeddings).
        radii: the spectral radii of seed 2.1 (per layer, per head).
        n_functions: M >= 1.
        radial: "volume", "uniform" or "boundary" (module docstring).
        seed: seed of the draw (reproducible: same seed, same functions).
        output: "head" (Transformer + MLP, seed 3.1) or "features" (the Transformer g_L alone).

    Raises:
        InputError: unsupported config, M < 1, an unknown radial law or output.
    """
    _check_config(config)
    check_positive_int(n_functions, "n_functions")
    check_seed(seed, limit=2**63 - 1)  # torch's seed range: block seeds (Note [seed blocks]) have 63 bits
    _check_radial(radial)
    if output not in ("head", "features"):
        raise InputError(f"output must be 'head' or 'features', but got output={output!r}")
    gen = torch.Generator().manual_seed(int(seed))
    M, L, H, d, dh, dff = (n_functions, config.n_layers, config.n_heads, config.d_model,
                           config.head_dim, config.d_ff)
    r = radii
    W_Q, W_K_T = _product_on_sphere((M, L, H, d, dh), (M, L, H, dh, d), r.B_KQ, 1 / math.sqrt(dh), radial, gen)
    W_V, W_O = _product_on_sphere((M, L, H, d, dh), (M, L, H, dh, d), r.B_V, 1.0, radial, gen)
    W_1 = _matrix_on_sphere((M, L, d, dff), r.B_W1, radial, gen)
    W_2 = _matrix_on_sphere((M, L, dff, d), r.B_W2, radial, gen)
    if config.ffn_bias:
        b_1 = _vector_on_sphere((M, L, dff), r.B_b1, radial, gen)
        b_2 = _vector_on_sphere((M, L, d), r.B_b2, radial, gen)
    else:
        b_1, b_2 = torch.zeros(M, L, dff, dtype=torch.float64), torch.zeros(M, L, d, dtype=torch.float64)
    widths = (d, *config.head_hidden, config.n_outputs)
    head_W = tuple(_matrix_on_sphere((M, a, b), r.B_head, radial, gen) for a, b in zip(widths[:-1], widths[1:]))
    head_b = tuple(_vector_on_sphere((M, b), r.B_head_bias, radial, gen) for b in widths[1:])
    return ReferenceClassSample(config, radii, radial, int(seed), W_Q, W_K_T.transpose(-1, -2).contiguous(),
                                W_V, W_O, W_1, W_2, b_1, b_2, head_W, head_b, output)


def random_inputs(n: int, T: int, d: int, *, seed: int = 0, radius: float = 1.0) -> Tensor:
    """``n`` sequences of ``T`` rows drawn uniformly from the l2 ball of ``radius`` in R^d (float64)."""
    for name, v in (("n", n), ("T", T), ("d", d)):
        check_positive_int(v, name)
    check_seed(seed, limit=2**63 - 1)  # torch's seed range; derived seeds (seed + 1, seed * 7919 + r) reach here
    gen = torch.Generator().manual_seed(int(seed))
    Z = torch.randn(n, T, d, generator=gen, dtype=torch.float64)
    rho = torch.rand(n, T, 1, generator=gen, dtype=torch.float64) ** (1.0 / d)
    return Z / Z.norm(dim=-1, keepdim=True) * rho * radius

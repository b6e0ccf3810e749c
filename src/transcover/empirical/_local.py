"""A local class: a given (trained) model plus weight perturbations inside norm balls.

.. math::

    F_{loc} = \\{ f_{\\theta + \\Delta} : \\|\\Delta_{role}\\|_2 \\le r_{role} \\text{ for every perturbed role} \\}

Each perturbed tensor of every layer (per head for ``W_Q, W_K, W_V, W_O``: the radius bounds each head's block
``||Delta_Q^h||_2 <= r``, so the whole matrix's norm reaches ``sqrt(H) r``; each matrix of the MLP head) gets a Gaussian
``Delta`` rescaled to spectral norm ``r * rho`` (biases: l2 norm), ``rho`` the radial law of
``_classes`` ("volume", "uniform", "boundary").  Its covering number is the *local* covering number
around the model, the quantity a generalisation argument localised at the trained weights uses;
the Monte-Carlo estimates of ``_montecarlo`` apply to it unchanged.

Functions are regenerated from ``(seed, j)`` when evaluated, so the sample needs no memory per
member and evaluating it twice (the uniform search does) gives the same functions.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from .._errors import InputError, check_positive_int
from ..model import TransformerSpec, transformer_forward
from ._classes import _U, _check_radial, _matrix_on_sphere, _vector_on_sphere, check_seed

__all__ = ["LOCAL_ROLES", "LocalClassSample", "sample_local_class"]

LOCAL_ROLES = ("W_Q", "W_K", "W_V", "W_O", "W_1", "W_2", "b_1", "b_2", "head")
# what a radius bounds, per layer: the attention roles per head (the module docstring), the rest per tensor
_RADIUS_OF = {**{role: "(spectral, per head)" for role in ("W_Q", "W_K", "W_V", "W_O")},
              "W_1": "(spectral)", "W_2": "(spectral)", "b_1": "(l2)", "b_2": "(l2)",
              "head": "(spectral, per MLP-head matrix)"}


@dataclass(frozen=True)
class LocalClassSample:
    """``n_functions`` perturbations of ``spec`` (member 0 is the model itself if ``include_center``)."""

    spec: TransformerSpec
    radii: dict[str, float]
    n_functions: int
    radial: str = "volume"
    seed: int = 0
    include_center: bool = True

    def __post_init__(self) -> None:
        check_seed(self.seed)  # member seeds ``seed * 1_000_003 + j`` stay inside int64 (MAX_SEED)

    @property
    def description(self) -> str:
        """The class in words, each radius with what it bounds: ``W_Q=0.05`` bounds every head's block
        ``||dW_Q^h||_2``, not the whole matrix, whose norm reaches ``sqrt(H) 0.05`` (red team 220)."""
        radii = ", ".join(f"{role}={v!r} {_RADIUS_OF[role]}" for role, v in self.radii.items())
        return (f"local class around {self.spec.name!r} ({self.spec.arch}, {self.spec.n_layers} layers), "
                f"radii (per layer) {radii}, radial={self.radial}")

    def member(self, j: int) -> TransformerSpec:
        """The spec of member ``j`` (deterministic in ``(seed, j)``)."""
        if self.include_center and j == 0:
            return self.spec
        gen = torch.Generator().manual_seed(int(self.seed) * 1_000_003 + j)
        r = self.radii

        def pert(t: Tensor | None, role: str, per_head: bool = False) -> Tensor | None:
            if t is None or r.get(role, 0.0) == 0.0:
                return t
            # float64: a small perturbation must not be rounded away by a float32 checkpoint
            t64 = t.double()
            if t.ndim == 1:
                return _inside_sum(t64, _vector_on_sphere(tuple(t.shape), r[role], self.radial, gen), r[role], role)
            return _inside_sum(t64, _matrix_on_sphere(tuple(t.shape), r[role], self.radial, gen), r[role], role)

        layers = []
        for layer in self.spec.layers:
            a, f = layer.attention, layer.ffn
            a2 = dataclasses.replace(a, W_Q=pert(a.W_Q, "W_Q"), W_K=pert(a.W_K, "W_K"),
                                     W_V=pert(a.W_V, "W_V"), W_O=pert(a.W_O, "W_O"))
            f2 = dataclasses.replace(f, W_1=pert(f.W_1, "W_1"), W_2=pert(f.W_2, "W_2"),
                                     b_1=pert(f.b_1, "b_1"), b_2=pert(f.b_2, "b_2"))
            layers.append(dataclasses.replace(layer, attention=a2, ffn=f2))
        head = self.spec.head
        if head is not None and r.get("head", 0.0) > 0.0:
            head = dataclasses.replace(head, weights=tuple(pert(W, "head") for W in head.weights))
        return dataclasses.replace(self.spec, layers=layers, head=head)

    def output_shape(self, X: Tensor) -> tuple[int, int]:
        """``(rows, width)`` of one member's outputs on the samples ``X`` (n, T, d): the model on one sample."""
        X = torch.as_tensor(X)
        if X.ndim != 3 or X.shape[-1] != self.spec.d_model or min(X.shape) == 0:
            raise InputError(f"samples must have shape (n, T, d_model={self.spec.d_model}), but got {tuple(X.shape)}")
        with torch.no_grad():
            return X.shape[0], int(transformer_forward(self.spec, X[:1].double()).numel())

    def evaluate(self, X: Tensor) -> Tensor:
        """All members on the embedded samples ``X`` (n, T, d_model): outputs (M, n, b), float64."""
        X = torch.as_tensor(X)
        d = self.spec.d_model
        if X.ndim != 3 or X.shape[-1] != d or min(X.shape) == 0:
            raise InputError(f"samples must have shape (n, T, d_model={d}), but got {tuple(X.shape)}")
        X = X.double()
        outs = []
        with torch.no_grad():
            for j in range(self.n_functions):
                y = transformer_forward(self.member(j), X)
                outs.append(y.reshape(X.shape[0], -1))
        return torch.stack(outs)


# Note [inside the local class] (Note [inside the class] of ``_classes`` for the sum with the model): a member is
# fl(W + D), whose perturbation fl(W + D) - W is D plus the sum's rounding, at most u |W + D| per entry, i.e. up to
# u (||W||_F + sqrt(k) ||D||_2) in spectral norm (k = min(rows, cols)). Where the weights are large against the
# radius that rounding left members outside the class (||fl(W + D) - W|| = 1.0000261 r at weights x1000 and r = 1e-9,
# red team 162), so D is shrunk until its norm plus that rounding, every computed norm charged, is at most r; a
# radius below the weights' float64 resolution is refused.


def _inside_sum(W: Tensor, D: Tensor, radius: float, role: str) -> Tensor:
    """``W + D`` with ``D`` shrunk (never grown) so that the exact ``fl(W + D) - W`` has norm at most ``radius``
    (spectral per matrix of the last two axes, l2 per vector); Note [inside the local class]."""
    vec = W.ndim == 1
    n = W.shape[-1] if vec else W.shape[-2] * W.shape[-1]
    k = 1 if vec else min(W.shape[-2], W.shape[-1])
    pad = 1.0 + 8.0 * (n + 4) * _U  # every computed norm within (n + 2)u, quotients and products 2u, four times over
    fro_W = (W.norm() if vec else torch.linalg.matrix_norm(W, ord="fro")) * pad
    size_D = (D.norm() if vec else torch.linalg.matrix_norm(D, ord=2)) * pad
    room = radius - _U * fro_W * pad
    if bool((room <= 0).any()):
        raise InputError(f"the perturbation radius {role}={radius!r} is below float64's resolution of the model's "
                         f"{role} weights (about {_U * float(fro_W.max()):.3g}): no member differs from the model by "
                         "a perturbation inside it; use a larger radius")
    c = torch.clamp(room / (size_D * (1.0 + math.sqrt(k) * _U) * pad), max=1.0)
    c = torch.where(size_D > 0, c, torch.ones_like(c))
    return W + (D * c if vec else D * c[..., None, None])


def sample_local_class(model, radii: Mapping[str, float], n_functions: int, *,
                       radial: str = "volume", seed: int = 0,
                       include_center: bool = True) -> LocalClassSample:
    """The class of ``model`` perturbed within the given spectral radii (module docstring): per head for ``W_Q, W_K,
    W_V, W_O``, per matrix for ``W_1, W_2`` and each head matrix, l2 for ``b_1, b_2``, in every layer.

    Args:
        model: a :class:`~transcover.model.TransformerSpec` or a
            :class:`~transcover.model.ReferenceTransformer` (or any module ``transcover.model.load``
            accepts, once it exists).
        radii: role -> radius, roles among ``LOCAL_ROLES``; absent roles are not perturbed.
        n_functions: M >= 1.

    Raises:
        InputError: an unknown role or one the model lacks, a negative or non-finite radius, all radii zero,
            M < 1, a seed beyond ``MAX_SEED``.
    """
    spec = _as_spec(model)
    check_seed(seed)
    clean = {}
    for role, v in dict(radii).items():
        if role not in LOCAL_ROLES:
            raise InputError(f"unknown perturbation role {role!r}; roles are {LOCAL_ROLES}")
        if not _has_role(spec, role):  # nothing would be perturbed: a class of one function (red team 191)
            raise InputError(f"the model has no {role} to perturb ({spec.arch}); choose among the roles it has: "
                             f"{', '.join(r for r in LOCAL_ROLES if _has_role(spec, r))}")
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
            raise InputError(f"radius for {role} must be a finite number >= 0, but got {role}={v!r}")
        clean[role] = float(v)
    if not any(v > 0 for v in clean.values()):
        raise InputError(f"at least one perturbation radius must be > 0, but got radii={dict(radii)}")
    check_positive_int(n_functions, "n_functions")
    return LocalClassSample(spec, clean, n_functions, _check_radial(radial), int(seed), include_center)


def _has_role(spec: TransformerSpec, role: str) -> bool:
    """Whether ``LocalClassSample.member`` has a tensor of ``role`` to perturb."""
    if role == "head":
        return spec.head is not None and len(spec.head.weights) > 0
    part = "attention" if role in ("W_Q", "W_K", "W_V", "W_O") else "ffn"
    return any(getattr(getattr(layer, part), role, None) is not None for layer in spec.layers)


def _as_spec(model) -> TransformerSpec:
    if isinstance(model, TransformerSpec):
        return model
    from ..model import ReferenceTransformer, reference_spec

    if isinstance(model, ReferenceTransformer):
        if model.embed is not None or model.pos is not None:
            raise InputError("the local class evaluates embedded inputs; use a ReferenceTransformer "
                             "without d_input/max_len, or pass its TransformerSpec")
        return reference_spec(model, snapshot=True)  # a fixed function, as load(module) gives (red team 210)
    try:
        from ..model import load
    except ImportError:
        raise InputError(f"cannot build a local class from {type(model).__name__}; pass a "
                         "TransformerSpec or a ReferenceTransformer") from None
    return load(model).to_torch()

"""Trained models: where attention goes, and the same error decomposition (seed sections 4.2, 5.3).

For a trained :class:`~transcover.model.ReferenceTransformer` on an I-sparse task, the analogue of
the construction's ideal read-out is the same network with every head's attention *restricted to
I* (keys outside I masked, the rest renormalised): ``F_I``.  Then

.. math::

    F - g^* = \\underbrace{(F - F_I)}_{\\text{attention part}} + \\underbrace{(F_I - g^*)}_{\\text{rest}},

and for one layer the attention part obeys, sample by sample (first-token read-out; ``mean``
averages the same bound over query positions),

.. math::

    |F(Z) - F_I(Z)| \\le L_{post} \\sum_h (1 - m_h(Z))\\, \\mathrm{diam}_h(Z),\\qquad
    L_{post} = (1 + \\|W_1\\|_2\\|W_2\\|_2) \\prod_i \\|W^{head}_i\\|_2,

because ``Σ_j π_j v_j - Σ_{j∈I} (π_j/m) v_j = (1 - m)(v̄_out - v̄_in)`` (m the mass on I,
``diam_h`` the diameter of the head's values ``x_j W_OV^h``), Π_norm is 1-Lipschitz, the FFN
residual is ``(1 + ||W_1|| ||W_2||)``-Lipschitz (ReLU) and the head ``Π||W_i||``-Lipschitz.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .._errors import InputError
from .._results import Kind, Quantity
from ..model import ForwardHooks, NormKind, NormSpec, ReferenceConfig, ReferenceTransformer, transformer_forward
from ._targets import SparseTarget, make_sparse_task, sparse_target
from ._threads import single_thread

__all__ = ["TrainedDecomposition", "forward_with_attention", "decompose_trained", "train_sparse_model"]


def forward_with_attention(model: ReferenceTransformer, X: Tensor, key_mask: Tensor | None = None
                           ) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    """``model(X)`` with the attention probabilities and the heads' outputs recorded (dot attention).

    The model's own forward pass (:func:`~transcover.model.transformer_forward` on
    ``model.functional_spec()``), observed through :class:`~transcover.model.ForwardHooks`.
    ``key_mask`` (B, T) bool: keys allowed (True) for every head and query; None keeps all.
    Returns ``(output (B, n_outputs), probs per layer (B, H, T, T), head outputs per layer
    (B, H, T, d) = P X W_OV^h)``.
    """
    if model.cfg.attention != "dot":
        raise InputError("forward_with_attention supports dot attention only")
    L = model.cfg.n_layers
    probs: list[list[Tensor]] = [[] for _ in range(L)]
    outs: list[list[Tensor]] = [[] for _ in range(L)]
    hooks = ForwardHooks(on_attention_probs=lambda layer, h, P: probs[layer].append(P),
                         on_head_output=lambda layer, h, Y: outs[layer].append(Y))
    z = transformer_forward(model.functional_spec(), model.embed_inputs(X), key_mask=key_mask, hooks=hooks)
    return z, [torch.stack(p, dim=1) for p in probs], [torch.stack(o, dim=1) for o in outs]


@dataclass(frozen=True)
class TrainedDecomposition:
    """Attention mass on I and the measured decomposition on a data set."""

    mass_on_I: tuple[float, ...]  # per head, mean over samples (and query positions for "mean")
    uniform_mass: float  # |I| / T, what a head that ignores position would put on I
    total: Quantity  # max over the data of |F - g*|
    attention: Quantity  # max |F - F_I|
    rest: Quantity  # max |F_I - g*|
    rmse_total: float
    rmse_attention: float
    rmse_rest: float
    attention_bound_ratio: float  # max over samples of |F - F_I| / (L_post sum_h (1-m_h) diam_h)
    L_post: float

    def to_dict(self) -> dict[str, object]:
        return {"mass_on_I": list(self.mass_on_I), "uniform_mass": self.uniform_mass,
                "total": self.total.to_dict(), "attention": self.attention.to_dict(),
                "rest": self.rest.to_dict(), "rmse_total": self.rmse_total,
                "rmse_attention": self.rmse_attention, "rmse_rest": self.rmse_rest,
                "attention_bound_ratio": self.attention_bound_ratio, "L_post": self.L_post}


def _spec_norm(W: Tensor) -> float:
    return float(torch.linalg.matrix_norm(W.detach().double(), 2))


def decompose_trained(model: ReferenceTransformer, target: SparseTarget, X: Tensor) -> TrainedDecomposition:
    """Mass on I, and ``|F - g*|`` split at ``F_I`` on the data ``X`` (B, T, d_in), 1-layer models.

    Raises:
        InputError: for a model with more than one layer, LayerNorm, or non-dot attention.
    """
    cfg = model.cfg
    if cfg.n_layers != 1 or cfg.norm == "layernorm" or cfg.activation != "relu":
        raise InputError("decompose_trained needs a 1-layer ReLU model with norm 'ball' or 'none'")
    B, T = X.shape[0], X.shape[1]
    if T <= max(target.indices):
        raise InputError(f"sequence length {T} is too short for I={target.indices}")
    key_mask = torch.zeros(B, T, dtype=torch.bool)
    key_mask[:, list(target.indices)] = True
    with torch.no_grad():
        F, probs, outs = forward_with_attention(model, X)
        F_I, _, outs_I = forward_with_attention(model, X, key_mask)
        y = target(X).to(F.dtype)
        F, F_I = F[:, 0], F_I[:, 0]
        P = probs[0]  # (B, H, T, T)
        mass = P[..., list(target.indices)].sum(-1)  # (B, H, T)
        queries = mass[..., 0] if cfg.readout == "first" else mass.mean(-1)
        mass_h = tuple(float(v) for v in queries.mean(0))
        # per-sample bound on |F - F_I|
        b = model.blocks[0]
        L_ffn = 1.0 + _spec_norm(b.W_1) * _spec_norm(b.W_2)
        L_head = math.prod(_spec_norm(lin.weight) for lin in model.head)
        L_post = L_ffn * L_head
        # values after W_O: x_j W_V^h W_O^h, and their diameter per head
        Xe = model.embed_inputs(X)
        if cfg.norm == "ball":
            Xe = NormSpec(NormKind.BALL)(Xe)
        V = torch.einsum("btd,hde,hef->bhtf", Xe, b.W_V, b.W_O)  # (B, H, T, d)
        diam = torch.cdist(V, V).amax(dim=(-1, -2))  # (B, H)
        off = 1.0 - mass  # (B, H, T)
        per_query = (off * diam[..., None]).sum(1)  # (B, T)
        q_bound = per_query[:, 0] if cfg.readout == "first" else per_query.mean(-1)
        bound = L_post * q_bound
        attn = (F - F_I).abs()
        # in float64: 1e-300 is 0 in float32, and a sample with all its mass on target gave 0/0 = NaN,
        # which then won the max over samples (red team of stop 36)
        ratio = float((attn.double() / bound.double().clamp_min(1e-300)).max())
    q = lambda v, what: Quantity(float(v), Kind.EMPIRICAL_LOWER, f"max over {B} samples: {what}")
    rms = lambda t: float(t.pow(2).mean().sqrt())
    return TrainedDecomposition(
        mass_h, len(target.indices) / T,
        q((F - y).abs().max(), "|F - g*|"), q(attn.max(), "|F - F_I|"), q((F_I - y).abs().max(), "|F_I - g*|"),
        rms(F - y), rms(F - F_I), rms(F_I - y), ratio, L_post,
    )


def train_sparse_model(task: str = "holder", *, seq_len: int = 8, sparsity: int = 2, beta: float = 1.0,
                       n_samples: int = 2048, steps: int = 300, d_model: int = 16, head_width: int = 32,
                       lr: float = 3e-3, norm: str = "none", seed: int = 0
                       ) -> tuple[ReferenceTransformer, SparseTarget]:
    """Train a 1-layer, ``sparsity``-head ReferenceTransformer on a fixed-I sparse task (MSE, Adam).

    A deliberately small loop (the full trainer is ``transcover.train``); deterministic for a seed.
    """
    for name, v in (("n_samples", n_samples), ("steps", steps), ("d_model", d_model), ("head_width", head_width)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise InputError(f"{name} must be a positive integer, but got {name}={v!r}")
    if not lr > 0:
        raise InputError(f"learning rate must be > 0, but got lr={lr!r}")
    target = sparse_target(task, seq_len, sparsity=sparsity, beta=beta, seed=seed)
    X, y = make_sparse_task(task, n_samples, seq_len, sparsity=sparsity, beta=beta, seed=seed)
    torch.manual_seed(seed)
    cfg = ReferenceConfig(d_model=d_model, n_heads=sparsity, n_layers=1, d_ff=2 * d_model,
                          d_head=max(1, d_model // sparsity), norm=norm, d_input=X.shape[-1],
                          max_len=seq_len, head_hidden=(head_width,), readout="first")
    model = ReferenceTransformer(cfg)
    with torch.no_grad():
        model.pos.normal_(0.0, 1.0)  # distinguishable positions from the start
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    batch = min(256, n_samples)
    with single_thread():
        for _ in range(steps):
            idx = torch.randint(0, n_samples, (batch,), generator=g)
            loss = (model(X[idx])[:, 0] - y[idx]).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    model.eval()
    return model, target

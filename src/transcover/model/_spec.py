"""The canonical decomposition of a Transformer (seed section 1.2).

Every adapter turns a real architecture into these typed pieces, and every later stage (norms,
Lipschitz constants, covering bounds, constraints) reads only these pieces.

Conventions (row vectors, as in the seed and THEORY.md section 2):

* a sequence is ``X`` of shape ``(T, d)``; a linear map is ``x @ W`` with ``W`` of shape
  ``(d_in, d_out)`` (the transpose of ``torch.nn.Linear.weight``);
* head ``h`` computes ``softmax(scale * (X W_Q^h + b_Q^h)(X W_K^h + b_K^h)^T) (X W_V^h + b_V^h)``
  and the heads' outputs, concatenated, go through ``W_O`` (shape ``(H * d_head, d)``), whose
  row block ``h`` is ``W_O^h`` (shape ``(d_head, d)``);
* the matrix inside the softmax is ``W_KQ^h = scale * W_Q^h (W_K^h)^T`` (``(d, d)``, rank
  ``<= d_head``; ``scale = 1/sqrt(d_head)`` unless the model says otherwise), so
  ``B_KQ = max_h ||W_KQ^h||_2``;
* the head's value-to-output map is ``W_OV^h = W_V^h W_O^h`` (``(d, d)``, rank ``<= d_head``),
  so ``B_V = max_h ||W_OV^h||_2``;
* the FFN is ``W_2^T act(W_1^T x + b_1) + b_2`` written as ``act(x W_1 + b_1) W_2 + b_2``; a
  gated FFN (Llama) is ``(act(x W_gate + b_gate) * (x W_1 + b_1)) W_2 + b_2``.

Note [attention biases]: with biases, the score of query ``i`` and key ``j`` is
``(x_i W_Q + b_Q)(x_j W_K + b_K)^T = x_i W_Q W_K^T x_j^T + b_Q W_K^T x_j^T + (terms constant in j)``.
Softmax is invariant to adding a constant to every score of a row, so ``b_K`` has *no* effect
and ``b_Q`` acts exactly as a key-dependent term: the scores equal ``x~_i A~ x_j^T`` with the
homogeneous input ``x~ = [x, 1]`` and ``A~ = scale * [W_Q; b_Q] W_K^T`` of shape ``(d + 1, d)``.
Likewise, since every softmax row sums to one, the value bias folds into a constant output bias:
``sum_j p_ij (x_j W_V + b_V) W_O + b_O = (sum_j p_ij x_j) W_OV + (b_V W_O + b_O)``.  The spec
keeps the raw biases; :func:`AttentionSpec.effective_output_bias` and
:func:`AttentionSpec.W_Q_augmented` give the exact folded forms, and the recomputation in
``transcover.model._functional`` uses them, so the adapter tests prove the folding.

Arrays (annotated ``Tensor``) are numpy arrays for a model read from files and torch tensors for a
live module (Note [no torch on the file path] in ``_arrays``); everything the analysis reads here
(shapes, indexing, :meth:`AttentionSpec.W_Q_augmented`, :meth:`AttentionSpec.effective_output_bias`,
:attr:`NormSpec.gamma_max_abs`) works on both without importing torch, while the forward-pass
methods (``Activation.__call__``, ``NormSpec.__call__``, ``RopeSpec.inv_freq``) import torch and
convert numpy weights to the input's dtype.  :meth:`TransformerSpec.to_torch` converts a whole spec.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

import numpy as np

from ._arrays import concat, is_tensor, max_abs, norm2_f64, to_tensor

if TYPE_CHECKING:  # Note [no torch on the file path] in ``_arrays``: torch is imported lazily
    from torch import Tensor

__all__ = [
    "Activation",
    "NormKind",
    "Placement",
    "Residual",
    "NormSpec",
    "RopeSpec",
    "RelativeBiasSpec",
    "AttentionSpec",
    "FFNSpec",
    "MoESpec",
    "LayerSpec",
    "MLPHeadSpec",
    "TransformerSpec",
    "LayerSequence",
]


#: The slope of CLIP's QuickGELU, ``x * sigmoid(1.702 x)`` (transformers ``QuickGELUActivation``).
QUICK_GELU_SLOPE = 1.702


class Activation(str, Enum):
    """Pointwise activation of the FFN (its Lipschitz constant lives in ``transcover.lipschitz``)."""

    RELU = "relu"
    GELU = "gelu"  # exact, erf-based
    GELU_TANH = "gelu_tanh"  # GPT-2's "gelu_new" tanh approximation
    SILU = "silu"  # x * sigmoid(x), Llama's gate activation
    QUICK_GELU = "quick_gelu"  # x * sigmoid(1.702 x) = silu(1.702 x) / 1.702, CLIP's activation
    IDENTITY = "identity"

    def __call__(self, x: Tensor) -> Tensor:
        import torch  # forward passes only

        if self is Activation.RELU:
            return torch.relu(x)
        if self is Activation.GELU:
            return torch.nn.functional.gelu(x)
        if self is Activation.GELU_TANH:
            return torch.nn.functional.gelu(x, approximate="tanh")
        if self is Activation.SILU:
            return torch.nn.functional.silu(x)
        if self is Activation.QUICK_GELU:
            return x * torch.sigmoid(QUICK_GELU_SLOPE * x)
        return x


class NormKind(str, Enum):
    """The normalisation map; ``BALL`` is the seed's Pi_norm (THEORY section 2)."""

    LAYERNORM = "layernorm"  # gamma * (x - mean) / sqrt(var + eps) + beta
    RMSNORM = "rmsnorm"  # gamma * x / sqrt(mean(x^2) + eps)
    BALL = "ball"  # Pi_norm(x) = x / max(1, ||x||_2), row-wise; 1-Lipschitz
    NONE = "none"


class Placement(str, Enum):
    """Where a sub-layer's normalisation sits relative to its residual branch."""

    PRE = "pre"  # x + f(norm(x))          (GPT-2, Llama, ViT)
    POST = "post"  # norm(x + f(x))        (BERT, the seed's Pi_norm o (id + g))


class Residual(str, Enum):
    """How a block's two branches meet the residual stream (THEORY F21 for PARALLEL)."""

    SEQUENTIAL = "sequential"  # x -> y = x + attn(.) -> y + ffn(.)   (the seed's composition)
    PARALLEL = "parallel"  # x -> x + attn(N_1 x) + ffn(N_2 x)          (GPT-NeoX/Pythia, GPT-J, Falcon)


@dataclass(frozen=True)
class NormSpec:
    """A normalisation; ``weight`` is the *gain* that multiplies the normalised vector.

    Gemma's RMSNorm multiplies by ``1 + gamma`` (its checkpoints store gamma around 0): its adapter
    stores the gain ``1 + gamma`` here (formed in float64), so every bound reads ``max|1 + gamma|``
    and two models' gains differ by exactly their gammas' difference (THEORY F26).
    """

    kind: NormKind
    weight: Tensor | None = None  # gamma, shape (d,)
    bias: Tensor | None = None  # beta, shape (d,)
    eps: float = 0.0  # the variance floor (LayerNorm / RMSNorm)

    def __post_init__(self) -> None:
        import numbers

        from .._errors import InputError

        # a NaN eps passed every ``eps < 0`` test and printed a certified NaN (red team of stop 36); a numpy
        # float is taken at its value (it was refused with a message that printed it as a valid number)
        if isinstance(self.eps, bool) or not isinstance(self.eps, numbers.Real) or not 0 <= self.eps < math.inf:
            raise InputError(f"a normalisation's eps must be a finite number >= 0, but got eps={self.eps!r} "
                             f"({type(self.eps).__name__})")
        object.__setattr__(self, "eps", float(self.eps))

    def __call__(self, x: Tensor) -> Tensor:
        import torch  # forward passes only

        if self.kind is NormKind.NONE:
            return x
        # Note [scaled norms]: each token is divided by a power of two s >= 1 at least its largest entry, so its
        # sum, mean and squares stay finite; with eps / s^2 (formed as (eps / s) / s) every expression below is the
        # unscaled one times an exact power of two, the same floats wherever nothing overflowed. Unscaled, a token
        # near 1e200 had an infinite norm or variance and came out 0 (red team 162: a Monte Carlo cover read log N = 0)
        # half-precision tokens are normalised in float32 and rounded once at the end: in float16 eps / s^2 and the
        # centred entries fell below the normal range from a token of 32 on (red team 166)
        out_dtype = x.dtype
        if x.is_floating_point() and x.element_size() < 4:
            x = x.float()
        big = x.detach().abs().amax(dim=-1, keepdim=True)
        _, e = torch.frexp(torch.where(torch.isfinite(big), big, torch.ones_like(big)))
        s = torch.ldexp(torch.ones_like(big), torch.clamp(e - 1, min=0))  # 2^(e-1) <= max|x| < 2^e; at least 1
        xs = x / s
        if self.kind is NormKind.BALL:
            return (xs / torch.maximum(xs.norm(dim=-1, keepdim=True), 1.0 / s)).to(out_dtype)
        eps_s = (self.eps / s) / s
        if self.eps > 0:  # eps / s^2 below the subnormals: a constant token's 0 / 0 (red team 166); the floor is
            # absorbed by every nonzero variance, so the other tokens keep their floats
            eps_s = torch.clamp(eps_s, min=torch.finfo(x.dtype).tiny * torch.finfo(x.dtype).eps)
        if self.kind is NormKind.LAYERNORM:
            c = xs - xs.mean(dim=-1, keepdim=True)
            y = c / torch.sqrt((c**2).mean(dim=-1, keepdim=True) + eps_s)
        else:  # RMSNORM
            y = xs / torch.sqrt((xs**2).mean(dim=-1, keepdim=True) + eps_s)
        y = y.to(out_dtype)
        if self.weight is not None:
            y = y * to_tensor(self.weight, y)
        if self.bias is not None:
            y = y + to_tensor(self.bias, y)
        return y

    @property
    def gamma_max_abs(self) -> float:
        """max_i |gamma_i| (1 when there is no learnable scale)."""
        return 1.0 if self.weight is None else max_abs(self.weight)

    @property
    def beta_norm(self) -> float:
        """||beta||_2 (0 when there is no learnable shift)."""
        return 0.0 if self.bias is None else norm2_f64(self.bias)


@dataclass(frozen=True)
class RopeSpec:
    """Rotary position embedding applied to queries and keys (Llama).

    With RoPE the matrix inside the softmax depends on the relative position ``i - j``:
    ``W_Q^h R_{i-j} (W_K^h)^T`` with ``R`` block-diagonal rotations, so B_KQ is a supremum over
    relative positions (``transcover.norms`` reports it as such).
    """

    theta: float = 10000.0
    rotary_dim: int | None = None  # None: the whole head dimension
    max_position: int = 2048
    # Scaled RoPE (linear, Llama 3 "llama3", YaRN; THEORY F22): the frequencies, one per rotated pair,
    # computed once from the configuration (``_rope_scaling``).  None: theta^(-2k/rotary_dim).
    inv_freq_values: tuple[float, ...] | None = None
    # Dynamic NTK scaling (THEORY F22 "dynamic scaling"): (factor, original length L0).  A sequence of
    # length T > L0 uses theta * (factor T / L0 - factor + 1)^(r / (r - 2)) as its base, so the
    # frequencies are a function of T (``inv_freq(d_head, T)``); None: fixed frequencies.
    dynamic: tuple[float, int] | None = None

    def dynamic_theta(self, d_head: int, T: int) -> float:
        """The base a sequence of length T rotates with (``theta`` itself unless dynamic and T > L0)."""
        if self.dynamic is None or T <= self.dynamic[1]:
            return float(self.theta)
        factor, L0 = self.dynamic
        rd = self.rotary_dim or d_head
        return float(self.theta) * (factor * T / L0 - (factor - 1)) ** (rd / (rd - 2))

    def inv_freq(self, d_head: int, T: int | None = None) -> Tensor:
        """The per-plane frequencies; with dynamic scaling those of a sequence of length T (None:
        the unscaled ones, i.e. any T <= L0)."""
        import torch  # RoPE forward passes only

        rd = self.rotary_dim or d_head
        if self.dynamic is not None and T is not None:
            return 1.0 / (self.dynamic_theta(d_head, T) ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd))
        if self.inv_freq_values is not None:
            if 2 * len(self.inv_freq_values) != rd:
                raise ValueError(f"RoPE has {len(self.inv_freq_values)} frequencies for {rd} rotated coordinates")
            return torch.tensor(self.inv_freq_values, dtype=torch.float64)
        return 1.0 / (self.theta ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd))


@dataclass(frozen=True)
class RelativeBiasSpec:
    """T5's relative position bias (THEORY F28): head h's score of query i and key j gains
    ``table[bucket(j - i), h]``, a number that depends on the positions only, not on the input.

    ``bucket`` is T5's logarithmic bucketing (``T5Attention._relative_position_bucket``): with
    ``bidirectional`` half the buckets are for keys after the query; offsets below half the
    remaining buckets get a bucket each, larger ones share logarithmically spaced buckets up to
    ``max_distance``.  T5 computes the table once, in layer 0, and every layer adds the same bias.
    """

    table: Tensor  # (num_buckets, H)
    max_distance: int = 128
    bidirectional: bool = True

    def __post_init__(self) -> None:
        # T5's bucketing divides by the exact-offset count and by log(max_distance / that count): fewer than four
        # buckets (two causal) or max_distance <= that count ended perturb in a ZeroDivisionError (37i)
        exact = (self.num_buckets // 2 if self.bidirectional else self.num_buckets) // 2
        if exact < 1 or isinstance(self.max_distance, bool) or not (
                isinstance(self.max_distance, (int, float)) and exact < self.max_distance < math.inf):
            from .._errors import InputError

            raise InputError(f"relative position bias with {self.num_buckets} buckets and max_distance="
                             f"{self.max_distance!r}: T5's bucketing needs at least {4 if self.bidirectional else 2} "
                             f"buckets and a finite max_distance above its exact offsets ({exact} here)")

    @property
    def num_buckets(self) -> int:
        return self.table.shape[-2]

    def buckets(self, T: int) -> Tensor:
        """The (T, T) bucket index of every (query i, key j), T5's bucketing of ``j - i``."""
        import torch

        rel = torch.arange(T)[None, :] - torch.arange(T)[:, None]  # j - i
        n = self.num_buckets
        out = torch.zeros_like(rel)
        if self.bidirectional:
            n //= 2
            out = out + (rel > 0).long() * n
            rel = rel.abs()
        else:
            rel = -torch.clamp(rel, max=0)
        exact = n // 2
        # float32 logarithm, as T5 computes it, so that the bucket boundaries are T5's own
        far = exact + (torch.log(rel.float() / exact) / math.log(self.max_distance / exact)
                       * (n - exact)).to(torch.long)
        far = torch.clamp(far, max=n - 1)
        return out + torch.where(rel < exact, rel, far)

    def bias(self, T: int, h: int, like: Tensor) -> Tensor:
        """Head h's (T, T) additive score bias, in ``like``'s dtype (a stack: ``(M, 1.., T, T)``)."""
        t = to_tensor(self.table, like)[..., self.buckets(T).to(like.device), h]  # (..., T, T)
        return t if t.ndim == 2 else t.reshape(t.shape[:1] + (1,) * (like.ndim - 3) + t.shape[1:])


def _vecmat(v: Any, W: Any) -> Any:
    """``v @ W`` for a vector and a matrix, or member by member for stacks ``(M, k)`` and ``(M, k, n)``."""
    return v @ W if v.ndim == 1 else (v[..., None, :] @ W)[..., 0, :]


def _float64(x: Any) -> np.ndarray:
    """A float64 numpy copy of a torch tensor or numpy array (for exact comparisons)."""
    if is_tensor(x):
        return x.detach().to("cpu").double().numpy()
    return np.asarray(x, dtype=np.float64)


@dataclass(frozen=True)
class AttentionSpec:
    """Multi-head self-attention, per head (shapes in brackets).

    ``W_Q`` [H, d, d_head], ``W_K`` [H_kv, d, d_head], ``W_V`` [H_kv, d, d_head],
    ``W_O`` [H, d_head, d]; biases ``b_Q`` [H, d_head], ``b_K``/``b_V`` [H_kv, d_head],
    ``b_O`` [d].  Grouped-query attention: query head ``h`` uses key/value head
    ``h // (H // H_kv)``.  Shapes are read from the trailing axes, so the arrays of a member stack
    (one leading axis M, Note [member stacks] in ``_functional``) are read the same way.
    """

    W_Q: Tensor
    W_K: Tensor
    W_V: Tensor
    W_O: Tensor
    b_Q: Tensor | None = None
    b_K: Tensor | None = None
    b_V: Tensor | None = None
    b_O: Tensor | None = None
    scale: float | None = None  # None: 1/sqrt(d_head)
    causal: bool = False
    rope: RopeSpec | None = None
    # Sliding-window attention (Mistral, Qwen2's upper layers): with ``window = w`` query i sees only
    # keys j with i - w < j (and j <= i when causal); None: no window.  Note [window mask] in
    # ``transcover.model._functional``.
    window: int | None = None
    # "dot": softmax(scale q k^T); "l2": Kim et al. 2021 L2 attention with W_K = W_Q tied and value
    # map A_h W_V^h W_O^h, A_h = W_Q^h W_Q^hT / sqrt(d_head) (transcover.lipschitz.l2_attention_forward)
    kind: str = "dot"
    # Query/key normalisation (Qwen3, Gemma 3; THEORY F23): RMSNorm over each head's d_head
    # coordinates of q = x W_Q + b_Q (resp. k), gamma of shape (d_head,) shared by the heads, applied
    # before RoPE.  None: no normalisation (as before).
    q_norm: NormSpec | None = None
    k_norm: NormSpec | None = None
    # Attention-logit soft-capping (Gemma 2; THEORY F24): scores -> c tanh(scores / c), before the mask.
    softcap: float | None = None
    # T5's relative position bias (THEORY F28): an input-independent term added to every score after
    # the scale, before soft-capping and the mask.  None: no such term (as before).
    position_bias: RelativeBiasSpec | None = None
    # Which coordinates q_norm/k_norm normalise together: "head" (each head's d_head, Qwen3, Gemma 3) or
    # "all" (the whole projection, H * d_head for queries and H_kv * d_head for keys, OLMo 2; F23).
    qk_norm_scope: str = "head"

    def __post_init__(self) -> None:
        if self.window is not None and (isinstance(self.window, bool) or not isinstance(self.window, int)
                                        or self.window < 1):
            raise ValueError(f"attention window must be a positive integer, but got {self.window!r}")
        if self.scale is not None and not (isinstance(self.scale, (int, float)) and 0 <= self.scale < float("inf")):
            raise ValueError(f"attention softmax scale must be a finite number >= 0, but got {self.scale!r}")
        if self.kind == "l2":
            self._check_l2()

    def _check_l2(self) -> None:
        """Refuse every field the L2 map does not compute (Note [L2 attention fields]).

        Note [L2 attention fields]: ``l2_attention_forward`` computes exactly
        ``sum_h softmax(-||x_i W_Q^h - x_j W_Q^h||^2 / sqrt(d_head)) X A_h W_V^h W_O^h``: no mask, no
        RoPE, no biases, no other softmax scale, no grouped heads, and W_K tied to W_Q.  A spec that
        asks for any of these would be silently computed (and bounded) as a different function, so
        it is refused here, where every forward and every bound reads it.
        """
        asked = [name for name, on in (
            ("causal masking", self.causal), ("RoPE", self.rope is not None),
            ("a sliding window", self.window is not None),
            ("a softmax scale", self.scale is not None),
            ("biases", any(b is not None for b in (self.b_Q, self.b_K, self.b_V, self.b_O))),
            ("grouped-query heads", self.W_K.shape[0] != self.W_Q.shape[0]),
            ("query/key normalisation", self.q_norm is not None or self.k_norm is not None),
            ("soft-capping", self.softcap is not None),
            ("a relative position bias", self.position_bias is not None),
        ) if on]
        if not asked and self.W_K is not self.W_Q:
            tied = tuple(self.W_K.shape) == tuple(self.W_Q.shape) and bool(
                np.array_equal(_float64(self.W_K), _float64(self.W_Q)))
            if not tied:
                asked.append("a key matrix W_K different from W_Q (L2 attention ties them)")
        if asked:
            raise ValueError("L2 attention (Kim et al. 2021) computes none of: " + ", ".join(asked)
                             + "; refused rather than computed as another function")

    @property
    def n_heads(self) -> int:
        return self.W_Q.shape[-3]

    @property
    def n_kv_heads(self) -> int:
        return self.W_K.shape[-3]

    @property
    def d_model(self) -> int:
        return self.W_Q.shape[-2]

    @property
    def d_head(self) -> int:
        return self.W_Q.shape[-1]

    @property
    def softmax_scale(self) -> float:
        return 1.0 / math.sqrt(self.d_head) if self.scale is None else self.scale

    def kv_index(self, h: int) -> int:
        """The key/value head that query head ``h`` reads (grouped-query attention)."""
        return h // (self.n_heads // self.n_kv_heads)

    def head(self, h: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(W_Q^h, W_K^h, W_V^h, W_O^h) for query head h, kv sharing resolved."""
        g = self.kv_index(h)
        return self.W_Q[..., h, :, :], self.W_K[..., g, :, :], self.W_V[..., g, :, :], self.W_O[..., h, :, :]

    def W_Q_augmented(self, h: int) -> Tensor:
        """[W_Q^h; b_Q^h] of shape (d + 1, d_head): the exact query map on x~ = [x, 1].

        See Note [attention biases]: ``b_K`` cancels in the softmax and is not needed.
        """
        Wq = self.W_Q[..., h, :, :]
        if self.b_Q is None:
            return concat([Wq, Wq[..., :1, :] * 0], axis=-2)
        bq = self.b_Q[..., h, None, :]
        bq = to_tensor(bq, Wq) if is_tensor(Wq) else np.asarray(bq, dtype=Wq.dtype)
        return concat([Wq, bq], axis=-2)

    def effective_output_bias(self) -> Any:
        """b_O + sum_h b_V^h W_O^h in float64: the constant the attention block adds (Note [attention biases]).

        A torch tensor when ``W_O`` is one, else a numpy array; ``None`` without biases.  Shape
        ``(d,)``, or ``(M, d)`` for a member stack.
        """
        if self.b_V is None and self.b_O is None:
            return None
        lead = tuple(self.W_O.shape[:-3])
        if not is_tensor(self.W_O):
            out_np = np.zeros(lead + (self.d_model,), dtype=np.float64)
            if self.b_V is not None:
                for h in range(self.n_heads):
                    out_np += _vecmat(np.asarray(self.b_V[..., self.kv_index(h), :], np.float64),
                                      np.asarray(self.W_O[..., h, :, :], np.float64))
            if self.b_O is not None:
                out_np += np.asarray(self.b_O, np.float64)
            return out_np
        import torch

        out = torch.zeros(lead + (self.d_model,), dtype=torch.float64)
        if self.b_V is not None:
            for h in range(self.n_heads):
                out += _vecmat(to_tensor(self.b_V[..., self.kv_index(h), :], dtype=torch.float64),
                               self.W_O[..., h, :, :].double())
        if self.b_O is not None:
            out += to_tensor(self.b_O, dtype=torch.float64)
        return out

    def validate(self) -> None:
        H, d, dh = self.W_Q.shape
        Hkv = self.W_K.shape[0]
        checks = {
            "W_K": (self.W_K, (Hkv, d, dh)),
            "W_V": (self.W_V, (Hkv, d, dh)),
            "W_O": (self.W_O, (H, dh, d)),
            "b_Q": (self.b_Q, (H, dh)),
            "b_K": (self.b_K, (Hkv, dh)),
            "b_V": (self.b_V, (Hkv, dh)),
            "b_O": (self.b_O, (d,)),
        }
        for name, (t, shape) in checks.items():
            if t is not None and tuple(t.shape) != shape:
                raise ValueError(f"attention {name} has shape {tuple(t.shape)}, expected {shape}")
        if self.qk_norm_scope not in ("head", "all"):
            raise ValueError(f"attention qk_norm_scope must be 'head' or 'all', got {self.qk_norm_scope!r}")
        joint = self.qk_norm_scope == "all"
        for name, n, heads in (("q_norm", self.q_norm, H), ("k_norm", self.k_norm, Hkv)):
            want = (heads * dh,) if joint else (dh,)
            if n is not None and n.weight is not None and tuple(n.weight.shape) != want:
                raise ValueError(f"attention {name} weight has shape {tuple(n.weight.shape)}, expected {want} "
                                 + ("(one RMSNorm over the whole projection)" if joint
                                    else "(one RMSNorm per head over d_head)"))
        if H % Hkv:
            raise ValueError(f"n_heads={H} is not a multiple of n_kv_heads={Hkv}")
        if self.position_bias is not None and tuple(self.position_bias.table.shape)[-1:] != (H,):
            raise ValueError(f"relative position bias table has shape {tuple(self.position_bias.table.shape)}, "
                             f"expected (num_buckets, {H})")
        if self.softcap is not None and not (math.isfinite(self.softcap) and self.softcap > 0):
            raise ValueError(f"attention softcap must be a finite number > 0, got {self.softcap!r}")


@dataclass(frozen=True)
class FFNSpec:
    """Feed-forward block ``act(x W_1 + b_1) W_2 + b_2`` (gated: ``(act(x W_gate + b_gate) * (x W_1 + b_1)) W_2 + b_2``).

    ``W_1`` [d, d_ff], ``b_1`` [d_ff], ``W_2`` [d_ff, d], ``b_2`` [d], ``W_gate`` [d, d_ff].
    """

    W_1: Tensor
    W_2: Tensor
    activation: Activation
    b_1: Tensor | None = None
    b_2: Tensor | None = None
    W_gate: Tensor | None = None
    b_gate: Tensor | None = None

    @property
    def d_ff(self) -> int:
        return self.W_1.shape[1]

    @property
    def gated(self) -> bool:
        return self.W_gate is not None

    def validate(self) -> None:
        d, dff = self.W_1.shape
        checks = {
            "W_2": (self.W_2, (dff, d)),
            "b_1": (self.b_1, (dff,)),
            "b_2": (self.b_2, (d,)),
            "W_gate": (self.W_gate, (d, dff)),
            "b_gate": (self.b_gate, (dff,)),
        }
        for name, (t, shape) in checks.items():
            if t is not None and tuple(t.shape) != shape:
                raise ValueError(f"FFN {name} has shape {tuple(t.shape)}, expected {shape}")


@dataclass(frozen=True)
class MoESpec:
    """A mixture-of-experts FFN with top-k routing (Mixtral, Qwen2-MoE, Qwen3-MoE; THEORY F25, F29).

    ``p = softmax(x W_router)`` over the ``E`` experts; the ``top_k`` largest ``p_e`` are kept (and
    divided by their sum when ``normalize_topk``: Mixtral always, Qwen-MoE by ``norm_topk_prob``),
    and the block outputs ``sum_{e in top_k} p_e FFN_e(x)`` with ``FFN_e`` the gated FFN
    ``(act(x W_gate[e]) * (x W_1[e])) W_2[e]``, plus ``sigmoid(x . shared_gate) * shared(x)`` when a
    shared expert exists (Qwen2-MoE; without ``shared_gate`` it is added ungated).

    ``W_router`` [d, E], ``W_1``/``W_gate`` [E, d, d_ff], ``W_2`` [E, d_ff, d], ``shared_gate`` [d].
    The selection is discontinuous in x, so no Lipschitz/G.3/covering bound exists (F25); norms do.
    """

    W_router: Tensor
    W_1: Tensor
    W_2: Tensor
    activation: Activation
    top_k: int
    W_gate: Tensor | None = None
    normalize_topk: bool = True
    shared: FFNSpec | None = None
    shared_gate: Tensor | None = None

    @property
    def n_experts(self) -> int:
        return self.W_router.shape[-1]

    @property
    def d_ff(self) -> int:
        return self.W_1.shape[-1]

    @property
    def gated(self) -> bool:
        return self.W_gate is not None

    def expert(self, e: int) -> FFNSpec:
        """Expert e as a plain FFN."""
        return FFNSpec(self.W_1[e], self.W_2[e], self.activation,
                       W_gate=None if self.W_gate is None else self.W_gate[e])

    def validate(self) -> None:
        d, E = self.W_router.shape
        dff = self.W_1.shape[-1]
        checks = {"W_1": (self.W_1, (E, d, dff)), "W_2": (self.W_2, (E, dff, d)),
                  "W_gate": (self.W_gate, (E, d, dff)), "shared_gate": (self.shared_gate, (d,))}
        for name, (t, shape) in checks.items():
            if t is not None and tuple(t.shape) != shape:
                raise ValueError(f"MoE {name} has shape {tuple(t.shape)}, expected {shape}")
        if not 1 <= self.top_k <= E:
            raise ValueError(f"MoE top_k={self.top_k} must be between 1 and the {E} experts")
        if self.shared is not None:
            self.shared.validate()


@dataclass(frozen=True)
class LayerSpec:
    """One Transformer block: attention and FFN sub-layers, each with its normalisation.

    ``placement`` PRE: ``x = x + attn(norm_attn(x)); x = x + ffn(norm_ffn(x))``;
    POST: ``x = norm_attn(x + attn(x)); x = norm_ffn(x + ffn(x))`` -- with ``NormKind.BALL`` this
    is the seed's ``g_{l+1} = Pi_norm o g_ff o Pi_norm o g_msa o g_l`` (residuals inside g).
    ``residual`` PARALLEL (pre-norm only): ``x = x + attn(norm_attn(x)) + ffn(norm_ffn(x))``, both
    branches reading the block's input (GPT-NeoX/Pythia, GPT-J, Falcon; THEORY F21).
    ``post_norm_attn`` / ``post_norm_ffn`` (pre-norm, sequential only; THEORY F26): a normalisation of
    the branch's output inside the residual, ``x + post(attn(norm_attn(x)))`` -- Gemma 2/3's sandwich
    norms; OLMo 2 has ``norm_attn``/``norm_ffn`` of kind NONE and only these.  None: as before.
    """

    index: int
    attention: AttentionSpec
    ffn: FFNSpec | MoESpec  # MoESpec: mixture of experts (norms only, THEORY F25)
    norm_attn: NormSpec
    norm_ffn: NormSpec
    placement: Placement
    names: dict[str, str] = field(default_factory=dict)  # role -> tensor name in the checkpoint
    residual: Residual = Residual.SEQUENTIAL
    post_norm_attn: NormSpec | None = None
    post_norm_ffn: NormSpec | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "residual", Residual(self.residual))  # "parallel" -> Residual.PARALLEL
        if self.residual is Residual.PARALLEL and self.placement is not Placement.PRE:
            raise ValueError(f"layer {self.index}: a parallel residual needs pre-norm placement "
                             f"(x + attn(N_1 x) + ffn(N_2 x)), not {self.placement.value}")
        if (self.post_norm_attn is not None or self.post_norm_ffn is not None) and (
                self.placement is not Placement.PRE or self.residual is not Residual.SEQUENTIAL):
            raise ValueError(f"layer {self.index}: branch-output norms (x + N_post(f(N_pre x)), THEORY F26) need "
                             "pre-norm placement and a sequential residual")


@dataclass(frozen=True)
class MLPHeadSpec:
    """The MLP head of the Transformer+MLP class (seed section 3): x -> W_L act(... act(W_1 x + b_1) ...) + b_L.

    ``weights[i]`` has shape (d_in_i, d_out_i) (row-vector convention); ``readout`` says how the
    sequence becomes a vector: "mean" over tokens or "first" token.
    """

    weights: tuple[Tensor, ...]
    biases: tuple[Tensor | None, ...]
    activation: Activation
    readout: str = "mean"


class LayerSequence(Sequence[LayerSpec]):
    """A lazily materialised sequence of layers: ``seq[i]`` builds layer ``i`` on demand.

    Large checkpoints are read one layer at a time (each tensor into its own array, released with
    its layer), so a model never needs to sit in memory whole.
    """

    def __init__(self, n: int, build: Callable[[int], LayerSpec]):
        self._n = n
        self._build = build

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._n))]
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(f"layer index {i} out of range for {self._n} layers")
        return self._build(i)

    def __iter__(self) -> Iterator[LayerSpec]:
        for i in range(self._n):
            yield self._build(i)


@dataclass(frozen=True)
class TransformerSpec:
    """A whole model in the seed's decomposition.

    ``embeddings`` holds the matrices outside the decomposition (token / position / patch
    embeddings, un-embedding, pooler), reported in their own section.
    """

    arch: str  # adapter name, e.g. "bert", "gpt2", "llama", "vit", "torch_encoder", "reference"
    name: str  # what the user pointed at (path or model name)
    d_model: int
    layers: Sequence[LayerSpec]
    input_norm: NormSpec | None = None  # applied to the embedded input before layer 0 (BERT's embedding LN, the seed's Pi_norm)
    final_norm: NormSpec | None = None  # applied after the last layer (GPT-2's ln_f, Llama's norm)
    head: MLPHeadSpec | None = None
    embeddings: Mapping[str, Tensor] = field(default_factory=dict)  # may be read lazily
    config: dict[str, object] = field(default_factory=dict)
    # one line each: what the loader noticed but did not refuse (e.g. unexpected tensors in a layer)
    warnings: tuple[str, ...] = ()

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def to_torch(self, dtype: Any = None) -> TransformerSpec:
        """The same spec with every array a torch tensor (imports torch); see ``_convert.as_torch``."""
        from ._convert import as_torch

        return as_torch(self, dtype)

"""RoPE frequencies from an HF configuration: default, partial, and the scaled types (THEORY F22).

The rotation of position t turns coordinate pair k of the rotated width r by ``t * inv_freq[k]``.
"default" is ``inv_freq[k] = theta^(-2k/r)``; the scaled types change these numbers once, from the
configuration, independently of the input (transformers ``modeling_rope_utils``):

* "linear" (position interpolation): ``inv_freq / factor``;
* "llama3" (Llama 3.1-3.3): wavelengths ``2 pi / inv_freq`` above ``L / low_freq_factor`` are divided
  by ``factor``, below ``L / high_freq_factor`` kept, and in between blended with
  ``s = (L / wavelen - low) / (high - low)``: ``(1 - s) inv_freq / factor + s inv_freq``
  (``L = original_max_position_embeddings``);
* "yarn": per pair a ramp between interpolation (``inv_freq / factor``) and extrapolation
  (``inv_freq``) over the correction range of ``beta_fast``/``beta_slow``, and an *attention factor*
  m that multiplies cos and sin, i.e. the rotated coordinates of q and k.  With the whole head
  rotated every score is multiplied by m^2, which the spec carries in the softmax scale; with a
  partial rotation m would scale only some coordinates, and is refused.

"dynamic" (NTK, ``_compute_dynamic_ntk_parameters``) chooses its frequencies from the *current
sequence length* T once it exceeds ``L0 = max_position_embeddings``: base
``theta (factor T / L0 - factor + 1)^(r / (r - 2))``.  The spec carries ``(factor, L0)``
(``RopeSpec.dynamic``) and the forward recomputes the frequencies for each T; the bounds hold for
every ``T <= factor L0``, the spec's ``max_position`` (THEORY F22, "dynamic scaling").  HF caches
the frequencies of the longest sequence seen until one shorter than L0 arrives; the spec is the
function of a fresh model (each sequence with its own length).  "longrope" switches between two
factor lists by length: refused.  Every value is computed in float64 here (HF computes them in float32); a
spec is then an exact statement of the float64 formula, and the round-trip tests compare with
float32's tolerance where HF's float32 frequencies enter.

numpy only: adapters run on the file path without torch (Note [no torch on the file path]).
"""

from __future__ import annotations

import math

import numpy as np

from .._errors import InputError, UnsupportedArchitectureError
from ._spec import RopeSpec

__all__ = ["rope_from_config"]

_POSITION_DEPENDENT = {
    "longrope": "LongRoPE switches between short and long factors by sequence length",
}


_ORIGINAL_LENGTH = ("llama3", "yarn", "longrope")


def _parameters(config: dict) -> dict:
    """The RoPE parameters as transformers 5.25's ``convert_rope_params_to_dict`` and ``standardize_rope_params``
    form them from config.json (red team 195):

    * a non-empty ``rope_scaling`` *replaces* ``rope_parameters`` (``rope_scaling or rope_parameters``);
      ``rope_theta`` / ``partial_rotary_factor`` missing from the result come from the top level
      (:func:`_number`), as the shared ``RotaryEmbeddingConfigMixin.convert_rope_params_to_dict`` fills them in;
      a family whose config class fills them from elsewhere passes those values as the top-level ones
      (GPT-NeoX: ``rotary_emb_base`` / ``rotary_pct``, else 10000 / 0.25; its top-level keys are ignored);
    * ``rope_type`` defaults to the 4.x ``type``, else "default";
    * for llama3 and yarn a top-level ``original_max_position_embeddings`` *overrides* the dict's (HF's
      exception for Phi-3-style configs), and the dict's value defaults to ``max_position_embeddings``.

    A nested per-layer-type dict (Gemma 3) is formed by its adapter and passed here without the top-level keys.
    """
    params = dict(config.get("rope_scaling") or config.get("rope_parameters") or {})
    params.setdefault("rope_type", params.get("type", "default"))
    if params["rope_type"] in _ORIGINAL_LENGTH:
        if "original_max_position_embeddings" in config:
            params["original_max_position_embeddings"] = config["original_max_position_embeddings"]
        elif config.get("max_position_embeddings") is not None:
            params.setdefault("original_max_position_embeddings", config["max_position_embeddings"])
    return params


def _original_length(p: dict, arch: str) -> float:
    """``original_max_position_embeddings``: a number > 0 (UnsupportedArchitectureError where absent)."""
    if "original_max_position_embeddings" not in p:
        raise UnsupportedArchitectureError(
            f"{arch}: rope_type {p['rope_type']!r} lacks 'original_max_position_embeddings'")
    old = _number(p, {}, "original_max_position_embeddings", 0.0, arch)
    if old <= 0:
        raise InputError(f"{arch} configuration: original_max_position_embeddings must be > 0, but got {old!r}")
    return old


def _llama3(inv: np.ndarray, p: dict, arch: str) -> np.ndarray:
    try:
        factor, low, high = float(p["factor"]), float(p["low_freq_factor"]), float(p["high_freq_factor"])
    except KeyError as e:
        raise UnsupportedArchitectureError(f"{arch}: rope_type 'llama3' lacks {e.args[0]!r}") from None
    old = _original_length(p, arch)
    wavelen = 2 * math.pi / inv
    out = np.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return np.where(medium, (1 - smooth) * out / factor + smooth * out, out)


def _yarn(theta: float, r: int, p: dict, config: dict, arch: str) -> tuple[np.ndarray, float]:
    old = _original_length(p, arch)
    factor = p.get("factor")
    factor = float(config["max_position_embeddings"]) / old if factor is None else float(factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = p.get("attention_factor")
    if attention is None:
        ms, ms_all = p.get("mscale"), p.get("mscale_all_dim")
        attention = mscale(factor, ms) / mscale(factor, ms_all) if (ms and ms_all) else mscale(factor)
    fast, slow = float(p.get("beta_fast") or 32), float(p.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return r * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = correction_dim(fast), correction_dim(slow)
    if p.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, r - 1)
    if lo == hi:
        hi += 0.001  # HF's guard against a zero-width ramp
    ramp = np.clip((np.arange(r // 2, dtype=np.float64) - lo) / (hi - lo), 0.0, 1.0)
    pos = theta ** (np.arange(0, r, 2, dtype=np.float64) / r)
    extrapolation = 1.0 - ramp
    inv = (1.0 / (factor * pos)) * (1 - extrapolation) + (1.0 / pos) * extrapolation
    return inv, float(attention)


def _dynamic(p: dict, L0: int, r: int, arch: str) -> tuple[float, int]:
    """``(factor, L0)`` of dynamic NTK scaling; HF's original length is ``max_position_embeddings``."""
    if p.get("factor") is None:
        raise UnsupportedArchitectureError(f"{arch}: rope_type 'dynamic' lacks 'factor'")
    factor = float(p["factor"])
    if not factor >= 1.0 or r < 4:
        raise UnsupportedArchitectureError(
            f"{arch}: rope_type 'dynamic' needs factor >= 1 and >= 4 rotated coordinates "
            f"(got factor {factor!r}, {r} coordinates; the base's exponent is r / (r - 2))")
    return factor, L0


def _number(p: dict, config: dict, key: str, default: float, arch: str) -> float:
    """``key`` from the RoPE parameters, else the configuration's top level, else ``default``; InputError
    unless a finite number (a null or textual value ended in ``internal error: TypeError``)."""
    v = p[key] if key in p else config.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise InputError(f"{arch} configuration: {key} must be a finite number, but got {key}={v!r}")
    return float(v)


# Note [partial rotation]: transformers 5's Llama-style rotary embeddings (Llama, Mistral, Qwen2/3, the MoE
# decoders, OLMo 1/2, Falcon, Gemma) ignore partial_rotary_factor in their default RoPE (compute_default_
# rope_parameters rotates the whole head_dim) and fail on it in the scaled types (ROPE_INIT_FUNCTIONS
# compute frequencies for the partial width, apply_rotary_pos_emb then multiplies the whole head by them:
# a shape error); transformers 4's shared _compute_default_rope_parameters computed frequencies for the
# partial width.  Such a checkpoint
# is a different function under each version, so only the families whose attention rotates the leading
# coordinates (GPT-NeoX, Phi: partial=True) read the factor; the others refuse it (red team 168).
def rope_from_config(config: dict, arch: str, d_head: int, *, default_factor: float = 1.0,
                     default_theta: float = 10000.0, partial: bool = False) -> tuple[RopeSpec, float]:
    """``(RopeSpec, score factor)`` for an HF configuration: the rotation, and the number every
    score is multiplied by (YaRN's m^2, else 1), which the adapter puts into the softmax scale.

    ``partial``: the family's attention rotates only ``int(d_head * partial_rotary_factor)`` coordinates
    (``default_factor`` where the configuration gives none); otherwise a factor other than 1 is refused
    (Note [partial rotation]).

    Raises:
        UnsupportedArchitectureError: a position-dependent or unknown rope type, an odd or empty
            rotated width, or YaRN's attention factor with a partial rotation.
        InputError: a partial_rotary_factor other than 1 where the family does not rotate part of a head,
            or a null or non-numeric factor or theta.
    """
    p = _parameters(config)
    rope_type = str(p.get("rope_type") or "default")
    factor_r = _number(p, config, "partial_rotary_factor", default_factor, arch)
    if not partial and factor_r != 1.0:
        family = str(config.get("model_type") or arch)
        raise InputError(
            f"{arch}: partial_rotary_factor is refused for {family}: transformers 5 rotates the whole head (its "
            "default RoPE ignores the factor, its scaled types fail on it) while transformers 4 computed frequencies "
            "for part of it, so the checkpoint's function depends on the transformers version; "
            f"but got partial_rotary_factor={factor_r!r}")
    theta = _number(p, config, "rope_theta", default_theta, arch)
    r = int(d_head * factor_r)
    if r < 2 or r % 2:
        raise UnsupportedArchitectureError(
            f"{arch}: partial rotary factor {factor_r!r} gives {r} rotated coordinates of a {d_head}-wide head; "
            "the rotation needs an even number >= 2")
    if rope_type in _POSITION_DEPENDENT:
        raise UnsupportedArchitectureError(
            f"{arch}: rope_type={rope_type!r} is refused: {_POSITION_DEPENDENT[rope_type]}, so the function "
            "of a sequence depends on its length beyond fixed frequencies (supported: default, linear, llama3, yarn, dynamic)")
    base = theta ** (-np.arange(0, r, 2, dtype=np.float64) / r)
    score = 1.0
    if "max_position_embeddings" in config and config["max_position_embeddings"] is None:
        # the model then accepts any length, and the bounds' range of offsets (RopeSpec.max_position) has no end
        raise InputError(f"{arch} configuration: max_position_embeddings must be a positive integer (the longest "
                         "sequence the bounds cover), but got max_position_embeddings=None")
    max_position = int(config.get("max_position_embeddings") or 2048)
    dynamic = None
    if rope_type == "default":
        inv = None
    elif rope_type == "dynamic":
        dynamic, inv = _dynamic(p, max_position, r, arch), None
        max_position = int(math.floor(dynamic[0] * dynamic[1]))  # the bounds' range: T <= factor L0
    elif rope_type == "linear":
        inv = base / float(p["factor"])
    elif rope_type == "llama3":
        inv = _llama3(base, p, arch)
    elif rope_type == "yarn":
        inv, m = _yarn(theta, r, p, config, arch)
        if m != 1.0 and r != d_head:
            raise UnsupportedArchitectureError(
                f"{arch}: YaRN's attention factor {m:g} with a partial rotation scales only some coordinates "
                "of q and k; not representable in the spec")
        score = m * m
    else:
        raise UnsupportedArchitectureError(
            f"{arch}: rope_type={rope_type!r} has no exact counterpart; supported: default, linear, llama3, yarn, dynamic")
    rope = RopeSpec(theta=theta, rotary_dim=None if r == d_head else r,
                    max_position=max_position, dynamic=dynamic,
                    inv_freq_values=None if inv is None else tuple(float(v) for v in inv))
    return rope, score

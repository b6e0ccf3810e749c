"""Synthetic checkpoints of any size, written tensor by tensor and never held in memory.

For benchmarks and tests of the scale features (issue 14): a safetensors writer that emits the
header first (every tensor's offsets follow from its shape and dtype) and then each tensor's bytes
in chunks produced on demand, so a multi-gigabyte checkpoint costs one chunk of memory; and two
layouts on top of it, a sharded Llama-shaped model and a small GPT-2, with seeded random weights.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .._io import atomic_write_text

__all__ = ["TensorPlan", "write_safetensors", "write_llama_checkpoint", "write_gpt2_checkpoint"]

_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
_CHUNK_ELEMS = 1 << 22  # values generated per step (16 MiB of float32 before narrowing)


@dataclass(frozen=True)
class TensorPlan:
    """One tensor to write: ``fill(rng, n)`` gives the next ``n`` values as float32."""

    name: str
    shape: tuple[int, ...]
    fill: Callable[[np.random.Generator, int], np.ndarray]
    seed: int = 0

    def nbytes(self, dtype: str) -> int:
        return math.prod(self.shape) * _ITEMSIZE[dtype]


def _encode(values: np.ndarray, dtype: str) -> bytes:
    v = np.ascontiguousarray(values, dtype=np.float32)
    if dtype == "BF16":  # round to nearest even on the upper 16 bits (finite inputs)
        u = v.view(np.uint32)
        u = u + (np.uint32(0x7FFF) + ((u >> 16) & 1))
        return (u >> 16).astype("<u2").tobytes()
    return v.astype({"F64": "<f8", "F32": "<f4", "F16": "<f2"}[dtype]).tobytes()


def write_safetensors(path: str | os.PathLike, plans: Iterable[TensorPlan], dtype: str = "BF16",
                      metadata: dict[str, str] | None = None) -> int:
    """Write ``plans`` to ``path`` in ``dtype`` without materialising any tensor; returns the file size.

    The file is written under a temporary name and renamed when complete (and fsync'd), so a reader
    never sees a half-written file unless it asks for one (see :func:`truncate` in the tests).
    """
    plans = list(plans)
    header: dict[str, object] = {"__metadata__": dict(metadata or {})} if metadata else {}
    offset = 0
    for p in plans:
        n = p.nbytes(dtype)
        header[p.name] = {"dtype": dtype, "shape": list(p.shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the reference writer aligns the data to 8 bytes
    path = Path(path)
    tmp = path.with_name(f".{path.name}.partial")
    try:
        with open(tmp, "wb") as f:
            f.write(len(blob).to_bytes(8, "little"))
            f.write(blob)
            for p in plans:
                rng = np.random.default_rng(p.seed)
                left = math.prod(p.shape)
                while left:
                    k = min(left, _CHUNK_ELEMS)
                    f.write(_encode(p.fill(rng, k), dtype))
                    left -= k
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk or an interrupt: no .partial left behind (red team 37h)
        tmp.unlink(missing_ok=True)
        raise
    return 8 + len(blob) + offset


def _normal(std: float) -> Callable[[np.random.Generator, int], np.ndarray]:
    return lambda rng, n: rng.standard_normal(n, dtype=np.float32) * np.float32(std)


def _ones(rng: np.random.Generator, n: int) -> np.ndarray:
    return np.ones(n, dtype=np.float32)


def _shard(plans: list[TensorPlan], dtype: str, shard_bytes: int) -> list[list[TensorPlan]]:
    shards: list[list[TensorPlan]] = [[]]
    size = 0
    for p in plans:
        if shards[-1] and size + p.nbytes(dtype) > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(p)
        size += p.nbytes(dtype)
    return shards


def write_llama_checkpoint(root: str | os.PathLike, *, hidden: int = 2048, intermediate: int = 8192,
                           layers: int = 16, heads: int = 32, kv_heads: int = 8, vocab: int = 128256,
                           dtype: str = "BF16", shard_bytes: int = 2 << 30, seed: int = 0,
                           std: float = 0.02) -> dict[str, object]:
    """A Llama-shaped HF checkpoint (config.json, shards, index) with random weights, untied lm_head.

    Returns a summary: total bytes, number of shards, the largest tensor (name, stored bytes, float32 bytes) and
    the float32 bytes of one layer (all its tensors, which ``analyze`` holds together).
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    dh = hidden // heads
    s = seed * 1_000_003
    plans = [TensorPlan("model.embed_tokens.weight", (vocab, hidden), _normal(std), s)]
    shapes = {"self_attn.q_proj.weight": (heads * dh, hidden), "self_attn.k_proj.weight": (kv_heads * dh, hidden),
              "self_attn.v_proj.weight": (kv_heads * dh, hidden), "self_attn.o_proj.weight": (hidden, heads * dh),
              "mlp.gate_proj.weight": (intermediate, hidden), "mlp.up_proj.weight": (intermediate, hidden),
              "mlp.down_proj.weight": (hidden, intermediate)}
    for i in range(layers):
        plans.append(TensorPlan(f"model.layers.{i}.input_layernorm.weight", (hidden,), _ones))
        plans.append(TensorPlan(f"model.layers.{i}.post_attention_layernorm.weight", (hidden,), _ones))
        for j, (key, shape) in enumerate(shapes.items()):
            plans.append(TensorPlan(f"model.layers.{i}.{key}", shape, _normal(std), s + 1 + 16 * i + j))
    plans.append(TensorPlan("model.norm.weight", (hidden,), _ones))
    plans.append(TensorPlan("lm_head.weight", (vocab, hidden), _normal(std), s + 7))
    shards = _shard(plans, dtype, shard_bytes)
    names = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    total = 0
    weight_map = {}
    for name, group in zip(names, shards):
        total += write_safetensors(root / name, group, dtype, metadata={"format": "pt"})
        weight_map.update({p.name: name for p in group})
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": hidden,
              "intermediate_size": intermediate, "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "vocab_size": vocab, "rms_norm_eps": 1e-5, "hidden_act": "silu",
              "max_position_embeddings": 2048, "rope_theta": 500000.0, "tie_word_embeddings": False,
              "torch_dtype": {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}.get(dtype, "float64")}
    atomic_write_text(root / "config.json", json.dumps(config, indent=2))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    atomic_write_text(root / "model.safetensors.index.json", json.dumps(index, indent=2))
    big = max(plans, key=lambda p: math.prod(p.shape))
    layer0 = [p for p in plans if p.name.startswith("model.layers.0.")]
    return {"bytes": total, "shards": len(shards), "tensors": len(plans), "largest": big.name,
            "largest_bytes": big.nbytes(dtype), "largest_f32_bytes": 4 * math.prod(big.shape),
            "layer_f32_bytes": sum(4 * math.prod(p.shape) for p in layer0)}


def write_gpt2_checkpoint(root: str | os.PathLike, *, d: int = 64, layers: int = 2, heads: int = 4,
                          vocab: int = 256, positions: int = 64, dtype: str = "F32", seed: int = 0,
                          std: float = 0.02) -> Path:
    """A small GPT-2 HF directory (config.json + model.safetensors), random weights from ``seed``."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    s = seed * 1_000_003
    plans = [TensorPlan("wte.weight", (vocab, d), _normal(std), s), TensorPlan("wpe.weight", (positions, d), _normal(std), s + 1)]
    for i in range(layers):
        p, t = f"h.{i}.", s + 16 * (i + 1)
        plans += [
            TensorPlan(p + "ln_1.weight", (d,), _ones), TensorPlan(p + "ln_1.bias", (d,), _normal(std), t),
            TensorPlan(p + "attn.c_attn.weight", (d, 3 * d), _normal(std), t + 1),
            TensorPlan(p + "attn.c_attn.bias", (3 * d,), _normal(std), t + 2),
            TensorPlan(p + "attn.c_proj.weight", (d, d), _normal(std), t + 3),
            TensorPlan(p + "attn.c_proj.bias", (d,), _normal(std), t + 4),
            TensorPlan(p + "ln_2.weight", (d,), _ones), TensorPlan(p + "ln_2.bias", (d,), _normal(std), t + 5),
            TensorPlan(p + "mlp.c_fc.weight", (d, 4 * d), _normal(std), t + 6),
            TensorPlan(p + "mlp.c_fc.bias", (4 * d,), _normal(std), t + 7),
            TensorPlan(p + "mlp.c_proj.weight", (4 * d, d), _normal(std), t + 8),
            TensorPlan(p + "mlp.c_proj.bias", (d,), _normal(std), t + 9),
        ]
    plans += [TensorPlan("ln_f.weight", (d,), _ones), TensorPlan("ln_f.bias", (d,), _normal(std), s + 2)]
    write_safetensors(root / "model.safetensors", plans, dtype, metadata={"format": "pt"})
    config = {"model_type": "gpt2", "n_embd": d, "n_layer": layers, "n_head": heads, "vocab_size": vocab,
              "n_positions": positions, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5}
    atomic_write_text(root / "config.json", json.dumps(config, indent=2))
    return root

"""``transcover analyze`` (and ``lipschitz --no-lower``, the certified bounds) on random-weight, sharded, bf16 checkpoints of today's
shapes (issue 15): Pythia-410M (GPT-NeoX: parallel residual, rotary_pct 0.25, biases) and
Llama-3.2-1B (llama3 rope scaling, GQA 32:8).  Weights are written tensor by tensor by
``transcover.scale._synthetic`` (never held in memory); each command runs in a child process whose
peak RSS is its own ``VmHWM`` (``bench_stream.run_analyze``).

    PYTHONPATH=src python benchmarks/bench_arch15.py --which pythia410m
    PYTHONPATH=src python benchmarks/bench_arch15.py --which llama32_1b
    ... --layers 2   # a quick run with fewer layers
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_stream import run_analyze  # noqa: E402

from transcover.scale._synthetic import TensorPlan, _normal, _ones, _shard, write_llama_checkpoint, write_safetensors  # noqa: E402

GB = 1e9


def write_pythia(root: Path, *, hidden: int = 1024, layers: int = 24, heads: int = 16, vocab: int = 50304,
                 shard_bytes: int = 400 << 20, std: float = 0.02) -> dict[str, object]:
    """A GPT-NeoX (Pythia) HF checkpoint: config.json, bf16 shards, index; random weights."""
    root.mkdir(parents=True, exist_ok=True)
    d, ff = hidden, 4 * hidden
    plans = [TensorPlan("gpt_neox.embed_in.weight", (vocab, d), _normal(std), 1)]
    shapes = {"attention.query_key_value.weight": (3 * d, d), "attention.query_key_value.bias": (3 * d,),
              "attention.dense.weight": (d, d), "attention.dense.bias": (d,),
              "mlp.dense_h_to_4h.weight": (ff, d), "mlp.dense_h_to_4h.bias": (ff,),
              "mlp.dense_4h_to_h.weight": (d, ff), "mlp.dense_4h_to_h.bias": (d,)}
    for i in range(layers):
        p = f"gpt_neox.layers.{i}."
        for ln in ("input_layernorm", "post_attention_layernorm"):
            plans += [TensorPlan(p + ln + ".weight", (d,), _ones), TensorPlan(p + ln + ".bias", (d,), _normal(std), 7)]
        plans += [TensorPlan(p + k, s, _normal(std), 100 + 16 * i + j) for j, (k, s) in enumerate(shapes.items())]
    plans += [TensorPlan("gpt_neox.final_layer_norm.weight", (d,), _ones),
              TensorPlan("gpt_neox.final_layer_norm.bias", (d,), _normal(std), 3),
              TensorPlan("embed_out.weight", (vocab, d), _normal(std), 2)]
    shards = _shard(plans, "BF16", shard_bytes)
    names = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    total, weight_map = 0, {}
    for name, group in zip(names, shards):
        total += write_safetensors(root / name, group, "BF16", metadata={"format": "pt"})
        weight_map.update({p.name: name for p in group})
    config = {"model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"], "hidden_size": d,
              "intermediate_size": ff, "num_hidden_layers": layers, "num_attention_heads": heads, "vocab_size": vocab,
              "layer_norm_eps": 1e-5, "hidden_act": "gelu", "rotary_pct": 0.25, "rotary_emb_base": 10000,
              "max_position_embeddings": 2048, "use_parallel_residual": True, "torch_dtype": "bfloat16"}
    (root / "config.json").write_text(json.dumps(config, indent=2))
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": weight_map}))
    return {"bytes": total, "shards": len(shards)}


def write_llama32(root: Path, *, layers: int = 16) -> dict[str, object]:
    """Llama-3.2-1B widths (2048, 32 heads of 64, 8 key/value heads, FFN 8192, vocab 128256) with
    Llama 3.2's rope scaling (llama3: factor 32, low 1, high 4, original 8192, theta 500000)."""
    out = write_llama_checkpoint(root, hidden=2048, intermediate=8192, layers=layers, heads=32, kv_heads=8,
                                 vocab=128256, shard_bytes=1 << 30)
    cfg = json.loads((root / "config.json").read_text())
    cfg.update(max_position_embeddings=131072, rope_scaling={
        "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192})
    (root / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--which", choices=["pythia410m", "llama32_1b"], required=True)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--src", default=str(Path(__file__).resolve().parents[1] / "src"))
    ap.add_argument("--keep", default=None, help="write the checkpoint here and keep it")
    args = ap.parse_args()
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="arch15_"))
    try:
        if args.which == "pythia410m":
            info = write_pythia(root, layers=args.layers or 24)
        else:
            info = write_llama32(root, layers=args.layers or 16)
        print(f"{args.which}: {info['bytes'] / GB:.2f} GB of bf16 in {info['shards']} shards at {root}")
        for cmd in (["analyze"], ["lipschitz", "--no-lower"]):
            peak, secs, rc, tail = run_analyze(root, args.src, []) if cmd == ["analyze"] else _run(cmd, root, args.src)
            print(f"  {cmd[0]:9s} rc={rc} {secs:7.1f} s  peak RSS {peak / 1e6:7.0f} MB" + ("" if rc == 0 else f"  {tail}"))
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return 0


def _run(cmd: list[str], root: Path, src: str):
    """``run_analyze`` with another subcommand (same child, same VmHWM)."""
    import os
    import subprocess
    import time

    from bench_stream import PEAK

    env = dict(os.environ, PYTHONPATH=src, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", PEAK, cmd[0], str(root), "--quiet", *cmd[1:]], env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    secs = time.perf_counter() - t0
    peak = float(proc.stderr.rsplit("VmHWM_kB", 1)[1].split()[0]) * 1024 if "VmHWM_kB" in proc.stderr else float("nan")
    return peak, secs, proc.returncode, proc.stderr[-400:]


if __name__ == "__main__":
    raise SystemExit(main())

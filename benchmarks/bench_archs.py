"""Time and peak RSS of ``transcover analyze`` on today's architectures at real sizes (issue 15).

Each checkpoint is built from the family's real ``transformers`` config at the published shape
(Pythia-410M: GPT-NeoX, parallel residual, partial rotary; Llama-3.2-1B: GQA, "llama3" rope
scaling, tied embeddings; Qwen3-0.6B: q/k-norm), with seeded random weights, sharded bf16
safetensors written tensor by tensor (the tensor names and shapes come from instantiating the
Hugging Face model on the meta device, so nothing is held in memory), then analysed in a child
process whose own peak RSS (``VmHWM``) is reported.

    PYTHONPATH=src python benchmarks/bench_archs.py                     # every shape
    PYTHONPATH=src python benchmarks/bench_archs.py --only pythia-410m --fast
    ... --src /path/to/other/src --keep /tmp/ckpts   # the same files analysed by another checkout

Each line also gives the child's CPU time (user + sys, ``getrusage``) and the 1-minute load average
before and after it: on a shared machine the wall time alone says little.  The shapes run one after
the other, never two analyses at once.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_stream import MB  # noqa: E402

GB = 1e9

# the child prints its own peak RSS (VmHWM, its address space only) and CPU time as it exits
_CHILD = ("import sys, re, resource; from transcover.cli import main; rc = main(sys.argv[1:]); "
          "u = resource.getrusage(resource.RUSAGE_SELF); "
          "print('VmHWM_kB', re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1), "
          "'CPU_s', u.ru_utime + u.ru_stime, file=sys.stderr); sys.exit(rc)")


def run_analyze(model: Path, src: str, extra: list[str]) -> dict:
    """Wall and CPU seconds, peak RSS, exit code and load averages of one ``analyze`` child."""
    env = dict(os.environ, PYTHONPATH=src, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _CHILD, "analyze", str(model), "--quiet", *extra], env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    secs = time.perf_counter() - t0
    tail = proc.stderr.rsplit("VmHWM_kB", 1)
    peak = cpu = float("nan")
    if len(tail) == 2:
        fields = tail[1].split()
        peak, cpu = float(fields[0]) * 1024, float(fields[2])
    return {"rss": peak, "wall": secs, "cpu": cpu, "rc": proc.returncode, "tail": proc.stderr[-400:],
            "load": (load0, os.getloadavg()[0])}


def _configs() -> dict:
    from transformers import GPTNeoXConfig, LlamaConfig, Qwen3Config

    return {
        "pythia-410m": GPTNeoXConfig(
            vocab_size=50304, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
            intermediate_size=4096, rotary_pct=0.25, rotary_emb_base=10000, max_position_embeddings=2048,
            use_parallel_residual=True, hidden_act="gelu", layer_norm_eps=1e-5, tie_word_embeddings=False),
        "llama-3.2-1b": LlamaConfig(
            vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
            num_attention_heads=32, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5, hidden_act="silu",
            max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=True,
            rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
        "qwen3-0.6b": Qwen3Config(
            vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
            num_attention_heads=16, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
            max_position_embeddings=40960, rope_theta=1000000.0, tie_word_embeddings=True),
    }


def _fill(name: str, std: float):
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "bias":
        return lambda rng, n: np.zeros(n, np.float32)
    if "norm" in name or "layernorm" in name:
        return lambda rng, n: np.ones(n, np.float32)
    return lambda rng, n: (std * rng.standard_normal(n)).astype(np.float32)


def write_checkpoint(root: Path, config, *, std: float = 0.02, shard_bytes: int = 2 << 30) -> dict:
    """The HF layout of ``config`` with seeded random bf16 weights, sharded, never held in memory."""
    import torch
    from transformers import AutoModelForCausalLM

    from transcover.scale._synthetic import TensorPlan, _shard, write_safetensors

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items() if v.is_floating_point()}
    if getattr(config, "tie_word_embeddings", False):
        shapes.pop("lm_head.weight", None)
    plans = [TensorPlan(k, s, _fill(k, std), 1000 + i) for i, (k, s) in enumerate(shapes.items())]
    shards = _shard(plans, "BF16", shard_bytes)
    names = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    root.mkdir(parents=True, exist_ok=True)
    total, weight_map = 0, {}
    for name, group in zip(names, shards):
        total += write_safetensors(root / name, group, "BF16", metadata={"format": "pt"})
        weight_map.update({p.name: name for p in group})
    config.dtype = "bfloat16"
    config.to_json_file(root / "config.json")
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    big = max(plans, key=lambda p: math.prod(p.shape))
    return {"bytes": total, "shards": len(shards), "tensors": len(plans), "largest": big.name,
            "largest_bytes": big.nbytes("BF16")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", action="append", help="run only these shapes (repeatable)")
    p.add_argument("--fast", action="store_true", help="analyze --fast (estimates) instead of certified")
    p.add_argument("--keep", default=None, help="write the checkpoints here and keep them (reused if there)")
    p.add_argument("--src", default=None, help="analyse with this source tree (PYTHONPATH) instead of ours")
    args = p.parse_args()
    configs = _configs()
    names = args.only or list(configs)
    src = args.src or str(Path(__file__).resolve().parents[1] / "src")
    base = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="tc_archs_", dir="/tmp"))
    failed = 0
    try:
        for name in names:
            root = base / name
            t0 = time.perf_counter()
            info_file = root / "bench_info.json"
            if args.keep and info_file.exists():
                info = json.loads(info_file.read_text())
            else:
                info = write_checkpoint(root, configs[name])
                info_file.write_text(json.dumps(info))
            gen = time.perf_counter() - t0
            r = run_analyze(root, src, ["--fast"] if args.fast else [])
            limit = 3 * info["largest_bytes"] + 300 * MB
            print(f"{name:14s} {info['bytes'] / GB:5.2f} GB bf16 in {info['shards']} shard(s), {info['tensors']} tensors "
                  f"(ready in {gen:.0f} s) | analyze{' --fast' if args.fast else ''}: exit {r['rc']}, "
                  f"wall {r['wall']:.1f} s, CPU {r['cpu']:.1f} s, peak RSS {r['rss'] / MB:.0f} MB "
                  f"(3 x largest + 300 MB = {limit / MB:.0f} MB), load {r['load'][0]:.2f} -> {r['load'][1]:.2f}",
                  flush=True)
            if r["rc"]:
                print("   ", " | ".join(r["tail"].strip().splitlines()[-3:]), file=sys.stderr)
                failed += 1
            if not args.keep:
                shutil.rmtree(root, ignore_errors=True)
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

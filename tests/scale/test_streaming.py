"""Streaming analysis (issue 14, item 1): exact chunked decoding, and peak RSS independent of the checkpoint size."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

import transcover.model._safetensors as st_mod
from transcover.model._safetensors import SafetensorsFile
from transcover.scale._synthetic import TensorPlan, write_gpt2_checkpoint, write_safetensors

SRC = str(Path(__file__).resolve().parents[2] / "src")


def test_chunked_bf16_and_fp16_decoding_is_exact_across_chunk_boundaries(tmp_path, monkeypatch):
    vals = np.random.default_rng(0).standard_normal(1001).astype(np.float32) * 3
    vals[:4] = [0.0, -0.0, 65504.0, 1e-7]

    def fill(rng, n, _state={"at": 0}):
        out = vals[_state["at"]: _state["at"] + n]
        _state["at"] += n
        return out

    for dtype, torch_dtype in (("BF16", torch.bfloat16), ("F16", torch.float16)):
        path = tmp_path / f"{dtype}.safetensors"
        fill.__defaults__[0]["at"] = 0
        write_safetensors(path, [TensorPlan("w", (7, 143), fill)], dtype)
        expected = torch.from_numpy(vals).to(torch_dtype).float().numpy().reshape(7, 143)
        monkeypatch.setattr(st_mod, "_CHUNK", 2 * 97)  # 97 values per chunk: boundaries mid-row
        got = SafetensorsFile(path).get("w")
        assert got.dtype == np.float32 and got.flags.writeable
        np.testing.assert_array_equal(got, expected)  # exact, bit for bit (signed zero included)
        assert np.signbit(got.ravel()[1])


# Note [measuring the peak]: ru_maxrss of a child is useless here: after fork + exec Linux keeps the
# larger of the forked image's RSS (this test process, with torch imported) and the new program's.
# VmHWM in /proc/self/status belongs to the current address space only, so the child reports it.
PEAK = ("import sys, re; from transcover.cli import main; rc = main(sys.argv[1:]); "
        "print('VmHWM_kB', re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1), "
        "file=sys.stderr); sys.exit(rc)")


def peak_rss_of(args: list[str], src: str = SRC) -> int:
    """Peak RSS in bytes of ``transcover ARGS`` in a fresh process (Note [measuring the peak])."""
    env = dict(os.environ, PYTHONPATH=src, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", PEAK, *args], env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
    assert proc.returncode == 0, proc.stderr
    return int(proc.stderr.rsplit("VmHWM_kB", 1)[1].split()[0]) * 1024


def _peak_rss_of_analyze(model: Path, src: str = SRC) -> int:
    return peak_rss_of(["analyze", str(model), "--quiet", "--fast"], src)


def test_peak_rss_does_not_grow_with_the_number_of_layers(tmp_path):
    """A 2x larger checkpoint (same widths, twice the layers) must not need more memory.

    Before issue 14 the memory-mapped reader left every page it had read resident, so the peak grew
    by about the checkpoint's size (here ~60 MB of bf16).
    """
    small = write_gpt2_checkpoint(tmp_path / "small", d=512, layers=10, heads=8, vocab=512, dtype="BF16")
    big = write_gpt2_checkpoint(tmp_path / "big", d=512, layers=20, heads=8, vocab=512, dtype="BF16")
    size = lambda p: sum(f.stat().st_size for f in p.iterdir())  # noqa: E731
    extra = size(big) - size(small)
    assert extra > 60e6
    growth = _peak_rss_of_analyze(big) - _peak_rss_of_analyze(small)
    layer_f32 = 2 * 12 * 512 * 512 * 4 / 2  # one layer's weights decoded to float32 (~6.3 MB)
    assert growth < 0.25 * extra, f"peak RSS grew by {growth / 1e6:.1f} MB for {extra / 1e6:.1f} MB more checkpoint"
    assert growth < 2 * layer_f32 + 8e6


def test_certified_embedding_needs_no_float64_copy(tmp_path):
    """The certified norms of a large embedding cost its float32 decoding plus O(block), not 3x it.

    Before issue 14: float32 decoding + a float64 copy (+ the resident mapped pages), ~3.5x the float32 size.
    """
    vocab, d = 200_000, 128
    model = write_gpt2_checkpoint(tmp_path / "m", d=d, layers=1, heads=2, vocab=vocab, positions=16, dtype="BF16")
    with_emb = peak_rss_of(["analyze", str(model), "--quiet"])
    without = peak_rss_of(["analyze", str(model), "--quiet", "--no-embeddings"])
    f32 = vocab * d * 4
    extra = with_emb - without
    assert extra < 1.25 * f32 + 40e6, f"the embedding cost {extra / 1e6:.0f} MB for {f32 / 1e6:.0f} MB of float32"

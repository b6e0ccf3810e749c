"""Benchmark: transcover's chunked greedy eps-net against the straightforward one (issue 5).

    python benchmarks/bench_cover.py [--M 100000] [--naive-M 20000] [--eps 0.3] [--json out/bench_cover.json]

Data: M functions whose outputs on n = 32 samples with b = 8 outputs (n*b = 256) lie on a smooth
3-dimensional manifold, ``tanh(Z A)`` with ``Z ~ U[-1, 1]^3`` and a Gaussian ``A`` (3 x 256): the
net size then grows slowly with M, like a real class's.  ``eps`` = 0.3 in ``q = inf`` gives about
1 000 centres.

* transcover: ``IncrementalNet`` (blocked ``torch.cdist`` against the current centres only;
  memory O(M n b + K n b)).
* naive: all pairwise distances (one ``M x M`` float32 matrix: 40 GB at M = 100 000, more than
  this machine's memory), then the sequential greedy.  Same distance kernel, same decisions: the
  script checks that both return the same centres.

Each variant runs in its own subprocess (a fresh interpreter, so peaks do not mix) and reports its
wall time and peak resident memory (``resource.getrusage(RUSAGE_SELF).ru_maxrss``).  The naive
subprocesses run under ``RLIMIT_AS`` (``--mem-limit-gib``) so the 40 GB attempt fails cleanly
instead of taking the machine down.  The naive time at M is extrapolated from ``--naive-M`` as
``t_dist (M/m)^2 + t_greedy (M/m)(K_M/K_m)``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

N_SAMPLES, N_OUT, INTRINSIC = 32, 8, 3


def make_data(M: int, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    Z = torch.rand(M, INTRINSIC, generator=g) * 2 - 1
    A = torch.randn(INTRINSIC, N_SAMPLES * N_OUT, generator=g)
    return torch.tanh(Z @ A).reshape(M, N_SAMPLES, N_OUT)  # float32


def naive_net(Y, eps: float, q: float):
    """Straightforward: the full M x M distance matrix, then greedy over it."""
    import torch

    M, n, b = Y.shape
    t0 = time.perf_counter()
    if q == math.inf or b == 1:
        D = torch.cdist(Y.reshape(M, n * b), Y.reshape(M, n * b), p=math.inf)
    else:
        D = torch.zeros(M, M, dtype=Y.dtype)
        for i in range(n):
            torch.maximum(D, torch.cdist(Y[:, i], Y[:, i], p=q, compute_mode="donot_use_mm_for_euclid_dist"), out=D)
    t1 = time.perf_counter()
    covered = torch.zeros(M, dtype=torch.bool)
    centres = []
    for i in range(M):
        if not covered[i]:
            centres.append(i)
            covered |= D[i] <= eps
    return centres, t1 - t0, time.perf_counter() - t1


def child(args: argparse.Namespace) -> None:
    import torch

    from transcover.empirical import IncrementalNet

    torch.set_num_threads(args.threads)
    Y = make_data(args.M)
    base_rss = _rss_now_kib()
    out: dict[str, object] = {"variant": args.child, "M": args.M, "base_rss_mib": base_rss / 1024}
    try:
        t0 = time.perf_counter()
        if args.child == "fast":
            net = IncrementalNet(args.eps, args.q)
            net.add(Y)
            centres = net.indices.tolist()
            out.update(seconds=time.perf_counter() - t0)
        else:
            centres, t_dist, t_greedy = naive_net(Y, args.eps, args.q)
            out.update(seconds=t_dist + t_greedy, seconds_distances=t_dist, seconds_greedy=t_greedy)
        out.update(net_size=len(centres), centres_hash=hash(tuple(centres)), status="ok")
    except (MemoryError, RuntimeError) as err:  # torch reports a failed allocation as RuntimeError
        out.update(status="out of memory", error=" ".join(str(err).split())[:200])
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(out))


def _rss_now_kib() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return float(line.split()[1])
    return float("nan")


def run_child(variant: str, M: int, args: argparse.Namespace, mem_limit: int | None) -> dict:
    cmd = [sys.executable, __file__, "--child", variant, "--M", str(M), "--eps", str(args.eps),
           "--q", str(args.q), "--threads", str(args.threads)]

    def limit() -> None:
        if mem_limit is not None:
            resource.setrlimit(resource.RLIMIT_AS, (mem_limit, mem_limit))

    proc = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=limit)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"variant": variant, "M": M, "status": f"failed (exit {proc.returncode}): {tail[:200]}"}
    return json.loads(lines[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--M", type=int, default=100_000)
    p.add_argument("--naive-M", type=int, default=20_000)
    p.add_argument("--eps", type=float, default=0.3)
    p.add_argument("--q", type=float, default=math.inf)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--mem-limit-gib", type=float, default=16.0, help="RLIMIT_AS of the naive subprocesses")
    p.add_argument("--json", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    limit = int(args.mem_limit_gib * 2**30)
    M, m = args.M, args.naive_M
    print(f"M={M}, n*b={N_SAMPLES * N_OUT} (n={N_SAMPLES}, b={N_OUT}), q={args.q}, eps={args.eps}, "
          f"threads={args.threads}")
    print(f"naive M x M float32 matrix at M={M}: {M * M * 4 / 1e9:.1f} GB "
          f"(naive subprocess limit {args.mem_limit_gib:g} GiB of address space)")
    res = {
        "fast_M": run_child("fast", M, args, None),
        "naive_M": run_child("naive", M, args, limit),
        "fast_m": run_child("fast", m, args, None),
        "naive_m": run_child("naive", m, args, limit),
    }
    for k, r in res.items():
        extra = "" if r.get("status") != "ok" else (f"  time {r['seconds']:8.2f} s  centres {r['net_size']:5d}  "
                                                     f"peak RSS {r['peak_rss_mib']:7.0f} MiB")
        print(f"{r['variant']:>5} M={r['M']:>6}: {r.get('status')}{extra}"
              + ("" if r.get("status") == "ok" else f"  {r.get('error', '')}"))
    f, nm, fm = res["fast_M"], res["naive_m"], res["fast_m"]
    summary: dict[str, object] = {"results": res}
    if nm.get("status") == "ok" and fm.get("status") == "ok":
        same = nm["centres_hash"] == fm["centres_hash"] and nm["net_size"] == fm["net_size"]
        summary["same_centres_at_naive_M"] = same
        summary["speedup_at_naive_M"] = nm["seconds"] / fm["seconds"]
        print(f"at M={m}: identical centres: {same}; speed-up {nm['seconds'] / fm['seconds']:.1f}x; "
              f"peak RSS naive {nm['peak_rss_mib']:.0f} MiB vs transcover {fm['peak_rss_mib']:.0f} MiB")
        if f.get("status") == "ok":
            r = M / m
            t_ext = nm["seconds_distances"] * r**2 + nm["seconds_greedy"] * r * f["net_size"] / max(1, nm["net_size"])
            summary["naive_extrapolated_seconds_at_M"] = t_ext
            summary["speedup_extrapolated_at_M"] = t_ext / f["seconds"]
            print(f"at M={M}: naive extrapolated {t_ext:.0f} s (and {M * M * 4 / 2**30:.1f} GiB matrix) vs transcover "
                  f"{f['seconds']:.1f} s, peak RSS {f['peak_rss_mib']:.0f} MiB: speed-up "
                  f"{t_ext / f['seconds']:.0f}x")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()

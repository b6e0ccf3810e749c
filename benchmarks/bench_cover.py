"""Benchmark: transcover's blocked greedy eps-net against the straightforward chunked greedy (issue 14).

    OMP_NUM_THREADS=1 python benchmarks/bench_cover.py [--M 100000] [--eps 0.3] [--q inf] [--json out.json]

Data: M functions whose outputs on n = 32 samples with b = 8 outputs (n*b = 256, float32) lie on a
smooth 3-dimensional manifold, ``tanh(Z A)`` with ``Z ~ U[-1, 1]^3`` and a Gaussian ``A``
(3 x 256).  ``eps = 0.3`` in ``q = inf`` gives about 1 000 centres at M = 10^5.

The baseline is the strongest straightforward implementation, not an all-pairs matrix: for each
point in order, the distance to every current centre (a preallocated centres array) in one
vectorised numpy call, and the point is appended when the minimum is ``> eps``.  Same greedy order,
so the centres must be identical (the script checks it; the baseline compares in float32, where
numpy casts ``eps``, so on near-ties it could differ -- transcover's decisions are exact).

1. Net alone, in this process, side by side: wall time of each, the ratio, identical centres, and
   each variant's peak resident memory (``VmHWM`` after resetting it through
   ``/proc/self/clear_refs``; it includes the data and the loaded libraries).
2. Net + packing, whole processes: ``transcover cover finite`` (the CLI's ``main``, imports
   included) on the same data saved as .npy against a process running the baseline for the eps-net
   and the 2eps-net; wall time, and each child's own ``VmHWM`` at its end.

Run with one thread (``--threads 1``, the default); the load average is printed, as other jobs
may share the machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

N_SAMPLES, N_OUT, INTRINSIC = 32, 8, 3


def make_data(M: int, seed: int = 0) -> np.ndarray:
    import torch

    g = torch.Generator().manual_seed(seed)
    Z = torch.rand(M, INTRINSIC, generator=g) * 2 - 1
    A = torch.randn(INTRINSIC, N_SAMPLES * N_OUT, generator=g)
    return torch.tanh(Z @ A).reshape(M, N_SAMPLES, N_OUT).numpy()  # float32


def baseline_net(Y: np.ndarray, eps: float, q: float) -> list[int]:
    """The straightforward chunked greedy: one vectorised distance-to-all-centres call per point."""
    M, n, b = Y.shape
    flat = q == math.inf or b == 1
    X = Y.reshape(M, n * b) if flat else Y
    C = np.empty_like(X)  # centres, first k rows used (no reallocation)
    k = 0
    centres = []
    for i in range(M):
        if k:
            diff = np.abs(C[:k] - X[i])
            if flat:
                d = diff.max(axis=1)
            elif q == 1.0:
                d = diff.sum(axis=2).max(axis=1)
            else:
                d = np.sqrt((diff * diff).sum(axis=2)).max(axis=1)
            if d.min() <= eps:
                continue
        C[k] = X[i]
        k += 1
        centres.append(i)
    return centres


def transcover_net(Y: np.ndarray, eps: float, q: float) -> list[int]:
    import torch

    from transcover.empirical import greedy_net

    return greedy_net(torch.from_numpy(Y), eps, q).tolist()


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as fh:  # "5" resets VmHWM to the current RSS (Linux >= 4.0)
        fh.write("5")


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return float(line.split()[1]) / 1024
    return float("nan")


def timed(fn, *args) -> tuple[list[int], float, float]:
    _reset_peak()
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0, _status_mib("VmHWM")


def child_baseline(path: str, eps: float, q: float) -> None:
    """A whole process: load, baseline eps-net and 2eps-net (the packing), print the sizes."""
    Y = np.load(path)
    net = baseline_net(Y, eps, q)
    pack = baseline_net(Y, 2 * eps, q)
    print(json.dumps({"net": len(net), "packing": len(pack), "peak_rss_mib": _status_mib("VmHWM")}))


def child_cli(argv: list[str]) -> None:
    """A whole process: ``transcover cover ...`` as the CLI runs it, then this process's peak RSS."""
    from transcover.cli import main as cli_main

    rc = cli_main(argv)
    print(json.dumps({"peak_rss_mib": _status_mib("VmHWM")}), file=sys.stderr)
    sys.exit(rc)


def run_process(cmd: list[str], threads: int) -> dict:
    """Wall time, exit code and output of one whole process (it prints its own VmHWM)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               OPENBLAS_NUM_THREADS=str(threads))
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=env)
        _, status, _ = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return {"seconds": wall, "rc": proc.returncode,
                "stdout": out.read().strip()[-2000:], "stderr": err.read().strip()[-500:]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--M", type=int, default=100_000)
    p.add_argument("--eps", type=float, default=0.3)
    p.add_argument("--q", type=float, default=math.inf)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    p.add_argument("--child-baseline", default=None, help=argparse.SUPPRESS)
    if sys.argv[1:2] == ["--child-cli"]:
        child_cli(sys.argv[2:])
        return
    args = p.parse_args()
    if args.child_baseline:
        child_baseline(args.child_baseline, args.eps, args.q)
        return
    import torch

    torch.set_num_threads(args.threads)
    Y = make_data(args.M)
    qn = "inf" if args.q == math.inf else str(int(args.q))
    print(f"M={args.M}, n*b={N_SAMPLES * N_OUT} (n={N_SAMPLES}, b={N_OUT}), float32, q={qn}, eps={args.eps}, "
          f"threads={args.threads}, load average before: {os.getloadavg()}")
    res: dict[str, object] = {"M": args.M, "eps": args.eps, "q": qn, "threads": args.threads,
                              "load_before": os.getloadavg()}

    # 1. net alone, same process, side by side
    fast, t_fast, hwm_fast = timed(transcover_net, Y, args.eps, args.q)
    base, t_base, hwm_base = timed(baseline_net, Y, args.eps, args.q)
    same = fast == base
    res["net"] = {"transcover_s": t_fast, "baseline_s": t_base, "speedup": t_base / t_fast,
                  "centres": len(fast), "baseline_centres": len(base), "identical_centres": same,
                  "peak_rss_mib_transcover": hwm_fast, "peak_rss_mib_baseline": hwm_base}
    print(f"net alone (same process): transcover {t_fast:.2f} s, baseline chunked greedy {t_base:.2f} s, "
          f"speed-up {t_base / t_fast:.1f}x; centres {len(fast)} vs {len(base)}, identical: {same}")
    print(f"  peak RSS (VmHWM, includes data {Y.nbytes / 2**20:.0f} MiB and libraries): "
          f"transcover {hwm_fast:.0f} MiB, baseline {hwm_base:.0f} MiB")

    # 2. net + packing, whole processes
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "outputs.npy")
        np.save(path, Y)
        cli = [sys.executable, __file__, "--child-cli", "cover", "finite", path, "--eps", repr(args.eps),
               "--q", qn, "--workers", str(args.threads), "--quiet", "--json", str(Path(tmp) / "cover.json")]
        r_cli = run_process(cli, args.threads)
        if r_cli["rc"] == 0:
            row = json.loads((Path(tmp) / "cover.json").read_text())
            row = row.get("result", row)["rows"][0]
            r_cli.update(net=row["net_size"], packing=row["packing_size"],
                         **json.loads(r_cli["stderr"].splitlines()[-1]))
        r_base = run_process([sys.executable, __file__, "--child-baseline", path, "--eps", repr(args.eps),
                              "--q", str(args.q)], args.threads)
        if r_base["rc"] == 0:
            r_base.update(json.loads(r_base["stdout"].splitlines()[-1]))
    for name, r in (("transcover CLI", r_cli), ("baseline", r_base)):
        if r["rc"] != 0:
            sys.exit(f"{name} process failed (exit {r['rc']}): {r['stderr'][-300:]}")
    res["net_and_packing_process"] = {"transcover_cli": r_cli, "baseline": r_base,
                                      "speedup": r_base["seconds"] / r_cli["seconds"]}
    print(f"net + packing, whole process: `transcover cover finite` {r_cli['seconds']:.2f} s "
          f"(net {r_cli.get('net')}, packing {r_cli.get('packing')}, peak RSS {r_cli['peak_rss_mib']:.0f} MiB, "
          f"rc {r_cli['rc']}), baseline {r_base['seconds']:.2f} s (net {r_base.get('net')}, packing "
          f"{r_base.get('packing')}, peak RSS {r_base['peak_rss_mib']:.0f} MiB): speed-up "
          f"{r_base['seconds'] / r_cli['seconds']:.1f}x")
    res["load_after"] = os.getloadavg()
    print(f"load average after: {os.getloadavg()} (2 cores shared with other jobs)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=2, default=str))


if __name__ == "__main__":
    main()

"""Monte-Carlo classes and per-example local certification: 1 worker vs 2 workers, side by side (issue 14).

Both runs of each pair happen in this process, one after the other, through the public scale API
(``scale._montecarlo.monte_carlo_reference``, ``scale._local.local_rows``) with no store, so every
item is computed: ``backend="serial"`` (1 worker) and ``backend="process", workers=2`` (spawned
processes; their start-up, the model load in each worker and the transfer of the results are in
the timing).  The results of the two runs are compared bit for bit.  The Monte-Carlo merge (the
greedy net and packing over all members, in member order) is serial by construction; its time is
printed apart so the parallel share is visible.  The load average is printed with the timings: on
a shared machine the ratio understates what idle cores give, so the report also gives the items'
own compute seconds (summed, serial run), the cost of starting two workers that import torch
(measured here), and from them the ratio to expect when two cores are free:
``(items + serial rest) / (start-up + items / 2 + serial rest)``.

    PYTHONPATH=src python benchmarks/bench_scale_items.py [--functions 8192] [--sequences 16]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def _warm(i: int) -> int:
    """What a worker does before its first item: import torch and the item modules."""
    import transcover.scale._local  # noqa: F401
    import transcover.scale._montecarlo  # noqa: F401

    return i


def startup_seconds() -> float:
    from transcover.scale import Item, sweep

    t0 = time.perf_counter()
    sweep([Item(f"w{i}", f"w{i}", i) for i in range(2)], _warm, backend="process", workers=2)
    return time.perf_counter() - t0


def _timed(fn, **kw) -> tuple[object, float, float]:
    """(result, wall seconds, summed item seconds)."""
    items = []
    t0 = time.perf_counter()
    result = fn(on_result=lambda r: items.append(0.0 if r.reused else r.seconds), **kw)
    return result, time.perf_counter() - t0, sum(items)


def _summary(out: dict, serial_items: float, startup: float) -> None:
    rest = out["1 worker"]["seconds"] - serial_items
    out["1 worker"]["item seconds"] = round(serial_items, 2)
    out["ratio"] = round(out["1 worker"]["seconds"] / out["2 workers"]["seconds"], 2)
    expected = (serial_items + rest) / (startup + serial_items / 2 + rest)
    out["expected on 2 free cores (start-up as measured)"] = round(expected, 2)


def bench_montecarlo(functions: int, startup: float) -> dict:
    import torch

    from transcover.empirical import NormRadii, covering_of_outputs, random_inputs
    from transcover.empirical._montecarlo import reference_block_outputs
    from transcover.model import ReferenceConfig
    from transcover.scale._montecarlo import monte_carlo_reference

    cfg = ReferenceConfig(d_model=16, n_heads=2, n_layers=2, d_ff=32, head_hidden=(16,))
    X = random_inputs(16, 4, 16, seed=1)
    eps = [0.1, 0.2]
    out = {"functions": functions, "chunks": -(-functions // 256)}
    results, items = {}, {}
    for label, kw in (("1 worker", {"backend": "serial"}), ("2 workers", {"backend": "process", "workers": 2})):
        load = _load()
        results[label], wall, items[label] = _timed(monte_carlo_reference, config=cfg, radii=NormRadii(), X=X,
                                                    n_functions=functions, eps=eps, **kw)
        out[label] = {"seconds": round(wall, 2), "load_before": load}
    Y = reference_block_outputs(cfg, NormRadii(), X, 0, functions)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    covering_of_outputs(Y, eps, workers=1)
    out["serial merge seconds (greedy net + packing)"] = round(time.perf_counter() - t0, 2)
    out["identical"] = results["1 worker"].to_dict() == results["2 workers"].to_dict()
    _summary(out, items["1 worker"], startup)
    return out


def bench_local(sequences: int, root: str, startup: float) -> dict:
    import numpy as np
    import torch

    from transcover.model import load
    from transcover.scale._local import local_rows
    from transcover.scale._synthetic import write_gpt2_checkpoint

    model = str(write_gpt2_checkpoint(os.path.join(root, "gpt2"), d=64, layers=4, heads=4, vocab=128,
                                      positions=32, seed=3))
    spec = load(model).to_torch(torch.float64)
    rng = np.random.default_rng(0)
    seqs = [torch.from_numpy(rng.standard_normal((16, 64))) for _ in range(sequences)]
    rhos = [1e-3, 1e-2]
    out = {"model": "GPT-2 d=64, 4 layers", "sequences": sequences, "tokens": 16, "rhos": rhos}
    rows, items = {}, {}
    for label, kw in (("1 worker", {"backend": "serial"}), ("2 workers", {"backend": "process", "workers": 2})):
        load_avg = _load()
        rows[label], wall, items[label] = _timed(local_rows, model=model, seqs=seqs, rhos=rhos, spec=spec,
                                                 lower_iter=10, **kw)
        out[label] = {"seconds": round(wall, 2), "load_before": load_avg}
    out["identical"] = (json.dumps([r.to_dict() for r in rows["1 worker"]])
                        == json.dumps([r.to_dict() for r in rows["2 workers"]]))
    _summary(out, items["1 worker"], startup + _model_load_seconds(model))
    return out


def _model_load_seconds(model: str) -> float:
    """Each worker loads the model once before its first sequence."""
    import torch

    from transcover.model import load

    t0 = time.perf_counter()
    load(model).to_torch(torch.float64)
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--functions", type=int, default=8192, help="members of the Monte-Carlo class")
    ap.add_argument("--sequences", type=int, default=16, help="sequences certified one per item")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    print(f"cores: {os.cpu_count()}, load average at start: {_load()}")
    startup = startup_seconds()
    print(f"starting 2 spawned workers that import torch: {startup:.2f} s")
    with tempfile.TemporaryDirectory() as root:
        for name, result in (("monte carlo", bench_montecarlo(args.functions, startup)),
                             ("local certification", bench_local(args.sequences, root, startup))):
            print(name, json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

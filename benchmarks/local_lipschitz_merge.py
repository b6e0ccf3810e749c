"""Merge runs of ``local_lipschitz.py`` into one 150-sentence table (issue 12): a base run and reruns of some
sentences on newer code, each row tagged with the run it comes from.

    PYTHONPATH=src:benchmarks python benchmarks/local_lipschitz_merge.py --out DIR \
        BASE.json[=LABEL] RUN.json[=LABEL] ...

Later runs replace earlier ones sentence by sentence (a run's ``sentence`` counts from its ``skip``). A replaced
row keeps the larger of the two lowers of its ball (both are attained values on the same ball: the same sentence,
layer and radius; the merge refuses a pair whose token count or median token norm differ), and every certified
ball is checked against the merged lower. Writes ``local_lipschitz.json`` (the rows with their ``run``: a merged
file is a valid base for the next merge), ``local_lipschitz_table.md`` (the table over the sentences of the newest code first, then over all of them) and
``local_lipschitz_ratio.png`` (the ratio against rho over all sentences) under ``--out``.

With ``--against OLD.json`` (an earlier run or merge, e.g. ``git show ccb88e2:docs/results/local_lipschitz.json``),
also prints, per radius, the worst and median ratio of the merged rows from each run in ``--since`` (default: the
runs not in ``--stale``) beside OLD's certified ball over the same lower (the larger of the two runs' lowers), on
the (sentence, layer, rho) both hold.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

from transcover._results import check_certified
from transcover.report import atomic_write_text

from local_lipschitz import _figure, table


def _runs(specs: list[str]) -> list[tuple[str, dict]]:
    out = []
    for spec in specs:
        path, _, label = spec.partition("=")
        with open(path) as f:
            out.append((label or os.path.basename(os.path.dirname(os.path.abspath(path))), json.load(f)))
    return out


def merge(runs: list[tuple[str, dict]]) -> list[dict]:
    """The rows of ``runs`` (``(label, local_lipschitz.json)``, oldest first) keyed by absolute (sentence, layer,
    rho); a later run's row replaces an earlier one with the larger lower of the two."""
    rows: dict = {}
    for label, run in runs:
        skip = int(run.get("skip", 0))
        for r in run["layers"]:
            r = dict(r, sentence=r["sentence"] + skip, run=r.get("run", label))  # a merged file keeps its labels
            key = (r["sentence"], r["layer"], r["rho"])
            old = rows.get(key)
            if old is not None:
                if old["T"] != r["T"] or abs(old["median_norm"] - r["median_norm"]) > 1e-12 * r["median_norm"]:
                    raise SystemExit(f"runs {old['run']} and {label} disagree on sentence {key[0]} layer {key[1]}: "
                                     f"T {old['T']} vs {r['T']}, median norm {old['median_norm']} vs {r['median_norm']}")
                if old["lower"] > r["lower"]:
                    r["lower"], r["lower_method"] = old["lower"], old["lower_method"] + f" ({old['run']})"
                r["point_lower"] = max(r["point_lower"], old["point_lower"])
                r["ratio"], r["ratio_point_lower"] = r["ball"] / r["lower"], r["ball"] / r["point_lower"]
                r["point_ratio"] = r["point"] / r["point_lower"]
            rows[key] = r
    for (s, li, rho), r in rows.items():
        check_certified(f"sentence {s} layer {li} rho {rho:g} ({r['run']})", r["ball"], r["lower"])
    return [rows[k] for k in sorted(rows)]


def against(rows: list[dict], old_rows: list[dict], labels: set[str]) -> list[str]:
    """Per radius, over the rows of ``rows`` from the runs ``labels`` that ``old_rows`` (absolute sentences) also
    holds: the worst and median of ``ball / lower`` for both, ``lower`` the larger of the two rows' lowers (both
    attained on the same ball).  Refuses a pair whose token count or median norm differ, as ``merge``."""
    old = {(r["sentence"], r["layer"], r["rho"]): r for r in old_rows}
    by_rho: dict = {}
    for r in rows:
        o = old.get((r["sentence"], r["layer"], r["rho"]))
        if r["run"] not in labels or o is None:
            continue
        if o["T"] != r["T"] or abs(o["median_norm"] - r["median_norm"]) > 1e-12 * r["median_norm"]:
            raise SystemExit(f"sentence {r['sentence']} layer {r['layer']}: the runs disagree on the input")
        lo = max(r["lower"], o["lower"])
        check_certified(f"sentence {r['sentence']} layer {r['layer']} rho {r['rho']:g} (old)", o["ball"], lo)
        by_rho.setdefault(r["rho"], []).append((r["ball"] / lo, o["ball"] / lo, r["sentence"]))
    out = [f"| rho / median | pairs | sentences | {'/'.join(sorted(labels))}: worst | median | old: worst | median |",
           "|---|---|---|---|---|---|---|"]
    for rho in sorted(by_rho):
        new, was, sents = zip(*by_rho[rho])
        out.append(f"| {rho:g} | {len(new)} | {len(set(sents))} | {max(new):.4g} | {statistics.median(new):.4g} | "
                   f"{max(was):.4g} | {statistics.median(was):.4g} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+", help="local_lipschitz.json files, oldest first, each optionally =LABEL")
    ap.add_argument("--stale", default=None,
                    help="comma-separated labels of the runs on older code (default: the first file's label; needed "
                         "when the first file is itself a merge)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--against", default=None, help="an earlier run or merge to compare the merged rows with")
    ap.add_argument("--since", default=None,
                    help="comma-separated labels of the runs compared with --against (default: every run not stale)")
    a = ap.parse_args()
    runs = _runs(a.runs)
    if a.stale is None and any("run" in r for r in runs[0][1]["layers"]):
        raise SystemExit("the first file is a merge: name its runs on older code with --stale")
    stale = set(a.stale.split(",")) if a.stale else {runs[0][0]}
    rows = merge(runs)
    old = {r["sentence"] for r in rows if r["run"] in stale}
    fresh = [r for r in rows if r["sentence"] not in old]
    counts = {label: len({r["sentence"] for r in rows if r["run"] == label})
              for label in dict.fromkeys(r["run"] for r in rows)}
    head = ("Sentences per run: " + ", ".join(f"{label} {n}" for label, n in counts.items()) + f" (older code: "
            f"{', '.join(sorted(stale))}).\n\n## The sentences rerun on the newer code\n\n")
    text = (head + table(fresh, []) + "\n## All sentences (each row from its newest run; the CPU line adds up runs "
            "of different code)\n\n" + table(rows, []))
    os.makedirs(a.out, exist_ok=True)
    atomic_write_text(os.path.join(a.out, "local_lipschitz.json"), json.dumps(
        {"n": len({r["sentence"] for r in rows}), "runs": counts, "layers": rows}, indent=1))
    atomic_write_text(os.path.join(a.out, "local_lipschitz_table.md"), text)
    _figure(rows, [], os.path.join(a.out, "local_lipschitz_ratio.png"))
    print(text)
    if a.against:
        with open(a.against) as f:
            base = json.load(f)
        skip = int(base.get("skip", 0))
        old_rows = [dict(r, sentence=r["sentence"] + skip) for r in base["layers"]]
        labels = set(a.since.split(",")) if a.since else set(counts) - stale
        print(f"\nAgainst {a.against} (ratio = ball / the larger lower of the two):\n")
        print("\n".join(against(rows, old_rows, labels)))


if __name__ == "__main__":
    main()

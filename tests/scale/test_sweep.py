"""Sweeps (issue 14, items 2-4): same rows on every backend, resume, per-item failures, the CLI."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from transcover import InputError
from transcover.cli import main
from transcover.scale import ResultStore, sweep
from transcover.scale._analyze import analysis_items, analyze_item, expand_models, parse_step, sweep_rows
from transcover.scale._synthetic import write_gpt2_checkpoint, write_llama_checkpoint

SRC = str(Path(__file__).resolve().parents[2] / "src")
OPTIONS = {"arch": None, "allow_pickle": False, "fast": False, "rtol": 1e-3, "embeddings": True}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("run")
    for step in (30, 10, 20):
        write_gpt2_checkpoint(root / f"checkpoint-{step}", d=32, layers=1, heads=2, vocab=64, positions=16, seed=step)
    # a bf16, sharded, grouped-query RoPE model too: the torch-using path must agree across backends
    write_llama_checkpoint(root / "checkpoint-40", hidden=32, intermediate=64, layers=2, heads=4, kv_heads=2,
                           vocab=64, shard_bytes=6000, seed=4)
    return root


def _rows(report):
    return json.dumps([r.value for r in report.results], sort_keys=True)


def test_serial_process_pool_and_ray_give_identical_rows(run_dir):
    items = analysis_items(expand_models([str(run_dir)]), OPTIONS)
    serial = sweep(items, analyze_item, backend="serial")
    pool = sweep(items, analyze_item, backend="process", workers=2)
    ray = sweep(items, analyze_item, backend="ray", workers=2)  # a local Ray: ray.init(num_cpus=2)
    assert serial.computed == pool.computed == ray.computed == 4
    assert _rows(serial) == _rows(pool) == _rows(ray)  # bit for bit (floats are written with repr)
    assert [r["step"] for r in sweep_rows(serial)] == [10, 20, 30, 40]
    assert [r["arch"] for r in sweep_rows(serial)] == ["gpt2"] * 3 + ["llama"]


def test_resume_reuses_finished_items_and_no_resume_recomputes(run_dir, tmp_path):
    items = analysis_items(expand_models([str(run_dir)]), OPTIONS)
    with ResultStore(tmp_path / "s.sqlite") as store:
        first = sweep(items[:2], analyze_item, store=store)
        again = sweep(items, analyze_item, store=store)
        assert (first.computed, again.reused, again.computed) == (2, 2, 2)
        assert _rows(again) == _rows(sweep(items, analyze_item))
        fresh = sweep(items, analyze_item, store=store, resume=False)
        assert (fresh.reused, fresh.computed, len(store)) == (0, 4, 4)


def test_options_are_part_of_the_key(run_dir):
    models = expand_models([str(run_dir)])
    a = analysis_items(models, OPTIONS)
    b = analysis_items(models, {**OPTIONS, "rtol": 1e-4})
    assert not {i.key for i in a} & {i.key for i in b}


def test_rewriting_a_checkpoint_changes_its_key(tmp_path):
    ckpt = write_gpt2_checkpoint(tmp_path / "checkpoint-1", d=32, layers=1, heads=2, vocab=64, positions=16)
    before = analysis_items([str(ckpt)], OPTIONS)[0].key
    write_gpt2_checkpoint(ckpt, d=32, layers=1, heads=2, vocab=64, positions=16, seed=5)
    assert analysis_items([str(ckpt)], OPTIONS)[0].key != before


def test_broken_checkpoints_fail_alone(run_dir, tmp_path):
    bad = tmp_path / "checkpoint-99"
    bad.mkdir()
    good = run_dir / "checkpoint-10"
    (bad / "config.json").write_text((good / "config.json").read_text())
    (bad / "model.safetensors").write_bytes((good / "model.safetensors").read_bytes()[:5000])  # half-written
    models = [str(good), str(bad), str(tmp_path / "missing"), str(run_dir / "checkpoint-20")]
    report = sweep(analysis_items(models, OPTIONS), analyze_item, backend="process", workers=2)
    assert [r.ok for r in report.results] == [True, False, False, True]
    assert "truncated" in report.failed[0].value or "does not fit" in report.failed[0].value
    assert "not found" in report.failed[1].value


def test_duplicate_items_are_computed_once(run_dir):
    items = analysis_items([str(run_dir / "checkpoint-10")] * 3, OPTIONS)
    report = sweep(items, analyze_item)
    assert report.computed == 1 and len(report.results) == 3


def test_ray_missing_is_one_line_naming_the_extra(run_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # "import ray" now raises ImportError
    items = analysis_items([str(run_dir / "checkpoint-10")], OPTIONS)
    with pytest.raises(InputError, match=r"pip install 'transcover\[ray\]'"):
        sweep(items, analyze_item, backend="ray")


def test_parse_step():
    assert parse_step("/runs/a/checkpoint-1200") == 1200
    assert parse_step("/runs/step_30/model.safetensors") == 30
    assert parse_step("/models/gpt2") is None


def test_cli_sweep_writes_rows_figure_and_reports_failures(run_dir, tmp_path, capsys):
    bad = tmp_path / "checkpoint-50"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    models = [str(p) for p in sorted(run_dir.iterdir())] + [str(bad)]
    out, csv, fig = tmp_path / "o.json", tmp_path / "o.csv", tmp_path / "o.png"
    rc = main(["analyze", *models, "--store", str(tmp_path / "s.sqlite"), "--json", str(out), "--csv", str(csv),
               "--figure", str(fig), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 1  # documented: some item failed, the others were written
    assert "FAILED" in err and "checkpoint-50" in err and "1 failed" in err
    data = json.loads(out.read_text())
    assert [r["step"] for r in data["rows"]] == [10, 20, 30, 40] and data["counts"]["failed"] == 1
    assert fig.read_bytes()[:4] == b"\x89PNG"
    import csv as csv_mod

    table = list(csv_mod.DictReader(csv.read_text().splitlines()))
    # the failed checkpoint has its own row, marked, with no bound (red team 184: the CSV left it out)
    assert [r["step"] for r in table] == ["10", "20", "30", "40", "50"]
    assert all(r["error"] == "" for r in table[:4]) and table[4]["error"] and table[4]["B_W1_upper"] == ""
    rc = main(["analyze", str(run_dir), "--store", str(tmp_path / "s.sqlite"), "--quiet"])
    assert rc == 0 and "0 computed, 4 reused" in capsys.readouterr().err


def test_cli_corrupt_store_and_missing_ray_are_one_line_exit_2(run_dir, tmp_path):
    store = tmp_path / "bad.sqlite"
    store.write_bytes(b"\x00" * 5000)
    env = {"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-m", "transcover.cli", "analyze", str(run_dir), "--store", str(store)],
                          env=env, capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "is corrupt and was not used" in proc.stderr
    hide_ray = "import sys; sys.modules['ray'] = None; from transcover.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.run([sys.executable, "-c", hide_ray, "analyze", str(run_dir), "--backend", "ray",
                           "--store", str(tmp_path / "s.sqlite")], env=env, capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "pip install 'transcover[ray]'" in proc.stderr


def _dies_on_three(i):
    if i == 3:
        import os

        os._exit(9)  # a worker killed mid-item (as by the OOM killer)
    return {"i": i}


def test_a_dying_worker_fails_only_its_own_item():
    from transcover.scale import Item

    items = [Item(f"k{i}", f"item {i}", i) for i in range(7)]
    report = sweep(items, _dies_on_three, backend="process", workers=2)
    assert [r.ok for r in report.results] == [i != 3 for i in range(7)]
    assert "worker process died" in report.results[3].value
    assert [r.value for r in report.results if r.ok] == [{"i": i} for i in range(7) if i != 3]


def test_quick_keys_follow_mtimes_and_full_keys_follow_bytes(tmp_path):
    import os

    from transcover.scale import fingerprint

    ckpt = write_gpt2_checkpoint(tmp_path / "c", d=32, layers=1, heads=2, vocab=64, positions=16)
    quick, full = fingerprint(ckpt), fingerprint(ckpt, "full")
    (ckpt / "optimizer.pt").write_bytes(b"training state, not weights")
    assert (fingerprint(ckpt), fingerprint(ckpt, "full")) == (quick, full)
    weights = ckpt / "model.safetensors"
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # same bytes, new mtime (a copy)
    assert fingerprint(ckpt) != quick and fingerprint(ckpt, "full") == full
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one bit of one weight, header and size unchanged
    weights.write_bytes(bytes(data))
    assert fingerprint(ckpt, "full") != full


def test_keys_follow_the_roles_mapping_and_the_tokenizer(tmp_path):
    """The loader reads ``transcover_roles.json`` (which tensor is W_1) and, for texts, ``tokenizer.json``;
    leaving them out of the key let a resumed sweep reuse B_W1 = 0.84 after the roles file had made the
    matrix of norm 85.8 W_1 (red team of stop 36)."""
    from transcover.scale import fingerprint

    ckpt = write_gpt2_checkpoint(tmp_path / "c", d=32, layers=1, heads=2, vocab=64, positions=16)

    def keys():
        return [fingerprint(p, mode) for p in (ckpt, ckpt / "model.safetensors") for mode in ("quick", "full")]

    seen = [keys()]
    for name, text in (("transcover_roles.json", '{"roles": {}}'), ("tokenizer.json", "{}"),
                       ("transcover_roles.json", '{"roles": {"W_1": "x"}}')):
        (ckpt / name).write_text(text)
        seen.append(keys())
        # every edit moves every key: the folder's and the bare weights file's, quick and full
        assert all(new != old for new, old in zip(seen[-1], seen[-2]))


def test_local_keys_follow_an_explicit_roles_file(tmp_path):
    """``lipschitz --data --roles r.json --workers 2``: the items' keys cover the mapping (its content, not the file's
    name or spacing), so a resumed run after an edit of the mapping recomputes, and the workers load through it."""
    import torch

    from transcover.scale._local import local_items

    ckpt = write_gpt2_checkpoint(tmp_path / "c", d=32, layers=1, heads=2, vocab=64, positions=16)
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    for f in (a, b):
        f.write_text('{"roles": {}}')

    def item(roles):  # noqa: ANN001, ANN202
        return local_items(str(ckpt), [torch.zeros(3, 32, dtype=torch.float64)], [1e-3], roles=roles)[0]

    assert item(None).key != item(str(a)).key == item(str(b)).key != item({"roles": {"W_1": "x"}}).key
    assert item(str(a)).payload["roles"] == str(a) and item(None).payload["roles"] is None
    b.write_text('{ "roles" : {"W_1":"x"} }')
    assert item(str(b)).key != item(str(a)).key and item(str(b)).key == item({"roles": {"W_1": "x"}}).key


def test_a_config_json_path_is_keyed_as_its_folder(tmp_path, capsys):
    """Red team 184: ``analyze A/config.json B/config.json`` (the loader reads each folder) keyed the config alone, so
    two checkpoints with one config shared a key and B's row carried A's numbers; rewritten weights were reused."""
    from transcover.scale import fingerprint

    a = write_gpt2_checkpoint(tmp_path / "a", d=32, layers=1, heads=2, vocab=64, positions=16, seed=0)
    b = write_gpt2_checkpoint(tmp_path / "b", d=32, layers=1, heads=2, vocab=64, positions=16, seed=1)
    assert (a / "config.json").read_bytes() == (b / "config.json").read_bytes()
    for mode in ("quick", "full"):
        assert fingerprint(a / "config.json", mode) == fingerprint(a, mode) != fingerprint(b / "config.json", mode)
    out, store = tmp_path / "s.json", tmp_path / "st.sqlite"
    argv = ["analyze", str(a / "config.json"), str(b / "config.json"), "--store", str(store), "--quiet"]
    assert main([*argv, "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    singles = []
    for m in (a, b):
        assert main(["analyze", str(m), "--quiet", "--json", str(tmp_path / "one.json")]) == 0
        singles.append(json.loads((tmp_path / "one.json").read_text())["summary"]["B_W1"]["upper"])
    assert [r["B_W1_upper"] for r in rows] == singles and singles[0] != singles[1]


def test_describe_is_refused_in_a_sweep(tmp_path, capsys):
    """Red team 184: the dry run (``--describe``) with several models computed and stored a whole sweep."""
    a = write_gpt2_checkpoint(tmp_path / "a", d=32, layers=1, heads=2, vocab=64, positions=16)
    assert main(["analyze", str(a), str(a), "--describe", "--store", str(tmp_path / "st.sqlite")]) == 2
    assert "--describe lists one model's tensors" in capsys.readouterr().err
    assert not (tmp_path / "st.sqlite").exists()


def test_a_worker_reloads_a_model_whose_mapping_file_changed(tmp_path):
    """Red team 184: the per-process spec cache of ``lipschitz --data`` items was keyed on the mapping file's path, so
    a second call in one process after the file swapped W_1 and W_gate computed with the old reading (and stored that
    under the new key)."""
    import torch

    from transcover.scale import fingerprint
    from transcover.scale._local import _spec

    ckpt = tmp_path / "llama"
    write_llama_checkpoint(ckpt, hidden=16, intermediate=24, layers=1, heads=2, kv_heads=1, vocab=32, dtype="F32")
    roles = tmp_path / "roles.json"

    def mapping(w1: str, gate: str) -> str:
        return json.dumps({
            "layers": "model.layers.{i}.", "n_heads": 2, "n_kv_heads": 1, "placement": "pre", "norm": "rmsnorm",
            "eps": 1e-5, "activation": "silu", "causal": True, "rope_theta": 500000.0, "max_position": 2048,
            "roles": {"W_Q": "self_attn.q_proj.weight", "W_K": "self_attn.k_proj.weight",
                      "W_V": "self_attn.v_proj.weight", "W_O": "self_attn.o_proj.weight", "W_gate": gate, "W_1": w1,
                      "W_2": "mlp.down_proj.weight", "norm_attn.weight": "input_layernorm.weight",
                      "norm_ffn.weight": "post_attention_layernorm.weight"},
            "final_norm": {"weight": "model.norm.weight"},
            "embeddings": {"token_embedding": "model.embed_tokens.weight"}})

    payload = {"fingerprint": fingerprint(ckpt), "model": str(ckpt), "arch": None, "allow_pickle": False,
               "strict": False, "roles": str(roles)}
    roles.write_text(mapping("mlp.up_proj.weight", "mlp.gate_proj.weight"))
    first = _spec(payload).layers[0].ffn
    W1, Wg = first.W_1.clone(), first.W_gate.clone()
    roles.write_text(mapping("mlp.gate_proj.weight", "mlp.up_proj.weight"))  # the same path, W_1 and W_gate swapped
    second = _spec(payload).layers[0].ffn
    assert torch.equal(second.W_1, Wg) and torch.equal(second.W_gate, W1) and not torch.equal(W1, Wg)


def test_a_model_given_twice_is_counted_once(tmp_path, capsys):
    """Red team 184: ``analyze c100 c100 c200`` printed [1/3], [2/3] and never [3/3], and "2 item(s)" beside the JSON's
    3: the progress counts the distinct computations, the summary says how many were given."""
    a = write_gpt2_checkpoint(tmp_path / "a", d=32, layers=1, heads=2, vocab=64, positions=16, seed=0)
    b = write_gpt2_checkpoint(tmp_path / "b", d=32, layers=1, heads=2, vocab=64, positions=16, seed=1)
    assert main(["analyze", str(a), str(a), str(b), "--store", str(tmp_path / "s.sqlite"), "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "[1/2]" in err and "[2/2]" in err and "/3]" not in err
    assert "2 item(s) (3 given): 2 computed" in err


def test_items_sharing_a_key_keep_their_own_labels(run_dir, tmp_path):
    """Two byte-identical checkpoints (one key under --hash full) were both listed under the first's name."""
    import shutil

    copy = tmp_path / "checkpoint-11"
    shutil.copytree(run_dir / "checkpoint-10", copy)
    items = analysis_items([str(run_dir / "checkpoint-10"), str(copy)], OPTIONS, "full")
    assert items[0].key == items[1].key and items[0].label != items[1].label
    report = sweep(items, analyze_item)
    assert [r.item.label for r in report.results] == [it.label for it in items]
    assert report.computed == 1 and report.results[0].value == report.results[1].value


def test_keys_cover_shards_in_a_subfolder(tmp_path):
    """Stop 38 red team: an index may point into a subfolder (``sub/model-00001.safetensors``, which the loader
    follows); the key of the folder hashed only its top-level files, so rewritten shards there reused the old result,
    with ``--hash full`` too."""
    import os
    import shutil

    from transcover.scale import fingerprint

    ckpt = tmp_path / "c"
    write_llama_checkpoint(ckpt, hidden=32, intermediate=64, layers=2, heads=4, kv_heads=2, vocab=64, shard_bytes=6000,
                           seed=4)
    index = next(ckpt.glob("*.index.json"))
    data = json.loads(index.read_text())
    (ckpt / "sub").mkdir()
    for name in set(data["weight_map"].values()):
        shutil.move(ckpt / name, ckpt / "sub" / name)
    data["weight_map"] = {k: f"sub/{v}" for k, v in data["weight_map"].items()}
    index.write_text(json.dumps(data))
    keys = (fingerprint(ckpt), fingerprint(ckpt, "full"))
    shard = ckpt / "sub" / sorted(set(data["weight_map"].values()))[-1].split("/")[-1]
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 1  # one bit of one weight, header and size unchanged
    st = shard.stat()
    shard.write_bytes(bytes(raw))
    assert fingerprint(ckpt, "full") != keys[1]
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert fingerprint(ckpt) != keys[0]


def test_a_checkpoint_replaced_during_a_load_is_refused(tmp_path):
    """Stop 38 red team: each tensor is read through a new handle, so a checkpoint replaced between two tensors (a
    trainer saving the next step) gave layer 0 from one model and layer 1 from the other, without a word."""
    import os

    from transcover.model._safetensors import SafetensorsFile

    a = write_gpt2_checkpoint(tmp_path / "a", d=32, layers=2, heads=2, vocab=64, positions=16, seed=1)
    b = write_gpt2_checkpoint(tmp_path / "b", d=32, layers=2, heads=2, vocab=64, positions=16, seed=2)
    f = SafetensorsFile(a / "model.safetensors")
    first, second = f.keys()[:2]
    f.get(first)
    os.replace(b / "model.safetensors", a / "model.safetensors")  # same architecture, same size
    with pytest.raises(InputError, match="replaced or rewritten since it was opened"):
        f.get(second)


def test_sweep_keeps_strict_and_refuses_single_model_options(tmp_path, capsys):
    """Stop 38 red team: a sweep dropped --strict (a checkpoint --strict refuses alone was analysed with a warning,
    exit 0, and stored under the non-strict key) and ignored --plot and --roles without a word."""
    from safetensors.numpy import load_file, save_file

    a = write_gpt2_checkpoint(tmp_path / "checkpoint-1", d=32, layers=1, heads=2, vocab=64, positions=16, seed=1)
    b = write_gpt2_checkpoint(tmp_path / "checkpoint-2", d=32, layers=1, heads=2, vocab=64, positions=16, seed=2)
    tensors = load_file(b / "model.safetensors")
    tensors["h.0.attn.extra_gate"] = tensors["h.0.ln_1.weight"].copy()  # a tensor the architecture does not define
    save_file(tensors, b / "model.safetensors")
    store = str(tmp_path / "s.sqlite")
    assert main(["analyze", str(b), "--strict", "--quiet"]) == 2
    capsys.readouterr()
    assert main(["analyze", str(a), str(b), "--store", store, "--quiet"]) == 0  # warns, as analyze alone does
    capsys.readouterr()
    assert main(["analyze", str(a), str(b), "--store", store, "--strict", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "FAILED" in err and "checkpoint-2" in err and "0 reused" in err  # --strict is in the key: a new one
    for extra, needle in ((["--plot", str(tmp_path / "p.png")], "--plot"), (["--roles", str(tmp_path / "r.json")],
                                                                           "--roles")):
        assert main(["analyze", str(a), str(b), "--store", store, *extra]) == 2
        assert needle in capsys.readouterr().err


def test_quick_keys_tell_checkpoints_with_equal_mtimes_apart(tmp_path):
    """Red team 167: quick keys hashed file names, sizes, mtimes and headers only, so two checkpoints of one
    architecture whose weights had equal mtimes (tar keeps whole seconds) shared one key, and a sweep gave both rows
    the first one's result, with --no-resume too; a weight rewritten in place with its old mtime restored kept its
    key. The absolute path, device, inode and ctime are in the key now."""
    import os

    from transcover.scale import fingerprint

    a = write_gpt2_checkpoint(tmp_path / "a", d=32, layers=1, heads=2, vocab=64, positions=16)
    b = write_gpt2_checkpoint(tmp_path / "b", d=32, layers=1, heads=2, vocab=64, positions=16, seed=1)
    for ckpt in (a, b):
        for f in ckpt.iterdir():
            os.utime(f, ns=(10**18, 10**18))
    assert (a / "model.safetensors").read_bytes() != (b / "model.safetensors").read_bytes()
    assert fingerprint(a) != fingerprint(b)
    items = analysis_items([str(a), str(b)], OPTIONS, "quick")
    assert items[0].key != items[1].key
    report = sweep(items, analyze_item)
    assert report.computed == 2 and report.results[0].value != report.results[1].value
    # rewritten in place, its old mtime restored: the ctime moves, so the key does
    key = fingerprint(a)
    weights = a / "model.safetensors"
    st = weights.stat()
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert weights.stat().st_mtime_ns == st.st_mtime_ns and fingerprint(a) != key


def test_keys_change_with_the_code(monkeypatch):
    """Red team 167: the key held ``__version__`` only, which never changed across the commits that changed computed
    numbers, so a store written by an older checkout was reused after an upgrade. The key holds a digest of every
    source file of the package."""
    from transcover.scale import _keys

    digest = _keys.code_digest()
    assert len(digest) == 64 and digest == _keys.code_digest()
    before = _keys.item_key("analyze", "f" * 64, {"a": 1})
    monkeypatch.setattr(_keys, "code_digest", lambda: "0" * 64)
    assert _keys.item_key("analyze", "f" * 64, {"a": 1}) != before


def test_single_model_runs_refuse_the_options_only_a_sweep_uses(tmp_path, capsys, monkeypatch):
    """Red team 167 (left open at stop 40): --store, --workers, --backend, --hash, --no-resume given to a single-model
    ``analyze``, or to ``lipschitz`` without --data, did nothing, without a word; --threads is honoured by a single
    ``analyze``. Values equal to the defaults change nothing and pass."""
    monkeypatch.chdir(tmp_path)
    a = write_gpt2_checkpoint(tmp_path / "a", d=32, layers=1, heads=2, vocab=64, positions=16, seed=1)
    store = tmp_path / "s.sqlite"
    for argv, needles in (
            (["analyze", str(a), "--store", str(store)], ["--store applies to a sweep", "a single model"]),
            (["analyze", str(a), "--workers", "2", "--backend", "ray"], ["--workers, --backend apply to a sweep"]),
            (["analyze", str(a), "--hash", "full", "--no-resume"], ["--no-resume, --hash apply"]),
            (["lipschitz", str(a), "--store", str(store)], ["--store applies to the sequences of --data",
                                                             "the global bounds (no --data)"]),
            (["lipschitz", str(a), "--threads", "2", "--workers", "3"], ["--workers, --threads apply"])):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and all(n in err for n in needles), err
    assert not store.exists() and not (tmp_path / "transcover-results.sqlite").exists()
    import torch

    before = torch.get_num_threads()
    try:
        assert main(["analyze", str(a), "--quiet", "--threads", "1", "--workers", "1", "--backend", "local"]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert main(["analyze", str(a), "--threads", "0", "--quiet"]) == 2
    assert "--threads must be >= 1" in capsys.readouterr().err
    assert not (tmp_path / "transcover-results.sqlite").exists()
    # a sweep still defaults to ./transcover-results.sqlite
    b = write_gpt2_checkpoint(tmp_path / "b", d=32, layers=1, heads=2, vocab=64, positions=16, seed=2)
    assert main(["analyze", str(a), str(b), "--quiet"]) == 0
    assert (tmp_path / "transcover-results.sqlite").exists()

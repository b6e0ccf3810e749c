"""`transcover analyze` end to end: outputs, JSON schema, and every bad input as one clear line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from transcover.cli import main
from transcover.model import ReferenceConfig, ReferenceTransformer, save_reference


@pytest.fixture(scope="module")
def ref_file(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    model = ReferenceTransformer(ReferenceConfig(d_model=16, n_heads=2, n_layers=2, d_ff=24))
    return save_reference(model, tmp_path_factory.mktemp("ref") / "ref.safetensors")


def _run(argv, capsys):
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_json_and_csv_follow_the_schema(ref_file, tmp_path, capsys):
    js, cs = tmp_path / "a.json", tmp_path / "a.csv"
    code, out, err = _run(["analyze", str(ref_file), "--json", str(js), "--csv", str(cs), "--heads"], capsys)
    assert code == 0, err
    data = json.loads(js.read_text())
    assert data["schema"] == "transcover.analyze" and data["schema_version"] == "1.0"
    assert data["kind"] == "certified interval" and len(data["layers"]) == 2
    for layer in data["layers"]:
        for key in ("B_KQ", "B_V", "B_W1", "B_W2", "B_b1", "B_b2"):
            # every interval names its kind (issue 11: one serialiser, kind always kept)
            assert set(layer[key]) == {"lower", "upper", "kind"} and layer[key]["lower"] <= layer[key]["upper"]
            assert layer[key]["kind"] == "certified interval"
        assert len(layer["heads"]) == 2
        for head in layer["heads"]:
            assert {"B_KQ", "B_V"} <= set(head)
    assert cs.read_text().splitlines()[0].startswith("layer,B_KQ_lower,B_KQ_upper")
    assert "B_KQ" in out and "per head" in out


def test_bundled_model_is_the_default_and_runs_as_a_process(tmp_path):
    js = tmp_path / "minilm.json"
    proc = subprocess.run([sys.executable, "-m", "transcover.cli", "analyze", "--quiet", "--json", str(js)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(js.read_text())
    assert data["arch"] == "bert" and data["n_layers"] == 6 and data["n_heads"] == 12 and data["d_model"] == 384
    widest = max((lay[k]["upper"] - lay[k]["lower"]) / lay[k]["upper"]
                 for lay in data["layers"] for k in ("B_KQ", "B_V", "B_W1", "B_W2"))
    assert widest <= 1e-3
    assert {e["name"] for e in data["embeddings"]} >= {"token_embedding", "position_embedding"}


def _bad(argv, capsys, tmp_path, pattern):
    out_json = tmp_path / "never.json"
    code, out, err = _run([*argv, "--json", str(out_json)], capsys)
    assert code != 0
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("transcover: error:"), err
    assert pattern in lines[0], lines[0]
    assert not out_json.exists() and not list(tmp_path.glob(".never.json*"))  # nothing half-written
    return lines[0]


def test_missing_path(capsys, tmp_path):
    _bad(["analyze", str(tmp_path / "nope")], capsys, tmp_path, "nope")


def test_truncated_safetensors(ref_file, capsys, tmp_path):
    cut = tmp_path / "cut.safetensors"
    data = ref_file.read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    _bad(["analyze", str(cut)], capsys, tmp_path, "cut.safetensors")


def test_random_bytes(capsys, tmp_path):
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(os.urandom(4096))
    _bad(["analyze", str(junk)], capsys, tmp_path, "junk.safetensors")


def test_nan_weight_names_the_tensor(capsys, tmp_path):
    torch.manual_seed(0)
    model = ReferenceTransformer(ReferenceConfig(d_model=8, n_heads=2, n_layers=2, d_ff=8))
    with torch.no_grad():
        model.blocks[1].W_2[3, 4] = float("nan")
    path = save_reference(model, tmp_path / "nan.safetensors")
    _bad(["analyze", str(path)], capsys, tmp_path, "blocks.1.W_2")


def test_bare_safetensors_without_arch(capsys, tmp_path):
    path = tmp_path / "bare.safetensors"
    save_file({"x.weight": torch.zeros(2, 2)}, str(path))
    line = _bad(["analyze", str(path)], capsys, tmp_path, "arch")
    assert "bert" in line  # names the supported architectures


def test_unknown_arch_lists_supported(capsys, tmp_path):
    path = tmp_path / "bare.safetensors"
    save_file({"x.weight": torch.zeros(2, 2)}, str(path))
    line = _bad(["analyze", str(path), "--arch", "mamba"], capsys, tmp_path, "mamba")
    assert "gpt2" in line and "llama" in line


def test_pickle_refused_by_default(capsys, tmp_path):
    path = tmp_path / "model.bin"
    torch.save({"a": torch.zeros(1)}, path)
    _bad(["analyze", str(path), "--arch", "bert"], capsys, tmp_path, "allow-pickle")


def test_bad_rtol(ref_file, capsys, tmp_path):
    _bad(["analyze", str(ref_file), "--rtol", "-1"], capsys, tmp_path, "rtol")


def test_unwritable_output_leaves_nothing(ref_file, capsys, tmp_path):
    code, out, err = _run(["analyze", str(ref_file), "--quiet", "--json", str(tmp_path / "no" / "dir.json")], capsys)
    assert code == 2 and "does not exist" in err and len(err.strip().splitlines()) == 1


def test_half_precision_checkpoints_are_upcast(capsys, tmp_path):
    torch.manual_seed(0)
    model = ReferenceTransformer(ReferenceConfig(d_model=8, n_heads=2, n_layers=1, d_ff=8))
    for dtype in (torch.float16, torch.bfloat16):
        model_h = ReferenceTransformer(model.cfg)
        model_h.load_state_dict(model.state_dict())
        model_h.to(dtype)
        path = save_reference(model_h, tmp_path / f"{dtype}.safetensors")
        js = tmp_path / f"{dtype}.json"
        code, _, err = _run(["analyze", str(path), "--quiet", "--json", str(js)], capsys)
        assert code == 0, err
        exact = float(torch.linalg.matrix_norm(model_h.blocks[0].W_1.detach().double(), 2))
        iv = json.loads(js.read_text())["layers"][0]["B_W1"]
        assert iv["lower"] <= exact * (1 + 1e-12) and iv["upper"] >= exact * (1 - 1e-12)


def test_debug_shows_the_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "transcover.cli", "--debug", "analyze", str(tmp_path / "nope")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "Traceback" in proc.stderr

"""``transcover cover``: the three modes end to end, and one-line errors for bad input."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from transcover.cli import main


def test_finite_mode_writes_json_and_plot(tmp_path, capsys):
    np.save(tmp_path / "grid.npy", np.arange(10.0)[:, None])
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    rc = main(["cover", "finite", str(tmp_path / "grid.npy"), "--eps", "0.5", "1", "--exact",
               "--json", str(out), "--plot", str(png)])
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    # 10 grid points, spacing 1: N_int(0.5) = 10, N_ext(0.5) = 5 (packing attains it); eps = 1: 4 and 4
    assert [(r["packing_size"], r["exact_internal"]) for r in rows] == [(5, 10), (4, 4)]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_is_written_in_the_format_its_suffix_names(tmp_path, capsys):
    """Red team 220: ``--plot x.svg`` (or .pdf, .txt) wrote PNG bytes with exit 0; as ``perturb``, the suffix now picks
    the format and any other suffix is refused in one line before any work."""
    np.save(tmp_path / "grid.npy", np.arange(4.0)[:, None])
    base = ["cover", "finite", str(tmp_path / "grid.npy"), "--eps", "1", "--quiet"]
    for suffix, magic in ((".svg", b"<?xml"), (".PDF", b"%PDF-"), (".png", b"\x89PNG\r\n\x1a\n")):
        path = tmp_path / f"x{suffix}"
        assert main(base + ["--plot", str(path)]) == 0
        assert path.read_bytes().startswith(magic), (suffix, path.read_bytes()[:8])
        assert (b"<svg" in path.read_bytes()) == (suffix == ".svg")
    capsys.readouterr()
    json_path = tmp_path / "never.json"
    assert main(base + ["--plot", str(tmp_path / "x.txt"), "--json", str(json_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"transcover: error: --plot must end in .png or .svg or .pdf, but got --plot={tmp_path / 'x.txt'}"]
    assert not (tmp_path / "x.txt").exists() and not json_path.exists()


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_finite_mode_reads_torch_formats(tmp_path, suffix):
    Y = torch.arange(6.0).reshape(6, 1, 1)
    path = tmp_path / f"y{suffix}"
    if suffix == ".pt":
        torch.save({"outputs": Y, "other": Y}, path)
    else:
        from safetensors.torch import save_file

        save_file({"outputs": Y}, str(path))
    out = tmp_path / "r.json"
    pickle = ["--allow-pickle"] if suffix == ".pt" else []
    if pickle:  # a pickle is read only when asked (stop 36: it was read by default)
        assert main(["cover", "finite", str(path), "--eps", "1", "--json", str(out)]) == 2
        assert not out.exists()
    assert main(["cover", "finite", str(path), "--eps", "1", "--json", str(out)] + pickle) == 0
    assert json.loads(out.read_text())["rows"][0]["net_size"] == 3  # centres 0, 2, 4


def test_reference_and_uniform_modes(tmp_path):
    out = tmp_path / "mc.json"
    assert main(["cover", "reference", "--functions", "200", "--layers", "1", "--d-model", "8", "--d-ff", "8",
                 "--samples", "4", "--seq-len", "2", "--eps", "0.02", "0.05", "0.1", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["checkpoints"][-1] == 200 and len(data["rows"]) == 3
    # the greedy net bounds the packing number P from below and only estimates N (red team 37f)
    row = data["rows"][0]
    assert row["log_N_estimate"]["kind"] == "estimate" and row["log_P_lower"]["kind"] == "empirical lower bound"
    # the same net's log: the estimate to nearest, the lower bound rounded down (THEORY F112, logs of counts)
    est, low = row["log_N_estimate"]["value"], row["log_P_lower"]["value"]
    assert low in (est, math.nextafter(est, -math.inf))
    out2 = tmp_path / "u.json"
    assert main(["cover", "uniform", "--functions", "60", "--layers", "1", "--d-model", "8", "--d-ff", "8",
                 "--n", "2", "--pool", "6", "--restarts", "1", "--eps", "0.05", "--json", str(out2)]) == 0
    assert json.loads(out2.read_text())["rows"][0]["best_packing"] >= 1


@pytest.mark.parametrize("argv,match", [
    (["cover", "finite", "MISSING.npy", "--eps", "1"], "outputs file not found"),
    (["cover", "finite", "GRID", "--eps", "0"], "--eps must be"),
    (["cover", "finite", "GRID", "--eps", "1", "--q", "3"], "q must be 1, 2 or inf"),
    (["cover", "finite", "BAD", "--eps", "1"], "must have shape"),
    (["cover", "reference", "--functions", "0"], "--functions must be a positive integer"),
    (["cover", "reference", "--radius", "-1"], "radius scale must be a finite number > 0"),
    # inf is no scale (red team 220: "must be > 0, but got scale=inf"); a product beyond float64 is named as one
    (["cover", "reference", "--radius", "inf"], "radius scale must be a finite number > 0, but got scale=inf"),
    (["cover", "uniform", "--radius", "nan"], "radius scale must be a finite number > 0, but got scale=nan"),
    (["cover", "reference", "--radius", "1e308", "--B_KQ", "10"],
     "radius scale x B_KQ overflows in float64: scale=1e+308 x B_KQ=10.0 = inf"),
    (["cover", "uniform", "--radius", "1e-300", "--B_V", "1e-30"],
     "radius scale x B_V underflows to 0 in float64: scale=1e-300 x B_V=1e-30 = 0.0"),
    (["cover", "reference", "--B_KQ", "0"], "B_KQ must be"),
    (["cover", "uniform", "--samples", "-3"], "--samples must be a positive integer"),
    (["cover", "finite", "GRID", "--eps", "1", "--key", "nope"], "holds one array, not named tensors"),  # red team 181
    (["cover", "finite", "U64BIG", "--eps", "1"], "integers beyond 2^53"),
])
def test_bad_input_one_line_exit_2(tmp_path, capsys, argv, match):
    np.save(tmp_path / "grid.npy", np.arange(4.0)[:, None])
    np.save(tmp_path / "bad.npy", np.zeros((2, 2, 2, 2)))
    np.save(tmp_path / "u64big.npy", np.array([[2**60], [0]], dtype=np.uint64))
    subst = {"GRID": str(tmp_path / "grid.npy"), "BAD": str(tmp_path / "bad.npy"),
             "MISSING.npy": str(tmp_path / "missing.npy"), "U64BIG": str(tmp_path / "u64big.npy")}
    json_path = tmp_path / "never.json"
    rc = main([subst.get(a, a) for a in argv] + ["--json", str(json_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("transcover: error: ") and match in err[0]
    assert not json_path.exists()


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, np.uint64, np.int32])
def test_unsigned_outputs_are_read_exactly(tmp_path, dtype):
    """Red team 181: uint16/32/64 outputs were an internal error (torch has no comparisons for them, exit 1); they are
    read as the integers they hold, the same cover as their float64 values."""
    vals = np.array([[0], [1], [3], [7], [8]])
    np.save(tmp_path / "u.npy", vals.astype(dtype))
    np.save(tmp_path / "f.npy", vals.astype(np.float64))
    docs = []
    for name in ("u", "f"):
        out = tmp_path / f"{name}.json"
        argv = ["cover", "finite", str(tmp_path / f"{name}.npy"), "--eps", "1", "--quiet", "--json", str(out)]
        assert main(argv) == 0
        docs.append(json.loads(out.read_text())["rows"])
    assert docs[0] == docs[1] and docs[0]


def test_write_failures_and_a_file_as_output_folder_are_one_line(tmp_path, capsys):
    """Stop 36: a write the OS refuses named the hidden temporary file; ``train --out FILE`` printed a raw Errno."""
    Y = tmp_path / "y.npy"
    np.save(Y, np.arange(6.0).reshape(6, 1, 1))
    blocker = tmp_path / "afile"
    blocker.write_text("not a folder")
    assert main(["cover", "finite", str(Y), "--eps", "1", "--json", str(blocker / "r.json")]) == 2
    assert main(["train", "--task", "parity", "--epochs", "1", "--out", str(blocker)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 2 and all(".tmp" not in e and "Errno" not in e for e in err), err
    assert str(blocker) in err[1]


@pytest.mark.parametrize("argv, needle", [
    (["--eps", "1e-400"], "'1e-400' is below float64's range (it would read as 0)"),
    (["--eps", "1e400"], "'1e400' is beyond float64's range (it would read as infinity)"),
    (["--eps", "abc"], "invalid float value: 'abc'"),
])
def test_a_float_option_names_the_value_typed(tmp_path, capsys, argv, needle):
    """Red team 162: ``--eps 1e-400`` was refused as "got --eps=0.0", a value never typed (float64 rounds the literal
    to 0); every float option now refuses such literals as typed."""
    np.save(tmp_path / "y.npy", np.array([[0.0], [1.0]]))
    with pytest.raises(SystemExit) as e:
        main(["cover", "finite", str(tmp_path / "y.npy"), *argv])
    assert e.value.code == 2 and needle in capsys.readouterr().err


def test_pool_below_n_names_the_options(capsys):
    """Red team 162: the refusal named the API's ``pool_size``, not ``--pool``."""
    assert main(["cover", "uniform", "--n", "5", "--pool", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--pool must be >= --n" in err and "pool_size" not in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("argv, needle", [
    (["cover", "local", "minilm", "--perturb", "W_1=0.05", "W_Q=1e-400"], "--perturb W_Q: '1e-400' is below"),
    (["approx", "sweep", "--over", "R", "--Rs", "1e-400,2"], "'1e-400' is below float64's range"),
    (["approx", "sweep", "--over", "dm", "--cases", "1e999:2"], "'1e999' is beyond float64's range"),
    (["lipschitz", "--data", "sklearn-descr", "--limit", "1", "--rho", "1e-3,1e-400"], "'1e-400' is below"),
])
def test_numbers_inside_lists_name_the_value_typed(capsys, argv, needle):
    """Red team 166: values inside ROLE=R items and comma lists bypassed the float options' check; ``--perturb
    W_Q=1e-400`` left W_Q unperturbed without a word (its radius read as 0 skips the role)."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1

"""Issue 13, points 2-5: one spelling per concept, help with defaults, envelopes, figures, notebooks."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import transcover
from transcover.cli import build_parser, main
from transcover.model import ReferenceConfig, ReferenceTransformer, save_reference
from transcover.report import envelope, file_sha256


@pytest.fixture(scope="module")
def ref_file(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    model = ReferenceTransformer(ReferenceConfig(d_model=16, n_heads=2, n_layers=2, d_ff=24))
    return save_reference(model, tmp_path_factory.mktemp("ref") / "ref.safetensors")


def _options(parser: argparse.ArgumentParser, path=()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _options(sub, (*path, name))
        elif action.option_strings:
            yield path, action


def test_every_option_has_a_help_line_and_one_spelling():
    parser, _ = build_parser()
    missing = [(" ".join(p), a.option_strings) for p, a in _options(parser) if a.help is None]
    assert not missing  # `approx sweep --over` had none
    shown = {s for p, a in _options(parser) if a.help is not argparse.SUPPRESS for s in a.option_strings}
    assert "--ln-sigma-min" not in shown and "--radii" not in shown  # kept as hidden aliases only
    assert "--sigma-min" in shown


def _leaves(parser: argparse.ArgumentParser, path=()):
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
    for action in subs:
        for name, sub in action.choices.items():
            yield from _leaves(sub, (*path, name))


def test_debug_is_accepted_by_every_command_and_mode():
    """red team 217: ``cover reference --debug`` was "unrecognized arguments: --debug" (the sub-commands below
    a command had no --debug), while the README calls it general."""
    parser, _ = build_parser()
    without = [" ".join(p) for p, sub in _leaves(parser) if "--debug" not in sub._option_string_actions]
    assert not without
    assert len(list(_leaves(parser))) > 12  # cover's and approx's modes are among them


def test_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["lipschitz", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "lower-estimate search (default: 0)" in out  # --seed had no help and no default shown
    assert "(default: False)" not in out


def test_version_and_python_m(tmp_path):
    import os

    src = str(Path(transcover.__file__).resolve().parents[1])  # the package under test, wherever it lives
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-m", "transcover", "--version"], capture_output=True, text=True,
                         cwd=tmp_path, timeout=120, env=env)
    assert run.returncode == 0 and run.stdout.strip() == f"transcover {transcover.__version__}"


def test_mistyped_command_gets_a_suggestion(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["analyse"])
    assert exc.value.code == 2
    assert "did you mean 'analyze'?" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["report", "--eps", "1e400"], ["bound", "--n-samples", "x"], ["lipschitz", "--nope"],
                                  ["cover", "finite", "--q", "a"], ["analyze", "--seed"]])
def test_a_parse_error_is_one_line(argv, capsys):
    """Red team 189: argparse's own errors (a value beyond float64, an unknown option) printed the command's whole
    usage block before the error, where every other refusal is one line."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error:" in err[0] and "--help" in err[0], err


def test_deprecated_alias_still_works_and_says_so(ref_file, capsys):
    assert main(["lipschitz", str(ref_file), "--ln-sigma-min", "-1"]) == 2
    err = capsys.readouterr().err
    assert "--ln-sigma-min is deprecated; use --sigma-min" in err
    assert "--sigma-min must be a finite number >= 0" in err
    for cmd in (["lipschitz", str(ref_file)], ["perturb", str(ref_file), str(ref_file)]):  # inf named by its flag
        assert main(cmd + ["--sigma-min", "inf", "--quiet"]) == 2
        assert "--sigma-min must be a finite number >= 0, but got --sigma-min=inf" in capsys.readouterr().err


def test_output_folder_checked_before_computing(ref_file, tmp_path, capsys):
    missing = tmp_path / "nope" / "a.json"
    assert main(["analyze", str(ref_file), "--json", str(missing)]) == 2
    err = capsys.readouterr().err
    assert "folder" in err and "does not exist" in err and "B_KQ" not in err
    assert main(["report", str(ref_file), "-o", str(tmp_path / "nope" / "r.html")]) == 2
    assert "does not exist" in capsys.readouterr().err
    # red team 222: under a FILE the folder "does not exist" misled; the file is named as not a folder
    (tmp_path / "notes.txt").write_text("x")
    for argv in (["report", str(ref_file), "-o", str(tmp_path / "notes.txt" / "r.html")],
                 ["analyze", str(ref_file), "--json", str(tmp_path / "notes.txt" / "sub" / "a.json")]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"{tmp_path / 'notes.txt'} is a file, not a folder" in err and err.count("\n") == 1, err
    from transcover._io import atomic_write_bytes

    with pytest.raises(transcover.InputError, match="notes.txt is a file, not a folder"):
        atomic_write_bytes(tmp_path / "notes.txt" / "b.json", b"{}")


def test_json_envelope_names_the_tool_the_command_and_the_weights(ref_file, tmp_path):
    js = tmp_path / "a.json"
    assert main(["analyze", str(ref_file), "--quiet", "--json", str(js)]) == 0
    data = json.loads(js.read_text())
    assert data["schema"] == "transcover.analyze" and data["schema_version"] == "1.0"  # unchanged
    assert data["tool"] == "transcover" and data["tool_version"] == transcover.__version__
    assert data["command_line"][0] == "transcover"
    assert data["inputs"] == [{"path": str(ref_file), "sha256": file_sha256(ref_file),
                               "bytes": ref_file.stat().st_size}]
    assert len(data["layers"]) == 2  # the payload keeps its keys
    wrapped = envelope({"schema": "old", "x": 1}, schema="s", schema_version="2", argv=["a"])
    assert wrapped["schema"] == "s" and wrapped["x"] == 1 and wrapped["command_line"] == ["a"]


def test_analyze_plot_and_describe(ref_file, tmp_path, capsys):
    png, svg = tmp_path / "h.png", tmp_path / "h.svg"
    assert main(["analyze", str(ref_file), "--quiet", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["analyze", str(ref_file), "--quiet", "--plot", str(svg)]) == 0
    assert b"<svg" in svg.read_bytes()
    assert main(["analyze", str(ref_file), "--plot", str(tmp_path / "h.gif")]) == 2
    capsys.readouterr()
    assert main(["analyze", str(ref_file), "--describe"]) == 0
    out = capsys.readouterr().out
    assert "layer 0" in out and "W_Q" in out and "B_KQ" not in out  # a mapping, nothing measured


def test_notebook_views(ref_file):
    r = transcover.analyze(str(ref_file))
    text = repr(r)
    assert len(text.splitlines()) <= 5 and len(text) < 600  # was the whole dataclass tree
    assert "<table>" in r._repr_html_() and "certified interval" in r._repr_html_()
    df = r.to_dataframe()
    per_layer = sum(len(layer.matrices) + 3 for layer in r.layers)  # + b_1, b_2, b_attn
    assert len(df) == per_layer + len(r.embeddings)
    assert {"b_attn", "W_1", "W_KQ.h0", "W_OV.h1"} <= set(df["matrix"])
    assert (df["spectral_lower"] <= df["spectral_upper"]).all()
    summary = r.layers_dataframe()
    assert {"B_b_attn_upper", "B_W1_upper", "max_relative_gap"} <= set(summary.columns)
    assert r.get_summary().equals(summary)
    d = transcover.describe(str(ref_file))
    assert any(role == "W_Q" for _, role, _ in d.rows) and len(repr(d).splitlines()) == 1
    disp = r.plot()
    assert disp.figure_ is not None and len(disp.ax_) == 2
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2)
    assert r.plot(ax=axes).figure_ is fig  # scikit-learn style: draws on the axes given
    plt.close("all")


def _stderr_of(argv: list[str], *, terminal: bool) -> str:
    """stderr of the command ``transcover ARGV`` run in a child process, its stderr (fd 2) a pseudo-terminal or a pipe,
    stdin and stdout /dev/null.  The child is forked from this one and runs ``main(ARGV)`` (what ``python -m
    transcover`` runs), then exits with its code (checked 0): a fresh interpreter spent ~3.5 s CPU re-importing torch
    for each run.  Nothing the parent (pytest, a pipe on stderr) set up decides the child's terminal: its
    ``sys.stdout``/``sys.stderr`` are new files on its own fds 1 and 2, and ``isatty`` is asked of those (the terminal
    run of every caller shows the bar, so no state inherited from here can hide it)."""
    import os
    import select
    import signal
    import time

    master, slave = os.openpty() if terminal else os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 70
        try:
            os.close(master)
            null = os.open(os.devnull, os.O_RDWR)
            os.dup2(null, 0)
            os.dup2(null, 1)
            os.dup2(slave, 2)
            sys.stdin = open(0, closefd=False)  # noqa: SIM115
            sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
            sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
            code = main(argv)
        except BaseException:  # noqa: BLE001 -- reported on the child's stderr, exit 70
            import traceback

            traceback.print_exc()
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code if isinstance(code, int) else 70)
    os.close(slave)
    chunks, deadline = [], time.monotonic() + 300
    try:
        while True:
            ready, _, _ = select.select([master], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                os.kill(pid, signal.SIGKILL)
                raise TimeoutError(f"transcover {' '.join(argv)} ran past 300 s")
            try:
                data = os.read(master, 4096)
            except OSError:  # the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(master)
        _, status = os.waitpid(pid, 0)
    err = b"".join(chunks).decode("utf-8", "replace")
    assert os.waitstatus_to_exitcode(status) == 0, err
    return err


def test_approx_shows_progress_on_a_terminal_only():
    argv = ["approx", "encodings", "--n", "8", "--dim", "8"]
    assert "approx encodings" in _stderr_of(argv, terminal=True)
    assert "approx encodings" not in _stderr_of(argv, terminal=False)
    assert "approx encodings" not in _stderr_of([*argv, "--quiet"], terminal=True)


def test_outputs_that_would_destroy_an_input_or_each_other_are_refused(ref_file, tmp_path, capsys):
    """Red team 169: ``--json MODEL/model.safetensors`` replaced the weights with JSON (exit 0), ``--json data.txt``
    the data, and ``--json x --csv x`` kept only the CSV. Each is one line before any work; nothing is written."""
    import shutil

    from transcover.scale._synthetic import write_gpt2_checkpoint

    ckpt = write_gpt2_checkpoint(tmp_path / "m", d=32, layers=1, heads=2, vocab=64, positions=16, seed=1)
    weights, config = ckpt / "model.safetensors", ckpt / "config.json"
    before = weights.read_bytes(), config.read_bytes()
    data = tmp_path / "data.txt"
    data.write_text("hello world\n")
    copy = tmp_path / "copy.safetensors"
    shutil.copy(ref_file, copy)
    for argv, needle in (
            (["analyze", str(ckpt), "--json", str(weights)], "is a file this command reads (inside the input"),
            (["bound", str(ckpt), "--json", str(config)], "is a file this command reads (inside the input"),
            (["analyze", str(copy), "--csv", str(copy)], "is a file this command reads (an input)"),
            (["lipschitz", str(ckpt), "--data", str(data), "--json", str(data)], "(an input)"),
            (["analyze", str(ckpt), "--json", str(tmp_path / "o"), "--csv", str(tmp_path / "o")],
             "--json and --csv name the same file")):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert needle in err and err.count("\n") == 1, err
    assert (weights.read_bytes(), config.read_bytes()) == before and data.read_text() == "hello world\n"
    assert copy.read_bytes() == ref_file.read_bytes() and not (tmp_path / "o").exists()
    # a result written earlier beside the weights may be overwritten: the loader never reads it
    (ckpt / "analysis.json").write_text("{}")
    assert main(["analyze", str(ckpt), "--json", str(ckpt / "analysis.json"), "--quiet"]) == 0
    assert json.loads((ckpt / "analysis.json").read_text())["schema"] == "transcover.analyze"


def test_a_reader_leaving_early_does_not_lose_the_files(ref_file, tmp_path):
    """Red team 169: ``transcover bound ... --json b.json | head -1`` ended with exit 1, no message and no b.json: the
    table hit the closed pipe before the files were written."""
    out = tmp_path / "b.json"
    proc = subprocess.Popen([sys.executable, "-m", "transcover", "bound", str(ref_file), "--json", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before the first line
    with proc.stderr:
        err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 0, err
    assert json.loads(out.read_text())["schema"] == "transcover.bound"
    assert "Traceback" not in err and "BrokenPipe" not in err and "Exception ignored" not in err, err


def test_a_phase_of_unknown_size_draws_no_count():
    """``cover reference`` drew ``0/None`` beside its pulsing bar: a phase without a total shows no count."""
    from transcover.report._progress import count_text

    assert count_text(0, None) == "" and count_text(3.0, 8.0) == "3/8"
    out = _stderr_of(["cover", "reference", "--functions", "200", "--samples", "2", "--eps", "0.5"], terminal=True)
    assert "Monte Carlo covering" in out and "None" not in out


@pytest.fixture(scope="module")
def markup_file(ref_file, tmp_path_factory) -> Path:
    """The reference model at a path that reads as rich markup: "[/b]" closes a tag never opened, "[red]" opens one."""
    import shutil

    folder = tmp_path_factory.mktemp("markup") / "a["
    folder.mkdir()
    return Path(shutil.copy(ref_file, folder / "b]m[red]z.safetensors"))


@pytest.mark.parametrize("command", [["bound", "--json", "{tmp}/b.json"], ["analyze"], ["lipschitz", "--no-lower"]])
def test_a_model_path_is_printed_as_written_never_read_as_markup(markup_file, tmp_path, capsys, monkeypatch, command):
    """Red team 215: a model path "a[/b]" went into rich markup unescaped: ``bound``, ``analyze`` and ``lipschitz``
    crashed with a MarkupError (exit 1, the JSON never written), and "m[red]z" was printed as "mz"."""
    monkeypatch.setenv("COLUMNS", "300")
    argv = [command[0], str(markup_file), *(a.format(tmp=tmp_path) for a in command[1:])]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    out = "".join(printed.split())  # a table title wraps at the table's width, anywhere in the path
    assert str(markup_file) in out
    if command[0] == "bound":
        assert json.loads((tmp_path / "b.json").read_text())["model"] == str(markup_file)
        _assert_kind_labels(printed.splitlines())


def _assert_kind_labels(lines: list[str]) -> None:
    """Red team 215: "<= x  [certified upper bound]" and "R_A = y [estimate]" were read as rich style tags: the labels
    that say what the numbers are vanished from ``bound``'s text (checked on the bound run above, which prints them
    at COLUMNS=300)."""
    assert [ln for ln in lines if "log N_inf(eps=" in ln][0].rstrip().endswith("[certified upper bound]")
    assert "[estimate]; BFT log N" in [ln for ln in lines if "BFT spectral complexity R_A" in ln][0]


def _rewrite_in_place(path: Path, *, keep_mtime: bool) -> None:
    """One byte of the data flipped in place, same size; rewritten until the kernel's clock shows a new change time
    (a tick, without sleeping), then the mtime put back where ``keep_mtime``, else set one second later."""
    import os

    st = os.stat(path)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0x01
    while True:
        with path.open("r+b") as fh:
            fh.write(raw)
        if os.stat(path).st_ctime_ns != st.st_ctime_ns:
            break
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + (0 if keep_mtime else 10**9)))


def test_a_weights_file_rewritten_after_it_was_read_is_refused_and_nothing_written(ref_file, tmp_path, capsys,
                                                                                   monkeypatch):
    """Red team 219: the JSON's checksums were computed after the analysis, so a file rewritten after the loader had
    read it was listed with its new content's hash beside numbers from the old one.  The rewrite lands between the
    analysis and the envelope here (deterministic: a hook on analyze); the command refuses in one line, exit 2, and
    writes nothing."""
    import shutil

    from transcover import _api

    model = tmp_path / "m.safetensors"
    shutil.copy(ref_file, model)
    analyze = _api.analyze

    def then_rewrite(*args, **kwargs):
        result = analyze(*args, **kwargs)
        _rewrite_in_place(model, keep_mtime=False)
        return result

    monkeypatch.setattr(_api, "analyze", then_rewrite)
    js, csv = tmp_path / "a.json", tmp_path / "a.csv"
    assert main(["analyze", str(model), "--quiet", "--json", str(js), "--csv", str(csv)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "m.safetensors was replaced or rewritten after it was read" in err, err
    assert not js.exists() and not csv.exists()
    monkeypatch.setattr(_api, "analyze", analyze)  # unchanged since read: hashed as read
    assert main(["analyze", str(model), "--quiet", "--json", str(js)]) == 0
    import hashlib

    assert json.loads(js.read_text())["inputs"][0]["sha256"] == hashlib.sha256(model.read_bytes()).hexdigest()


def test_the_checksum_cache_sees_an_in_place_rewrite_with_the_mtime_put_back(ref_file, tmp_path):
    """Red team 219: file_sha256 cached by (path, size, mtime), so a same-size rewrite in place with its mtime
    restored returned the stale hash within one process; the key holds the inode and the change time too."""
    import hashlib
    import shutil

    path = tmp_path / "w.safetensors"
    shutil.copy(ref_file, path)
    before = file_sha256(path)
    _rewrite_in_place(path, keep_mtime=True)
    assert file_sha256(path) == hashlib.sha256(path.read_bytes()).hexdigest() != before


def test_the_inputs_are_the_files_read(ref_file, tmp_path):
    """Red team 219: ``inputs`` listed every .json and .safetensors of the folder: with both model.safetensors and an
    index, the unread shards too; and a shard in a subfolder named by the index not at all."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from transcover.report import input_hashes

    with safe_open(str(ref_file), "pt") as fh:
        meta = fh.metadata()
    tensors = load_file(str(ref_file))
    keys = sorted(tensors)
    d = tmp_path / "sharded"
    (d / "sub").mkdir(parents=True)
    weight_map = {}
    for name, part in (("a.safetensors", keys[::2]), ("sub/b.safetensors", keys[1::2])):
        save_file({k: tensors[k] for k in part}, str(d / name), metadata=meta)
        weight_map.update({k: name for k in part})
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    transcover.load(d)
    listed = [Path(i["path"]).relative_to(d).as_posix() for i in input_hashes(d)]
    assert sorted(listed) == ["a.safetensors", "model.safetensors.index.json", "sub/b.safetensors"]
    shutil.copy(ref_file, d / "model.safetensors")  # beside the index: read, and the shards are not
    with pytest.warns(transcover.TranscoverWarning, match="model.safetensors is read"):
        transcover.load(d)
    assert [Path(i["path"]).name for i in input_hashes(d)] == ["model.safetensors"]


@pytest.fixture(scope="module")
def worded_bert(tmp_path_factory) -> Path:
    """A 1-layer BERT with a word-level ``tokenizer.json`` of its 100-token vocabulary, and two lines of text."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    d = tmp_path_factory.mktemp("worded") / "bert"
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=100, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=32)
    transformers.BertModel(cfg).save_pretrained(str(d), safe_serialization=True)
    words = "the of and a to in is was it for on with as by at from".split()
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}
    vocab.update({f"x{k}": k for k in range(len(vocab), 100)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    (d.parent / "texts.txt").write_text("the of and a to in is was\nit for on with as by at from\n")
    return d


def _local_then(monkeypatch, change) -> None:
    """``change()`` run right after ``lipschitz --data``'s local table is computed: after the data was read."""
    import transcover.lipschitz as L

    table = L.local_table

    def then_change(*args, **kwargs):
        rows = table(*args, **kwargs)
        change()
        return rows

    monkeypatch.setattr(L, "local_table", then_change)


def test_the_tokenizer_that_split_the_texts_is_an_input(worded_bert, tmp_path):
    """Red team 222: the tokenizer.json that turned the texts into token ids was never listed, so two folders with
    one set of weights and texts but different tokenizers certified different constants under identical inputs."""
    js = tmp_path / "l.json"
    texts = worded_bert.parent / "texts.txt"
    assert main(["lipschitz", str(worded_bert), "--data", str(texts), "--limit", "1", "--no-lower", "--quiet",
                 "--json", str(js)]) == 0
    tok = worded_bert / "tokenizer.json"
    listed = {i["path"]: i["sha256"] for i in json.loads(js.read_text())["inputs"]}
    assert listed == {str(worded_bert / "config.json"): file_sha256(worded_bert / "config.json"),
                      str(worded_bert / "model.safetensors"): file_sha256(worded_bert / "model.safetensors"),
                      str(texts): file_sha256(texts), str(tok): file_sha256(tok)}


@pytest.mark.parametrize("what", ["ids.npy", "texts.txt", "tokenizer.json"])
def test_data_rewritten_after_it_was_read_is_refused_and_nothing_written(worded_bert, tmp_path, capsys, monkeypatch,
                                                                         what):
    """Red team 222: ``--data`` files were hashed at the end of the run, never compared with what was read: a data
    file (or the tokenizer of its texts) rewritten after the read was listed with its new content's hash beside
    constants certified at the old content, exit 0.  They are now held to their identity when read, as weights are."""
    import shutil

    import numpy as np

    model = tmp_path / "bert"
    shutil.copytree(worded_bert, model)
    np.save(tmp_path / "ids.npy", np.array([[1, 2, 3, 4]], dtype=np.int64))
    shutil.copy(worded_bert.parent / "texts.txt", tmp_path / "texts.txt")
    data = tmp_path / ("texts.txt" if what == "tokenizer.json" else what)
    target = model / what if what == "tokenizer.json" else data
    _local_then(monkeypatch, lambda: _rewrite_in_place(target, keep_mtime=False))
    js = tmp_path / "l.json"
    assert main(["lipschitz", str(model), "--data", str(data), "--limit", "1", "--no-lower", "--quiet",
                 "--json", str(js)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{target} was replaced or rewritten after it was read" in err, err
    assert not js.exists()


def test_a_history_appended_to_after_it_was_read_is_refused_and_nothing_written(ref_file, tmp_path, capsys,
                                                                                 monkeypatch):
    """Red team 222: ``report --history`` hashed the history at the end of the run: a training run appending a record
    after the report had read it gave the new file's hash beside plots of the old records, exit 0."""
    import transcover.norms as N

    hist = tmp_path / "history.jsonl"
    hist.write_text("".join(json.dumps({"step": k, "loss": 1.0 / (k + 1)}) + "\n" for k in range(3)))
    analyze = N.analyze_spec

    def then_append(*args, **kwargs):
        with hist.open("a") as fh:  # as a running `transcover train` does
            fh.write(json.dumps({"step": 3, "loss": 0.2}) + "\n")
        return analyze(*args, **kwargs)

    monkeypatch.setattr(N, "analyze_spec", then_append)
    out = tmp_path / "r.html"
    assert main(["report", str(ref_file), "--history", str(hist), "--no-lower", "--quiet", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{hist} was replaced or rewritten after it was read" in err, err
    assert not out.exists()


def test_built_in_sentences_are_named_alike_and_the_local_table_speaks_plainly(worded_bert, tmp_path):
    """Red team 222: with ``--data sklearn-descr`` the report's card printed "None" as the SHA-256 of the built-in
    sentences while the lipschitz JSON left them out; and its at-the-data table had the rows' JSON keys as headers
    and a column of "nan" in every row (none is computed there with --no-lower)."""
    import re

    js, out = tmp_path / "l.json", tmp_path / "r.html"
    common = [str(worded_bert), "--data", "sklearn-descr", "--limit", "1", "--no-lower", "--quiet"]
    assert main(["lipschitz", *common, "--json", str(js)]) == 0
    tok = str(worded_bert / "tokenizer.json")
    inputs = json.loads(js.read_text())["inputs"]
    assert {"path": "sklearn-descr", "sha256": None, "bytes": None} in inputs and tok in [i["path"] for i in inputs]
    assert main(["report", *common, "-o", str(out), "--seq-len", "8"]) == 0
    page = out.read_text()
    card = page[page.index("files read"):page.index("</table>", page.index("files read"))]
    assert "None" not in card and "<code>sklearn-descr</code>" in card and "built-in data set" in card
    assert f"<code>{file_sha256(tok)}</code>" in card
    local = page[page.index('id="local"'):page.index("</section>", page.index('id="local"'))]
    headers = re.findall(r"<th>([^<]*)</th>", local)
    assert headers and not [h for h in headers if "_" in h], headers  # no JSON key shown as a header
    cells = [re.findall(r"<td[^>]*>([^<]*)</td>", row) for row in re.findall(r"<tr>(.*?)</tr>", local)[1:]]
    assert all(len(r) == len(headers) for r in cells)
    assert not [h for k, h in enumerate(headers) if all(r[k] == "nan" for r in cells)], headers

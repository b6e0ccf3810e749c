"""Issue 10, defect 13: every file transcover writes respects the umask (Note [file modes] in transcover._io).

``mkstemp`` creates 0600 files and ``os.replace`` keeps that mode, so before the fix every JSON,
CSV, PNG and checkpoint came out 0600 whatever the umask.  A new file must get ``0o666 & ~umask``;
an overwritten one keeps its own bits; a failed write leaves nothing behind.
"""

from __future__ import annotations

import os
import stat
from contextlib import contextmanager

import pytest
import torch

from transcover import InputError
from transcover.cli import main
from transcover.model import ReferenceConfig, ReferenceTransformer, save_reference
from transcover import _io  # the writer itself (report re-exports it)
from transcover.report import atomic_write_bytes, atomic_write_text

UMASKS = [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)]


@contextmanager
def umask(value: int):
    old = os.umask(value)
    try:
        yield
    finally:
        os.umask(old)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("m") / "ref.safetensors"
    save_reference(ReferenceTransformer(ReferenceConfig(d_model=8, n_heads=2, n_layers=1, d_ff=8,
                                                        head_hidden=(8,))), path)
    return path


@pytest.mark.parametrize("mask, expected", UMASKS)
def test_new_files_follow_the_umask(tmp_path, mask, expected):
    with umask(mask):
        atomic_write_text(tmp_path / "a.json", "{}")
        atomic_write_bytes(tmp_path / "b.png", b"\x89PNG")
        # the reference: what a plain open() creates under the same umask
        with open(tmp_path / "plain", "w"):
            pass
    assert mode(tmp_path / "plain") == expected
    assert mode(tmp_path / "a.json") == expected and mode(tmp_path / "b.png") == expected


def test_current_umask_without_proc(monkeypatch):
    with umask(0o027):
        assert _io.current_umask() == 0o027

        def no_proc(*args, **kwargs):
            raise OSError("no /proc here")

        monkeypatch.setattr(_io, "open", no_proc, raising=False)
        assert _io.current_umask() == 0o027
        assert os.umask(0o027) == 0o027  # the fallback restored it


def test_overwrite_keeps_the_existing_mode(tmp_path):
    path = tmp_path / "r.json"
    with umask(0o022):
        atomic_write_text(path, "1")
        os.chmod(path, 0o640)
        atomic_write_text(path, "2")
    assert mode(path) == 0o640 and path.read_text() == "2"


def test_failed_write_leaves_nothing(tmp_path, monkeypatch):
    old = tmp_path / "old.json"
    atomic_write_text(old, "kept")

    def fail(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(_io.os, "replace", fail)
    # one line naming the file asked for (stop 36: the OSError named the hidden temporary file)
    with pytest.raises(InputError, match=r"cannot write .*new\.json: disk full"):
        atomic_write_text(tmp_path / "new.json", "x")
    with pytest.raises(InputError, match="old.json"):
        atomic_write_text(old, "lost")
    monkeypatch.undo()
    with pytest.raises(TypeError):
        atomic_write_bytes(tmp_path / "typed.bin", "not bytes")  # type: ignore[arg-type]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.json"] and old.read_text() == "kept"


@pytest.mark.parametrize("mask, expected", UMASKS)
def test_cli_json_and_csv_follow_the_umask(model_path, tmp_path, mask, expected):
    csv, ajs = tmp_path / "a.csv", tmp_path / "a.json"
    with umask(mask):
        assert main(["analyze", str(model_path), "--fast", "--quiet", "--json", str(ajs), "--csv", str(csv)]) == 0
    assert (mode(ajs), mode(csv)) == (expected, expected)


def test_cli_png_follows_the_umask(model_path, tmp_path):
    js, png = tmp_path / "b.json", tmp_path / "b.png"
    with umask(0o002):  # the slow command once, under the umask that differs most from mkstemp's 0600
        assert main(["bound", str(model_path), "--n-samples", "100", "--seq-len", "4", "--quiet",
                     "--json", str(js), "--plot", str(png)]) == 0
    assert (mode(js), mode(png)) == (0o664, 0o664)


def test_training_outputs_and_checkpoints_follow_the_umask(tmp_path):
    mask, expected = 0o002, 0o664
    out = tmp_path / "run"
    with umask(mask):
        assert main(["train", "--n-train", "60", "--epochs", "1", "--d-model", "8", "--d-ff", "8",
                     "--n-layers", "1", "--out", str(out), "--quiet", "--json", str(tmp_path / "r.json")]) == 0
        save_reference(ReferenceTransformer(ReferenceConfig(d_model=4, n_heads=1, n_layers=1, d_ff=4)),
                       tmp_path / "ref.safetensors")
    written = [out / f for f in ("history.jsonl", "history.csv", "history.png", "checkpoint/model.safetensors",
                                 "checkpoint/optimizer.pt", "checkpoint/state.json")]
    written += [tmp_path / "r.json", tmp_path / "ref.safetensors"]
    assert {str(p): mode(p) for p in written} == {str(p): expected for p in written}


def test_a_symlink_is_replaced_as_a_new_file_not_given_its_targets_mode(tmp_path):
    # the mode was read through the link: a 0666 target made a world-writable output under umask 077 (37h)
    victim = tmp_path / "victim"
    victim.write_text("kept")
    os.chmod(victim, 0o666)
    (tmp_path / "out.json").symlink_to(victim)
    with umask(0o077):
        atomic_write_text(tmp_path / "out.json", "{}")
    assert not (tmp_path / "out.json").is_symlink() and mode(tmp_path / "out.json") == 0o600
    assert victim.read_text() == "kept" and mode(victim) == 0o666


def test_results_store_follows_the_umask(tmp_path):
    from transcover.scale import ResultStore

    with umask(0o002):  # sqlite3 creates 0644 whatever the umask (37h)
        ResultStore(tmp_path / "s.sqlite").put("k", "label", "{}", 1.0)
    assert mode(tmp_path / "s.sqlite") == 0o664


@pytest.mark.parametrize("argv", [
    ["bound", "{m}", "--n-samples", "100", "--seq-len", "4", "--quiet", "--plot", "{d}/ok.png", "--json", "{d}/no/b.json"],
    ["bound", "{m}", "--n-samples", "100", "--seq-len", "4", "--quiet", "--json", "{d}/ok.json", "--plot", "{d}/no/b.png"],
    ["perturb", "{m}", "{m}", "--quiet", "--plot", "{d}/ok.png", "--json", "{d}/no/p.json"],
    ["train", "--n-train", "60", "--epochs", "1", "--d-model", "8", "--d-ff", "8", "--n-layers", "1", "--quiet",
     "--out", "{d}/run", "--json", "{d}/no/t.json"],
])
def test_every_output_path_is_checked_before_any_work(model_path, tmp_path, capsys, argv):
    # perturb, bound, cover, sweeps, train and lipschitz checked their paths only after computing, with the
    # other outputs (a PNG, a JSON, a trained checkpoint) already written (red team 37h)
    args = [a.format(m=model_path, d=tmp_path) for a in argv]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not exist" in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_sigterm_removes_the_temporary_file_of_a_write_in_progress(model_path, tmp_path):
    """SIGTERM's default action left ``.out.json.XXXX.tmp`` beside the old file (37h): it now unwinds like ^C."""
    import subprocess
    import sys

    out = tmp_path / "out.json"
    out.write_text("old")
    script = (
        "import os, signal, sys\n"
        "real = os.fsync\n"
        "def fsync(fd):\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    real(fd)\n"
        "os.fsync = fsync\n"
        "from transcover.cli import main\n"
        f"sys.exit(main(['analyze', {str(model_path)!r}, '--fast', '--quiet', '--json', {str(out)!r}]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 143 and proc.stderr.strip() == "transcover: terminated", proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"] and out.read_text() == "old"


def test_invisible_characters_are_shown_in_report_text():
    from transcover.report._html import text

    # a tensor named "ff.up\u202eexe" showed reversed in the report (red team 37h)
    assert text("ff.up\u202eexe\u200b\u2066<x>") == "ff.up\\u202eexe\\u200b\\u2066&lt;x&gt;"


def test_a_stream_is_written_through_not_replaced(tmp_path):
    """Stop 38 red team: ``--csv /dev/stdout`` (run as root) renamed a temporary file over /dev/stdout, which became a
    regular file; a FIFO likewise. A character device, FIFO or socket is now written into, and stays what it was."""
    import threading

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got = []
    def read() -> None:
        with open(fifo, "rb") as fh:
            got.append(fh.read())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    atomic_write_text(fifo, "a,b\n1,2\n")
    reader.join(timeout=10)
    assert got == [b"a,b\n1,2\n"] and stat.S_ISFIFO(os.stat(fifo).st_mode)
    link = tmp_path / "out.csv"
    link.symlink_to("/dev/null")
    atomic_write_text(link, "x")
    assert link.is_symlink() and stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_a_fifo_without_a_reader_is_one_line_not_a_wait(tmp_path):
    """Stop 38 red team: opening a FIFO with no reader for writing blocked without end."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(InputError, match="cannot write"):
        atomic_write_text(fifo, "x")
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_an_output_naming_stdout_redirected_to_a_file_is_written_through_it(model_path, tmp_path):
    """Red team 173: with stdout redirected to a file, ``--json /dev/stdout`` resolved to that regular file, so the
    atomic write renamed a temporary over the link: as root, the system's /dev/stdout became a plain file of the
    JSON and the redirect got nothing. A link into /proc/self/fd (as /dev/stdout is) is now written through the
    descriptor. A private link stands in for /dev/stdout here, so a failure harms nothing outside tmp_path."""
    import json
    import subprocess
    import sys

    link = tmp_path / "stdout_link"
    link.symlink_to("/proc/self/fd/1")
    log = tmp_path / "run.log"
    with log.open("wb") as fh:
        rc = subprocess.run([sys.executable, "-m", "transcover", "analyze", str(model_path), "--quiet", "--json",
                             str(link)], stdout=fh, stderr=subprocess.PIPE, timeout=300).returncode
    assert rc == 0
    assert link.is_symlink() and os.readlink(link) == "/proc/self/fd/1"  # the link itself untouched
    assert json.loads(log.read_text())["schema"] == "transcover.analyze"
    assert _io._descriptor(link) == 1 and _io._descriptor(tmp_path / "plain.json") is None

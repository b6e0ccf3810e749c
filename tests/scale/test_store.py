"""The results store (issue 14, item 3): committed rows come back verified; a corrupt store is refused."""

import sqlite3

import pytest

from transcover import InputError
from transcover.scale import ResultStore, StoreError


def test_rows_round_trip_and_survive_reopening(tmp_path):
    path = tmp_path / "r.sqlite"
    with ResultStore(path, run="a") as s:
        s.put("k1", "model-1", '{"x": 1.5}', 0.25)
        s.put("k2", "model-2", '{"x": 2.5}', 0.5)
    with ResultStore(path, run="b") as s:
        assert len(s) == 2 and s.get("k3") is None
        got = s.get("k1")
        assert (got.label, got.value, got.seconds, got.run) == ("model-1", '{"x": 1.5}', 0.25, "a")


def test_a_tampered_row_fails_its_checksum(tmp_path):
    path = tmp_path / "r.sqlite"
    with ResultStore(path) as s:
        s.put("k1", "m", '{"x": 1.5}', 0.1)
    db = sqlite3.connect(path)
    db.execute("UPDATE results SET value = '{\"x\": 9.5}' WHERE key = 'k1'")
    db.commit()
    db.close()
    with ResultStore(path) as s, pytest.raises(StoreError, match="fails its checksum"):
        s.get("k1")


@pytest.mark.parametrize("damage", ["garbage", "truncated", "flipped"])
def test_a_damaged_file_is_detected_on_open(tmp_path, damage):
    path = tmp_path / "r.sqlite"
    with ResultStore(path) as s:
        for i in range(300):  # several pages, so truncation and flips hit real structure
            s.put(f"k{i}", f"m{i}", '{"x": %d, "pad": "%s"}' % (i, "y" * 200), 0.1)
    data = bytearray(path.read_bytes())
    if damage == "garbage":
        path.write_bytes(b"this is not a database" * 100)
    elif damage == "truncated":
        path.write_bytes(bytes(data[: len(data) // 2]))
    else:
        for at in range(4096 + 100, len(data), 4096):  # one byte in the body of every page after the first
            data[at] ^= 0xFF
        path.write_bytes(bytes(data))
    with pytest.raises(StoreError, match="corrupt and was not used") as info:
        ResultStore(path)
    assert isinstance(info.value, InputError)  # the CLI prints it as one line, exit code 2
    assert "\n" not in str(info.value)


def _sqlite(path, *statements: str):
    """An SQLite file at ``path`` holding what ``statements`` create (another program's database)."""
    db = sqlite3.connect(path)
    for sql in statements:
        db.execute(sql)
    db.commit()
    db.close()
    return path


def test_a_foreign_sqlite_file_is_not_trusted(tmp_path):
    path = _sqlite(tmp_path / "other.sqlite", "CREATE TABLE meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)",
                   "INSERT INTO meta VALUES ('schema', 'something-else/9')")
    with pytest.raises(StoreError, match="schema"):
        ResultStore(path)


def test_another_programs_database_is_not_taken_over(tmp_path):
    """Red team 167: an SQLite file of another program (one table ``x``) was accepted as a store, the store's tables
    written into it; it is refused and left as it was. An empty SQLite file is still a new store."""
    path = _sqlite(tmp_path / "app.sqlite", "CREATE TABLE x (a INTEGER)", "INSERT INTO x VALUES (1)")
    before = path.read_bytes()
    with pytest.raises(StoreError, match="another program"):
        ResultStore(path)
    db = sqlite3.connect(path)
    assert [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")] == ["x"]
    db.close()
    assert path.read_bytes() == before
    ResultStore(_sqlite(tmp_path / "empty.sqlite")).close()


def test_a_folder_or_an_unwritable_place_is_named_as_such_not_as_corrupt(tmp_path, monkeypatch):
    # both were "results store ... is corrupt and was not used (unable to open database file)" (red team 37h)
    (tmp_path / "dir.sqlite").mkdir()
    with pytest.raises(InputError, match="is a folder"):
        ResultStore(tmp_path / "dir.sqlite")
    import os

    real = os.access
    monkeypatch.setattr(os, "access", lambda p, m: False if str(p) == str(tmp_path / "ro") else real(p, m))
    (tmp_path / "ro").mkdir()
    with pytest.raises(InputError, match="folder .*ro is not writable"):
        ResultStore(tmp_path / "ro" / "s.sqlite")


def test_store_errors_say_what_happened(tmp_path, monkeypatch):
    """Stop 38 red team: a valid store in a read-only folder, and one locked past the timeout, were reported as
    "corrupt"; a damaged page whose SQLite message was not UTF-8 ended in an internal UnicodeDecodeError (exit 1)."""
    import os

    path = tmp_path / "s.sqlite"
    ResultStore(path).close()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, m: False if str(p) == str(tmp_path) else real(p, m))
    with pytest.raises(InputError, match="folder that is not writable") as err:
        ResultStore(path)
    assert not isinstance(err.value, StoreError)
    monkeypatch.setattr(os, "access", real)

    class _Failing:
        def __init__(self, exc):
            self.exc = exc

        def execute(self, *args):
            raise self.exc

    for exc, kind, needle in ((sqlite3.OperationalError("database is locked"), InputError, "locked by another"),
                              (UnicodeDecodeError("utf-8", b"\xb0", 0, 1, "invalid start byte"), StoreError,
                               "is corrupt")):
        monkeypatch.setattr(sqlite3, "connect", lambda *a, exc=exc, **k: _Failing(exc))
        with pytest.raises(kind, match=needle) as err:
            ResultStore(path)
        assert kind is StoreError or not isinstance(err.value, StoreError)

"""The results store of a sweep: SQLite, one transaction per finished item, every row checksummed.

Why SQLite (stdlib ``sqlite3``): a commit is atomic and durable (write-ahead log, ``synchronous =
FULL``), so a sweep killed at any instant -- SIGKILL included -- leaves every item it had committed
and none half-written; a re-run (``--resume``, the default) reads them back instead of recomputing.
Only the sweep's main process writes (workers return values to it), so there is one writer.

Trust: a store is checked when opened -- the SQLite file header, ``PRAGMA quick_check`` (page and
index structure), and this module's schema version -- and every row read back is checked against
its SHA-256 checksum.  Any failure is a :class:`StoreError` (an ``InputError``: one line, exit 2)
naming the file; a corrupt store is never read from nor written to.  The user moves it away (or
points ``--store`` elsewhere); nothing is silently recomputed over it.
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from .._errors import InputError

__all__ = ["ResultStore", "StoreError", "StoredResult", "STORE_SCHEMA"]

STORE_SCHEMA = "transcover.results/1"
_MAGIC = b"SQLite format 3\x00"


class StoreError(InputError):
    """The results store cannot be trusted (corrupt, truncated, foreign, or a row fails its checksum)."""


@dataclass(frozen=True)
class StoredResult:
    key: str
    label: str
    value: str  # the item's JSON text, exactly as the worker produced it
    seconds: float
    run: str


def _checksum(key: str, value: str) -> str:
    return hashlib.sha256(key.encode() + b"\x00" + value.encode()).hexdigest()


class ResultStore:
    """A key -> JSON-text store in one SQLite file (see the module docstring).

    Args:
        path: the database file (created with its folder's permission; the folder must exist).
        run: an identifier written beside every row this process commits (which run computed it).
    """

    def __init__(self, path: str | os.PathLike, *, run: str = ""):
        self.path = Path(path)
        self.run = run or f"{os.getpid()}-{time.time_ns()}"
        if not self.path.parent.exists():
            raise InputError(f"cannot create results store {self.path}: folder {self.path.parent} does not exist")
        # a folder, or one that cannot be written, was reported as "corrupt" (SQLite's "unable to open") (37h)
        if self.path.is_dir():
            raise InputError(f"results store {self.path} is a folder; give a file name")
        if not self.path.exists():
            if not os.access(self.path.parent, os.W_OK | os.X_OK):
                raise InputError(f"cannot create results store {self.path}: folder {self.path.parent} is not writable")
            # created here, so its mode is 0666 & ~umask like every other output (sqlite3 makes 0644 whatever the
            # umask); SQLite reads an empty file as a new database and gives its -wal/-shm files the same mode
            try:
                os.close(os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
            except FileExistsError:  # another process created it meanwhile: use theirs
                pass
            except OSError as err:
                raise InputError(f"cannot create results store {self.path}: {err.strerror or err}") from None
        elif not os.access(self.path, os.R_OK | os.W_OK):
            raise InputError(f"results store {self.path} is not readable and writable by this user")
        elif not os.access(self.path.parent, os.W_OK | os.X_OK):  # was "corrupt (attempt to write a readonly db)"
            raise InputError(f"results store {self.path} is in a folder that is not writable ({self.path.parent}): "
                             "SQLite's write-ahead log is created beside it")
        existed = self.path.exists() and self.path.stat().st_size > 0
        if existed:
            with open(self.path, "rb") as f:
                if f.read(16) != _MAGIC:
                    raise self._corrupt("not an SQLite database (bad file header)")
        try:
            self._db = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
            if existed:
                check = self._db.execute("PRAGMA quick_check").fetchone()[0]
                if check != "ok":
                    raise self._corrupt(f"integrity check failed: {check}")
                # another program's database was taken over, its new tables written beside its own (red team 167):
                # a store is empty or has the meta table (created first, so a store being created by another run
                # passes too)
                tables = {r[0] for r in self._db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
                if tables and "meta" not in tables:
                    raise self._corrupt(f"a database of another program (tables {', '.join(sorted(tables)[:5])}), "
                                        "not a transcover results store")
            # WAL only after the checks: switching the journal mode rewrites the file's header (a foreign file was
            # changed before it was refused)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute("CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)")
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS results (key TEXT PRIMARY KEY, label TEXT NOT NULL, "
                "value TEXT NOT NULL, checksum TEXT NOT NULL, seconds REAL NOT NULL, run TEXT NOT NULL, "
                "created REAL NOT NULL)")
            self._db.execute("INSERT OR IGNORE INTO meta VALUES ('schema', ?)", (STORE_SCHEMA,))
            schema = self._db.execute("SELECT value FROM meta WHERE name = 'schema'").fetchone()[0]
        except sqlite3.OperationalError as err:
            text = str(err)
            if "locked" in text or "busy" in text:  # another process held it past the 30 s timeout: not damage
                raise InputError(f"results store {self.path} is locked by another process ({text}); "
                                 "wait for it or pass another --store") from err
            if "readonly" in text or "unable to open" in text:
                raise InputError(f"results store {self.path} cannot be written ({text})") from err
            raise self._corrupt(text) from err
        except sqlite3.DatabaseError as err:
            raise self._corrupt(str(err)) from err
        except UnicodeDecodeError as err:  # a damaged page can make SQLite's own text invalid UTF-8 (stop 38)
            raise self._corrupt(f"SQLite's report is not text: {err}") from err
        if schema != STORE_SCHEMA:
            raise self._corrupt(f"schema {schema!r}, expected {STORE_SCHEMA!r}")

    def _corrupt(self, why: str) -> StoreError:
        why = " ".join(why.split())[:300]
        return StoreError(f"results store {self.path} is corrupt and was not used ({why}); "
                          "move it away or pass another --store")

    def get(self, key: str) -> StoredResult | None:
        """The committed result of ``key``, checksum verified; ``None`` when there is none."""
        try:
            row = self._db.execute("SELECT key, label, value, checksum, seconds, run FROM results WHERE key = ?",
                                   (key,)).fetchone()
        except sqlite3.DatabaseError as err:
            raise self._corrupt(str(err)) from err
        if row is None:
            return None
        if _checksum(row[0], row[2]) != row[3]:
            raise self._corrupt(f"row {row[1]!r} fails its checksum")
        return StoredResult(row[0], row[1], row[2], float(row[4]), row[5])

    def put(self, key: str, label: str, value: str, seconds: float) -> None:
        """Commit one finished item (one transaction; replaces an earlier result of the same key)."""
        try:
            with self._db:
                self._db.execute("BEGIN IMMEDIATE")
                self._db.execute("INSERT OR REPLACE INTO results VALUES (?, ?, ?, ?, ?, ?, ?)",
                                 (key, label, value, _checksum(key, value), float(seconds), self.run, time.time()))
        except sqlite3.DatabaseError as err:
            raise self._corrupt(str(err)) from err

    def keys(self) -> list[str]:
        return [r[0] for r in self._db.execute("SELECT key FROM results ORDER BY created")]

    def rows(self) -> list[StoredResult]:
        """Every committed result, checksum verified."""
        out = []
        for key in self.keys():
            got = self.get(key)
            assert got is not None
            out.append(got)
        return out

    def __len__(self) -> int:
        return int(self._db.execute("SELECT count(*) FROM results").fetchone()[0])

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> "ResultStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

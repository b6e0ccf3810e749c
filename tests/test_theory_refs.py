"""Every formula, lemma and seed-section reference in the repository resolves in docs/theory.md.

The code cites ``THEORY F6``, ``Lemma G.3``, ``Theorem G.5``, ``seed 2.1``, ``THEORY section 4.2``
and the like; docs/theory.md has one heading per target (``### F6 — ...``, ``### Lemma G.3 — ...``,
``#### seed 2.1 — ...``, ``## Section 2 — ...``, ``### Ambiguity 4.2 — ...``).  The scanner reads
whole files (docstrings, comments and the ``source`` strings of results alike) and excludes the
few look-alikes it knows: safetensors dtype names (``"F16"``, ``BF16``), "F1 score", and random
seeds listed in ``_NOT_SECTIONS``.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
THEORY = ROOT / "docs" / "theory.md"

# ---- references ---------------------------------------------------------------------------------

_F = re.compile(r"(?<![\w.])F(\d{1,3})([a-z])?(?!\w)")
_F_SCORE = re.compile(r"F1[ -]score", re.IGNORECASE)
# a linter's codes (``# noqa: F401, E731``): not formula numbers, which have three digits from F100 on
_NOQA = re.compile(r"noqa:\s*[A-Z]+\d+(?:\s*,\s*[A-Z]+\d+)*")
# a line that names tensor dtypes: F16/F32/F64 there are safetensors dtype codes, not formulas
_DTYPE_LINE = re.compile(r"dtype|BF16|float(?:16|32|64)|\"F(?:16|32|64)\"|(?<!\w)F(?:32|64)(?!\w)")
_LEMMA = re.compile(r"\b(Lemma|lemma|Theorem|theorem)\s+([GH]\.\d+)\b")
_BARE_LEMMA = re.compile(r"(?<![\w.])([GH]\.\d+)\b")
# the number must end the token: "the seed's 1/eps^2 form" is not a section reference
_SEED = re.compile(r"\b[Ss]eed(?:'s)?(?:[ -]+(?:sections?|§))?[ -]+(\d+(?:\.\d+)?(?:\s*,\s*\d+(?:\.\d+)?)*)(?![/\w^])")
_THEORY_SECTION = re.compile(r"THEORY(?:\.md)?[^()\n]{0,20}?\bsection\s+(\d+(?:\.\d+)?)(?:\s*\(?item\s+(\d+)\)?)?")
_THEORY_ITEM = re.compile(r"THEORY(?:\.md)?\s+(\d)\.(\d)\b")

# "seed N" occurrences that are random seeds, verified by hand: (path relative to ROOT, text)
_NOT_SECTIONS = {("src/transcover/train/_experiment.py", "seed 0")}


def find_references(text: str, path: str = "<text>") -> list[tuple[str, str]]:
    """``(key, "path:line")`` for every reference in ``text``.  Keys: ``F6``, ``F16a``,
    ``Lemma G.3``, ``Theorem G.5``, ``G.3`` (bare), ``seed 2.1``, ``section 2``, ``section 4.2``."""
    refs: list[tuple[str, str]] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        where = f"{path}:{lineno}"
        line = _NOQA.sub("noqa", line)
        for m in _F.finditer(line):
            number, suffix = m.group(1), m.group(2) or ""
            if number in ("16", "32", "64") and not suffix and _DTYPE_LINE.search(line):
                continue
            if _F_SCORE.match(line, m.start()):
                continue
            refs.append((f"F{int(number)}{suffix}", where))
        kinded = set()
        for m in _LEMMA.finditer(line):
            refs.append((f"{m.group(1).capitalize()} {m.group(2)}", where))
            kinded.add(m.start(2))
        for m in _BARE_LEMMA.finditer(line):
            if m.start(1) not in kinded:
                refs.append((m.group(1), where))
        for m in _SEED.finditer(line):
            if (path, m.group(0)) in _NOT_SECTIONS:
                continue
            refs.extend((f"seed {n.strip()}", where) for n in m.group(1).split(","))
        for m in _THEORY_SECTION.finditer(line):
            key = m.group(1) if m.group(2) is None else f"{m.group(1)}.{m.group(2)}"
            refs.append((f"section {key}", where))
        for m in _THEORY_ITEM.finditer(line):
            refs.append((f"section {m.group(1)}.{m.group(2)}", where))
    return refs


def design_table_references(text: str, path: str) -> list[tuple[str, str]]:
    """The "seed §" column of docs/design.md's package table."""
    refs: list[tuple[str, str]] = []
    column = None
    for lineno, line in enumerate(text.splitlines(), 1):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if column is None:
            if line.startswith("|") and "seed §" in cells:
                column = cells.index("seed §")
            continue
        if not line.startswith("|"):
            break
        for item in cells[column].split(","):
            item = item.strip()
            if re.fullmatch(r"\d+(?:\.\d+)?|closing remark", item):
                refs.append((f"seed {item}", f"{path}:{lineno}"))
    return refs


# ---- anchors ------------------------------------------------------------------------------------

_HEADINGS = [
    (re.compile(r"^#{1,6}\s+(F\d{1,3}[a-z]?)\s+—"), lambda m: m.group(1)),
    (re.compile(r"^#{1,6}\s+(Lemma|Theorem)\s+([GH]\.\d+)\s+—"), lambda m: f"{m.group(1)} {m.group(2)}"),
    (re.compile(r"^#{1,6}\s+seed\s+(\d+(?:\.\d+)?|closing remark)\s+—"), lambda m: f"seed {m.group(1)}"),
    (re.compile(r"^#{1,6}\s+Section\s+(\d+)\s+—"), lambda m: f"section {m.group(1)}"),
    (re.compile(r"^#{1,6}\s+Ambiguity\s+(\d+\.\d+)\s+—"), lambda m: f"section {m.group(1)}"),
]


def anchors(theory_text: str) -> set[str]:
    found = set()
    for line in theory_text.splitlines():
        for pattern, key in _HEADINGS:
            m = pattern.match(line)
            if m:
                found.add(key(m))
    return found


def resolves(key: str, targets: set[str]) -> bool:
    if re.fullmatch(r"[GH]\.\d+", key):  # bare: either kind of heading
        return f"Lemma {key}" in targets or f"Theorem {key}" in targets
    return key in targets


def unresolved(refs: list[tuple[str, str]], targets: set[str]) -> list[tuple[str, str]]:
    return [(k, w) for k, w in refs if not resolves(k, targets)]


def _scanned_files() -> list[Path]:
    files = [p for d in ("src", "tests", "benchmarks", "examples") for p in (ROOT / d).rglob("*.py")]
    files += list((ROOT / "src").rglob("*.md")) + list((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
    return sorted(p for p in files if p.resolve() != Path(__file__).resolve())


def _repository_references() -> list[tuple[str, str]]:
    refs = []
    for p in _scanned_files():
        rel = p.relative_to(ROOT).as_posix()
        text = p.read_text(encoding="utf-8")
        refs += find_references(text, rel)
        if rel == "docs/design.md":
            refs += design_table_references(text, rel)
    return refs


# ---- tests --------------------------------------------------------------------------------------


def test_every_reference_in_the_repository_resolves():
    missing = unresolved(_repository_references(), anchors(THEORY.read_text(encoding="utf-8")))
    assert not missing, "references without a heading in docs/theory.md:\n" + "\n".join(
        f"  {w}: {k}" for k, w in missing)


def test_the_scanner_sees_the_references_the_code_is_known_to_make():
    # guards against a scanner that silently finds nothing (the first test would then pass)
    refs = _repository_references()
    keys = {k for k, _ in refs}
    kinds = {"F": 0, "lemma": 0, "seed": 0, "section": 0}
    for k, _ in refs:
        kind = ("F" if k.startswith("F") else "seed" if k.startswith("seed")
                else "section" if k.startswith("section") else "lemma")
        kinds[kind] += 1
    assert kinds["F"] >= 50 and kinds["lemma"] >= 20 and kinds["seed"] >= 20 and kinds["section"] >= 5, kinds
    assert {"F6", "F8", "F14", "Lemma G.3", "Theorem G.5", "Lemma H.1", "seed 2.1", "section 2"} <= keys


def test_theory_has_every_numbered_item():
    targets = anchors(THEORY.read_text(encoding="utf-8"))
    expected = {f"F{i}" for i in range(1, 19)} | {"F16a", "F16b", "F16c", "F16d"}
    expected |= {"Lemma G.1", "Lemma G.2", "Lemma G.3", "Theorem G.5", "Lemma H.1"}
    expected |= {f"section {i}" for i in range(1, 8)} | {f"section 4.{i}" for i in range(1, 8)}
    assert expected <= targets, sorted(expected - targets)


def test_a_fake_reference_is_reported_missing():
    targets = anchors(THEORY.read_text(encoding="utf-8"))
    text = ("See THEORY F999 and F6; Lemma G.7, Theorem G.1 (the real one is Lemma G.1), G.3;\n"
            "seed sections 2.1, 8.4; THEORY.md section 2.1 and THEORY section 2.")
    missing = {k for k, _ in unresolved(find_references(text), targets)}
    assert missing == {"F999", "Lemma G.7", "Theorem G.1", "seed 8.4", "section 2.1"}


def test_look_alikes_are_not_references():
    text = ('if dtype == "F16":\n'
            "F64 / F32 are views; BF16 is the upper half of a float32\n"
            "report the F1 score; colour 0xF1F1F1; #F1F1F1\n"
            "random seeded runs; seed=3; the seed's 1/eps^2 form")
    assert find_references(text) == []


def test_internal_links_of_theory_point_to_headings():
    text = THEORY.read_text(encoding="utf-8")
    slugs = set()
    for line in text.splitlines():
        m = re.match(r"^#{1,6}\s+(.*)$", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            slugs.add(slug)
    links = re.findall(r"\]\(#([^)]+)\)", text)
    assert links, "docs/theory.md links to its own sections"
    assert set(links) <= slugs, sorted(set(links) - slugs)

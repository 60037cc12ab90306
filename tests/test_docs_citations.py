"""Every document the code cites is in the repository (issue 33 item 4, "self-contained docs").

Convention (stated at the top of docs/model.md): a citation is `docs/<file>.md §X` (backticks around the path
allowed), optionally followed by more sections joined by `,` / `-` / `–` / `and` (`docs/design.md §3, §9`,
`docs/model.md §2-§3`); words after a number point inside that section (`§2.4 step 2`, `§5 pitfall 3`). `X` must be
the number at the start of a heading of that file: `## 2.3 Attention with sinks`, `## 1. Configuration`. Inside
docs/model.md and docs/design.md a bare `§X` means a section of the same file.

No file may cite the documents this repository does not contain (the old `spec §` / `design §` / `design.md §`
citations, `/work/shared`, `spec/gpt-oss.md`, `pitfalls.md`).
"""

from __future__ import annotations

import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCANNED = ("slope_jax", "tests", "benchmarks", "docs", "launch", "checkpoints", "configs", "README.md")
SUFFIXES = (".py", ".md", ".sh", ".json", ".toml", ".txt", ".yaml", ".yml", ".cfg")
SELF = os.path.relpath(os.path.abspath(__file__), REPO)

_NUM = r"\d+(?:\.\d+)*"
CITATION = re.compile(rf"`?docs/([\w-]+\.md)`?((?:\s*(?:,|-|–|and)?\s*§\s?{_NUM})+)")
SECTION = re.compile(rf"§\s?({_NUM})")
HEADING = re.compile(rf"^#{{1,6}}\s+({_NUM})\.?(?:\s|$)", re.M)
SELF_CITING = ("docs/model.md", "docs/design.md")
FORBIDDEN = (
    (re.compile(r"(?<![\w/.`-])(?:spec|design)(?:\.md)?\s?§\s?\d"), "a 'spec §' / 'design §' citation"),
    (re.compile(r"/work/shared"), "a path outside the repository"),
    (re.compile(r"spec/gpt-oss\.md"), "the external model spec"),
    (re.compile(r"(?<!docs/)\bpitfalls\.md"), "the external pitfalls list"),
)


def _text_files():
    for top in SCANNED:
        path = os.path.join(REPO, top)
        if os.path.isfile(path):
            yield top
            continue
        for root, dirs, files in os.walk(path):
            dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__pycache__")))
            for name in sorted(files):
                if name.endswith(SUFFIXES):
                    yield os.path.relpath(os.path.join(root, name), REPO)


def _read(rel: str) -> str:
    with open(os.path.join(REPO, rel), encoding="utf-8", errors="replace") as f:
        text = f.read()
    return text.replace("\\u00a7", "§")  # JSON files escape the section sign


def _headings(rel: str) -> set[str]:
    return set(HEADING.findall(_read(rel)))


def _citations():
    """(file, line, cited doc, section number) for every `docs/<file>.md §X`, plus bare `§X` in the cited docs."""
    for rel in _text_files():
        for lineno, line in enumerate(_read(rel).splitlines(), 1):
            for m in CITATION.finditer(line):
                for sec in SECTION.findall(m.group(2)):
                    yield rel, lineno, "docs/" + m.group(1), sec
            if rel in SELF_CITING and not line.lstrip().startswith("#"):
                for sec in SECTION.findall(CITATION.sub("", line)):
                    yield rel, lineno, rel, sec


def test_heading_convention_parses_numbered_headings():
    text = "# Title\n## 1. Configuration\n## 2.3 Attention with sinks\n### 5.1 Checks\n## Sources\n"
    assert set(HEADING.findall(text)) == {"1", "2.3", "5.1"}
    cites = [(m.group(1), SECTION.findall(m.group(2))) for m in CITATION.finditer(
        "(docs/design.md §3, §9) `docs/model.md` §2.4 step 2; docs/model.md §2-§3, §5.1 and docs/x.md")]
    assert cites == [("design.md", ["3", "9"]), ("model.md", ["2.4"]), ("model.md", ["2", "3", "5.1"])]
    assert FORBIDDEN[0][0].search("(spec §2.3)") and FORBIDDEN[0][0].search("design.md §7")
    assert not FORBIDDEN[0][0].search("docs/design.md §7") and not FORBIDDEN[0][0].search("OCP MX spec v1.0 §5")


@pytest.mark.parametrize("doc", SELF_CITING)
def test_cited_documents_exist_with_numbered_sections(doc):
    assert os.path.isfile(os.path.join(REPO, doc)), doc
    assert len(_headings(doc)) >= 9, f"{doc}: expected numbered '## N.M ...' headings"


def test_every_citation_names_an_existing_file_and_section():
    cites = list(_citations())
    assert len(cites) >= 60, f"only {len(cites)} citations found: is the scan broken?"
    bad = []
    headings: dict[str, set[str]] = {}
    for rel, lineno, doc, sec in cites:
        if not os.path.isfile(os.path.join(REPO, doc)):
            bad.append(f"{rel}:{lineno}: cites {doc}, which does not exist")
            continue
        if doc not in headings:
            headings[doc] = _headings(doc)
        if sec not in headings[doc]:
            bad.append(f"{rel}:{lineno}: cites {doc} §{sec}, which has no heading '## {sec} ...'")
    assert not bad, "\n".join(bad)


def test_no_citation_of_documents_the_repository_lacks():
    bad = []
    for rel in _text_files():
        if rel == SELF:
            continue
        for lineno, line in enumerate(_read(rel).splitlines(), 1):
            for rx, what in FORBIDDEN:
                if rx.search(line):
                    bad.append(f"{rel}:{lineno}: {what}: {line.strip()[:100]}")
    assert not bad, "\n".join(bad)

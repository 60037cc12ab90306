"""Stamp the committed result JSONs that have no `provenance` with one taken from git history.

    python benchmarks/stamp_provenance.py            # every benchmarks/measured/**/*.json without provenance
    python benchmarks/stamp_provenance.py --check    # list the files without one; exit 1 if any

Results written by `common.write_result` carry a provenance recorded at run time. The results committed before it
existed are stamped here instead, without re-running them: `commit` is the last commit that changed the file (its
numbers are those of that commit's tree, or of a tree shortly before it: a result is committed after its run), `date`
that commit's date (UTC), `first_commit` the commit that added the file (renames followed), and `stamped_later: true`
with a note saying so. Files that already have a provenance are left alone, so a re-run changes nothing; a file
with no commit yet is refused (commit it first, or re-run its benchmark).
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEASURED = os.path.join(REPO, "benchmarks", "measured")
NOTE = ("stamped from git history by benchmarks/stamp_provenance.py, not recorded at run time: commit is the last "
        "commit that changed this file and date that commit's date (the run came shortly before); versions, machine "
        "and load were not recorded")


def result_files(root: str = MEASURED) -> list[str]:
    return sorted(glob.glob(os.path.join(root, "**", "*.json"), recursive=True))


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", REPO, *args], capture_output=True, text=True, check=True).stdout.strip()


def _utc(iso: str) -> str:
    return datetime.datetime.fromisoformat(iso).astimezone(datetime.timezone.utc).isoformat(timespec="seconds")


def history_provenance(path: str) -> dict:
    """The provenance of a committed file from git: last and first commit, the last one's date (UTC)."""
    rel = os.path.relpath(path, REPO)
    last = _git("log", "-1", "--format=%H %cI", "--", rel).split()
    if not last:
        raise SystemExit(f"{rel}: no commit changed this file; commit it (or re-run its benchmark) first")
    first = _git("log", "--follow", "--diff-filter=A", "--format=%H", "--", rel).split()
    return {"commit": last[0], "date": _utc(last[1]), "first_commit": first[-1] if first else last[0],
            "stamped_later": True, "note": NOTE}


def stamp(path: str) -> bool:
    """Add a history provenance to `path` if it has none; True if the file was changed."""
    from slope_jax.atomic import atomic_json

    with open(path) as f:
        text = f.read()
    doc = json.loads(text)
    if "provenance" in doc:
        return False
    doc["provenance"] = history_provenance(path)
    lines = text.splitlines()
    indent = len(lines[1]) - len(lines[1].lstrip(" ")) if len(lines) > 1 else None  # keep the file's layout
    atomic_json(path, doc, indent=indent or None)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only list the result files without a provenance")
    ap.add_argument("files", nargs="*", help="result JSONs (default: every one under benchmarks/measured/)")
    a = ap.parse_args()
    files = a.files or result_files()
    if a.check:
        missing = [f for f in files if "provenance" not in json.load(open(f))]
        for f in missing:
            print(f"no provenance: {os.path.relpath(f, REPO)}")
        sys.exit(1 if missing else 0)
    sys.path.insert(0, REPO)
    for f in files:
        print(f"{'stamped' if stamp(f) else 'has one'}: {os.path.relpath(f, REPO)}")


if __name__ == "__main__":
    main()

"""Evidence with provenance (issue 33): every committed result JSON says which commit produced it and when, every
benchmark writes its JSON through the one writer that records that (`benchmarks/common.write_result`), and no
benchmark depends on the test suite."""

import glob
import json
import os
import re

import pytest
from support import REPO

RESULTS = sorted(glob.glob(os.path.join(REPO, "benchmarks", "measured", "**", "*.json"), recursive=True))
BENCHMARKS = sorted(glob.glob(os.path.join(REPO, "benchmarks", "*.py")))


def test_the_result_files_are_found():
    assert len(RESULTS) >= 17, RESULTS


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: os.path.relpath(p, REPO))
def test_every_committed_result_carries_commit_and_date(path):
    with open(path) as f:
        prov = json.load(f).get("provenance")
    assert isinstance(prov, dict), "no provenance: run the benchmark again, or benchmarks/stamp_provenance.py"
    assert re.fullmatch(r"[0-9a-f]{40}", prov.get("commit") or ""), prov.get("commit")
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", prov.get("date") or ""), prov.get("date")
    if prov.get("stamped_later"):  # from git history: says so
        assert "git history" in prov["note"]
    else:  # recorded at run time by common.write_result
        assert {"dirty", "versions", "machine", "load"} <= set(prov), sorted(prov)


def _source(path):
    with open(path) as f:
        return f.read()


@pytest.mark.parametrize("path", BENCHMARKS, ids=os.path.basename)
def test_benchmarks_write_results_through_common_and_use_nothing_from_tests(path):
    src = _source(path)
    assert not re.search(r"^\s*(from|import)\s+(tests\b|conftest\b|support\b)", src, re.M), path
    assert not re.search(r"""["']tests["']\s*,|["']tests/""", src), f"{path} names a file under tests/"
    if os.path.basename(path) in ("common.py", "stamp_provenance.py"):
        return
    # result files: write_result only (json.dump to a file is left to children's private exchange files)
    assert "atomic_json(FLAGS" not in src and 'open(FLAGS.out, "w")' not in src, path

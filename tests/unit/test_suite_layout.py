"""The suite's own layout: pytest imports test files by basename (no __init__.py, rootdir import mode), so two
files of one name in different folders fail collection whenever one worker collects both."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_no_two_test_files_share_a_basename():
    names = Counter(path.name for path in TESTS.rglob("test_*.py"))
    assert not [name for name, count in names.items() if count > 1]

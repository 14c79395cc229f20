"""README.md and docs/*.md claim no more than the tests show, and say where each proof ran (issue 32).

A claim ends with a proof reference, in one of these forms:
    (test: `tests/integration/test_x.py::test_name`, CPU)
    (tests: `tests/unit/test_a.py::test_one`, `tests/unit/test_b.py::test_two[id]`, CPU; `tests/gpu/test_gpu.py::t`, H100)
    (measured: `benchmarks/gpu_memory.py`, H100)
Each group of references ends with where it ran (LABELS). What this file checks:
1. every `tests/...py::name` anywhere in those files names an existing file and a test defined in it (a
   parametrized id after `[` must be one the file can produce), and every `tests/...py` path exists;
2. every label is one of LABELS, and an H100 label is backed by the GPU record: a test under tests/gpu/ that passed
   there (NOT_PASSED_ON_H100 lists what didn't), or a script or test file that tests/gpu/RESULTS.md names;
3. in README.md's capability sections (CLAIM_SECTIONS), every paragraph and every top-level bullet carries a
   reference, except the few in NOT_CLAIMS (each with its reason) and the bullets of a list whose referenced lead-in
   stands for them (LEAD_IN_COVERS). A new unreferenced paragraph fails here.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RESULTS = ROOT / "tests" / "gpu" / "RESULTS.md"

LABELS = {
    "CPU": "a unit test, or real processes over gloo on CPU (the rehearsal)",
    "H100": "passed on one H100 80GB in a run recorded in tests/gpu/RESULTS.md (never more than one GPU)",
    "CPU against H100 measurements": "a CPU test that checks figures measured on that H100",
}
# GPU tests, or parametrized cases of them, that have not passed on the H100, with the RESULTS.md row that says so.
# A reference labelled H100 may not name them; a test with such a case must be named by the cases that passed.
NOT_PASSED_ON_H100 = {
    "tests/gpu/test_gpu.py::test_every_strategy_over_nccl_at_world_size_1[zero3-nvme-offload]":
        "NCCL, world 1: ZeRO-3 + NVMe offload",
    "tests/gpu/test_gpu.py::test_two_ranks_sharing_the_gpu_match_one_process[fsdp2]": "2 ranks share the GPU: FSDP2",
    "tests/gpu/test_gpu.py::test_kill_9_mid_run_then_resume": "kill -9 after checkpoint 6, resume (ZeRO-3)",
    "tests/gpu/test_kernels_gpu.py::test_packed_rows_give_each_example_its_own_logits[flash_attention_2-bfloat16]":
        "packed rows: flash_attention_2 | skipped",
}  # fmt: skip

CLAIM_SECTIONS = [
    "",  # the opening paragraphs, before the first heading
    "The demo",
    "A short tour",
    "After training: merge, chat, infer, eval, report",
    "One GPU, eight GPUs, two nodes — and a rehearsal on CPU first",
    "When things fail",
]
OTHER_SECTIONS = {
    "Set-up: two commands": "how to install and run the tests: instructions",
    "Benchmarks": "measurements, each row naming the script (or test) that took it; figures, not capabilities",
    "Development": "the make targets",
}
# Paragraphs of the claim sections that claim no capability, by their opening words.
NOT_CLAIMS = {
    "**Where each claim is proven.**": "explains the references themselves",
    "With internet, the same recipe can train": "an instruction, which says the tests don't run it",
    "The GPU tier (`make test-gpu`": "says where the GPU record is; the bullets after it carry the H100 references",
    "What has not passed yet": "lists what has no proof on a GPU; the record is tests/gpu/RESULTS.md",
}
# Lead-in paragraphs whose reference covers the bullets after them: the bullets are parts of that one claim.
LEAD_IN_COVERS = {
    "`metrics.json` also records `startup_seconds`": "the bullets name the phases the referenced test times",
    "Measured here, on a quiet 2-core VM": "the bullets are the referenced test's wall time, recipe by recipe",
}

REF = re.compile(r"\((tests?|measured): ([^()]*)\)")
GROUP = re.compile(r"^((?:`[^`]+`, )*`[^`]+`), ([^`]+)$")
TEST_ID = re.compile(r"tests/[\w/]+\.py::[\w:]+(?:\[[^\]`\s]*\])?")
TEST_PATH = re.compile(r"tests/[\w/]+\.py\b(?!::)")


@dataclass
class Block:
    section: str
    kind: str  # "paragraph" or "item"
    text: str
    items: list[Block] = field(default_factory=list)  # a lead-in paragraph's bullets
    lead: Block | None = None  # a bullet's lead-in paragraph

    def opening(self) -> str:
        return " ".join(self.text.split())[:90]

    def has_reference(self) -> bool:
        return bool(REF.search(" ".join(self.text.split())))


def readme_blocks() -> list[Block]:
    """README's paragraphs and top-level bullets (nested bullets and indented lines folded into their bullet), by
    level-2 section; code blocks, tables and headings left out."""
    blocks: list[Block] = []
    section, fenced, current, lead = "", False, None, None
    for line in (ROOT / "README.md").read_text().splitlines():
        if line.startswith("```"):
            fenced, current = not fenced, None
            continue
        if fenced:
            continue
        if line.startswith("## "):
            section, current, lead = line[3:].strip(), None, None
            continue
        if not line.strip() or line.startswith(("#", "|")):
            if current and current.kind == "paragraph" and current.text.rstrip().endswith(":"):
                lead = current  # a lead-in may stand a blank line away from its list
            current = None
            continue
        if line.startswith("- "):
            if current and current.kind == "paragraph":
                lead = current if current.text.rstrip().endswith(":") else None
            current = Block(section, "item", line, lead=lead)
            if lead:
                lead.items.append(current)
            blocks.append(current)
        elif current:
            current.text += "\n" + line  # the paragraph goes on, or a bullet's nested bullet or continuation
        else:
            current, lead = Block(section, "paragraph", line), None
            blocks.append(current)
    return blocks


@cache
def defined_tests(path: Path) -> tuple[set[str], set[str], set[str]]:
    """(test names as `name` or `Class::name`, the parametrized ones, the string constants) of a test file."""
    tree = ast.parse(path.read_text())
    names, parametrized = set(), set()

    def add(node, prefix=""):
        names.add(prefix + node.name)
        if any("parametrize" in ast.unparse(d) for d in node.decorator_list):
            parametrized.add(prefix + node.name)

    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            add(node)
        elif isinstance(node, ast.ClassDef):
            names.add(node.name)
            for inner in node.body:
                if isinstance(inner, ast.FunctionDef | ast.AsyncFunctionDef):
                    add(inner, node.name + "::")
    constants = {str(n.value) for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str | int)}
    return names, parametrized, constants


def missing_test(reference: str) -> str | None:
    """Why `tests/...py::name[id]` names no test, or None."""
    path, _, name = reference.partition("::")
    if not (ROOT / path).is_file():
        return f"{path} does not exist"
    name, _, case = name.partition("[")
    names, parametrized, constants = defined_tests(ROOT / path)
    if name not in names:
        return f"{path} defines no test {name}"
    if case:
        case = case.rstrip("]")
        if name not in parametrized:
            return f"{path}::{name} is not parametrized, so it has no case [{case}]"
        if case not in constants and not all(part in constants for part in case.split("-")):
            return f"{path}::{name} has no parameter that gives the case [{case}]"
    return None


def references(text: str) -> list[tuple[str, list[str], str]]:
    """(kind, paths, label) of every reference group in a text; a malformed group raises AssertionError."""
    found = []
    for kind, body in REF.findall(" ".join(text.split())):
        for group in body.split("; "):
            match = GROUP.match(group)
            assert match, (
                f"malformed proof reference ({kind}: {body}): each group is `path`, `path`, LABEL (where it ran)"
            )
            found.append((kind, re.findall(r"`([^`]+)`", match.group(1)), match.group(2)))
    return found


def label_problem(kind: str, path: str, label: str) -> str | None:
    if label not in LABELS:
        return f"{path}: where it ran is {label!r}, not one of {sorted(LABELS)}"
    on_gpu = path.startswith("tests/gpu/")
    if kind != "measured" and label == "CPU" and on_gpu:
        return f"{path} runs only on a GPU: label it H100 (if it passed there), not CPU"
    if label == "H100" and kind != "measured":
        if not on_gpu:
            return f"{path} is labelled H100 but is not a GPU test (tests/gpu/)"
        bare = path.partition("[")[0]
        failed = [k for k in NOT_PASSED_ON_H100 if k == path or (k.startswith(bare + "[") and "[" not in path)]
        if failed:
            return f"{path} did not pass on the H100 (tests/gpu/RESULTS.md: {NOT_PASSED_ON_H100[failed[0]]!r}); name the cases that passed"  # fmt: skip
    if (label == "H100" and kind == "measured") or label == "CPU against H100 measurements":
        file = path.partition("::")[0]  # a test file must be named by its path; a script also by its stem
        named = {file} if kind != "measured" else {file, Path(file).stem}
        if not any(name in RESULTS.read_text() for name in named):
            return f"{path} is labelled {label!r} but tests/gpu/RESULTS.md doesn't name it"
    return None


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_every_test_a_doc_names_exists(doc):
    text = doc.read_text()
    problems = [p for ref in sorted(set(TEST_ID.findall(text))) if (p := missing_test(ref))]
    problems += [
        f"{path} does not exist" for path in sorted(set(TEST_PATH.findall(text))) if not (ROOT / path).is_file()
    ]
    assert not problems, f"{doc.name} names tests that don't exist (renamed? fix the reference):\n" + "\n".join(
        problems
    )


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_every_reference_says_where_it_ran_and_a_gpu_label_is_on_record(doc):
    problems = []
    for kind, paths, label in references(doc.read_text()):
        for path in paths:
            if kind == "measured" and not (ROOT / path).exists():
                problems.append(f"{path} does not exist")
            if kind != "measured" and not TEST_ID.fullmatch(path):
                problems.append(f"{path}: a test reference is `tests/...py::test_name`")
            problems += [p for p in [label_problem(kind, path, label)] if p]
    assert not problems, f"{doc.name}:\n" + "\n".join(problems)


def test_the_gpu_exceptions_are_the_ones_on_record():
    record = RESULTS.read_text()
    for reference, row in NOT_PASSED_ON_H100.items():
        assert not missing_test(reference), missing_test(reference)
        assert all(part.strip() in record for part in row.split("|")), f"tests/gpu/RESULTS.md has no row {row!r}"


def test_readme_sections_are_all_classified():
    sections = {b.section for b in readme_blocks()}
    unknown = sections - set(CLAIM_SECTIONS) - set(OTHER_SECTIONS)
    assert not unknown, f"README sections neither in CLAIM_SECTIONS nor in OTHER_SECTIONS: {sorted(unknown)}"
    assert set(CLAIM_SECTIONS) <= sections, f"gone from README: {sorted(set(CLAIM_SECTIONS) - sections)}"


def test_every_capability_claim_in_the_readme_points_to_its_test():
    blocks = [b for b in readme_blocks() if b.section in CLAIM_SECTIONS]

    def exempt(block: Block, table: dict[str, str]) -> bool:
        return any(block.opening().startswith(opening) for opening in table)

    def covered(block: Block) -> bool:
        if block.has_reference() or exempt(block, NOT_CLAIMS):
            return True
        if block.kind == "paragraph":  # a lead-in is covered by its bullets
            return bool(block.items) and all(covered(item) for item in block.items)
        return bool(block.lead and block.lead.has_reference() and exempt(block.lead, LEAD_IN_COVERS))

    missing = [f"  [{b.section or 'opening'}] {b.kind}: {b.opening()}..." for b in blocks if not covered(b)]
    assert not missing, (
        "README claims without a proof reference. End each with (test: `tests/...py::test_name`, CPU) naming the "
        "test that shows it and where it ran, weaken it to what a test shows, or, if it claims nothing, add its "
        "opening words to NOT_CLAIMS with the reason:\n" + "\n".join(missing)
    )
    for table in (NOT_CLAIMS, LEAD_IN_COVERS):
        stale = [o for o in table if sum(b.opening().startswith(o) for b in blocks) != 1]
        assert not stale, f"entries that match no README paragraph (or several): {stale}"

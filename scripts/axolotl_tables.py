"""docs/axolotl.md's tables of what llmtune does with each Axolotl key: `python scripts/axolotl_tables.py [--write]`.

Generated from llmtune/recipe/axolotl_history.py (which releases defined each key, and what llmtune does with it)
and llmtune/recipe/axolotl_keys.py (why a key has no effect, what to do instead of a refused one). Prints the
markdown; --write puts it between the markers in docs/axolotl.md, and the summary of counts (keys per release, per
action) between the summary markers above them. tests/unit/test_axolotl_corpus.py fails when the doc and this
output differ, so re-run with --write after the key tables change.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the llmtune of this checkout, not an installed one
from llmtune.recipe import axolotl_keys  # noqa: E402
from llmtune.recipe.axolotl_history import DATASET_KEYS, KEYS, RELEASES  # noqa: E402

DOC = Path(__file__).resolve().parents[1] / "docs" / "axolotl.md"
START, END = "<!-- tables:start -->", "<!-- tables:end -->"
SUMMARY = ("<!-- summary:start -->", "<!-- summary:end -->")
# The releases the summary counts keys of: the two README-era ones, the first of each schema layout, the last.
MILESTONES = ("v0.3.0", "v0.4.0", "v0.5.0", "v0.8.0")
ACTIONS = (  # the summary's rows: kind in the history table -> what it means
    ("llmtune", "llmtune's own key"),
    ("alias", "read under today's name (alias)"),
    ("translated", "rewritten into today's form"),
    ("no effect", "accepted without effect, said once"),
    ("refused", "refused, naming the capability"),
)
# Actions of the history table that are not one of the kinds above, and what they mean for a recipe.
UNLABELLED = {
    "unknown": "unknown keys when written directly in a dataset entry",
}
UNLABELLED_NOTE = {
    "unknown": "The history table marks these 'unknown'. The custom-format fields among them (`field_instruction`, "
    "`format`, `system_prompt`, ...) are read inside a `type:` mapping, where Axolotl defined them.",
}


def span(entries: list[tuple]) -> str:
    """'v0.3.0 to v0.18.0' over the releases that defined any of the entries."""
    first = min((e[0] for e in entries), key=RELEASES.index)
    last = max((e[1] for e in entries), key=RELEASES.index)
    return first if first == last else f"{first} to {last}"


def names(keys: list[str], prefix: str = "") -> str:
    """`a`, `b`, ...; four or more keys sharing their first word are written once as `word_*` (n)."""
    by_word = defaultdict(list)
    for key in sorted(keys):
        by_word[key.split("_")[0]].append(key)
    parts = []
    for word, group in by_word.items():
        if len(group) >= 4 and "_" in group[0]:
            parts.append(f"`{prefix}{word}_*` ({len(group)})")
        else:
            parts.extend(f"`{prefix}{key}`" for key in group)
    return ", ".join(parts)


def hint_for(keys: list[str], table: dict) -> str:
    hints = [table[k].hint for k in keys if k in table and table[k].hint]
    return hints[0] if hints else ""


def defined_in(release: str) -> int:
    """How many top-level keys the release defined: between a key's first and last release, less its gaps."""
    at = RELEASES.index(release)
    return sum(RELEASES.index(e[0]) <= at <= RELEASES.index(e[1]) and release not in (e[3] if len(e) > 3 else ())
               for e in KEYS.values())  # fmt: skip


def kind_of(action: str) -> str:
    return "alias" if action.startswith("alias of ") else action.partition(": ")[0]


def summary() -> str:
    """The paragraph and table of counts above the tables: releases, keys per release, keys per action."""
    counts = [f"{defined_in(r)} ({r})" for r in (*MILESTONES, RELEASES[-1])]
    text = (f"The table covers {len(RELEASES)} releases ({RELEASES[0]} to {RELEASES[-1]}) and {len(KEYS)} top-level "
            f"keys. By release, from {counts[0].replace(' (', ' keys (', 1)} and {counts[1]} to "
            f"{', '.join(counts[2:-1])} and {counts[-1]}. What llmtune does with them today:")  # fmt: skip
    out = [textwrap.fill(text, width=118), "", "| action | keys |", "| --- | --- |"]
    for kind, meaning in ACTIONS:
        keys = sorted(k for k, e in KEYS.items() if kind_of(e[2]) == kind)
        named = f" ({', '.join(f'`{k}`' for k in keys)})" if kind == "translated" else ""
        out.append(f"| {meaning}{named} | {len(keys)} |")
    return "\n".join(out) + "\n"


def tables() -> str:
    groups = defaultdict(lambda: defaultdict(list))  # action kind -> label -> [(name, entry)]
    for prefix, table in (("", KEYS), ("datasets[].", DATASET_KEYS)):
        for key, entry in table.items():
            kind, _, label = entry[2].partition(": ") if ": " in entry[2] else (entry[2], "", "")
            if kind.startswith("alias of "):
                kind, label = "alias", kind.removeprefix("alias of ")
            if kind == "no effect":
                reasons = axolotl_keys.AXOLOTL_DATASET_KEYS if prefix else axolotl_keys.AXOLOTL_ONLY_KEYS
                found = reasons.get(key)
                label = found.reason if found else "(no reason recorded in axolotl_keys.py)"
            groups[kind][label].append((prefix + key, entry))
    own = sum(len(v) for v in groups["llmtune"].values())
    total = len(KEYS) + len(DATASET_KEYS)
    out = [
        f"{len(KEYS)} top-level keys and {len(DATASET_KEYS)} dataset-entry keys that Axolotl releases "
        f"{RELEASES[0]} to {RELEASES[-1]} defined ({total} in all). {own} are llmtune's own keys; the rest:",
        "",
        "### Read under today's name",
        "",
        "A note says so once.",
        "",
        "| written | releases | read as |",
        "| --- | --- | --- |",
    ]
    for target, items in sorted(groups["alias"].items()):
        for name, entry in sorted(items):
            out.append(f"| `{name}` | {span([entry])} | `{target}` |")
    out += ["", "### Rewritten into today's form", "", "| written | releases | read as |", "| --- | --- | --- |"]
    for form, items in sorted(groups["translated"].items()):
        for name, entry in sorted(items):
            out.append(f"| `{name}` | {span([entry])} | {form} |")
    count = sum(len(v) for v in groups["no effect"].values())
    out += ["", "### Accepted without effect", "", f"{count} keys, each said once, by reason:", ""]
    for reason, items in sorted(groups["no effect"].items(), key=lambda kv: (-len(kv[1]), kv[0])):
        out.append(f"- {reason} ({len(items)}): {names([n for n, _ in items])}")
    refused = groups["refused"]
    count = sum(len(v) for v in refused.values())
    out += [
        "",
        "### Refused, and why",
        "",
        f"{count} keys ask for a capability llmtune doesn't have. Set to a value that asks for nothing (`false`, "
        "empty, or a listed default) a key is accepted without effect; any other value is refused in one line "
        "that names the capability and the key, with what to do instead.",
        "",
        "| capability | keys | releases | instead |",
        "| --- | --- | --- | --- |",
    ]
    for capability, items in sorted(refused.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        top = [n for n, _ in items if not n.startswith("datasets[]")]
        data = [n.removeprefix("datasets[].") for n, _ in items if n.startswith("datasets[]")]
        hint = hint_for(top, axolotl_keys.AXOLOTL_ONLY_KEYS) or hint_for(data, axolotl_keys.AXOLOTL_DATASET_KEYS)
        keys = ", ".join(filter(None, [names(top), names(data, "datasets[].")]))
        out.append(f"| {capability} | {keys} | {span([e for _, e in items])} | {hint} |")
    for kind in sorted(set(groups) - {"llmtune", "alias", "translated", "no effect", "refused"}):
        items = [item for label in groups[kind].values() for item in label]
        what = UNLABELLED.get(kind, f"marked '{kind}' in the history table")
        out += ["", f"### {what[0].upper()}{what[1:]}", "", f"{len(items)} keys: {names([n for n, _ in items])}"]
        out += ["", UNLABELLED_NOTE[kind]] if kind in UNLABELLED_NOTE else []
    return "\n".join(out) + "\n"


def write(doc: Path = DOC) -> None:
    text = doc.read_text(encoding="utf-8")
    for (start, end), generated in (((START, END), tables()), (SUMMARY, summary())):
        head, rest = text.split(start, 1)
        _, tail = rest.split(end, 1)
        text = f"{head}{start}\n{generated}{end}{tail}"
    doc.write_text(text, encoding="utf-8")


def in_doc(doc: Path = DOC, markers: tuple[str, str] = (START, END)) -> str:
    """What docs/axolotl.md holds between the markers (the tables', or SUMMARY)."""
    start, end = markers
    return doc.read_text(encoding="utf-8").split(start, 1)[1].split(end, 1)[0].removeprefix("\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"replace the tables in {DOC.name}")
    args = parser.parse_args(argv)
    if args.write:
        write()
    else:
        sys.stdout.write(tables())
    return 0


if __name__ == "__main__":
    sys.exit(main())

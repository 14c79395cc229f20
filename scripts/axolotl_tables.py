"""docs/axolotl.md's tables of what llmtune does with each Axolotl key: `python scripts/axolotl_tables.py [--write]`.

Generated from llmtune/recipe/axolotl_history.py (which releases defined each key, and what llmtune does with it)
and llmtune/recipe/axolotl_keys.py (why a key has no effect, what to do instead of a refused one). Prints the
markdown; --write puts it between the markers in docs/axolotl.md. tests/unit/test_axolotl_corpus.py fails when
the doc and this output differ, so re-run with --write after the key tables change.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the llmtune of this checkout, not an installed one
from llmtune.recipe import axolotl_keys  # noqa: E402
from llmtune.recipe.axolotl_history import DATASET_KEYS, KEYS, RELEASES  # noqa: E402

DOC = Path(__file__).resolve().parents[1] / "docs" / "axolotl.md"
START, END = "<!-- tables:start -->", "<!-- tables:end -->"
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
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    doc.write_text(f"{head}{START}\n{tables()}{END}{tail}", encoding="utf-8")


def in_doc(doc: Path = DOC) -> str:
    """What docs/axolotl.md holds between the markers."""
    return doc.read_text(encoding="utf-8").split(START, 1)[1].split(END, 1)[0].removeprefix("\n")


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

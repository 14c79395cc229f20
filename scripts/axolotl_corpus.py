"""How many public Axolotl recipes llmtune accepts, by era: `python scripts/axolotl_corpus.py`.

The recipes are listed, not copied, in scripts/axolotl_corpus.tsv (repository, commit, path, the commit's month,
the Axolotl release most likely meant). They are read from DIR/<owner>+<name>/<path> (--dir), and with
--download any missing one is fetched first from raw.githubusercontent.com at the listed commit. Each recipe is
validated and planned as scripts/axolotl_examples.py does (the same functions). Prints, per half-year, how many
were accepted; the first refusal line of each refused recipe; the refusals grouped by the capability they name;
and every recipe that raised anything other than llmtune's UserError (exit code 1 if any did).
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
import traceback
import urllib.request
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import axolotl_examples as examples  # noqa: E402  (sets HF_HUB_OFFLINE before llmtune is imported)

from llmtune.recipe.axolotl_history import DATASET_KEYS, KEYS  # noqa: E402

MANIFEST = Path(__file__).resolve().with_suffix(".tsv")
COLUMNS = ("repo", "commit", "path", "date", "release")
RAW = "https://raw.githubusercontent.com/{repo}/{commit}/{path}"


@dataclass(frozen=True)
class Row:
    repo: str
    commit: str
    path: str
    date: str  # YYYY-MM of the commit
    release: str

    def local(self, folder: Path) -> Path:
        return folder / self.repo.replace("/", "+", 1) / self.path

    @property
    def era(self) -> str:
        year, month = self.date.split("-")
        return f"{year} H{1 if int(month) <= 6 else 2}"


def read_manifest(path: Path = MANIFEST) -> list[Row]:
    """The manifest's rows; lines starting with # are comments, the first other line is the header."""
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line and not line.startswith("#")]
    reader = csv.reader(lines, delimiter="\t")
    header = tuple(next(reader))
    if header != COLUMNS:
        raise ValueError(f"{path}: header {header}, expected {COLUMNS}")
    return [Row(*fields) for fields in reader]


def download(row: Row, target: Path) -> bool:
    try:
        with urllib.request.urlopen(RAW.format(repo=row.repo, commit=row.commit, path=row.path), timeout=30) as r:
            data = r.read()
    except OSError as err:
        print(f"could not download {row.repo}/{row.path}: {err}", file=sys.stderr)
        return False
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)
    return True


# A refusal for a local file (the recipe author's own data, model or DeepSpeed file) says nothing about llmtune:
# such a recipe is checked again with local paths left unchecked, and counted by what that finds.
ABSENT = re.compile(r"(does not exist|not found in) ")
# What a refusal asks for, read from llmtune's one-line message: "<capability> is not supported (<key>: ...)",
# an unknown key, or the schema's complaint about one key's value. The first pattern that matches names the class.
CLASSES = (
    (re.compile(r"unknown key '([^']+)'"), "unknown key {0}"),
    (re.compile(r"\d+ unknown keys: '([^']+)'"), "unknown key {0}"),  # several: grouped by the first
    (re.compile(r"(?:unknown dataset type|Axolotl's dataset type) '([^']+)'"), "dataset type {0}"),
    (re.compile(r"(?:^|: )([^:;]*?) (?:is|are) not supported"), "{0}"),
    (re.compile(r"^(?:[\w.\[\]]+: )?(.+?) can't run (?:under|with) ([^:;(]+)"), "{0} under {1}"),
    (re.compile(r"^([\w.\[\]]+)(?: \(written as \w+\))?: "), "a value of {0}"),
)


def refusal_class(message: str) -> str:
    for pattern, label in CLASSES:
        found = pattern.search(message)
        if found:
            label = label.format(*(g.strip() for g in found.groups()))
            return label + (released(label.removeprefix("unknown key "), message) if "unknown key" in label else "")
    return "other"


def released(key: str, message: str) -> str:
    """Which Axolotl releases defined an unknown key, from llmtune's history table (a dataset entry's key in
    DATASET_KEYS, where the table may itself mark it 'unknown')."""
    table = DATASET_KEYS if re.match(r"\w+\[\d+\]: unknown key", message) else KEYS
    if key not in table:
        return " (no Axolotl release has it)"
    first, last, action = table[key][:3]
    return f" (Axolotl {first} to {last}; llmtune's table: {action})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("/work/axolotl-corpus"), help="where the recipes lie")
    parser.add_argument("--manifest", type=Path, default=MANIFEST, help="the TSV that lists them")
    parser.add_argument("--download", action="store_true", help="fetch missing recipes from GitHub first")
    parser.add_argument("--num-processes", type=int, default=2, help="processes to plan for (default 2)")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (the rehearsal's plan)")
    args = parser.parse_args(argv)
    rows = read_manifest(args.manifest)
    totals, accepted = defaultdict(Counter), defaultdict(Counter)
    classes: dict[str, list[str]] = defaultdict(list)
    accepted_beyond, absent = defaultdict(Counter), Counter()
    failures, missing = [], []
    for row in rows:
        path = row.local(args.dir)
        if not path.is_file() and not (args.download and download(row, path)):
            missing.append(row)
            continue
        group = examples.kind(path)
        totals[row.era][group] += 1
        try:
            refusal = examples.check(path, args.num_processes, args.device)
            if refusal is not None and ABSENT.search(refusal):
                beyond = examples.check(path, args.num_processes, args.device, check_files=False)
                absent[row.era] += 1
                if beyond is None:
                    accepted_beyond[row.era][group] += 1
                    print(f"{row.repo}/{row.path} [{group}, {row.release}]: {refusal} -- and nothing else")
                    continue
                refusal = beyond  # what it asks for besides its author's files
        except Exception:  # noqa: BLE001 - any exception but UserError is a bug in llmtune: count and show it
            failures.append((row, traceback.format_exc()))
            continue
        if refusal is None:
            accepted[row.era][group] += 1
            continue
        print(f"{row.repo}/{row.path} [{group}, {row.release}]: {refusal}")
        classes[refusal_class(refusal)].append(refusal)

    print("\n| era | recipes | accepted | text accepted | vision | rl | name an absent local file | "
          "accepted but for that |\n| --- | --- | --- | --- | --- | --- | --- | --- |")  # fmt: skip
    for era in sorted(totals) + ["all"]:
        every = ["all"] if era != "all" else sorted(totals)
        tot, acc, but = (sum((c[e] for e in (every if era == "all" else [era])), Counter())
                         for c in (totals, accepted, accepted_beyond))  # fmt: skip
        n, a = sum(tot.values()), sum(acc.values())
        gone = sum(absent.values()) if era == "all" else absent[era]
        print(f"| {era} | {n} | {a} ({a / max(1, n):.0%}) | {acc['text']}/{tot['text']} | "
              f"{acc['vision']}/{tot['vision']} | {acc['rl']}/{tot['rl']} | {gone} | {sum(but.values())} |")  # fmt: skip

    print("\nrefused, by what they ask for:")
    for label, messages in sorted(classes.items(), key=lambda item: (-len(item[1]), item[0])):
        print(f"  {len(messages):3d}  {label}  e.g. {messages[0]}")
    if missing:
        print(f"\n{len(missing)} recipes not under {args.dir} (use --download): "
              + ", ".join(f"{r.repo}/{r.path}" for r in missing[:5]))  # fmt: skip
    repos = len({r.repo for r in rows})
    print(f"\n{len(rows)} recipes from {repos} repositories; {len(failures)} raised something other than UserError")
    for row, trace in failures:
        print(f"\nFAILED {row.repo}/{row.path} ({row.commit}):\n{trace}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

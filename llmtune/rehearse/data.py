"""The recipe's data in a rehearsal: read, tokenized and packed as the real run does it, on a sample of rows.

Two passes, both through the train room's own code (llmtune.train.data): one at the recipe's sequence_len, the
numbers the report extrapolates to the full dataset (and where a malformed row or a masking mistake is found,
named by its file and line as the real run names it); and the sample files the shrunken run trains on. A hub
dataset that can't be loaded (offline, not cached) is an error, unless a stand-in file was given for it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path

from llmtune.errors import UserError

DEFAULT_SAMPLE_ROWS = 1000


@dataclass
class Source:
    """One datasets[] / test_datasets[] entry as the rehearsal uses it."""

    label: str  # datasets[0]
    path: str  # what the recipe names
    spec: dict  # the entry for the rehearsal's recipe (a sample file, or the recipe's own entry)
    rows_total: int | None  # rows in the whole source (after shards/skip), None when unknown
    rows_sampled: int
    stand_in: str | None = None  # the file used in place of a source that could not be loaded


@dataclass
class DataCheck:
    sources: list[Source]
    stats: dict  # the train room's data stats at the real sequence_len, over the sampled rows
    notes: list[str] = field(default_factory=list)

    @property
    def sampled(self) -> bool:
        return any(s.rows_total is None or s.rows_total > s.rows_sampled for s in self.sources)


def parse_stand_ins(values: list[str] | None) -> dict[str, str]:
    """--stand-in-data values: 'FILE' (every source that can't be loaded), 'datasets[1]=FILE' or '1=FILE'."""
    found: dict[str, str] = {}
    for value in values or []:
        label, _, file = value.rpartition("=")
        label = f"datasets[{label}]" if label.isdigit() else label or "*"
        if not Path(file).is_file():
            raise UserError(f"--stand-in-data {value}: {file} is not a file", "give a local data file")
        found[label] = str(Path(file).resolve())
    return found


def _first(n: int):
    """A progress function for the train room's readers that stops each source after n rows."""
    return lambda items, _description, total=None: islice(items, n)


def _count_rows(spec, label: str, seen: int, limit: int) -> int | None:
    """Rows in the whole source: JSON lines are counted by line, other local files read; hub sets from their info."""
    from llmtune.train.data.sources import read_rows

    path = Path(spec.path)
    if seen <= limit:
        return seen
    if path.is_file() and path.suffix == ".jsonl" and not getattr(spec, "skip", None):
        with path.open("rb") as handle:
            lines = sum(1 for line in handle if line.strip())
        return -(-lines // (spec.shards or 1))
    if path.exists():
        return sum(1 for _ in read_rows(spec, label))
    try:
        from datasets import load_dataset_builder

        splits = load_dataset_builder(spec.path, spec.name, revision=spec.revision).info.splits or {}
        total = splits[spec.split].num_examples
    except Exception:  # noqa: BLE001 - offline, no info, unknown split: the count is simply unknown
        return None
    return max(0, -(-(total - (getattr(spec, "skip", None) or 0)) // (spec.shards or 1)))


def _sample(spec, label: str, limit: int, folder: Path, stand_in: str | None) -> Source:
    from llmtune.train.data.sources import read_rows

    original = spec
    if stand_in:
        spec = spec.model_copy(update={"path": stand_in, "ds_type": None, "name": None, "data_files": None,
                                       "revision": None, "split": "train"})  # fmt: skip
    rows = [row for row, _ in islice(read_rows(spec, label), limit + 1)]  # the train room's reader and its errors
    total = _count_rows(spec, label, len(rows), limit)
    entry = spec.model_dump(mode="json", exclude_unset=True)  # set-ness is read (sharegpt's field_messages)
    if Path(spec.path).exists() and len(rows) <= limit:  # small and local: the ranks read the file itself
        return Source(label, original.path, entry, total, len(rows), stand_in)
    file = folder / f"{label.replace('[', '-').rstrip(']')}.jsonl"
    file.parent.mkdir(parents=True, exist_ok=True)
    with file.open("w", encoding="utf-8") as handle:
        for row in rows[:limit]:
            handle.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
    for key in ("ds_type", "name", "data_files", "revision", "split", "shards", "skip"):
        entry.pop(key, None)  # already applied: the sample holds the rows the real run would read first
    entry["path"] = str(file)
    return Source(label, original.path, entry, total, min(len(rows), limit), stand_in)


def _readable(spec, label: str) -> str | None:
    """None when the source yields a row, else why not (in the train room's words)."""
    from llmtune.train.data.sources import read_rows

    if Path(spec.path).exists():
        return None
    try:
        next(iter(read_rows(spec, label)), None)
    except UserError as err:
        return err.message
    return None


def gather_sources(recipe, limit: int, folder: Path, stand_ins: dict[str, str]) -> list[Source]:
    """Each dataset entry, sampled; an entry that can't be loaded takes its stand-in, or stops the rehearsal."""
    sources = []
    labels = [f"{group}[{index}]" for group in ("datasets", "test_datasets")
              for index in range(len(getattr(recipe, group) or []))]  # fmt: skip
    unknown = [label for label in stand_ins if label != "*" and label not in labels]
    if unknown:
        raise UserError(f"--stand-in-data {unknown[0]}=...: the recipe has no {unknown[0]} (it has "
                        f"{', '.join(labels)})", "name an entry of the recipe's datasets or test_datasets, "
                        "e.g. datasets[0]=FILE or 0=FILE")  # fmt: skip
    for group in ("datasets", "test_datasets"):
        for index, spec in enumerate(getattr(recipe, group) or []):
            label = f"{group}[{index}]"
            stand_in = None
            problem = _readable(spec, label)
            if problem:
                stand_in = stand_ins.get(label) or stand_ins.get("*")
                if stand_in is None:
                    raise UserError(problem, f"rehearse offline with a local file of the same format in its place: "
                                             f"--stand-in-data {label}=FILE (said in the report)")  # fmt: skip
            sources.append(_sample(spec, label, limit, folder, stand_in))
    return sources


def check_data(recipe, tokenizer, sources: list[Source], limit: int, cache: Path) -> DataCheck:
    """Tokenize and pack the sampled rows at the recipe's sequence_len, exactly as the real run does."""
    from llmtune.recipe import Recipe
    from llmtune.train.data.prepare import prepare_data

    changes: dict = {"dataset_prepared_path": str(cache)}  # the real run's cache is left alone
    stand_ins = {s.label: s for s in sources if s.stand_in}
    for group in ("datasets", "test_datasets"):
        specs = getattr(recipe, group) or []
        if any(f"{group}[{i}]" in stand_ins for i in range(len(specs))):
            changes[group] = [stand_ins[f"{group}[{i}]"].spec if f"{group}[{i}]" in stand_ins
                              else spec.model_dump(mode="json", exclude_unset=True)
                              for i, spec in enumerate(specs)]  # fmt: skip
    # what the recipe set, no more: the train room's checks read which keys a recipe sets
    checked = Recipe.model_validate({**recipe.model_dump(mode="json", exclude_unset=True), **changes})
    prepared = prepare_data(checked, tokenizer, _first(limit))
    notes = [f"{s.label}: {s.path} could not be loaded here; STAND-IN data {s.stand_in} was used in its place "
             "(same format: the real rows were not checked)" for s in sources if s.stand_in]  # fmt: skip
    return DataCheck(sources, prepared.stats, notes)

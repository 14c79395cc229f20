"""Read raw rows from what a `datasets[]` entry names: local files or folders, saved datasets, the hub.

Each row comes with where it was found ("train.jsonl line 12"), so a malformed row can be
named in the error. JSON and JSONL are parsed here, line by line, for exactly that reason.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path

from llmtune.errors import UserError

BUILDERS = {".csv": "csv", ".tsv": "csv", ".parquet": "parquet", ".arrow": "arrow", ".txt": "text"}
READABLE = (".jsonl", ".json", *BUILDERS)


def _jsonl(path: Path) -> Iterator[tuple[dict, str]]:
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise UserError(
                    f"{path} line {number}: not valid JSON ({err.msg})", "fix or remove that line"
                ) from None
            if not isinstance(row, dict):
                raise UserError(f"{path} line {number}: a row must be a JSON object, not {type(row).__name__}")
            yield row, f"{path} line {number}"


def _json(path: Path) -> Iterator[tuple[dict, str]]:
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        if err.msg == "Extra data":  # JSON lines in a .json file
            yield from _jsonl(path)
            return
        raise UserError(f"{path} line {err.lineno}: not valid JSON ({err.msg})") from None
    if isinstance(data, dict) and len(data) == 1 and isinstance(next(iter(data.values())), list):
        data = next(iter(data.values()))  # {"data": [...]}
    if not isinstance(data, list):
        raise UserError(f"{path}: expected a list of rows (or JSON lines)", "write one JSON object per row")
    for index, row in enumerate(data):
        if not isinstance(row, dict):
            raise UserError(f"{path} item {index}: a row must be a JSON object, not {type(row).__name__}")
        yield row, f"{path} item {index}"


def _with_builder(builder: str, files: list[str], label: str) -> Iterator[tuple[dict, str]]:
    from datasets import load_dataset

    kwargs = {"delimiter": "\t"} if files[0].endswith(".tsv") else {}
    try:
        table = load_dataset(builder, data_files=files, split="train", **kwargs)
    except Exception as err:  # the datasets library reports parse errors with many types
        raise UserError(f"{label}: could not read {', '.join(files)} as {builder} ({err})") from None
    for index, row in enumerate(table):
        yield row, f"{files[0] if len(files) == 1 else label} row {index}"


def _files_in(folder: Path, data_files) -> list[Path]:
    if data_files:
        names = [data_files] if isinstance(data_files, str) else data_files
        return [folder / n if (folder / n).exists() else Path(n) for n in names]
    return sorted(p for p in folder.rglob("*") if p.suffix in READABLE and p.is_file())


def _file_rows(path: Path, ds_type: str | None, label: str) -> Iterator[tuple[dict, str]]:
    kind = _kind(path, ds_type)
    if kind in ("json", "jsonl"):
        yield from (_json(path) if path.suffix == ".json" else _jsonl(path))
    elif kind:
        yield from _with_builder(kind, [str(path)], label)
    else:
        raise UserError(
            f"{label}: don't know how to read {path.name}", "set ds_type: json, csv, parquet, arrow or text"
        )


def _hub_rows(spec, label: str, streaming: bool = False) -> Iterator[tuple[dict, str]]:
    """A hub dataset's rows; `name` may list several configurations (Axolotl read each and mixed them)."""
    from datasets import load_dataset

    for name in spec.name if isinstance(spec.name, list) else [spec.name]:
        try:
            table = load_dataset(
                spec.path, name=name, split=spec.split, data_files=spec.data_files, revision=spec.revision,
                trust_remote_code=spec.trust_remote_code or None, streaming=streaming,
            )  # fmt: skip
        except Exception as err:
            raise UserError(
                f"{label}: could not load hub dataset '{spec.path}'{f' ({name})' if name else ''} "
                f"({type(err).__name__}: {str(err).splitlines()[0][:200]})",
                "check the id and split, your network or HF_TOKEN; or point path at a local file",
            ) from None
        where = f"{spec.path}{f' {name}' if name else ''} ({spec.split})"
        for index, row in enumerate(table):
            yield row, f"{where} row {index}"


def _builder_files(spec) -> list[Path]:
    """`path: json` (a `datasets` builder name) with `data_files` that are all local: those files, read here."""
    if spec.path not in ("json", "jsonl", "csv", "parquet", "arrow", "text") or Path(spec.path).exists():
        return []
    names = [spec.data_files] if isinstance(spec.data_files, str) else spec.data_files or []
    files = [Path(name) for name in names]
    return files if files and all(f.is_file() for f in files) else []


def _saved_dataset_rows(folder: Path, spec, label: str) -> Iterator[tuple[dict, str]]:
    from datasets import DatasetDict, load_from_disk

    table = load_from_disk(str(folder))
    if isinstance(table, DatasetDict):
        if spec.split not in table:
            raise UserError(f"{label}: split '{spec.split}' not in {folder} (has {', '.join(table)})")
        table = table[spec.split]
    for index, row in enumerate(table):
        yield row, f"{folder} row {index}"


def reads_with_datasets(spec) -> bool:
    """Whether read_rows needs the `datasets` library for this source: every source but local JSON files (a
    missing path is a hub id)."""
    path = Path(spec.path)
    files = [path] if path.is_file() else _files_in(path, spec.data_files) if path.is_dir() else _builder_files(spec)
    if _builder_files(spec):
        return any(_kind(f, spec.path) not in ("json", "jsonl") for f in files)
    if not files or (
        path.is_dir() and ((path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists())
    ):
        return True
    return any(_kind(f, spec.ds_type) not in ("json", "jsonl") for f in files)


def _kind(path: Path, ds_type: str | None) -> str | None:
    """How a file is read: ds_type when given, else by its extension."""
    return ds_type or {".jsonl": "jsonl", ".json": "json"}.get(path.suffix) or BUILDERS.get(path.suffix)


def read_rows(spec, label: str, streaming: bool = False) -> Iterator[tuple[dict, str]]:
    """Rows of one dataset entry; `label` names the entry (e.g. 'datasets[0]') in errors.

    streaming: a hub dataset is read in datasets' streaming mode (rows arrive as they download)."""
    path = Path(spec.path)
    if path.is_file():
        rows = _file_rows(path, spec.ds_type, label)
    elif path.is_dir():
        if (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists():
            rows = _saved_dataset_rows(path, spec, label)
        else:
            files = _files_in(path, spec.data_files)
            if not files:
                raise UserError(f"{label}: no data files in {path}", f"put {', '.join(READABLE)} files there")
            rows = (item for f in files for item in _file_rows(f, spec.ds_type, label))
    elif _builder_files(spec):
        rows = (item for f in _builder_files(spec) for item in _file_rows(f, spec.path, label))
    else:
        rows = _hub_rows(spec, label, streaming)
    if spec.skip:
        rows = itertools.islice(rows, spec.skip, None)
    if spec.shards:
        rows = (item for index, item in enumerate(rows) if index % spec.shards == spec.shards_idx)
    return rows


def fingerprint_source(spec) -> str:
    """What identifies the source's content for the cache key: file contents, or the hub id and revision."""
    import hashlib

    path = Path(spec.path)
    files = [path] if path.is_file() else _files_in(path, spec.data_files) if path.is_dir() else _builder_files(spec)
    if path.is_dir() and not files:
        files = sorted(p for p in path.rglob("*") if p.is_file())
    digest = hashlib.sha256()
    for file in files:
        digest.update(str(file.name).encode())
        with file.open("rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
    if not files:
        digest.update(f"hub:{spec.path}:{spec.name}:{spec.split}:{spec.revision}:{spec.data_files}".encode())
    return digest.hexdigest()

"""Read raw rows from what a `datasets[]` entry names: local files or folders, saved datasets, the hub.

Each row comes with where it was found ("train.jsonl line 12"), so a malformed row can be
named in the error. JSON and JSONL are parsed here, line by line, for exactly that reason.
"""

from __future__ import annotations

import glob
import itertools
import json
from collections.abc import Iterator
from pathlib import Path

from llmtune.errors import UserError
from llmtune.recipe.paths import BUILDERS as BUILDER_NAMES
from llmtune.recipe.paths import is_glob, one_split_only

BUILDERS = {".csv": "csv", ".tsv": "csv", ".parquet": "parquet", ".arrow": "arrow", ".txt": "text"}
# compressed files as `datasets` reads them (Axolotl's sources): opened by Python's own modules
COMPRESSED = {".gz": "gzip", ".bz2": "bz2", ".xz": "lzma"}
READABLE = (".jsonl", ".json", *BUILDERS)


def _open_bytes(path: Path):
    """A data file's bytes, decompressed by its suffix."""
    import importlib

    module = COMPRESSED.get(path.suffix)
    return importlib.import_module(module).open(path, "rb") if module else path.open("rb")


def _undecodable(path: Path, where: str, err: Exception) -> UserError:
    if isinstance(err, UnicodeDecodeError):
        return UserError(f"{path}{where}: not UTF-8 text (byte 0x{err.object[err.start]:02x})",
                         "save the file as UTF-8 (compressed files need their .gz, .bz2 or .xz suffix)")  # fmt: skip
    return UserError(f"{path}: can't be read ({err})", "check the file (a compressed one must be complete)")


def _text(raw: bytes, path: Path, where: str) -> str:
    """UTF-8 text (a byte-order mark at the start skipped), or one line naming where it isn't."""
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise _undecodable(path, where, err) from None


def _jsonl(path: Path) -> Iterator[tuple[dict, str]]:
    try:
        with _open_bytes(path) as handle:
            for number, raw in enumerate(handle, start=1):
                line = _text(raw, path, f" line {number}")
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
    except (OSError, EOFError) as err:
        raise _undecodable(path, "", err) from None


def _json(path: Path) -> Iterator[tuple[dict, str]]:
    try:
        with _open_bytes(path) as handle:
            raw = handle.read()
    except (OSError, EOFError) as err:
        raise _undecodable(path, "", err) from None
    text = _text(raw, path, "")
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


def _files_in(folder: Path, data_files, split: str = "train") -> list[Path]:
    """The data files of a local folder for one split. `data_files` names them (globs too, as `datasets` reads them);
    otherwise the files whose names say the split (train.jsonl, data/test-00000-of-00001.parquet: `datasets`' own
    patterns, as Axolotl's load_dataset(folder, split=...) reads them), or every readable file when no name says one."""
    if data_files:
        names = [data_files] if isinstance(data_files, str) else data_files
        found: list[Path] = []
        for name in names:
            if is_glob(name):
                found += sorted(Path(p) for p in glob.glob(str(folder / name), recursive=True) if Path(p).is_file())
            else:
                found.append(folder / name if (folder / name).exists() else Path(name))
        return found
    files = sorted(p for p in folder.rglob("*") if _kind(p, None) and p.is_file() and not p.name.startswith("."))
    by_split = _splits_by_name(folder, files)
    if not by_split:
        return files
    base = split_name(split)
    if base not in by_split:
        raise UserError(f"split '{base}' is not among the files of {folder} (their names say "
                        f"{', '.join(sorted(by_split))})", "set split: to one of those")  # fmt: skip
    return by_split[base]


def _splits_by_name(folder: Path, files: list[Path]) -> dict[str, list[Path]]:
    """{split: files} where file names say their split, as `datasets` infers it; {} where none do."""
    import re

    words = r"(train|training|test|testing|eval|evaluation|valid|validation|dev)"
    if not any(re.search(rf"(^|[/\\._-]){words}([/\\._-]|$)", str(f.relative_to(folder)), re.I) for f in files):
        return {}  # no name says a split (and `datasets` isn't imported for it)
    try:
        from datasets.data_files import DataFilesDict, get_data_patterns

        patterns = get_data_patterns(str(folder))
        resolved = DataFilesDict.from_patterns(patterns, base_path=str(folder))
    except Exception:  # no patterns match (EmptyDatasetError) or an older datasets: read every file
        return {}
    if list(resolved) == ["train"] and set(map(str, patterns.get("train", []))) <= {"**", "**/*"}:
        return {}
    wanted = {str(p.resolve()) for p in files}
    found = {
        split: sorted(Path(f) for f in names if str(Path(f).resolve()) in wanted) for split, names in resolved.items()
    }
    return {str(split): names for split, names in found.items() if names}


def split_name(split: str | None) -> str:
    """'train[:500]' -> 'train'."""
    return (split or "train").split("[", 1)[0].strip()


def split_slice(rows: list, split: str | None, label: str) -> list:
    """The rows a split's slice keeps ('train[:500]', 'train[10%:]', as `datasets` reads it); all without one."""
    import re

    if not split or "[" not in split:
        return rows
    match = re.fullmatch(r"\s*\w+\[\s*(-?\d+%?)?\s*:\s*(-?\d+%?)?\s*\]\s*", split)
    if not match:
        raise UserError(f"{label}.split: '{split}' is not a slice llmtune reads for local files",
                        "write it as train[:N], train[N:], train[A:B] or with percentages, e.g. train[:10%]")  # fmt: skip

    def bound(text: str | None) -> int | None:
        if text is None:
            return None
        if text.endswith("%"):
            return round(len(rows) * int(text[:-1]) / 100)
        return int(text)

    return rows[bound(match.group(1)) : bound(match.group(2))]


def _file_rows(path: Path, ds_type: str | None, label: str) -> Iterator[tuple[dict, str]]:
    kind = _kind(path, ds_type) or "jsonl"  # any other name is read as JSON, as Axolotl reads it
    if kind in ("json", "jsonl"):
        yield from (_json(path) if _plain_suffix(path) == ".json" else _jsonl(path))
    else:  # `datasets` decompresses csv and text itself
        yield from _with_builder(kind, [str(path)], label)


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
            if spec.path in BUILDER_NAMES and spec.data_files:
                raise UserError(
                    f"{label}: datasets' {spec.path} reader could not read data_files {spec.data_files} "
                    f"({type(err).__name__}: {str(err).splitlines()[0][:200]})",
                    "check that the files exist and share their columns (a glob reads them as one table)",
                ) from None
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
    if spec.path not in BUILDER_NAMES or Path(spec.path).exists():
        return []
    names = [spec.data_files] if isinstance(spec.data_files, str) else spec.data_files or []
    files = [Path(name) for name in names]
    return files if files and all(f.is_file() for f in files) else []


def _saved_dataset_rows(folder: Path, spec, label: str) -> Iterator[tuple[dict, str]]:
    from datasets import DatasetDict, load_from_disk

    table = load_from_disk(str(folder))
    if isinstance(table, DatasetDict):
        if split_name(spec.split) not in table:
            raise UserError(f"{label}: split '{split_name(spec.split)}' not in {folder} (has {', '.join(table)})")
        table = table[split_name(spec.split)]
    for index, row in enumerate(table):
        yield row, f"{folder} row {index}"


def _saved_dataset(path: Path) -> bool:
    """A folder `datasets`' save_to_disk wrote."""
    return path.is_dir() and ((path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists())


def local_files(spec) -> list[Path]:
    """The files a local source reads for its split ([] for a saved dataset or a hub id); UserError for a split
    a folder's file names don't hold."""
    path = Path(spec.path)
    if path.is_file():
        return [path]
    if path.is_dir():
        return [] if _saved_dataset(path) else _files_in(path, spec.data_files, spec.split)
    return _builder_files(spec)


def reads_with_datasets(spec) -> bool:
    """Whether read_rows needs the `datasets` library for this source: every source but local JSON files (a
    missing path is a hub id)."""
    if _saved_dataset(Path(spec.path)):
        return True
    files = local_files(spec)
    if _builder_files(spec):
        return any(_kind(f, spec.path) not in ("json", "jsonl") for f in files)
    if not files:
        return True
    return any(_kind(f, spec.ds_type) not in ("json", "jsonl") for f in files)


def _plain_suffix(path: Path) -> str:
    """The suffix that says the format: alpaca.jsonl.gz -> .jsonl."""
    return Path(path.stem).suffix if path.suffix in COMPRESSED else path.suffix


def _kind(path: Path, ds_type: str | None) -> str | None:
    """How a file is read: ds_type when given, else by its extension (under a compression suffix)."""
    suffix = _plain_suffix(path)
    return ds_type or {".jsonl": "jsonl", ".json": "json"}.get(suffix) or BUILDERS.get(suffix)


def read_rows(spec, label: str, streaming: bool = False, seed: int = 42) -> Iterator[tuple[dict, str]]:
    """Rows of one dataset entry; `label` names the entry (e.g. 'datasets[0]') in errors.

    streaming: a hub dataset is read in datasets' streaming mode (rows arrive as they download).
    seed: the recipe's; `shards` keeps the rows Axolotl keeps with it (shuffled by it, then one contiguous shard)."""
    path, builder = Path(spec.path), _builder_files(spec)  # (builder: path: json with local data_files)
    refused = (
        one_split_only(label, spec.split, spec.data_files if builder else path) if path.is_file() or builder else None
    )
    if refused:
        raise refused
    if path.is_file():
        rows = _file_rows(path, spec.ds_type, label)
    elif path.is_dir():
        if _saved_dataset(path):
            rows = _saved_dataset_rows(path, spec, label)
        else:
            files = _files_in(path, spec.data_files, spec.split)
            if not files:
                raise UserError(f"{label}: no data files in {path}", f"put {', '.join(READABLE)} files there")
            rows = (item for f in files for item in _file_rows(f, spec.ds_type, label))
    elif builder:
        rows = (item for f in builder for item in _file_rows(f, spec.path, label))
    elif str(spec.path).startswith(("/", "./", "../", "~")):  # a local path, never a hub id: it is gone
        raise UserError(f"{label}: {spec.path} does not exist", "restore the file, or point path at where it is now")
    else:
        rows = _hub_rows(spec, label, streaming)
    if "[" in (spec.split or "") and (path.exists() or builder):  # the hub reads its own slices
        rows = iter(split_slice(list(rows), spec.split, label))
    if spec.skip:
        rows = itertools.islice(rows, spec.skip, None)
    if spec.shards and streaming and not (path.exists() or builder):  # rows as they arrive: every shards-th one
        rows = (item for index, item in enumerate(rows) if index % spec.shards == spec.shards_idx)
    elif spec.shards:
        rows = iter(shard_of(list(rows), spec.shards, spec.shards_idx, seed))
    return rows


def shard_of(rows: list, shards: int, index: int, seed: int) -> list:
    """The rows Axolotl's `dataset.shuffle(seed=seed).shard(shards, index)` keeps, in its order: datasets' shuffle
    is numpy's default_rng(seed).permutation, and a shard is a contiguous block (the first len % shards one row
    longer)."""
    import numpy as np

    from llmtune.recipe.mixing import shard_block

    return [rows[i] for i in shard_block(np.random.default_rng(seed).permutation(len(rows)), shards, index)]


def fingerprint_source(spec) -> str:
    """What identifies the source's content for the cache key: file contents, or the hub id and revision."""
    import hashlib

    path = Path(spec.path)
    files = local_files(spec)
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

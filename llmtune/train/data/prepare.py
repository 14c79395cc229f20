"""Raw datasets -> tokenized, length-checked, cached examples -> train/eval rows (packed or not).

The tokenized examples are cached under `dataset_prepared_path/<key>`, where the key hashes the
data files' contents, the tokenizer, and the recipe keys that change tokens. Splitting and
packing are cheap and run after the cache, from the seed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

from llmtune.errors import UserError
from llmtune.recipe.data import CustomFormat
from llmtune.recipe.mixing import shuffle_each
from llmtune.recipe.sharegpt import default_system_of
from llmtune.train.data.base import PreparedData, arrange, empty_data, no_progress
from llmtune.train.data.counts import dataset_counts, deduplicate, empty_reason, snapshot
from llmtune.train.data.formats import IGNORE, FormatContext, RowError
from llmtune.train.data.packing import pack_examples
from llmtune.train.data.reward import converter, fit_pair
from llmtune.train.data.rows import TokenRows
from llmtune.train.data.sources import fingerprint_source, read_rows

CACHE_FORMAT = 7  # bump when tokenization or the cache layout changes (2: flat numpy arrays; 3: eot_tokens;
# 4: chat_template labels a space-fused first word, train_on_inputs per turn, no empty answers; 5: rows whose tool
# calls the chat template drops are refused: a cache made before may hold them; 6: `shards` keeps Axolotl's rows;
# 7: content parts' train flags and text keys, qwen3's reasoning, alpaca's whitespace input)


def tokenizer_fingerprint(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    extra = json.dumps([type(tokenizer).__name__, tokenizer.chat_template, str(tokenizer.special_tokens_map)])
    return hashlib.sha256((body + extra).encode()).hexdigest()


def cache_key(recipe, tokenizer) -> str:
    groups = {g: getattr(recipe, g) or [] for g in ("datasets", "test_datasets")}
    payload = {
        "format": CACHE_FORMAT,
        "sources": {
            g: [[fingerprint_source(s), s.model_dump(mode="json")] for s in specs] for g, specs in groups.items()
        },
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "keys": {
            k: getattr(recipe, k)
            for k in (
                "sequence_len",
                "excess_length_strategy",
                "train_on_inputs",
                "chat_template",
                "chat_template_jinja",
                "chat_template_kwargs",
                "eot_tokens",
                "min_sample_len",
                "dataset_exact_deduplication",
                "default_system_message",
                "eval_sequence_len",
                "shuffle_before_merging_datasets",
            )
        },  # fmt: skip
        "streamed_rows": stream_budget(recipe),
        "shard_seed": recipe.seed
        if any(s.shards for specs in groups.values() for s in specs) or recipe.shuffle_before_merging_datasets
        else None,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _template_for(spec, recipe, tokenizer) -> str | None:
    from llmtune.train.data.templates import resolve_chat_template

    if spec.type not in ("chat_template", "bradley_terry.chat_template"):
        return None
    if spec.chat_template:
        return resolve_chat_template(spec.chat_template, spec.chat_template_jinja or recipe.chat_template_jinja,
                                     tokenizer)  # fmt: skip
    return resolve_chat_template(recipe.chat_template, recipe.chat_template_jinja, tokenizer)


def _template_name(spec, recipe) -> str:
    """The chat_template a dataset's rows render with, as the recipe writes it."""
    return spec.chat_template or recipe.chat_template or "tokenizer_default"


def eot_token_ids(recipe, tokenizer) -> frozenset[int]:
    """The ids of the recipe's eot_tokens; each must be one token (as Axolotl requires)."""
    ids = set()
    for token in recipe.eot_tokens or []:
        encoded = tokenizer.encode(token, add_special_tokens=False)
        if len(encoded) != 1:
            raise UserError(f"eot_tokens: '{token}' is {len(encoded)} tokens to this tokenizer, not one",
                            "add it under tokens: (or special_tokens) so it becomes a single token")  # fmt: skip
        ids.add(encoded[0])
    return frozenset(ids)


def stream_budget(recipe) -> int | None:
    """With streaming, how many rows (packed: tokens) each streamed dataset is read for: what max_steps uses on
    this world size, plus a tenth (and the eval share). None when nothing is streamed."""
    if not recipe.streaming or not recipe.max_steps:
        return None
    world = int(os.environ.get("WORLD_SIZE", 1))
    rows = recipe.max_steps * recipe.micro_batch_size * recipe.gradient_accumulation_steps * world
    if recipe.val_set_size:
        size = recipe.val_set_size
        rows = rows / (1 - size) if size < 1 else rows + size
    rows = int(rows * 1.1) + 1
    return rows * recipe.sequence_len if recipe.sample_packing else rows


def _no_length_warning(record) -> bool:
    """transformers' tokenizer warns that a row longer than its model_max_length "will result in indexing errors";
    llmtune measures every row against sequence_len and drops or truncates it before the model sees it (the data line
    says how many), so the warning is dropped (a filter on transformers' logger: public logging)."""
    return "Token indices sequence length is longer than the specified maximum" not in record.getMessage()


def tokenize_group(specs, group: str, recipe, tokenizer, stats: dict, progress) -> list[dict]:
    import logging

    logging.getLogger("transformers.tokenization_utils_base").addFilter(_no_length_warning)
    examples: list[dict] = []
    eot_ids = eot_token_ids(recipe, tokenizer)
    budget = stream_budget(recipe) if group == "datasets" else None
    # eval_sequence_len: test_datasets rows are measured against it (Axolotl's split == "test")
    key, limit = recipe.test_row_limit if group == "test_datasets" else ("sequence_len", recipe.sequence_len)
    empty, system = [], default_system_of(recipe.default_system_message, recipe.chat_template)
    for index, spec in enumerate(specs):
        label = f"{group}[{index}]"
        ctx = FormatContext(tokenizer, spec, recipe.train_on_inputs, limit,
                            _template_for(spec, recipe, tokenizer), eot_ids, recipe.num_labels or 2,
                            system, template_name=_template_name(spec, recipe))  # fmt: skip
        to_examples = converter(spec)
        taken, rows_before, kept_before, before = 0, stats["rows"], len(examples), snapshot(stats)
        # a custom format's answer field in no row: no example would train anything (Axolotl reads a missing
        # field_output as an empty answer, row by row, which trains nothing); with train_on_inputs the prompt trains
        asks = isinstance(spec.type, CustomFormat) and not recipe.train_on_inputs
        answer, answered, fields = (spec.type.field_output, False, "") if asks else (None, True, "")
        for row, where in progress(read_rows(spec, label, recipe.streaming, recipe.seed), f"tokenizing {label}"):
            if budget is not None and taken >= budget:
                break  # streamed: max_steps needs no more

            try:
                pieces = to_examples(row, ctx)
            except RowError as err:
                raise row_error(err, where, label, spec, recipe) from None
            stats["rows"] += 1
            if not answered:
                answered, fields = answer in row, fields or ", ".join(map(str, row))
            for ids, labels in pieces:
                if spec.type == "bradley_terry.chat_template":  # a stored pair: each side must fit
                    fitted = fit_pair(ids, labels, limit, recipe.excess_length_strategy == "truncate")
                    if fitted is None:
                        too_long(recipe, where, label, spec, "a side of the pair is longer than", key, limit)
                        stats["dropped_too_long"] += 1
                        continue
                    stats["truncated"] += fitted[0] is not ids
                    ids, labels = fitted
                elif len(ids) > limit:
                    too_long(recipe, where, label, spec, f"{len(ids)} tokens, longer than", key, limit)
                    if recipe.excess_length_strategy == "drop":
                        stats["dropped_too_long"] += 1
                        continue
                    ids, labels = ids[:limit], labels[:limit]
                    stats["truncated"] += 1
                if all(label_id == IGNORE for label_id in labels[1:]):
                    stats["dropped_no_labels"] += 1
                    continue
                if recipe.min_sample_len and len(ids) < recipe.min_sample_len:
                    stats["dropped_too_short"] += 1
                    continue
                examples.append({"input_ids": ids, "labels": labels})
                taken += len(ids) if recipe.sample_packing else 1
        read = stats["rows"] - rows_before
        if read and not answered:
            raise UserError(f"{label} ({spec.path}): field_output '{answer}' is in none of its {read} rows, so no "
                            "example would train anything", f"set {label}.type.field_output "
                            f"to the field that holds the answers (its rows have: {fields})")  # fmt: skip
        stats.setdefault("per_dataset", {})[label] = dataset_counts(stats, before, read, len(examples) - kept_before)
        shuffle_each(examples, kept_before, recipe, len(specs))
        if len(examples) == kept_before:
            empty.append((label, spec))
    if examples and os.environ.get("RANK", "0") == "0":  # (none at all: no_examples says why, as an error)
        for label, spec in empty:  # one source among several gives nothing: said, with what dropped its rows
            print(f"[llmtune] warning: {label} ({spec.path}){empty_reason(stats['per_dataset'][label], spec, recipe, key)}"
                  f": the run trains on the other {group} only", file=sys.stderr, flush=True)  # fmt: skip
    return examples


def row_error(err: RowError, where: str, label: str, spec, recipe) -> UserError:
    """A row's error, naming the recipe key its dataset came from (pretraining_dataset entries train as datasets)."""
    if label.startswith("datasets[") and "pretraining_dataset" in recipe.model_fields_set:  # (read as datasets)
        label = "pretraining_dataset" + label[len("datasets") :]
    hint = err.hint or (f"set {label}.field (Axolotl's text_column) to the field that holds the text" if spec.type
                        == "completion" else "fix the row, or set the dataset's type/fields to match the data")  # fmt: skip
    return UserError(f"{where}: {err} ({label}.type is {shown_type(spec.type)})", hint)


def shown_type(kind) -> str:
    """A dataset type as a message names it: its name, or a custom mapping's field names as the recipe set them
    (its formats left out: long, and not what a row's error is about)."""
    if kind is None:
        return "pretokenized"
    if isinstance(kind, str):
        return kind
    given = {k: v for k, v in kind.model_dump(exclude_unset=True).items() if k.startswith("field")}
    return "a mapping {" + ", ".join(f"{key}: {value}" for key, value in given.items()) + "}"


def too_long(recipe, where: str, label: str, spec, what: str, key: str, limit: int) -> None:
    """excess_length_strategy: raise: a row longer than `key` (sequence_len, or eval_sequence_len for test_datasets)
    stops preparation, named like a malformed row."""
    if recipe.excess_length_strategy == "raise":
        raise UserError(f"{where}: {what} {key} {limit} ({label}.type is {shown_type(spec.type)}; "
                        "excess_length_strategy is raise)", f"shorten or remove the row, raise {key}, or set "
                        "excess_length_strategy: drop or truncate")  # fmt: skip


def _save(directory: Path, groups: dict[str, TokenRows], stats: dict) -> None:
    """Each group as three flat arrays (token ids, labels, row offsets), published by one rename."""
    tmp = directory.with_name(f".{directory.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    for name, rows in groups.items():
        rows.save(tmp / name)
    (tmp / "stats.json").write_text(json.dumps(stats, indent=2))
    try:
        os.replace(tmp, directory)
    except OSError:  # another process finished first; its copy is the same
        shutil.rmtree(tmp, ignore_errors=True)


def _load(directory: Path) -> tuple[dict[str, TokenRows], dict]:
    groups = {part.name: TokenRows.load(part) for part in sorted(p for p in directory.iterdir() if p.is_dir())}
    return groups, json.loads((directory / "stats.json").read_text())


def turn_end_notes(recipe, tokenizer) -> list[str]:
    """One note per chat template whose answers end untrained (see formats.untrained_turn_end), with the fix."""
    from llmtune.train.data.formats import untrained_turn_end

    notes, seen = [], set()
    eot_ids = eot_token_ids(recipe, tokenizer)
    for group in ("datasets", "test_datasets"):
        for index, spec in enumerate(getattr(recipe, group) or []):
            mode = (spec.train_on_eot or spec.train_on_eos) if eot_ids else spec.train_on_eos
            template = _template_for(spec, recipe, tokenizer) if mode != "none" else None
            if template is None or template in seen:
                continue
            seen.add(template)
            found = untrained_turn_end(template, tokenizer, eot_ids)
            if found is None:
                continue
            terminator, why = found
            if not terminator:
                notes.append(f"note: {group}[{index}]: {why}, so the model never learns to end its answers; pick a "
                             "chat_template whose turns end with a token")  # fmt: skip
                continue
            notes.append(f"note: {group}[{index}]: the chat template ends each answer with {terminator!r}, which "
                         f"{why}, so the end of each answer is never trained (the model won't learn to stop); make "
                         f"it a special token (special_tokens: {{eos_token: {terminator!r}}} or "
                         f"{{additional_special_tokens: [{terminator!r}]}}), or set eot_tokens: [{terminator!r}] (with "
                         f"tokens: [{terminator!r}] if it isn't one token)")  # fmt: skip
    return notes


def no_examples(recipe, stats: dict, purpose: str = "training") -> UserError:
    """Why no example of `recipe.datasets` is left: an empty file is named; otherwise what dropped the rows."""
    if not stats["rows"]:
        return empty_data(recipe, f"{purpose} examples")
    reasons = [f"{stats['rows']} rows read", f"{stats['dropped_too_long']} longer than sequence_len "
               f"{recipe.sequence_len}", f"{stats['dropped_no_labels']} with no trained tokens"]  # fmt: skip
    hints = []
    if stats["dropped_too_long"]:
        hints.append("raise sequence_len, set excess_length_strategy: truncate")
    if stats["dropped_no_labels"]:
        hints.append("check roles_to_train / train_on_inputs")
    if stats.get("dropped_too_short"):
        reasons.append(f"{stats['dropped_too_short']} shorter than min_sample_len {recipe.min_sample_len}")
        hints.append("lower min_sample_len")
    return UserError(f"no usable {purpose} examples: " + ", ".join(reasons), ", or ".join(hints) or "check the data")


def tokenize_with_cache(recipe, tokenizer, progress=no_progress, purpose: str = "training") -> tuple[dict, dict]:
    """Tokenized examples per group ('train', and 'test' with test_datasets), from the cache when possible.
    `purpose` names what the examples are for in the error when none is left ('training', 'eval')."""
    if os.environ.get("RANK", "0") == "0":  # as runtime.progress.log prints (data sits below runtime)
        for note in turn_end_notes(recipe, tokenizer):
            print(f"[llmtune] {note}", file=sys.stderr, flush=True)
    directory = None
    if recipe.dataset_prepared_path:
        directory = Path(recipe.dataset_prepared_path) / cache_key(recipe, tokenizer)
        if (directory / "stats.json").exists():
            groups, stats = _load(directory)
            return groups, {**stats, "cache_hit": True, "cache_dir": str(directory)}
    stats = {"rows": 0, "dropped_too_long": 0, "truncated": 0, "dropped_no_labels": 0, "dropped_too_short": 0,
             "dropped_duplicates": 0}  # fmt: skip
    examples = {"train": tokenize_group(recipe.datasets, "datasets", recipe, tokenizer, stats, progress)}
    if recipe.test_datasets:
        examples["test"] = tokenize_group(recipe.test_datasets, "test_datasets", recipe, tokenizer, stats, progress)
    if recipe.dataset_exact_deduplication:
        deduplicate(examples, stats)
    groups = {name: TokenRows.from_examples(rows) for name, rows in examples.items()}
    if not len(groups["train"]):
        raise no_examples(recipe, stats, purpose)
    if directory is not None:
        try:
            directory.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise UserError(f"dataset_prepared_path: can't create {directory.parent} ({err.strerror or err})",
                            "point dataset_prepared_path at a folder you can write") from None  # fmt: skip
        _save(directory, groups, stats)
    return groups, {**stats, "cache_hit": False, "cache_dir": str(directory) if directory else None}


def split_and_pack(recipe, groups: dict[str, list[dict]], stats: dict) -> PreparedData:
    train, evaluation = arrange(groups["train"], groups.get("test"), recipe)  # curriculum: the data's own order
    stats = dict(stats, train_examples=len(train), eval_examples=len(evaluation) if evaluation is not None else 0)
    stats["train_tokens"] = train.total_tokens()
    if recipe.sample_packing:
        train, efficiency = pack_examples(train, recipe.sequence_len, recipe.seed)
        stats["packing_efficiency"] = round(efficiency, 4)
        if evaluation and (recipe.eval_sample_packing if recipe.eval_sample_packing is not None else True):
            # test_datasets rows may be up to eval_sequence_len long: packed to it (val_set_size's to sequence_len)
            length = recipe.test_row_limit[1] if recipe.test_datasets else recipe.sequence_len
            evaluation, _ = pack_examples(evaluation, length, recipe.seed)
    stats["train_rows"] = len(train)
    return PreparedData(train, evaluation, stats)


def prepare_data(recipe, tokenizer, progress=no_progress, purpose: str = "training") -> PreparedData:
    from llmtune.recipe.preference import ONLINE_METHODS

    if recipe.rl in ONLINE_METHODS:  # GRPO's prompts and reward columns, through the user's transforms
        import os
        from pathlib import Path

        from llmtune.recipe.online import user_functions
        from llmtune.train.data.online_rows import prepare_online_data

        folder = os.environ.get("LLMTUNE_RECIPE_DIR")
        return prepare_online_data(recipe, tokenizer, user_functions(recipe, Path(folder) if folder else None),
                                   progress)  # fmt: skip
    if recipe.rl:  # preference rows stay strings: TRL's trainers tokenize them
        from llmtune.train.data.preference_rows import prepare_preference_data

        return prepare_preference_data(recipe, tokenizer, progress)
    groups, stats = tokenize_with_cache(recipe, tokenizer, progress, purpose)
    return split_and_pack(recipe, groups, stats)

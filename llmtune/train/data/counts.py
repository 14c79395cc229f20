"""What preparing the rows kept and dropped, in all and per dataset: the counts `preprocess` lists, the data line a
run logs, and exact deduplication (which drops examples across datasets, so it is counted against the dataset
each dropped one came from)."""

from __future__ import annotations

# stats key -> how a line names it (the key a limit comes from is filled in: sequence_len, eval_sequence_len)
DROPS = {
    "dropped_too_long": "longer than {limit} dropped",
    "truncated": "longer than {limit} truncated",
    "dropped_no_labels": "without trained tokens",
    "dropped_too_short": "shorter than min_sample_len {min_sample_len} dropped",
    "dropped_duplicates": "exact duplicates dropped",
}


def snapshot(stats: dict) -> dict[str, int]:
    """The drop counters before a dataset is read (its own counts are the difference after)."""
    return {key: stats.get(key, 0) for key in DROPS}


def dataset_counts(stats: dict, before: dict[str, int], rows: int, examples: int) -> dict:
    """One dataset's entry of stats['per_dataset']: rows read, examples kept, and each nonzero drop."""
    counts = {"rows": rows, "examples": examples}
    counts.update({key: stats[key] - before[key] for key in DROPS if stats.get(key, 0) - before[key]})
    return counts


def deduplicate(groups: dict[str, list[dict]], stats: dict) -> None:
    """dataset_exact_deduplication: drop examples identical to an earlier one (eval ones also when in train). Each
    drop is counted in all and against its dataset: a group's examples lie in its datasets' order, each dataset's
    together (shuffle_before_merging_datasets shuffles within them), so the per-dataset counts give their spans."""
    seen: set[tuple] = set()
    per_dataset = stats.get("per_dataset") or {}
    for name, prefix in (("train", "datasets["), ("test", "test_datasets[")):
        owners = [label for label, counts in per_dataset.items() if label.startswith(prefix)
                  for _ in range(counts["examples"])]  # fmt: skip
        kept = []
        for position, example in enumerate(groups.get(name) or []):
            key = (tuple(example["input_ids"]), tuple(example["labels"]))
            if key not in seen:
                seen.add(key)
                kept.append(example)
                continue
            stats["dropped_duplicates"] += 1
            if position < len(owners):
                counts = per_dataset[owners[position]]
                counts["examples"] -= 1
                counts["dropped_duplicates"] = counts.get("dropped_duplicates", 0) + 1
        if name in groups:
            groups[name] = kept


def phrases(counts: dict, recipe, limit: str = "sequence_len", always: tuple[str, ...] = ()) -> list[str]:
    """'3 longer than sequence_len dropped', ... for each nonzero drop in `counts` (and the keys in `always`)."""
    return [f"{counts.get(key, 0)} " + words.format(limit=limit, min_sample_len=recipe.min_sample_len)
            for key, words in DROPS.items() if counts.get(key) or key in always]  # fmt: skip


def data_line(recipe, stats: dict, plan: dict | None = None) -> str:
    """The line a supervised run logs once its data is ready; where the rows can't fill one global batch on several
    ranks, what accelerate does then (each rank's batch filled by repeating rows) is said with it."""
    limit = "sequence_len" + " (eval_sequence_len for test rows)" * bool(
        recipe.eval_sequence_len and recipe.test_datasets
    )
    long = "truncated" if recipe.excess_length_strategy == "truncate" else "dropped_too_long"
    shown = phrases(stats, recipe, limit, always=(long, "dropped_no_labels"))
    packing = f", packing efficiency {stats['packing_efficiency']:.1%}" if recipe.sample_packing else ""
    line = (f"data: {stats['train_examples']} train / {stats['eval_examples']} eval examples "
            f"({'cache hit' if stats['cache_hit'] else 'tokenized'}; {', '.join(shown)}){packing}")  # fmt: skip
    rows, batch = stats.get("train_rows"), (plan or {}).get("global_batch_size")
    if rows and batch and rows < batch and (plan.get("data_parallel_size") or 1) > 1 and plan["strategy"] != "pipeline":
        line += (f"\n[llmtune] note: {rows} training row(s) don't fill one global batch of {batch}: each rank's batch is filled "
                 "by repeating rows (every step sees copies of them); add rows, or lower micro_batch_size or the "
                 "processes")  # fmt: skip
    return line


def dataset_line(label: str, counts: dict, recipe) -> str:
    """preprocess's line for one dataset: '  datasets[0]: 12 rows, 9 examples (2 duplicates dropped ...)'."""
    dropped = phrases(counts, recipe, recipe.test_row_limit[0] if label.startswith("test_") else "sequence_len")
    return f"  {label}: {counts['rows']} rows, {counts['examples']} examples" + (
        f" ({', '.join(dropped)})" if dropped else ""
    )


def empty_reason(counts: dict, spec, recipe, limit: str) -> str:
    """Why a dataset gave no example: ' has no rows', or ': none of its 8 rows gave an example (8 shorter than
    min_sample_len 75 dropped)'; roles_to_train is named where the recipe set it and rows had no trained tokens."""
    if not counts["rows"]:
        return " has no rows"
    why = phrases({key: value for key, value in counts.items() if key != "truncated"}, recipe, limit)
    if counts.get("dropped_no_labels") and "roles_to_train" in spec.model_fields_set:
        why.append(f"roles_to_train: {spec.roles_to_train}")
    return f": none of its {counts['rows']} rows gave an example" + (f" ({'; '.join(why)})" if why else "")

"""Preprocessing: the first tokenization of a dataset against a cache hit, in tokens/s. Target: hit >= 20x faster.

Both times are "ready to train": tokenize (or open the cache), split and pack. Rows are built lazily from the
cache's arrays when the data loader asks for them, after a first run and after a hit alike; one full read of
every row is timed separately and the ratio is also given with it added to both sides.

    python benchmarks/preprocess.py
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, record
from throughput import variable_length_rows, write_rows

sys.path.insert(0, str(ROOT / "tests" / "fixtures"))


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from llmtune.recipe.loader import recipe_from_mapping
    from llmtune.train.data.prepare import split_and_pack, tokenize_with_cache
    from llmtune.train.model.load import load_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = write_rows(root / "data.jsonl", variable_length_rows(20000))
        tokenizer_dir = ROOT / "tests" / "fixtures" / "tokenizer"
        mapping = {"base_model": str(tokenizer_dir), "datasets": [{"path": str(data), "type": "alpaca"}],
                   "sequence_len": 512, "sample_packing": True, "dataset_prepared_path": str(root / "prepared")}  # fmt: skip
        recipe = recipe_from_mapping(mapping, root / "r.yaml").recipe
        tokenizer = load_tokenizer(recipe, str(tokenizer_dir))
        timings = []
        for _ in range(2):
            start = time.perf_counter()
            groups, stats = tokenize_with_cache(recipe, tokenizer)
            loaded = time.perf_counter()
            prepared = split_and_pack(recipe, groups, stats)
            ready = time.perf_counter()
            read = sum(len(row["input_ids"]) for row in prepared.train)
            timings.append((ready - start, prepared.stats, loaded - start, ready - loaded, time.perf_counter() - ready))
    (first, s1, _, _, _), (hit, s2, hit_open, packing, reading) = timings
    assert not s1["cache_hit"] and s2["cache_hit"] and read == s1["train_tokens"]
    tokens = s1["train_tokens"]
    print(f"{'':12} {'seconds':>8} {'tokens/s':>12}")
    print(f"{'first':12} {first:8.3f} {tokens / first:12.0f}")
    print(f"{'cache hit':12} {hit:8.3f} {tokens / hit:12.0f}")
    with_read = (first + reading) / (hit + reading)
    print(f"cache hit is {first / hit:.1f}x faster (target >= 20x); {s1['rows']} rows, {tokens} tokens; the hit opens the "
          f"cache in {hit_open:.3f} s and packs in {packing:.3f} s. Reading every packed row once (the data loader's "
          f"work, the same after either) takes {reading:.3f} s; counted on both sides the ratio is {with_read:.1f}x")
    record("preprocess", {"first_s": round(first, 4), "hit_s": round(hit, 4), "speedup": round(first / hit, 2),
                          "hit_open_s": round(hit_open, 4), "packing_s": round(packing, 4),
                          "read_all_rows_s": round(reading, 4), "speedup_with_one_read": round(with_read, 2), "rows": s1["rows"],
                          "tokens": tokens})  # fmt: skip


if __name__ == "__main__":
    main()

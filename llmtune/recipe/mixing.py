"""Recipe keys about which rows a run draws from its datasets once they are read: the order they are merged in, a
shard of the whole, the length of eval rows, and the last partial batch of an epoch."""

from __future__ import annotations

from pydantic import Field, model_validator

from llmtune.recipe.base import Section


class MixingKeys(Section):
    shuffle_before_merging_datasets: bool = Field(
        False, description="Shuffle each dataset's rows (with seed) before the datasets are merged, for test_datasets "
        "too; with shuffle_merged_datasets: false each dataset keeps its block in the listed order (a curriculum by "
        "dataset). One dataset: no effect, as in Axolotl.",
    )  # fmt: skip
    dataset_shard_num: int | None = Field(
        None, gt=0, description="Train on one of this many contiguous shards of the merged, shuffled rows (Axolotl's "
        "dataset.shard), taken before val_set_size splits them; test_datasets are sharded alike. Needs "
        "dataset_shard_idx.",
    )  # fmt: skip
    dataset_shard_idx: int | None = Field(
        None, ge=0, description="Which shard of dataset_shard_num (0-based)."
    )  # fmt: skip
    eval_sequence_len: int | None = Field(
        None, gt=0, description="Maximum tokens per test_datasets row (dropped or truncated per "
        "excess_length_strategy, packed to this length with eval_sample_packing); default sequence_len. An eval split "
        "of val_set_size comes from the training rows, at sequence_len.",
    )  # fmt: skip
    dataloader_drop_last: bool = Field(
        False, description="Drop each epoch's last micro-batch round that can't fill every data-parallel rank (fewer "
        "steps, no wrapped-around rows); eval rows are never dropped.",
    )  # fmt: skip

    @model_validator(mode="after")
    def _shard_pair(self):
        if (self.dataset_shard_num is None) != (self.dataset_shard_idx is None):
            given, missing = (("dataset_shard_num", "dataset_shard_idx") if self.dataset_shard_idx is None
                              else ("dataset_shard_idx", "dataset_shard_num"))  # fmt: skip
            raise ValueError(f"{given} is set without {missing}: sharding the merged rows takes both (the number of "
                             "shards and which one to train on)")  # fmt: skip
        if self.dataset_shard_num is not None and self.dataset_shard_idx >= self.dataset_shard_num:
            raise ValueError(f"dataset_shard_idx {self.dataset_shard_idx} is not one of dataset_shard_num "
                             f"{self.dataset_shard_num}'s shards (0 to {self.dataset_shard_num - 1})")  # fmt: skip
        return self

    @property
    def test_row_limit(self) -> tuple[str, int]:
        """The key and length test_datasets rows are measured and packed at (val_set_size's eval rows are training
        rows, at sequence_len)."""
        if self.eval_sequence_len:
            return "eval_sequence_len", self.eval_sequence_len
        return "sequence_len", self.sequence_len

    def mixing_rules(self) -> None:
        """Rules across sections (Recipe's cross-concern validator calls this)."""
        if self.dataset_shard_num is not None and self.streaming:
            raise ValueError("dataset_shard_num shards the merged rows, which streamed data never holds at once; use "
                             "datasets[].shards (every shards-th row of a stream) instead")  # fmt: skip
        if self.eval_sequence_len and self.eval_sequence_len > self.sequence_len and self.context_parallel_size > 1:
            raise ValueError(f"eval_sequence_len {self.eval_sequence_len} is over sequence_len {self.sequence_len}: "
                             "context parallelism splits every row of a batch alike, at the training length; remove "
                             "eval_sequence_len or make it at most sequence_len")  # fmt: skip


def merged_order(count: int, recipe, shuffle: bool = True) -> list[int] | None:
    """The rows a run keeps of `count` merged rows, in its order: shuffled with the seed (shuffle_merged_datasets,
    unless curriculum_sampling keeps the data's order; `shuffle=False` for eval rows, whose order nothing reads),
    then the dataset_shard_idx-th of dataset_shard_num contiguous blocks, the first count % num one row longer (as
    datasets' shard cuts them). None: all of them, as read."""
    import numpy as np

    sharded = recipe.dataset_shard_num is not None
    shuffled = recipe.shuffle_merged_datasets and not recipe.curriculum_sampling and (shuffle or sharded)
    if not (shuffled or sharded):
        return None
    order = np.random.default_rng(recipe.seed).permutation(count) if shuffled else np.arange(count)
    if sharded:
        order = shard_block(order, recipe.dataset_shard_num, recipe.dataset_shard_idx)
    return order.tolist()


def shard_block(rows, shards: int, index: int):
    """The index-th of `shards` contiguous blocks of rows, the first len % shards one row longer, as datasets'
    shard(num_shards, index) cuts them."""
    size, longer = divmod(len(rows), shards)
    start = size * index + min(index, longer)
    return rows[start : start + size + (1 if index < longer else 0)]


def shuffle_each(rows: list, start: int, recipe, datasets: int) -> None:
    """shuffle_before_merging_datasets: one dataset's rows (rows[start:], just read) in place, with the seed (the
    permutation datasets' shuffle draws); nothing for a lone dataset, as Axolotl merges none."""
    import numpy as np

    if recipe.shuffle_before_merging_datasets and datasets > 1 and len(rows) - start > 1:
        block = rows[start:]
        rows[start:] = [block[i] for i in np.random.default_rng(recipe.seed).permutation(len(block))]

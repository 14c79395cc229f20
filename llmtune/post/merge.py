"""`llmtune merge`: one standard Hugging Face model folder out of whatever a run saved.

- LoRA / QLoRA: the adapter is folded into the base weights tensor by tensor (post/fold.py), in the
  recipe's dtype (bf16/fp16 when it trained in them, else fp32; `--dtype` overrides).
- Full fine-tune: the final model is re-sharded; when the final save is missing, the newest complete
  checkpoint is consolidated first (post/consolidate.py: DeepSpeed ZeRO partitions, FSDP sharded states).

Reading and writing weights one tensor at a time is train/model/shards.py.

The folder gets sharded safetensors (+ model.safetensors.index.json), config, generation config,
tokenizer and chat template, and a model card. It is written beside the target and renamed into
place at the end, so an interrupted merge leaves nothing half-written under the target name.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from llmtune.errors import UserError, reading
from llmtune.post.consolidate import PLAN, RunWeights, find_weights, run_of, run_recipe, write_full_weights
from llmtune.post.fold import fold_adapter, merge_through_peft
from llmtune.train.model.shards import ShardWriter, base_folder

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt")  # fmt: skip
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


@dataclass
class MergeResult:
    output: Path
    shards: list[str]
    total_bytes: int
    merged_modules: int
    source: str
    dtype: str


def _target_dtype(plan: dict, dtype: str | None):
    import torch

    name = DTYPES.get(dtype or "") or DTYPES.get(plan.get("precision", ""), "float32")
    return getattr(torch, name)


def merge_run(run: Path, output: Path | None = None, max_shard_size: str = "5GB", dtype: str | None = None,
              force: bool = False, progress: Callable = lambda items, _d, total=None: items) -> MergeResult:  # fmt: skip
    from llmtune.plan.memory.table import parse_size_option

    run, chosen = run_of(run)
    plan_file = run / PLAN
    if not plan_file.exists():
        raise UserError(f"{run} is not an llmtune run folder (no llmtune/plan.json)",
                        "pass a run's output_dir, or one of its checkpoint-N folders")  # fmt: skip
    if is_merged(run):
        raise UserError(f"{run} is already a merged model (written by llmtune merge): there is nothing to fold in",
                        f"use it as it is (llmtune infer {run}, llmtune eval {run}, or base_model: {run})")  # fmt: skip
    recipe = run_recipe(run, hint="merge it with the llmtune version that trained it")
    plan = json.loads(plan_file.read_text())["plan"]
    output = output or run / ("merged" if chosen is None else f"merged-{chosen.name}")
    max_bytes = int(parse_size_option("--max-shard-size", max_shard_size))
    if dtype is not None and dtype not in DTYPES:
        raise UserError(f"--dtype '{dtype}' is not one of {', '.join(DTYPES)}", "use bf16, fp16 or fp32")
    _check_output(run, output, force)
    weights = find_weights(run, chosen)
    target = _target_dtype(plan, dtype)
    staging = output.with_name(f".{output.name}.merging-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        staging.mkdir(parents=True)
    except OSError as err:  # read-only, immutable or missing place: nothing was written
        raise UserError(f"can't write the merged model next to {output} ({err.strerror or err})",
                        "pass --output a folder on a writable disk") from None  # fmt: skip
    try:
        writer = ShardWriter(staging, max_bytes)
        config_dir, merged, source = _write_weights(recipe, weights, writer, target, progress)
        shards = writer.finish()
        if not (config_dir / "config.json").exists():  # a checkpoint of sharded states: the run's, else the base's
            config_dir = run if (run / "config.json").exists() else base_folder_of(recipe)
        changes = merged.pop("config_changes")
        if recipe.num_labels:  # a reward model reads its score at the last non-pad token
            from transformers import AutoTokenizer

            changes["pad_token_id"] = AutoTokenizer.from_pretrained(str(run)).pad_token_id
        _copy_side_files(run, config_dir, staging, weights.folder)
        _write_config(config_dir, staging, target, changes, _special_token_ids(staging))
        # provenance, and what lets `llmtune eval/infer MERGED` read the recipe (its eval split, its template)
        (staging / "llmtune").mkdir()
        shutil.copy2(plan_file, staging / "llmtune" / "plan.json")
        (staging / MERGED).write_text(json.dumps({"run": str(run.resolve()), "weights": weights.note}) + "\n")
        result = MergeResult(output, shards, writer.total_bytes, merged["modules"], source, str(target).split(".")[-1])
        (staging / "README.md").write_text(_card(recipe, plan, weights, result))
        if output.exists():
            shutil.rmtree(output)
        output.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging, output)
        return result
    except Exception as err:  # the disk filled up, or the place turned read-only, midway: nothing half-written kept
        shutil.rmtree(staging, ignore_errors=True)
        # (safetensors reports a full disk as its own error, naming the OS error in its text)
        if getattr(err, "errno", None) not in WRITE_ERRORS and "No space left" not in str(err):
            raise
        reason = getattr(err, "strerror", None) or str(err).splitlines()[0][:120]
        raise UserError(f"writing the merged model to {output} failed ({reason}); nothing was kept",
                        "free space, or pass --output a folder on a writable disk with room for it") from None  # fmt: skip
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


MERGED = Path("llmtune") / "merged.json"  # what a merged folder says of itself


def is_merged(folder: Path) -> bool:
    """A folder llmtune merge wrote (its marker; before the marker existed, its model card's tag)."""
    if (folder / MERGED).is_file():
        return True
    card = folder / "README.md"
    return card.is_file() and "tags: [llmtune, merged]" in card.read_text(errors="replace")[:400]


WRITE_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)  # a place that can't be written


def _check_output(run: Path, output: Path, force: bool) -> None:
    """The merged folder may replace only an earlier merge: never the run, a folder holding it, a file, or a folder
    with anything but a model's files in it (other runs, checkpoints, notes), --force or not."""
    where, source = output.resolve(), run.resolve()
    if where == source or where in source.parents:
        raise UserError(f"--output {output} holds the run being merged ({run})", "pick a new folder for the merge")
    if where.exists() and not where.is_dir():
        raise UserError(f"--output {output} is a file", "pick a folder for the merged model")
    if not where.exists() or not any(where.iterdir()):
        return
    if not force:
        raise UserError(f"{output} already exists", "pass --output DIR, or --force to replace it")
    foreign = sorted(entry.name for entry in where.iterdir()
                     if (entry.is_dir() and entry.name != "llmtune") or entry.name in ("metrics.json",)
                     or entry.name.startswith("checkpoint-"))  # fmt: skip
    # a plain model folder (the run's own base model, a full run's checkpoint) is never replaced
    what = next((reason for wrong, reason in (
        (foreign, ", ".join(foreign[:3])), (not (where / "config.json").is_file(), "no config.json"),
        (where.name.startswith("checkpoint-"), "a checkpoint"),
        (not is_merged(where), f"no {MERGED}: a model llmtune merge didn't write, perhaps a base model"),
    ) if wrong), None)  # fmt: skip
    if what:
        raise UserError(f"--force replaces only an earlier merged model, and {output} is not one ({what})",
                        "pick a new folder for the merge")  # fmt: skip


def _write_weights(recipe, weights: RunWeights, writer: ShardWriter, target, progress):
    if weights.kind != "adapter":
        fused = None
        if recipe.llama4_linearized_experts:  # experts saved one Linear each: written back fused
            from llmtune.train.model import linearize

            config = json.loads(((weights.folder if (weights.folder / "config.json").exists() else
                                  base_folder_of(recipe)) / "config.json").read_text())  # fmt: skip
            experts = (config.get("text_config") or config).get("num_local_experts")
            if experts:
                writer = fused = linearize.FusedExperts(writer, experts)
        write_full_weights(weights, writer, target, progress)
        if fused:
            fused.check()
        return weights.folder, {"modules": 0, "config_changes": {}}, weights.note
    folder = base_folder_of(recipe)
    with reading(weights.folder / "adapter_config.json"):
        on_parameters = json.loads((weights.folder / "adapter_config.json").read_text()).get("target_parameters")
    if on_parameters:  # LoRA on fused expert tensors: peft merges it, transformers writes its own on-disk layout
        done, changes = merge_through_peft(weights.folder, folder, writer, target, progress)
    else:
        done, changes = fold_adapter(weights.folder, folder, writer, target, progress)
    return (
        folder,
        {"modules": done, "config_changes": changes},
        f"the adapter from {weights.note}, base weights from {folder}",
    )


def _special_token_ids(folder: Path) -> dict[str, int]:
    """The eos/bos/pad ids of the tokenizer in `folder` (the one training used), those it defines."""
    if not (folder / "tokenizer_config.json").exists():
        return {}
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    names = ("eos_token_id", "bos_token_id", "pad_token_id")
    return {name: getattr(tokenizer, name) for name in names if getattr(tokenizer, name) is not None}


def align_token_ids(config: dict, generation: dict | None, ids: dict[str, int]) -> None:
    """The configs' special token ids made to agree with the tokenizer's, as the Trainer aligns a full fine-tune's
    (transformers' align_special_tokens): an eos token the recipe changed (special_tokens: {eos_token: ...})
    would otherwise not stop generation. eos ids the configs list are kept beside the tokenizer's."""
    for name, token in ids.items():
        several = name == "eos_token_id"
        for values in (config, generation):
            if values is None:
                continue
            current = values.get(name)
            if current == token or (isinstance(current, list) and token in current):
                continue
            if several and (isinstance(current, list) or (values is generation and current is not None)):
                held = current if isinstance(current, list) else [current]
                values[name] = [token, *(t for t in held if t is not None and t != token)]
            else:
                values[name] = token


def _write_config(config_dir: Path, staging: Path, target, changes: dict, token_ids: dict[str, int]) -> None:
    config = json.loads((config_dir / "config.json").read_text())
    config.pop("quantization_config", None)
    name = str(target).split(".")[-1]
    config["dtype"] = name
    if "torch_dtype" in config:
        config["torch_dtype"] = name
    config.update(changes)
    if "use_cache" in config:
        config["use_cache"] = True  # training turned it off; a merged model is for generation
    generation = None
    if (config_dir / "generation_config.json").exists():
        generation = json.loads((config_dir / "generation_config.json").read_text())
    align_token_ids(config.get("text_config") or config, generation, token_ids)
    (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if generation is not None:
        (staging / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def _copy_side_files(run: Path, config_dir: Path, staging: Path, weights_folder: Path | None = None) -> None:
    """The tokenizer and chat template training used: the merged checkpoint's or the run's, else the base's."""
    source = next((folder for folder in (weights_folder, run) if folder and (folder / "tokenizer_config.json").exists()),
                  config_dir)  # fmt: skip
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy2(source / name, staging / name)


def _card(recipe, plan: dict, weights: RunWeights, result: MergeResult) -> str:
    from llmtune.train.model.load import head_of

    method = {"lora": "LoRA", "qlora": "QLoRA"}.get(recipe.adapter or "", "full fine-tune")
    what = (f"The {method} adapter folded into the base weights ({result.merged_modules} modules)"
            if weights.kind == "adapter" else f"The {method} weights")  # fmt: skip
    return (
        f"---\nlibrary_name: transformers\nbase_model: {recipe.base_model}\ntags: [llmtune, merged]\n---\n\n"
        f"# {result.output.name}\n\n{what}, from {weights.note}; trained with llmtune ({plan['title']}, "
        f"{plan['world_size']} process(es)). {len(result.shards)} safetensors shard(s), "
        f"{result.total_bytes / 1e6:.1f} MB in {result.dtype}.\n\n"
        f"Load it with `{head_of(recipe)[0]}.from_pretrained(<this folder>)`; the tokenizer and chat template are here "
        "too.\n"
    )


def base_folder_of(recipe) -> Path:
    """The folder of the recipe's base model (its local folder, or the hub snapshot)."""
    from llmtune.train.model.load import model_source

    return base_folder(model_source(recipe)[0], recipe.revision_of_model)

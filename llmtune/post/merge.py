"""`llmtune merge`: one standard Hugging Face model folder out of whatever a run saved.

- LoRA / QLoRA: the adapter is folded into the base weights tensor by tensor, straight from the base's
  safetensors files, without building the model. Peak memory is one output shard plus one tensor plus
  the adapter, not two copies of the model. QLoRA bases are stored unquantized, so the merge lands in
  the recipe's dtype (bf16/fp16 when it trained in them, else fp32; `--dtype` overrides).
- Full fine-tune: the final model is re-sharded; when the final save is missing, the newest complete
  checkpoint is consolidated (DeepSpeed ZeRO partitions with DeepSpeed's own zero_to_fp32, FSDP
  sharded checkpoints with torch.distributed.checkpoint) first.

The folder gets sharded safetensors (+ model.safetensors.index.json), config, generation config,
tokenizer and chat template, and a model card. It is written beside the target and renamed into
place at the end, so an interrupted merge leaves nothing half-written under the target name.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from llmtune.errors import UserError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt")  # fmt: skip
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


# --------------------------------------------------------------------------------------------- reading tensors
def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return [folder / name for name in dict.fromkeys(json.loads(index.read_text())["weight_map"].values())]
    files = sorted(folder.glob("model*.safetensors")) or sorted(folder.glob("*.safetensors"))
    files = [f for f in files if not f.name.startswith("adapter_")]
    if files:
        return files
    return sorted(folder.glob("pytorch_model*.bin"))


def iter_tensors(folder: Path) -> Iterator[tuple[str, object]]:
    """(name, tensor) over a model folder's weight files, one file open at a time."""
    files = _weight_files(folder)
    if not files:
        raise UserError(f"no model weights in {folder}", "it needs *.safetensors or pytorch_model*.bin files")
    for path in files:
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():
                    yield name, handle.get_tensor(name)
        else:  # legacy pickles: weights only, memory-mapped
            import torch

            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            yield from state.items()
            del state


def read_tensor(folder: Path, wanted: str):
    """One tensor of a model folder."""
    for name, tensor in iter_tensors(folder):
        if name == wanted:
            return tensor
    raise KeyError(wanted)


def base_folder(source: str, revision: str | None = None) -> Path:
    """A local folder with the base model's files (a hub id is fetched or taken from the HF cache)."""
    if Path(source).is_dir():
        return Path(source)
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(source, revision=revision,
                                      allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt"]))  # fmt: skip
    except Exception as err:  # noqa: BLE001 - the hub raises many kinds; all mean "can't get it"
        raise UserError(f"could not get the base model '{source}' ({str(err).splitlines()[0][:160]})",
                        "check base_model, your network or HF_TOKEN") from None  # fmt: skip


# --------------------------------------------------------------------------------------------- writing shards
def _release_freed_memory() -> None:
    """Hand freed heap pages back to the OS (glibc keeps them otherwise, and RSS would creep up shard by shard)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


@dataclass
class ShardWriter:
    """Tensors in, safetensors shards of at most max_bytes out (a bigger tensor gets a shard of its own)."""

    folder: Path
    max_bytes: int
    pending: dict = field(default_factory=dict)
    pending_bytes: int = 0
    written: list[tuple[str, list[str]]] = field(default_factory=list)
    total_bytes: int = 0
    names: set = field(default_factory=set)

    def add(self, name: str, tensor) -> None:
        if name in self.names:
            raise RuntimeError(f"merge: tensor {name} written twice")
        self.names.add(name)
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self.flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += size
        self.total_bytes += size

    def flush(self) -> None:
        if not self.pending:
            return
        from safetensors.torch import save_file

        part = f"part-{len(self.written):05d}.safetensors"
        save_file(self.pending, str(self.folder / part), metadata={"format": "pt"})
        self.written.append((part, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0
        _release_freed_memory()

    def finish(self) -> list[str]:
        self.flush()
        if len(self.written) == 1:
            os.replace(self.folder / self.written[0][0], self.folder / "model.safetensors")
            return ["model.safetensors"]
        count, weight_map, names = len(self.written), {}, []
        for number, (part, keys) in enumerate(self.written, 1):
            name = f"model-{number:05d}-of-{count:05d}.safetensors"
            os.replace(self.folder / part, self.folder / name)
            weight_map.update(dict.fromkeys(keys, name))
            names.append(name)
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return names


# --------------------------------------------------------------------------------------------- the adapter
@dataclass
class LoraPair:
    a: object
    b: object
    scale: float
    embedding: bool = False
    magnitude: object = None  # DoRA


def _pattern_value(patterns: dict, module: str, default):
    for pattern, value in (patterns or {}).items():
        if module == pattern or re.fullmatch(rf"(.*\.)?{pattern}", module):
            return value
    return default


def read_adapter(folder: Path) -> tuple[dict[str, LoraPair], dict[str, object], dict]:
    """LoRA pairs by base weight name, whole tensors the adapter replaces (modules_to_save), the adapter config."""
    import math

    from safetensors.torch import load_file

    config = json.loads((folder / "adapter_config.json").read_text())
    weights = folder / "adapter_model.safetensors"
    if not weights.exists():
        raise UserError(f"{folder} has adapter_config.json but no adapter_model.safetensors", "rerun the training save")
    state = load_file(str(weights))
    pairs: dict[str, dict] = {}
    replaced: dict[str, object] = {}
    for key, tensor in state.items():
        name = key.removeprefix("base_model.model.")
        match = re.fullmatch(r"(.+)\.(lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector)(?:\.[^.]+)?(?:\.weight)?", name)  # fmt: skip
        if match:
            module, part = match.groups()
            pairs.setdefault(module, {})[part] = tensor
        else:  # modules_to_save (a trained lm_head, a resized embedding): the tensor replaces the base's
            # (PEFT also saves an adapted embedding's own weight as ".base_layer.weight" when it may be resized)
            replaced[re.sub(r"\.(modules_to_save|original_module)(\.[^.]+)?\.|\.base_layer\.", ".", name)] = tensor
    lora = {}
    for module, parts in pairs.items():
        rank = _pattern_value(config.get("rank_pattern"), module, config["r"])
        alpha = _pattern_value(config.get("alpha_pattern"), module, config.get("lora_alpha", rank))
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        embedding = "lora_embedding_A" in parts
        a, b = (
            (parts.get("lora_embedding_A"), parts.get("lora_embedding_B"))
            if embedding
            else (parts.get("lora_A"), parts.get("lora_B"))
        )
        if a is None or b is None:
            raise UserError(f"adapter module {module} has only one of its LoRA matrices", "the adapter file is damaged")
        lora[f"{module}.weight"] = LoraPair(a, b, scale, embedding, parts.get("lora_magnitude_vector"))
    return lora, replaced, config


def merged_weight(base, pair: LoraPair, fan_in_fan_out: bool):
    """W + scale * B A in fp32 (DoRA: rescaled to the trained magnitude per output row)."""
    weight = base.float()
    delta = (pair.b.float() @ pair.a.float()) * pair.scale
    if pair.embedding:
        delta = delta.T
    elif fan_in_fan_out:
        delta = delta.T
    if delta.shape != weight.shape:
        raise UserError(f"the adapter's update has shape {tuple(delta.shape)} but the base weight has "
                        f"{tuple(weight.shape)}", "the adapter was trained on another base model")  # fmt: skip
    weight = weight + delta
    if pair.magnitude is not None:
        norm = weight.norm(p=2, dim=1, keepdim=True)
        weight = weight * (pair.magnitude.float().view(-1, 1) / norm)
    return weight


# --------------------------------------------------------------------------------------------- what a run saved
@dataclass
class RunWeights:
    kind: str  # "adapter" | "full" | "deepspeed" | "fsdp"
    folder: Path  # where the weights (or the checkpoint) are
    note: str


def find_weights(run: Path) -> RunWeights:
    from llmtune.train.checkpoints import last_complete

    def kind_of(folder: Path) -> str | None:
        if (folder / "adapter_config.json").exists():
            return "adapter"
        if (folder / "model.safetensors").exists() or (folder / "model.safetensors.index.json").exists():
            return "full"
        if any(folder.glob("pytorch_model*.bin")):
            return "full"
        if any(folder.glob("global_step*")) or (folder / "latest").exists():
            return "deepspeed"
        if any(folder.glob("pytorch_model_fsdp_*")) or any(folder.glob("model_fsdp_*")):
            return "fsdp"
        return None

    kind = kind_of(run)
    if kind in ("adapter", "full"):
        return RunWeights(kind, run, f"the final save in {run}")
    checkpoint = last_complete(run)
    if checkpoint is not None and (kind := kind_of(checkpoint)):
        return RunWeights(kind, checkpoint, f"{checkpoint.name} (the run has no final save)")
    raise UserError(f"{run} has no model, adapter or complete checkpoint to merge",
                    "train it first (llmtune train), or resume it so it saves")  # fmt: skip


def consolidate(weights: RunWeights) -> dict:
    """A sharded DeepSpeed/FSDP checkpoint as one full state dict (fp32)."""
    if weights.kind == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        tag = None
        if not (weights.folder / "latest").exists():
            tag = sorted(weights.folder.glob("global_step*"), key=lambda p: int(p.name[11:] or 0))[-1].name
        state = get_fp32_state_dict_from_zero_checkpoint(str(weights.folder), tag=tag)
        return {key.removeprefix("module."): value for key, value in state.items()}
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    folder = next(
        iter(sorted(weights.folder.glob("pytorch_model_fsdp_*")) or sorted(weights.folder.glob("model_fsdp_*")))
    )
    state = _load_state_dict_from_keys(checkpoint_id=str(folder))
    return dict(state.get("model", state))


# --------------------------------------------------------------------------------------------- merge
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
    from llmtune.plan.estimate import parse_size_option
    from llmtune.recipe import Recipe

    plan_file = run / "llmtune" / "plan.json"
    if not plan_file.exists():
        raise UserError(f"{run} is not an llmtune run folder (no llmtune/plan.json)", "pass a run's output_dir")
    payload = json.loads(plan_file.read_text())
    recipe, plan = Recipe.model_validate(payload["recipe"]), payload["plan"]
    output = output or run / "merged"
    max_bytes = int(parse_size_option("--max-shard-size", max_shard_size))
    if dtype is not None and dtype not in DTYPES:
        raise UserError(f"--dtype '{dtype}' is not one of {', '.join(DTYPES)}", "use bf16, fp16 or fp32")
    if output.exists() and any(output.iterdir()) and not force:
        raise UserError(f"{output} already exists", "pass --output DIR, or --force to replace it")
    weights = find_weights(run)
    target = _target_dtype(plan, dtype)
    staging = output.with_name(f".{output.name}.merging-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        writer = ShardWriter(staging, max_bytes)
        config_dir, merged, source = _write_weights(recipe, weights, writer, target, progress)
        shards = writer.finish()
        if not (config_dir / "config.json").exists():  # a checkpoint of sharded states: the run's, else the base's
            config_dir = run if (run / "config.json").exists() else _base_folder_of(recipe)
        _write_config(config_dir, staging, target, merged.pop("config_changes"))
        _copy_side_files(run, config_dir, staging)
        # provenance, and what lets `llmtune eval/infer MERGED` read the recipe (its eval split, its template)
        (staging / "llmtune").mkdir()
        shutil.copy2(plan_file, staging / "llmtune" / "plan.json")
        result = MergeResult(output, shards, writer.total_bytes, merged["modules"], source, str(target).split(".")[-1])
        (staging / "README.md").write_text(_card(recipe, plan, weights, result))
        if output.exists():
            shutil.rmtree(output)
        output.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging, output)
        return result
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _write_weights(recipe, weights: RunWeights, writer: ShardWriter, target, progress):
    if weights.kind == "full":
        tensors = iter_tensors(weights.folder)
        for name, tensor in progress(tensors, "writing shards", total=None):
            writer.add(name, tensor.to(target))
        return weights.folder, {"modules": 0, "config_changes": {}}, weights.note
    if weights.kind in ("deepspeed", "fsdp"):
        state = consolidate(weights)
        for name in progress(list(state), "writing shards", total=len(state)):
            writer.add(name, state.pop(name).to(target))
        return weights.folder, {"modules": 0, "config_changes": {}}, weights.note
    lora, replaced, adapter_config = read_adapter(weights.folder)
    folder = _base_folder_of(recipe)
    base_config = json.loads((folder / "config.json").read_text())
    fan_in_fan_out = bool(adapter_config.get("fan_in_fan_out"))
    changes, done, embedding = {}, 0, None  # embedding: (name, rows) of the input embedding, kept as facts only
    for name, tensor in progress(iter_tensors(folder), "merging", total=None):
        if name in replaced:
            tensor = replaced.pop(name)
        pair = lora.pop(name, None)
        if pair is not None:
            tensor = merged_weight(tensor, pair, fan_in_fan_out)
            done += 1
        if name.endswith(("embed_tokens.weight", "wte.weight", "word_embeddings.weight")):
            embedding = (name, int(tensor.shape[0]))
        writer.add(name, tensor.to(target))
    # A tied output layer is stored once, as the embedding: an adapter on it gets an output layer of its own.
    for name in dict.fromkeys(n for n in [*lora, *replaced] if n.endswith("lm_head.weight")):
        if embedding is None or not base_config.get("tie_word_embeddings", True):
            break
        tensor = replaced.pop(name, None)
        if tensor is None:
            tensor = read_tensor(folder, embedding[0])
        pair = lora.pop(name, None)
        if pair is not None:
            tensor = merged_weight(tensor, pair, fan_in_fan_out)
            done += 1
        writer.add(name, tensor.to(target))
        changes["tie_word_embeddings"] = False
    if lora or replaced:
        missing = ", ".join(sorted([*lora, *replaced])[:3])
        raise UserError(f"the adapter changes weights the base model doesn't have ({missing})",
                        "the adapter was trained on another base model")  # fmt: skip
    if embedding is not None and embedding[1] != base_config.get("vocab_size"):
        changes["vocab_size"] = embedding[1]  # the adapter carried a resized embedding (added tokens)
    return (
        folder,
        {"modules": done, "config_changes": changes},
        f"the adapter from {weights.note}, base weights from {folder}",
    )


def _base_folder_of(recipe) -> Path:
    from llmtune.train.model import model_source

    return base_folder(model_source(recipe)[0], recipe.revision_of_model)


def _write_config(config_dir: Path, staging: Path, target, changes: dict) -> None:
    config = json.loads((config_dir / "config.json").read_text())
    config.pop("quantization_config", None)
    name = str(target).split(".")[-1]
    config["dtype"] = name
    if "torch_dtype" in config:
        config["torch_dtype"] = name
    config.update(changes)
    if "use_cache" in config:
        config["use_cache"] = True  # training turned it off; a merged model is for generation
    (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if (config_dir / "generation_config.json").exists():
        shutil.copy2(config_dir / "generation_config.json", staging / "generation_config.json")


def _copy_side_files(run: Path, config_dir: Path, staging: Path) -> None:
    """The run's tokenizer and chat template (the ones training used), else the base's."""
    source = run if (run / "tokenizer_config.json").exists() else config_dir
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy2(source / name, staging / name)


def _card(recipe, plan: dict, weights: RunWeights, result: MergeResult) -> str:
    method = {"lora": "LoRA", "qlora": "QLoRA"}.get(recipe.adapter or "", "full fine-tune")
    what = (f"The {method} adapter folded into the base weights ({result.merged_modules} modules)"
            if weights.kind == "adapter" else f"The {method} weights")  # fmt: skip
    return (
        f"---\nlibrary_name: transformers\nbase_model: {recipe.base_model}\ntags: [llmtune, merged]\n---\n\n"
        f"# {result.output.name}\n\n{what}, from {weights.note}; trained with llmtune ({plan['title']}, "
        f"{plan['world_size']} process(es)). {len(result.shards)} safetensors shard(s), "
        f"{result.total_bytes / 1e6:.1f} MB in {result.dtype}.\n\n"
        "Load it with `AutoModelForCausalLM.from_pretrained(<this folder>)`; the tokenizer and chat template are here too.\n"
    )

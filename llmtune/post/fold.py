"""Folding a LoRA / QLoRA / DoRA adapter into its base weights, tensor by tensor.

The base is read straight from its safetensors files, without building the model: peak memory is one output
shard plus one tensor plus the adapter, not two copies of the model. QLoRA bases are stored unquantized, so
the result lands in the dtype asked for.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from llmtune.errors import UserError, reading
from llmtune.recipe.adapter import names_module
from llmtune.train.model.shards import ShardWriter, iter_tensors, read_tensor


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


def read_adapter(folder: Path) -> tuple[dict[str, LoraPair], dict[str, object], dict[str, tuple], dict]:
    """LoRA pairs by base weight name, whole tensors the adapter replaces (modules_to_save), rows it replaces
    (peft's trainable tokens: (ids, values) by weight name), the adapter config."""
    import math

    from safetensors.torch import load_file

    with reading(folder / "adapter_config.json"):
        config = json.loads((folder / "adapter_config.json").read_text())
    weights = folder / "adapter_model.safetensors"
    if not weights.exists():
        raise UserError(f"{folder} has adapter_config.json but no adapter_model.safetensors", "rerun the training save")
    with reading(weights):
        state = load_file(str(weights))
    if not state:  # folding it would write the base model unchanged under the merged name
        raise UserError(f"{weights} holds no tensors: the adapter lost its training when it was saved",
                        "retrain with this llmtune (it checks each saved adapter), or merge a checkpoint-N folder whose "
                        "adapter has weights")  # fmt: skip
    pairs: dict[str, dict] = {}
    replaced: dict[str, object] = {}
    tokens: dict[str, object] = {}
    for key, tensor in state.items():
        name = key.removeprefix("base_model.model.")
        if re.search(r"\.token_adapter\.trainable_tokens_delta(\.[^.]+)?$", name):  # the trained rows' values
            tokens[f"{name.split('.token_adapter.')[0]}.weight"] = tensor
            continue
        match = re.fullmatch(r"(.+)\.(lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector)(?:\.[^.]+)?(?:\.weight)?", name)  # fmt: skip
        if match:
            module, part = match.groups()
            pairs.setdefault(module, {})[part] = tensor
        else:  # modules_to_save (a trained lm_head, a resized embedding): the tensor replaces the base's
            # (PEFT also saves an adapted embedding's own weight as ".base_layer.weight" when it may be resized)
            # (and a trainable-tokens layer's resized embedding as ".token_adapter.base_layer.weight")
            replaced[re.sub(r"\.(modules_to_save|original_module)(\.[^.]+)?\.|\.(token_adapter\.)?base_layer\.", ".",
                            name)] = tensor  # fmt: skip
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
    rows = {}
    spec = config.get("trainable_token_indices")
    for name, values in tokens.items():
        ids = token_ids(spec, name.removesuffix(".weight"))
        if ids is None and isinstance(spec, dict) and len(tokens) > 1:  # a tied head's copy of the embedding's rows,
            ids = next((i for i in spec.values() if len(i) == values.shape[0]), None)  # which peft saves unnamed
        if ids is None or len(ids) != values.shape[0]:
            raise UserError(f"the adapter's trained token rows of {name} don't match its trainable_token_indices",
                            "the adapter file is damaged")  # fmt: skip
        rows[name] = (ids, values)
    return lora, replaced, rows, config


def token_ids(spec, module: str) -> list[int] | None:
    """The ids whose rows peft's trainable tokens trained in `module`: a list is the input embedding's (and a tied
    head's, which peft saves beside it), a mapping names modules by the end of their path."""
    if isinstance(spec, dict):
        return next((ids for key, ids in spec.items() if names_module(module, key)), None)
    return spec


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


def _fold_linearized(tensor, name: str, lora: dict, fan_in_fan_out: bool):
    """A fused Llama 4 experts tensor (gate_up_proj [E, H, 2I] or down_proj [E, I, H]) with the LoRA of an adapter
    trained on the linearized layout (experts.gate_projs.N, up_projs.N, down_projs.N) folded in: (tensor, folded)."""
    prefix, kind = name.rsplit(".", 1)
    halves = {"gate_up_proj": (("gate_projs", 0), ("up_projs", 1)), "down_proj": (("down_projs", None),)}[kind]
    tensor, folded = tensor.float().clone(), 0
    for expert in range(tensor.shape[0]):
        for projection, half in halves:
            pair = lora.pop(f"{prefix}.{projection}.{expert}.weight", None)
            if pair is None:
                continue
            size = tensor.shape[-1] // 2
            part = tensor[expert] if half is None else tensor[expert, :, half * size : (half + 1) * size]
            part.copy_(merged_weight(part.t(), pair, fan_in_fan_out).t())  # a Linear's weight is the transpose
            folded += 1
    return tensor, folded


def fold_adapter(adapter: Path, folder: Path, writer: ShardWriter, target, progress: Callable) -> tuple[int, dict]:
    """Base weights from `folder` with the adapter folded in, into the writer: (modules folded, config changes)."""
    lora, replaced, rows, adapter_config = read_adapter(adapter)
    base_config = json.loads((folder / "config.json").read_text())
    if base_config.get("tie_word_embeddings", True) and any(not n.endswith("lm_head.weight") for n in rows):
        for name in [n for n in rows if n.endswith("lm_head.weight")]:  # a tied head is the embedding: one tensor
            rows.pop(name)
            replaced.pop(name, None)
    fan_in_fan_out = bool(adapter_config.get("fan_in_fan_out"))
    changes, done, embedding = {}, 0, None  # embedding: (name, rows) of the input embedding, kept as facts only
    # A reward model's adapter (peft's SEQ_CLS / TOKEN_CLS): its new head replaces the base's language-model head
    head = {"SEQ_CLS": "ForSequenceClassification", "TOKEN_CLS": "ForTokenClassification"}.get(
        adapter_config.get("task_type") or ""
    )
    for name, tensor in progress(iter_tensors(folder), "merging", total=None):
        if head and name.endswith("lm_head.weight"):
            continue
        if name in replaced:
            tensor = replaced.pop(name)
        pair = lora.pop(name, None)
        if pair is not None:
            tensor = merged_weight(tensor, pair, fan_in_fan_out)
            done += 1
        if name in rows:  # peft's trainable tokens: those rows take their trained values
            ids, values = rows.pop(name)
            tensor = tensor.clone()
            tensor[ids] = values.to(tensor.dtype)
            done += 1
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")) and lora:  # llama4_linearized_experts
            tensor, folded = _fold_linearized(tensor, name, lora, fan_in_fan_out)
            done += folded
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
    if head:
        for name in [n for n in replaced if n.split(".")[0] in ("score", "classifier")]:
            tensor = replaced.pop(name)
            writer.add(name, tensor.to(target))
            labels = int(tensor.shape[0]) if name.endswith("weight") else None
            if labels:
                changes["architectures"] = [
                    a.replace("ForCausalLM", head) for a in base_config.get("architectures", [])
                ]
                changes["id2label"] = {str(i): f"LABEL_{i}" for i in range(labels)}
                changes["label2id"] = {f"LABEL_{i}": i for i in range(labels)}
    if lora or replaced or rows:
        missing = ", ".join(sorted([*lora, *replaced, *rows])[:3])
        raise UserError(f"the adapter changes weights the base model doesn't have ({missing})",
                        "the adapter was trained on another base model")  # fmt: skip
    if embedding is not None and embedding[1] != base_config.get("vocab_size"):
        changes["vocab_size"] = embedding[1]  # the adapter carried a resized embedding (added tokens)
    return done, changes


def merge_through_peft(
    adapter: Path, folder: Path, writer: ShardWriter, target, progress: Callable
) -> tuple[int, dict]:
    """An adapter on parameters (peft's target_parameters: a MoE model's fused expert tensors, which peft's
    all-linear selects) has no tensor of the base's files to fold into: transformers 5 keeps the experts fused in
    memory and writes them back one per expert. So the base is loaded whole (in the target dtype), peft merges the
    adapter, and transformers' save_pretrained writes its on-disk layout, read back tensor by tensor."""
    import tempfile

    from peft import PeftModel
    from peft.tuners.lora import LoraLayer
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(folder), dtype=target)
    model = PeftModel.from_pretrained(base, str(adapter))
    done = sum(1 for module in model.modules() if isinstance(module, LoraLayer))
    merged = model.merge_and_unload()
    with tempfile.TemporaryDirectory(prefix=".llmtune-merge-", dir=writer.folder.parent) as saved:
        merged.save_pretrained(saved)
        for name, tensor in progress(iter_tensors(Path(saved)), "merging", total=None):
            writer.add(name, tensor.to(target))
    return done, {}

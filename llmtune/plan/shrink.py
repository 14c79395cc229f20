"""The shrunken copy of a model that `llmtune rehearse` trains: the same architecture, fewer layers, narrower.

Pure arithmetic on config.json mappings (nothing is built, no torch). What the shrink keeps: the model type and
class, the vocabulary (so the embedding and output paths, tied or not, are the real ones), the head dimension
(unless a hidden size is asked for), the ratio of query to key/value heads (GQA), the MLP's width ratio, and
every per-layer setting. What it changes: the layer count (enough for every pipeline stage, at least two so
that sharding has more than one unit) and the hidden size (the fewest heads that keep the GQA ratio).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from llmtune.errors import UserError
from llmtune.plan.memory.facts import (
    KEYS,
    KNOWN_MODELS,
    UNGATED_MLP,
    ModelFacts,
    fetch_hub_config,
    find_config_json,
)
from llmtune.plan.memory.facts import facts_from_config as _read_facts

MIN_LAYERS = 2  # more than one decoder layer: several FSDP units, ZeRO-3 fetching layer after layer
MIN_HEADS = 2  # more than one head: the attention's reshapes across heads are exercised
# bitsandbytes' CPU path for 4-bit weights (taken in eval mode) packs output rows in blocks of 32 and reshapes the
# quantization constants to one per 64 inputs: a k-bit base's linear layers need input and output widths that are
# multiples of 64 (bitsandbytes.functional._convert_weight_packed_for_cpu; the real models' widths all are)
KBIT_CPU_BLOCK = 64

# Architecture defaults for configs synthesised from llmtune's table of known shapes (model_facts.KNOWN_MODELS),
# by hub organisation: what that family's config.json says beyond the shape.
_LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu", "rms_norm_eps": 1e-5,
          "attention_bias": False, "mlp_bias": False}  # fmt: skip
_LLAMA31_ROPE = {"rope_theta": 500000.0, "max_position_embeddings": 131072,
                 "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}  # fmt: skip
FAMILIES = {
    "meta-llama/llama-3.1": {**_LLAMA, **_LLAMA31_ROPE},
    "meta-llama/llama-3.2": {**_LLAMA, **_LLAMA31_ROPE, "rope_scaling": {**_LLAMA31_ROPE["rope_scaling"], "factor": 32.0}},
    "meta-llama/meta-llama-3": {**_LLAMA, "rope_theta": 500000.0, "max_position_embeddings": 8192},
    "mistralai/": {"model_type": "mistral", "architectures": ["MistralForCausalLM"], "hidden_act": "silu",
                   "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "max_position_embeddings": 32768, "sliding_window": None},
    "qwen/": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_act": "silu", "rms_norm_eps": 1e-6,
              "rope_theta": 1000000.0, "max_position_embeddings": 32768, "use_sliding_window": False},
    "huggingfacetb/": {**_LLAMA, "rope_theta": 100000.0, "max_position_embeddings": 8192},
    "tinyllama/": {**_LLAMA, "rope_theta": 10000.0, "max_position_embeddings": 2048},
}  # fmt: skip


@dataclass
class FullConfig:
    """The real model's config.json and where it came from (said in the report)."""

    config: dict
    source: str


@dataclass
class Shrunk:
    config: dict  # the shrunken model's config.json
    full: ModelFacts
    shrunk: ModelFacts
    changes: list[str] = field(default_factory=list)  # "num_hidden_layers 32 -> 2", one per changed key


def text_config(config: dict) -> dict:
    """The language model's part of a config (multimodal configs nest it under text_config)."""
    return config.get("text_config") or config


def facts_from_config(config: dict) -> ModelFacts:
    """ModelFacts of a decoder-only LM's config.json mapping (as model_facts.read_model_facts reads a file)."""
    try:
        return _read_facts(config)
    except (KeyError, TypeError, ZeroDivisionError) as err:
        raise UserError(f"the model's config.json has no {err} (not a decoder-only language model?)",
                        "point base_model_config at the config.json of a causal LM") from None  # fmt: skip


def known_config(name: str) -> dict | None:
    """A config.json synthesised from llmtune's table of known shapes and the family's defaults, or None."""
    lowered = name.lower()
    plain = lowered.split("/")[-1].replace("-instruct", "").replace("-chat", "")  # Mistral-7B-Instruct-v0.3
    for known, shape in KNOWN_MODELS.items():
        stem = known.split("/")[1].lower()
        if lowered != known.lower() and not lowered.split("/")[-1].startswith(stem) and not plain.startswith(stem):
            continue
        hidden, layers, heads, kv_heads, intermediate, vocab, tied = shape
        family = next((v for k, v in FAMILIES.items() if known.lower().startswith(k)), _LLAMA)
        return {**family, "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
                "num_key_value_heads": kv_heads, "intermediate_size": intermediate, "vocab_size": vocab,
                "tie_word_embeddings": tied, "initializer_range": 0.02}  # fmt: skip
    return None


def read_full_config(name: str, fetch: bool = True) -> FullConfig | None:
    """The real config.json: a local folder or file, the HF cache, one fetch from the Hub, or llmtune's table."""
    path = find_config_json(name)
    source = "local" if path is not None and Path(name).expanduser().exists() else "HF cache"
    if path is None and fetch and not Path(name).expanduser().exists():
        path, source = fetch_hub_config(name), "the Hub (config.json only)"
    if path is not None:
        try:
            return FullConfig(json.loads(Path(path).read_text()), f"{source}: {path}")
        except (OSError, ValueError) as err:
            raise UserError(f"can't read {path} ({err})", "point base_model_config at a valid config.json") from None
    synthesised = known_config(name)
    if synthesised is not None:
        return FullConfig(synthesised, "llmtune's table of known models (offline; architecture defaults filled in)")
    return None


def layers_needed(pipeline_stages: int = 1, virtual_stages: int = 1) -> int:
    """Layers the shrunken model needs: one per pipeline stage (and virtual stage), at least MIN_LAYERS."""
    return max(MIN_LAYERS, pipeline_stages * max(1, virtual_stages))


def _heads(full: ModelFacts, hidden: int | None, multiple: int, split: int = 1) -> tuple[int, int, int]:
    """(heads, kv heads, head dim) of the shrunken model: the GQA ratio kept, the fewest heads (>= MIN_HEADS) that
    `split` ranks can share as the full model's are (Ulysses: heads divided among them, kv heads divided or
    repeated); the head dimension kept unless a hidden size is asked for. Every projection's width (kv heads x head
    dim, and so the hidden size) stays a multiple of `multiple`, and the head dimension even (rotary embeddings
    rotate pairs)."""
    if full.num_heads % full.num_kv_heads:
        raise UserError(f"the model has {full.num_heads} heads and {full.num_kv_heads} key/value heads, which don't "
                        "divide", "check the model's config.json")  # fmt: skip
    ratio = full.num_heads // full.num_kv_heads
    if full.num_kv_heads == 1 and full.model_type in UNGATED_MLP and ratio > 1:  # multi-query (Falcon's 71 heads
        # over one key/value head): the one key/value head kept, not the ratio
        ratio = max(MIN_HEADS, split)
    kv_heads = max(1, math.ceil(MIN_HEADS / ratio))
    while kv_heads < full.num_kv_heads and ((ratio * kv_heads) % split or (kv_heads % split and split % kv_heads)):
        kv_heads += 1
    heads = ratio * kv_heads
    step = math.lcm(2, multiple // math.gcd(kv_heads, multiple))
    target = full.head_dim if hidden is None else hidden / heads
    if hidden is None and full.head_dim % step == 0:
        return heads, kv_heads, full.head_dim
    return heads, kv_heads, max(step, step * round(target / step))


def _round_up(value: float, multiple: int = 8) -> int:
    return max(multiple, int(math.ceil(value / multiple)) * multiple)


def shrink_config(config: dict, min_layers: int = MIN_LAYERS, hidden: int | None = None,
                  layers: int | None = None, multiple: int = 1, heads_split: int = 1) -> Shrunk:  # fmt: skip
    """The shrunken model's config.json. `hidden` (optional, rounded to heads x an even head dimension) trades
    the head dimension for speed; `layers` (optional) raises the layer count above what the plan needs;
    `multiple` divides every linear layer's width (bitsandbytes' CPU kernels for 4-bit weights need 64);
    `heads_split`: the ranks that share the heads (context parallelism under DeepSpeed)."""
    full = facts_from_config(config)
    heads, kv_heads, head_dim = _heads(full, hidden, multiple, heads_split)
    new_layers = max(min_layers, layers or 0)
    if new_layers > full.num_layers and min_layers > full.num_layers:
        raise UserError(f"the plan needs {min_layers} layers (one per pipeline stage) but the model has "
                        f"{full.num_layers}", "use fewer pipeline stages")  # fmt: skip
    new_layers = min(new_layers, full.num_layers)
    new_hidden = heads * head_dim
    text = dict(text_config(config))
    width = (text.get("intermediate_size") or full.intermediate_size) / full.hidden_size  # the config's own key
    # (ModelFacts' dense width is Llama 4's intermediate_size_mlp, which the loop below keeps in ratio)
    width = (next((text[k] for k in KEYS["mlp"] if isinstance(text.get(k), int)), None) or full.intermediate_size
             ) / full.hidden_size if "intermediate_size" not in text else width  # fmt: skip

    def own(kind: str) -> str:  # the config's own key for it (GPT-2's n_embd, OPT's ffn_dim), else today's name
        return next((key for key in KEYS[kind] if key in text), KEYS[kind][0])

    values = {own("layers"): new_layers, own("hidden"): new_hidden, own("heads"): heads,
              own("mlp"): _round_up(width * new_hidden, math.lcm(8, multiple))}  # fmt: skip
    if text.get("word_embed_proj_dim") == full.hidden_size:  # OPT's embedding width, the hidden size's here
        values["word_embed_proj_dim"] = new_hidden
    if "num_key_value_heads" in text or full.model_type not in UNGATED_MLP:
        values["num_key_value_heads"] = kv_heads
    elif "num_kv_heads" in text:  # Falcon's new decoder architecture
        values["num_kv_heads"] = kv_heads
    # head_dim: where the config has it, or the class defaults one of its own (Gemma); the older families
    # (ungated MLPs) derive it from hidden / heads, some as a read-only property (Falcon)
    if "head_dim" in text or (head_dim != full.head_dim and full.model_type not in UNGATED_MLP):
        values["head_dim"] = head_dim
    for key, value in text.items():  # MoE experts and the like keep their width ratio too
        if (key.endswith("intermediate_size") or key == "intermediate_size_mlp") and key != "intermediate_size" \
                and isinstance(value, int):  # fmt: skip
            values[key] = _round_up(value / full.hidden_size * new_hidden, math.lcm(8, multiple))
        elif isinstance(value, list) and len(value) == full.num_layers:  # per-layer settings (layer_types, ...)
            values[key] = value[:new_layers]
    if isinstance(text.get("max_window_layers"), int):
        values["max_window_layers"] = min(text["max_window_layers"], new_layers)
    before = {**text, "head_dim": text.get("head_dim", full.head_dim)}
    changes = [f"{key} {before.get(key)} -> {value}" for key, value in values.items()
               if before.get(key) != value and not isinstance(value, list)]  # fmt: skip
    text.update(values)
    text["torch_dtype"] = "float32"  # random weights written in fp32; the worker loads them in the recipe's dtype
    shrunk_config = {**config, "text_config": text} if "text_config" in config else text
    if "quantization_config" in config or "quantization_config" in text:
        text.pop("quantization_config", None)
        shrunk_config.pop("quantization_config", None)
        changes.append("quantization_config dropped (random weights are plain)")
    return Shrunk(shrunk_config, full, facts_from_config(shrunk_config), changes)


def parameter_ratio(shrunk: Shrunk) -> float:
    """How many times more parameters the real model has."""
    return shrunk.full.total_params() / shrunk.shrunk.total_params()

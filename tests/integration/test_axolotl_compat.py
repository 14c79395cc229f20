"""Accepted Axolotl-style recipes train as written in the CPU rehearsal: the model swapped for a tiny random one of
the same architecture family (2 layers, hidden 64, the fixture tokenizer), the data for a local file of the same
type, and the run shortened. Everything else in the recipe stays as the corpus writes it."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
from pathlib import Path

import pytest
import yaml
from harness import llmtune, losses, read_metrics
from tiny import load_tokenizer, write_jsonl

from llmtune.train.engine.arguments import OPTIMIZER_PACKAGES
from llmtune.train.model.linearize import linear_experts

pytestmark = pytest.mark.integration

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "axolotl_recipes"

# model type -> (config class, extra config arguments); all 2 layers, hidden 64
FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {
            "head_dim": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "decoder_sparse_step": 1,
        },
    ),
    "gemma3_text": ("Gemma3TextConfig", {"head_dim": 16, "sliding_window": 64, "query_pre_attn_scalar": 16}),
    "phi": ("PhiConfig", {"partial_rotary_factor": 0.5}),
    "llama4_text": (
        "Llama4TextConfig",
        {"head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 1, "intermediate_size_mlp": 128,
         "interleave_moe_layer_step": 1, "no_rope_layers": [1, 1], "attention_chunk_size": 512, "rope_scaling": None},
    ),  # fmt: skip
}
# corpus recipe -> (family, processes)
SAMPLE = {
    "llama3-lora-tracking": ("llama", 1),
    "mistral-qlora-chat": ("mistral", 1),
    "qwen2-pretrain-fsdp2": ("qwen2", 2),
    "qwen3-moe-lora-kernels": ("qwen3_moe", 1),
    "gemma3-qlora-eot": ("gemma3_text", 1),
    "phi2-fft-dedup": ("phi", 1),
    "llama3-qat-fsdp2": ("llama", 2),
    "gemma3-eaft-chat": ("gemma3_text", 1),
    "qwen2-reward-model": ("qwen2", 2),
    "qwen2-prm-lora": ("qwen2", 1),
    "llama4-scout-linearized-qlora": ("llama4_text", 1),
    "qwen2-muon-pretrain-fsdp2": ("qwen2", 2),
}
WORDS = ["apple", "river", "stone", "cloud", "green", "happy", "seven", "light", "table", "music", "paper", "bread"]


def tiny_model(root: Path, family: str, special: tuple[str, ...] = ()) -> Path:
    """A randomly initialised model of this family with the fixture tokenizer, saved under root/family; `special`:
    tokens its vocabulary has as special ones, as the real model's has its turn markers (<end_of_turn>)."""
    import hashlib

    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    path = root / (family + (f"-{hashlib.sha256(repr(special).encode()).hexdigest()[:8]}" if special else ""))
    if path.exists():
        return path
    tokenizer = load_tokenizer()
    if special:
        tokenizer.add_special_tokens({"additional_special_tokens": list(special)})
    class_name, extra = FAMILIES[family]
    config = getattr(transformers, class_name)(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        **extra,
    )  # fmt: skip
    torch.manual_seed(0)
    # Llama 4 is saved linearized, as the checkpoints llama4_linearized_experts recipes name (4-bit loads need it)
    linear = linear_experts(config) if family == "llama4_text" else contextlib.nullcontext()
    with linear:
        model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return path


def rows_like(spec: dict, count: int = 24) -> list[dict]:
    """Local rows of the kind a `datasets` entry reads: alpaca, chat (with its field names), reward pairs, reward
    steps, or plain text."""
    kind = str(spec.get("type") or "")
    if kind.startswith("alpaca"):
        return [{"instruction": f"Repeat {w}", "input": "", "output": f"{w} {w}"} for w in (WORDS * 2)[:count]]
    if kind.startswith("bradley_terry"):
        return [{"system": "Repeat exactly.", "input": f"Repeat {w}", "chosen": f"{w} {w}", "rejected": v}
                for w, v in zip(WORDS * 2, WORDS[::-1] * 2, strict=True)][:count]  # fmt: skip
    if kind == "stepwise_supervised":
        return [{"prompt": f"Add 2 and {i}", "completions": [f"2 plus {i}", f"is {i + 2 + i % 2}"],
                 "labels": [True, i % 2 == 0]} for i in range(count)]  # fmt: skip
    if kind.startswith("chat_template"):
        mapping = spec.get("message_property_mappings") or {}
        role = mapping.get("role") or spec.get("message_field_role") or "role"
        content = mapping.get("content") or spec.get("message_field_content") or "content"
        user, assistant = ("human", "gpt") if role == "from" else ("user", "assistant")
        rows = []
        for word in (WORDS * 2)[:count]:
            answer = {role: assistant, content: f"{word} {word}"}
            if spec.get("field_thinking"):
                answer[spec["field_thinking"]] = f"they want {word} twice"
            rows.append({spec.get("field_messages", "messages"): [{role: user, content: f"Repeat {word}"}, answer]})
        return rows
    field = spec.get("field") or spec.get("text_column") or "text"
    return [{field: f"The {w} is next to the {v}. " * 3} for w, v in zip(WORDS * 2, WORDS[::-1] * 2, strict=True)][
        :count
    ]


def rehearsal_recipe(name: str, family: str, root: Path) -> Path:
    """The corpus recipe with a tiny model, local data of the same type, and a short run."""
    recipe = yaml.safe_load((CORPUS / f"{name}.yml").read_text())
    # eot tokens and the special tokens a recipe names are tokens of the real model's vocabulary (Gemma 3's
    # <end_of_turn>, Llama 4's <|eot|>): the tiny model's vocabulary has them too
    named = [v for v in (recipe.get("special_tokens") or {}).values() if isinstance(v, str)]
    special = tuple(dict.fromkeys([*(recipe.get("eot_tokens") or []), *named]))
    recipe["base_model"] = str(tiny_model(root.parent / "models", family, special))
    recipe.pop("tokenizer_config", None)  # the tiny model carries the fixture tokenizer
    for group in ("datasets", "pretraining_dataset"):
        for index, spec in enumerate(recipe.get(group) or []):
            data = write_jsonl(root / f"{group}-{index}.jsonl", rows_like(spec))
            for hub_only in ("split", "name", "data_files"):
                spec.pop(hub_only, None)
            spec["path"] = str(data)
    if recipe.get("optimizer") in OPTIMIZER_PACKAGES and not importlib.util.find_spec("torchao"):
        recipe["optimizer"] = "adamw_torch"  # torchao's low-bit AdamW isn't installed here; the rest is as written
    recipe.update(output_dir=str(root / "out"), dataset_prepared_path=str(root / "prepared"), max_steps=4,
                  sequence_len=min(recipe.get("sequence_len", 2048), 128), logging_steps=1)  # fmt: skip
    path = root / f"{name}.yml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


@pytest.mark.parametrize(("name", "family", "processes"), [(n, *v) for n, v in SAMPLE.items()], ids=list(SAMPLE))
def test_accepted_recipe_trains_in_rehearsal(tmp_path_factory, name, family, processes):
    root = tmp_path_factory.mktemp(name)
    path = rehearsal_recipe(name, family, root)
    result = llmtune("train", path, "--rehearse", "--num-processes", processes, timeout=600)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    metrics = read_metrics(path)
    history = losses(metrics)
    assert len(history) == metrics["steps"] and all(math.isfinite(loss) for loss in history), history  # each step
    # max_steps, unless the recipe's loss watchdog stops the run first: a random model's loss (ln 512 = 6.2) stays
    # above its threshold, so it stops after `patience` steps, as the recipe asks
    written = yaml.safe_load(path.read_text())
    threshold, patience = written.get("loss_watchdog_threshold"), written.get("loss_watchdog_patience") or 3
    watched = threshold is not None and all(loss > threshold for loss in history[:patience])
    assert metrics["world_size"] == processes and metrics["steps"] == (patience if watched else 4), history
    plan = json.loads((root / "out" / "llmtune" / "plan.json").read_text())
    assert plan["plan"]["cluster"]["device"] == "cpu"
    if yaml.safe_load(path.read_text()).get("llama4_linearized_experts"):  # LoRA reached every routed expert
        from safetensors import safe_open

        with safe_open(str(root / "out" / "adapter_model.safetensors"), framework="pt") as handle:
            keys = list(handle.keys())
        for projection in ("gate_projs", "up_projs", "down_projs"):
            assert sum(f"experts.{projection}." in k and "lora_A" in k for k in keys) == 4 * 2, keys  # 4 x 2 layers
    qat = yaml.safe_load(path.read_text()).get("qat")
    if qat:  # every linear layer of the tiny model trained fake-quantized, from the step the recipe names
        assert sum(metrics["qat"]["modules"].values()) == metrics["qat"]["linear_layers"] > 0
        assert metrics["qat"]["fake_quant_from_step"] == (qat.get("fake_quant_after_n_steps") or 0)

"""What a plan refuses or notes for one feature, beside the strategy: GPTQ bases, async checkpoints, ReLoRA, Muon
with offload, QAT, an elastic world's sizes. Each raises a UserError naming the keys, or returns the plan's note."""

from __future__ import annotations

import functools
import importlib.util

from llmtune.errors import UserError
from llmtune.plan.cluster import Cluster
from llmtune.plan.commands import ELASTIC
from llmtune.plan.memory.facts import ModelFacts
from llmtune.recipe import Recipe
from llmtune.recipe.kernels import liger_requested
from llmtune.recipe.sharegpt import default_system_of, sharegpt_conversation

STRATEGY_TITLES = {
    "single": "single process", "ddp": "DDP (data parallel)", "zero1": "DeepSpeed ZeRO-1",
    "zero2": "DeepSpeed ZeRO-2", "zero3": "DeepSpeed ZeRO-3", "fsdp1": "FSDP1", "fsdp2": "FSDP2",
    "pipeline": "pipeline parallel", "tp": "tensor parallel",
}  # fmt: skip


def gptq_check(recipe, strategy: str) -> str:
    """A GPTQ base trains LoRA through transformers' GPTQ integration (optimum and gptqmodel), replicated: its
    packed integer weights are buffers that ZeRO-3, FSDP and tensor parallelism don't shard."""
    import importlib.util

    if strategy in ("zero3", "tp", "pipeline") or strategy.startswith("fsdp"):
        raise UserError(f"gptq: true under {STRATEGY_TITLES.get(strategy, strategy)} is not supported: GPTQ's packed "
                        "weights are buffers the engine can't shard", "use DDP or ZeRO-1/2 (a GPTQ base is small "
                        "already), or adapter: qlora on the 16-bit model")  # fmt: skip
    missing = [name for name in ("optimum", "gptqmodel") if importlib.util.find_spec(name) is None]
    if missing:
        raise UserError(f"gptq: true (a GPTQ base) is not supported here: it needs {' and '.join(missing)} "
                        "(transformers loads GPTQ weights through them), not installed", f"pip install "
                        f"{' '.join(missing)}, or use adapter: qlora on the 16-bit model")  # fmt: skip
    return "GPTQ base: loaded as quantized (its quantization_config), LoRA trains over its dequantized weights"


def check_kto_batch(recipe: Recipe) -> None:
    """TRL's KTO estimates its KL term from the other completions of a micro-batch: with one there is none (the term
    is the reward itself), and TRL refuses it, but only once the model is loaded."""
    if recipe.rl == "kto" and recipe.micro_batch_size < 2:
        raise UserError("rl: kto needs micro_batch_size 2 or more: TRL's KTO estimates its KL term from the other "
                        "completions of the same micro-batch (with one, it is the reward itself; TRL refuses it after "
                        "loading the model)", "set micro_batch_size: 2 (Axolotl's KTO example does)")  # fmt: skip


def check_chat_templates(recipe: Recipe) -> None:
    """A dataset rendered with the tokenizer's own chat template (chat_template: tokenizer_default, or none given)
    when the tokenizer, on this machine already, has none: one line now, not after the model has loaded."""
    import json

    from llmtune.plan.memory.facts import model_file

    specs = [
        (group, i, spec)
        for group in ("datasets", "test_datasets")
        for i, spec in enumerate(getattr(recipe, group) or [])
    ]
    own = [(group, i, spec) for group, i, spec in specs if isinstance(spec.type, str)
           and (spec.type in ("chat_template", "bradley_terry.chat_template") or spec.type.startswith("chat_template."))
           and (spec.chat_template or recipe.chat_template or "tokenizer_default") == "tokenizer_default"]  # fmt: skip
    if not own:
        return
    name = recipe.tokenizer_config or recipe.base_model
    found = model_file(name, "tokenizer_config.json")
    if found is None or any((found.parent / f).is_file() for f in ("chat_template.jinja", "chat_template.json")):
        return  # not here yet (checked when it loads), or a template beside it
    try:
        if json.loads(found.read_text()).get("chat_template"):
            return
    except (OSError, ValueError, AttributeError):
        return
    group, index, spec = own[0]
    raise UserError(f"{group}[{index}] (type: {spec.type}) renders with the tokenizer's own chat template, and the "
                    f"tokenizer of {name} has none (a base model's usually hasn't)", "set chat_template: chatml (or "
                    "another named template, or jinja with chat_template_jinja), as the model is meant to "
                    "chat")  # fmt: skip


def _check_async_checkpoint(recipe: Recipe, strategy: str, facts: ModelFacts | None) -> str:
    """async_checkpoint runs through torch's distributed checkpoint; refused where the engine writes its own
    checkpoints or the Trainer's format is needed. Returns the plan's note, with the host memory it stages into."""
    refusals = {
        "zero": ("DeepSpeed writes ZeRO checkpoints itself; its decoupled checkpoint engine (DeepSpeed >= 0.17) "
                 "writes through its async_io op (libaio), which llmtune doesn't drive yet",
                 "remove async_checkpoint (ZeRO checkpoints are then written synchronously), or use fsdp_version: 2"),
        "fsdp1": ("FSDP1's sharded checkpoints go through accelerate's synchronous save", "use fsdp_version: 2"),
        "pipeline": ("pipeline stages checkpoint in llmtune's own loop, synchronously", "remove async_checkpoint"),
    }  # fmt: skip
    key = "zero" if strategy.startswith("zero") else strategy
    if key in refusals:
        why, hint = refusals[key]
        raise UserError(f"async_checkpoint is not supported here: {why}", hint)
    if recipe.early_stopping_patience or recipe.load_best_model_at_end:
        key = "early_stopping_patience" if recipe.early_stopping_patience else "load_best_model_at_end"
        raise UserError(f"async_checkpoint with {key} is not supported: keeping the best checkpoint reloads it in "
                        "the Trainer's own format", "remove one of them")  # fmt: skip
    if recipe.save_strategy == "no":
        return "async_checkpoint: no effect (save_strategy: no)"
    size = ""
    if facts is not None:
        from llmtune.plan.memory.peak import estimate

        row = next(r for r in estimate(recipe, facts, 1, 1) if r.name == "single / DDP")
        staged = row.staging / 2**30
        shown = f"{staged:.1f} GiB" if staged >= 0.1 else f"{row.staging / 2**20:.1f} MiB"
        size = f" (up to {shown} per rank, less where the states are sharded)"
    return (f"async_checkpoint: each checkpoint's model and optimizer states are copied to pinned host memory{size} "
            "and written by a background thread while training goes on; a checkpoint counts for resume once every "
            "rank has finished writing it, and a save waits for the previous write")  # fmt: skip


def _check_relora(recipe: Recipe, strategy: str) -> str:
    """ReLoRA's restarts change whole weights and the optimizer's state in place: one process or DDP, and an
    optimizer whose state holds one plain number per parameter. Returns the plan's note."""
    if strategy not in ("single", "ddp"):
        what = "DeepSpeed" if strategy == "zero" else STRATEGY_TITLES[strategy]
        raise UserError(f"relora under {what} is not supported: a restart merges each LoRA into its whole base weight "
                        "and prunes the optimizer's state in place, which sharded or split weights don't allow "
                        "(Axolotl refuses DeepSpeed and FSDP too)",
                        "run ReLoRA in one process or with DDP")  # fmt: skip
    name = recipe.optimizer
    bnb_8bit = name.endswith("8bit") and "torch" not in name and "ademamix" not in name  # blockwise state1/state2
    if name == "adafactor" or (name.endswith(("8bit", "4bit")) and not bnb_8bit):
        kind = "factored" if name == "adafactor" else "quantized in a layout a restart can't prune"
        raise UserError(f"relora with optimizer: {name} is not supported: a restart prunes the optimizer's state "
                        f"value by value, and this optimizer's state is {kind}",
                        "use adamw_torch, or adamw_bnb_8bit (its 8-bit state is pruned dequantized)")  # fmt: skip
    method = recipe.relora_prune_method
    ratio = recipe.relora_pruned_fraction
    return (f"ReLoRA: every {recipe.jagged_restart_steps} steps the LoRA is merged into the base weights and "
            f"restarted, {ratio:.1%} of its optimizer state zeroed ({method}); the LR falls over "
            f"{recipe.jagged_restart_anneal_steps} steps before and warms up over {recipe.jagged_restart_warmup_steps} "
            f"after each restart; the saved adapter holds every cycle (rank lora_r x cycles)")  # fmt: skip


def _check_muon_offload(recipe: Recipe) -> None:
    """Muon's Newton-Schulz step gathers each whole matrix (DTensor.full_tensor) on the device its shard is on;
    with FSDP2 offload the shards and their gradients live on the CPU, which NCCL can't gather (gloo can: a CPU
    rehearsal would pass), so it is refused on every device."""
    if not recipe.resolved_fsdp()[1].offload_params:
        return
    key = "fsdp_config.offload_params" if recipe.fsdp_config and recipe.fsdp_config.offload_params else "fsdp: offload"
    raise UserError(f"optimizer: muon with {key} is not supported: its Newton-Schulz step needs each whole weight "
                    "matrix on the GPU, and FSDP2 offload keeps the shards and their gradients on the CPU, where NCCL "
                    "can't gather them", f"remove {key} (muon runs under FSDP2 without offload), or use optimizer: "
                    "adamw_torch")  # fmt: skip


def _qat_notes(recipe: Recipe) -> list[str]:
    from llmtune.recipe.qat import INSTALL_HINT as QAT_HINT

    notes = [recipe.qat.describe() + "; the saved model keeps full-precision weights: quantize it afterwards to the "
             "same scheme (torchao) for deployment"]  # fmt: skip
    if recipe.qat.weight_dtype == "nvfp4":
        notes.append("qat nvfp4: rounded with torchao's NVFP4 quantizer and multiplied in high precision (emulated: "
                     "runs on any GPU and in rehearsal; torchao's own NVFP4 matmuls need Blackwell)")  # fmt: skip
    if liger_requested(recipe)["fused_linear_cross_entropy"]:
        notes.append("qat: the fused linear cross-entropy reads lm_head's weight directly, so lm_head trains without "
                     "fake quantization on GPUs")  # fmt: skip
    if importlib.util.find_spec("torchao") is None:
        notes.append(f"torchao is not installed here; the run needs it: {QAT_HINT}")
    return notes


def _check_elastic_sizes(recipe: Recipe, cluster: Cluster, strategy: str, global_batch: int) -> None:
    """min_machines: every machine count it allows must keep the global batch (by more accumulation)."""
    least = recipe.min_machines
    if least is None:
        return
    if recipe.rdzv_backend not in ELASTIC:
        raise UserError("min_machines needs rdzv_backend: c10d or etcd (torchrun's elastic rendezvous)")
    if least > cluster.num_machines:
        raise UserError(f"min_machines {least} is more than the {cluster.num_machines} machines of the launch "
                        "(--num-machines; llmtune slurm's --nodes)", "lower min_machines, or ask for more machines")  # fmt: skip
    if least == cluster.num_machines:
        return
    if strategy != "ddp":
        raise UserError(f"min_machines {least} < --num-machines {cluster.num_machines} changes the world size, which "
                        f"{STRATEGY_TITLES[strategy]} checkpoints can't follow",
                        "use DDP (no deepspeed/fsdp/pipeline keys), or set min_machines to --num-machines")  # fmt: skip
    per_step = recipe.micro_batch_size * cluster.processes_per_machine
    bad = [m for m in range(least, cluster.num_machines + 1) if global_batch % (per_step * m)]
    if bad:
        raise UserError(f"with {', '.join(map(str, bad))} machine(s) the global batch {global_batch} can't be kept "
                        f"(it is not a multiple of micro_batch_size x processes = {per_step} per machine)",
                        "raise min_machines, or choose gradient_accumulation_steps so every machine count divides it")  # fmt: skip


@functools.cache
def _modelling_classes(model_type: str) -> tuple[frozenset[str], tuple[str, ...], frozenset[str]] | None:
    """(classes defined, the _no_split_modules among them, the whole-model classes) in transformers' modelling files
    for `model_type`, read without importing them; None where transformers ships none (remote code)."""
    import re
    from pathlib import Path

    spec = importlib.util.find_spec("transformers")
    models = Path(spec.origin).parent / "models" if spec and spec.origin else None
    # a text model type lives in its family's folder (gemma3_text in gemma3/)
    folder = next((models / name for name in (model_type, model_type.removesuffix("_text"))
                   if models and (models / name).is_dir()), None)  # fmt: skip
    files = sorted(folder.glob("modeling_*.py")) if folder else []
    if not files:
        return None
    source = "\n".join(file.read_text(encoding="utf-8", errors="replace") for file in files)
    bases = dict(re.findall(r"^class (\w+)\(([^)]*)\)", source, flags=re.MULTILINE))
    defined = frozenset(re.findall(r"^class (\w+)\(", source, flags=re.MULTILINE))
    own = re.findall(r"_no_split_modules\s*=\s*\[([^\]]*)\]", source)
    layers = sorted({name for found in own for name in re.findall(r"[\"'](\w+)[\"']", found) if name in defined})
    return defined, tuple(layers), _whole_models(bases)


def _whole_models(bases: dict[str, str]) -> frozenset[str]:
    """The classes that are whole models (PreTrainedModel subclasses, transitively) and never a module inside the
    loaded one: the abstract *PreTrainedModel bases and the task models (...ForSequenceClassification) besides it."""
    models = {name for name, base in bases.items() if "PreTrainedModel" in base}
    while True:
        more = {name for name, base in bases.items() if name not in models
                and any(part.strip() in models for part in base.split(","))}  # fmt: skip
        if not more:
            break
        models |= more
    return frozenset(name for name in models if name.endswith("PreTrainedModel") or "For" in name)


def check_wrap_class(names: str | None, facts: ModelFacts | None) -> None:
    """fsdp_config.transformer_layer_cls_to_wrap names classes of this model's own modelling code (a copy from
    another model's recipe fails in every rank, after loading, in accelerate). Read from transformers' modelling
    files for the model type, without importing them; a model type transformers doesn't ship (remote code) or a
    class found nowhere is left to accelerate."""
    found = _modelling_classes(facts.model_type) if names and facts is not None and facts.model_type else None
    if found is None:
        return
    defined, layers, whole = found
    for name in (part.strip() for part in names.split(",")):
        what = f"is not a class of {facts.model_type} models" if name not in defined else \
            "is a whole-model class, not a layer inside the model" if name in whole else None  # fmt: skip
        if name and what:
            raise UserError(f"fsdp_config.transformer_layer_cls_to_wrap: {name} {what} (accelerate would stop every "
                            "rank after loading the model)",
                            f"use {' or '.join(layers[:3]) or 'the model decoder layer class'}, or remove the key "
                            "(the model's own _no_split_modules are wrapped)")  # fmt: skip


def wrap_class_error(err: Exception) -> UserError | None:
    """accelerate's refusal of a wrap class it can't find in the loaded model (one the plan could not read, of a
    model with remote code), as the user error it is; None for any other error."""
    text = str(err)
    if not isinstance(err, ValueError) or not text.startswith("Could not find the transformer layer class"):
        return None
    name = text.removeprefix("Could not find the transformer layer class").removesuffix("in the model.").strip()
    return UserError(f"fsdp_config.transformer_layer_cls_to_wrap: the loaded model has no {name} module (accelerate "
                     "wraps only classes of modules inside it)",
                     "name the class of the model's decoder layers (its _no_split_modules), or remove the key")  # fmt: skip


FSDP1_ONLY = ("use_orig_params", "sync_module_states", "backward_prefetch", "forward_prefetch", "limit_all_gathers")


def fsdp2_notes(recipe, settings) -> list[str]:
    """What an FSDP2 plan says of FSDP1 intent: the version chosen without being asked for (Axolotl runs fsdp_config
    alone as FSDP1, deprecated), and FSDP1 keys the recipe sets that FSDP2 has no use for."""
    if settings.auto_wrap_policy == "SIZE_BASED_WRAP":
        raise UserError("fsdp_config.auto_wrap_policy: SIZE_BASED_WRAP under FSDP2: accelerate's size rule also picks "
                        "the ModuleList that holds the layers, which fully_shard refuses (every rank would stop after "
                        "loading the model)", "use TRANSFORMER_BASED_WRAP (the default: each decoder layer is a unit), "
                        "or fsdp_version: 1 for a size-based wrap")  # fmt: skip
    notes = []
    if not recipe.fsdp_version and not settings.version:
        notes.append("fsdp_config without fsdp_version runs FSDP2 (Axolotl would run FSDP1, which transformers "
                     "deprecates); set fsdp_version: 1 to keep FSDP1")  # fmt: skip
    unused = [key for key in FSDP1_ONLY if key in settings.model_fields_set]
    if unused:
        notes.append(f"fsdp_config: {', '.join(unused)} {'are FSDP1 keys' if len(unused) > 1 else 'is an FSDP1 key'}"
                     " with no FSDP2 counterpart: not used")  # fmt: skip
    return notes


def eval_notes(recipe, facts: ModelFacts | None) -> list[str]:
    """eval_sequence_len where it has no effect (Axolotl's too: it measures supervised test_datasets only), and eval's
    forward passes where they carry more tokens than training's micro-batches (eval_batch_size,
    eval_sequence_len): the estimate counts training's, and eval's logits grow with its tokens."""
    notes = []
    if recipe.eval_sequence_len and (recipe.rl or not recipe.test_datasets):
        where = "preference and GRPO rows are measured at sequence_len" if recipe.rl else \
            "val_set_size's eval rows come from the training rows, at sequence_len"  # fmt: skip
        notes.append(f"eval_sequence_len has no effect here: it measures supervised test_datasets rows; {where}")
    if recipe.rl or not (recipe.test_datasets or recipe.val_set_size):
        return notes
    key, length = recipe.test_row_limit if recipe.test_datasets else ("sequence_len", recipe.sequence_len)
    tokens, trained = (
        (recipe.eval_batch_size or recipe.micro_batch_size) * length,
        recipe.micro_batch_size * recipe.sequence_len,
    )
    if tokens <= trained:
        return notes
    logits = f": its fp32 logits alone are {tokens * facts.vocab_size * 4 / 2**30:.2f} GiB" if facts else ""
    return [
        *notes,
        f"eval: forward passes of up to {tokens} tokens per rank (eval_batch_size x "
        f"{key}), more than training's "
        f"{trained}; the estimate counts training's micro-batches{logits} (no gradients or saved activations)",
    ]


def system_message_notes(recipe) -> list[str]:
    """default_system_message where no dataset reads it (default_system_of: ShareGPT conversations in chatml or
    llama3 under the same chat_template)."""
    if not recipe.default_system_message:
        return []
    system = default_system_of(recipe.default_system_message, recipe.chat_template)
    for spec in [*(recipe.datasets or []), *(recipe.test_datasets or [])]:
        kind = spec.type.split(":")[0] if isinstance(spec.type, str) else ""
        if system and kind.startswith("sharegpt") and sharegpt_conversation(
                spec.conversation, kind == "sharegpt.load_glaive") == system[0]:  # fmt: skip
            return []
    return [
        "default_system_message: no effect here: it is the system message of sharegpt datasets with "
        "conversation: chatml or llama3 when chat_template names the same template (as Axolotl applied it); "
        "give chat_template rows a system turn, or write it into the template"
    ]


def warmup_notes(recipe) -> list[str]:
    """A recipe without warmup_steps or warmup_ratio warms up as Axolotl does (objectives/schedule.warmup_steps)."""
    if recipe.warmup_steps is not None or recipe.warmup_ratio is not None:
        return []
    return ["warm-up: the recipe sets neither warmup_steps nor warmup_ratio: Axolotl's default, 3% of the run's steps "
            "(at most 100; set warmup_steps: 0 for none)"]  # fmt: skip


def check_expert_dropout(recipe, facts: ModelFacts | None) -> None:
    """LoRA that reaches a mixture of experts' fused expert tensors (transformers 5) goes through peft's
    ParamWrapper, which takes no dropout: peft refused it after the model had loaded, under a hint about the
    targets (Axolotl's mixtral example sets lora_dropout 0.05, from before the experts were fused)."""
    if not recipe.adapter or not recipe.lora_dropout or facts is None or not facts.num_experts:
        return
    from llmtune.plan.memory.experts import fused_expert_lora, peft_maps_experts

    mapped = peft_maps_experts(facts.model_type)
    parameters = recipe.lora_target_parameters or []
    listed = recipe.lora_target_modules
    if recipe.lora_target_linear or isinstance(listed, str):
        chosen = None  # every linear layer (a string: a regex, said by peft if it matches none)
    else:
        chosen = set(listed or [])  # (none listed: peft's defaults for the family, attention projections)
    if mapped is None and not parameters:
        return  # experts as linear layers: LoRA's own dropout
    if fused_expert_lora(facts.hidden_size, facts.expert_intermediate_size, 1, chosen, parameters, bool(mapped)):
        raise UserError(f"lora_dropout: {recipe.lora_dropout} with LoRA on {facts.model_type}'s fused expert weights: "
                        "peft adapts those through its ParamWrapper, which takes no dropout",
                        "set lora_dropout: 0 (or leave the experts out of the targets)")  # fmt: skip


def check_unfrozen_patterns(recipe) -> None:
    """Every unfrozen_parameters entry of a full fine-tune must match a parameter of the model, read from its
    config.json on the meta device where it is on this machine. One that matches nothing trains nothing: Axolotl's
    Mixtral recipes name `block_sparse_moe`, which transformers 5 calls `mlp`, so their experts would stay frozen
    while the embeddings trained, without a word."""
    from llmtune.plan.memory.unfrozen import unmatched_patterns

    unmatched, names = unmatched_patterns(recipe)
    if not unmatched:
        return
    import difflib

    shown = difflib.get_close_matches(unmatched[0].strip("^$"), names, n=2, cutoff=0.3) or names[:2]
    raise UserError(f"unfrozen_parameters: {', '.join(repr(p) for p in unmatched)} "
                    f"match{'es' if len(unmatched) == 1 else ''} no parameter of {recipe.base_model}, so "
                    f"{'it trains' if len(unmatched) == 1 else 'they train'} nothing (its names look like "
                    f"{', '.join(shown)})", "patterns are regexes matched from the start of the name ('.' is a "
                    "literal dot): write them against the names above")  # fmt: skip

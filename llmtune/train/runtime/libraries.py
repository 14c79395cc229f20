"""Which optional libraries a rank imports: only those its plan uses.

transformers, accelerate and peft import every optional library they find installed: peft imports bitsandbytes
(which looks for its kernel hub and prints a line when it isn't there), transformers' quantizer registry imports
torchao (load failures and torch `_pytree` deprecations), accelerate imports DeepSpeed to unwrap any model ("Setting
accelerator to CPU"). A LoRA run on one GPU pays seconds of start-up and a screen of lines for libraries it never
calls. Python's own rule for a module that must not load (`sys.modules[name] = None`: `import name` raises
ImportError and `importlib.util.find_spec(name)` answers None) makes those libraries look absent to the availability
checks, so they take their "not installed" path. It is applied before any of them is imported, and only to a library
the recipe and plan certainly don't use: when in doubt (a hub checkpoint whose config isn't on disk yet), it stays.
"""

from __future__ import annotations

import json
import sys
from importlib import metadata
from pathlib import Path

# transformers' optimizer names that build their optimizer from bitsandbytes / torchao (trainer_optimizer.py's
# _BITSANDBYTES_OPTIMIZERS and _TORCHAO_OPTIMIZERS; tests/unit/test_libraries.py holds the two lists together).
BITSANDBYTES_OPTIMIZERS = frozenset({
    "adamw_bnb_8bit", "adamw_8bit", "paged_adamw_32bit", "paged_adamw_8bit", "ademamix", "ademamix_8bit",
    "paged_ademamix_32bit", "paged_ademamix_8bit", "lion_32bit", "lion_8bit", "paged_lion_32bit", "paged_lion_8bit",
    "rmsprop_bnb", "rmsprop_bnb_8bit", "rmsprop_bnb_32bit",
})  # fmt: skip
TORCHAO_OPTIMIZERS = frozenset({"adamw_torch_4bit", "adamw_torch_8bit"})

# Checkpoints saved quantized name their library in config.json's quantization_config.quant_method.
QUANT_METHODS = {"bitsandbytes": "bitsandbytes", "torchao": "torchao"}

# The trackers: DeepSpeed imports mlflow whenever it is installed (its autotuner, at `import deepspeed`), 1.4 s of
# every ZeRO rank's start-up measured on the 2-core CPU machine, for a run that doesn't log to it
TRACKERS = ("mlflow", "wandb", "tensorboard")
OPTIONAL = ("deepspeed", "torchao", "bitsandbytes", "liger_kernel", "datasets", "scipy", "boto3", *TRACKERS)
# imported by transformers for object-detection losses (scipy) and by accelerate for SageMaker (boto3), never by a
# language model's training; kept where the recipe runs the user's own Python (GRPO rewards, dataset transforms),
# as the trackers are (a reward function may log to one)
USER_CODE_LIBRARIES = ("scipy", "boto3", *TRACKERS)


def _checkpoint_quant_method(base_model: str, revision: str | None = None) -> str | None:
    """quant_method of the base model's config.json, "" when it has none, None when the config isn't on disk."""
    if base_model.endswith(".gguf"):
        return ""  # llmtune de-quantizes GGUF files itself
    config = Path(base_model) / "config.json"
    if not config.is_file():
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(base_model, "config.json", revision=revision)
        except Exception:  # not a repo id (a missing folder): the worker reports it
            return None
        if not isinstance(cached, str):
            return None
        config = Path(cached)
    try:
        quantization = json.loads(config.read_text()).get("quantization_config") or {}
    except (OSError, ValueError):
        return None
    return str(quantization.get("quant_method", "")) if isinstance(quantization, dict) else ""


def needed(recipe, plan: dict) -> set[str]:
    """The optional libraries this rank may import: what the plan's strategy, the recipe's keys and the checkpoint
    use. A library whose use can't be ruled out counts as needed."""
    uses = set()
    if plan["strategy"].startswith("zero"):
        uses.add("deepspeed")
    if recipe.qat or recipe.optimizer in TORCHAO_OPTIMIZERS:
        uses.add("torchao")
    if recipe.load_in_4bit or recipe.load_in_8bit or recipe.optimizer in BITSANDBYTES_OPTIMIZERS:
        uses.add("bitsandbytes")
    uses.update(recipe.trackers)
    monitors = plan.get("deepspeed_config") or {}  # DeepSpeed's own monitors, from the recipe's DeepSpeed JSON
    uses.update(name for name in ("tensorboard", "wandb") if (monitors.get(name) or {}).get("enabled"))
    if (plan.get("kernels") or {}).get("liger"):
        uses.add("liger_kernel")
    from llmtune.train.data.sources import reads_with_datasets

    specs = [*(recipe.datasets or []), *(recipe.test_datasets or []), *(recipe.pretraining_dataset or [])]
    if any(reads_with_datasets(spec) for spec in specs):  # llmtune reads local JSON itself, and caches its own way
        uses.add("datasets")
    if recipe.rl:  # TRL's trainers take (and tokenize) a datasets.Dataset
        uses.add("datasets")
    from llmtune.recipe.preference import ONLINE_METHODS
    from llmtune.recipe.user_code import looks_like_function

    if recipe.rl in ONLINE_METHODS or any(isinstance(spec.type, str) and looks_like_function(spec.type)
                                          for spec in specs):  # fmt: skip
        uses.update(USER_CODE_LIBRARIES)  # GRPO's reward functions and row transforms are the user's own Python
    method = _checkpoint_quant_method(recipe.base_model, recipe.revision_of_model)
    if method is None:
        uses.update(QUANT_METHODS.values())
    elif method in QUANT_METHODS:
        uses.add(QUANT_METHODS[method])
    return uses


def hide_unused(recipe, plan: dict) -> list[str]:
    """Make the optional libraries this rank doesn't use look absent; returns their names. Must run before torch,
    transformers, accelerate and peft are imported (a library already imported stays)."""
    keep = needed(recipe, plan)
    hidden = [name for name in OPTIONAL if name not in keep and name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # Python's own "don't import this": ImportError, and find_spec() is None
    return hidden


def imported() -> dict[str, str]:
    """The optional libraries this process really imported, with their versions (for the rank report)."""
    found = {}
    for name in OPTIONAL:
        if sys.modules.get(name) is not None:
            try:
                found[name] = metadata.version(name.replace("_", "-"))
            except metadata.PackageNotFoundError:
                found[name] = "?"
    return found


def ask_cpu_info_once(plan: dict) -> bool:
    """DeepSpeed's CPU optimizer (ZeRO's optimizer offload, to CPU or NVMe) asks py-cpuinfo three times as it starts,
    and each answer is a fresh Python process (1.2 s measured on the 2-core CPU machine); the CPU doesn't change
    within a rank, so the rank keeps the first answer. Returns whether it applies to this plan."""
    zero = (plan.get("deepspeed_config") or {}).get("zero_optimization") or {}
    if (zero.get("offload_optimizer") or {}).get("device") not in ("cpu", "nvme"):
        return False
    import copy
    import functools

    import cpuinfo

    first = functools.cache(cpuinfo.get_cpu_info)
    cpuinfo.get_cpu_info = functools.wraps(first)(lambda: copy.deepcopy(first()))  # callers read it: each a copy
    return True

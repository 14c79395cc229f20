"""The fast-path keys (Liger kernels, Cut Cross Entropy, flash attention, torch.compile): what runs where.

Pure and torch-free: the schema validates with it, the planner shows it (`llmtune plan`), and the
worker applies what it resolves. On GPUs the keys do what they say; in CPU rehearsal they are off
and the planner says so once, so the same recipe rehearses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from llmtune.errors import UserError
from llmtune.recipe.batches import KERNELS, SEQUENCE_SPLIT, Batches, resolve_batches

LIGER_PLUGIN = "axolotl.integrations.liger.LigerPlugin"
CCE_PLUGIN = "axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin"
KNOWN_PLUGINS = (LIGER_PLUGIN, CCE_PLUGIN)
INSTALL_HINT = "pip install 'llmtune[kernels]'"

# recipe key -> Liger's keyword in apply_liger_kernel_to_<model_type>; "glu" is swiglu or geglu, by model
LIGER_KEYS = {
    "liger_rope": "rope",
    "liger_rms_norm": "rms_norm",
    "liger_glu_activation": "glu",
    "liger_layer_norm": "layer_norm",
    "liger_cross_entropy": "cross_entropy",
    "liger_fused_linear_cross_entropy": "fused_linear_cross_entropy",
}
SHOWN = {
    "glu": "swiglu/geglu",
    "cross_entropy": "cross-entropy",
    "fused_linear_cross_entropy": "fused linear cross-entropy",
}
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def check_plugins(plugins: list[str] | None) -> list[str] | None:
    """Only the two Axolotl plugins whose effect llmtune provides itself are accepted."""
    for name in plugins or []:
        if name not in KNOWN_PLUGINS:
            raise ValueError(
                f"plugin '{name}' is not supported; llmtune has no plugin system "
                f"(it understands {LIGER_PLUGIN} and {CCE_PLUGIN} only)"
            )
    return plugins


def cut_cross_entropy_on(recipe) -> bool:
    """Axolotl turns Cut Cross Entropy on by listing its plugin (cut_cross_entropy defaults to true there)."""
    if recipe.cut_cross_entropy is not None:
        return recipe.cut_cross_entropy
    return CCE_PLUGIN in (recipe.plugins or [])


def liger_requested(recipe) -> dict[str, bool]:
    """Every Liger keyword, True or False. Cut Cross Entropy runs as Liger's fused linear cross-entropy:
    the same saving (the full logits tensor is never made), one kernel package instead of two."""
    wanted = {kw: bool(getattr(recipe, key)) for key, kw in LIGER_KEYS.items()}
    if cut_cross_entropy_on(recipe):
        wanted["fused_linear_cross_entropy"] = True
    return wanted


def gpu_only_keys(recipe) -> list[str]:
    """The keys set in this recipe that only do something on GPUs."""
    keys = [key for key in LIGER_KEYS if getattr(recipe, key)]
    if cut_cross_entropy_on(recipe):
        keys.append("cut_cross_entropy")
    if recipe.attn_implementation == "flash_attention_2":
        keys.append("flash_attention" if recipe.flash_attention else "attn_implementation: flash_attention_2")
    if recipe.torch_compile:
        keys.append("torch_compile")
    return keys


@dataclass
class Kernels:
    """What the GPU run uses: Liger keywords, the attention implementation, TrainingArguments for compile."""

    device: str = "cuda"
    liger: dict[str, bool] = field(default_factory=dict)
    attention: str | None = None  # attn_implementation for from_pretrained; None: the model's default
    compile: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    off_in_rehearsal: list[str] = field(default_factory=list)  # keys that apply on GPUs only
    attention_fallback: str | None = None  # why flash_attention_2 became sdpa
    batches: Batches | None = None  # padding-free or padded micro-batches, and the attention kernel that reads them
    optimizer: str | None = None  # the optim name the Trainer gets, where llmtune chose a faster twin of the recipe's
    loader: dict = field(default_factory=dict)  # TrainingArguments for data loading (workers, prefetch, pinning)
    generation: list[str] = field(default_factory=list)  # rl: grpo/gdpo: where generations run (plan/generation.py)
    vllm_share: float | None = None  # colocated vLLM's share of each GPU, where the plan computed it

    @property
    def liger_on(self) -> list[str]:
        return [name for name, on in self.liger.items() if on]

    def describe(self) -> str:
        if self.off_in_rehearsal:
            return f"off in CPU rehearsal (on GPUs: {', '.join(self.off_in_rehearsal)})"
        parts = []
        if self.liger_on:
            parts.append("liger " + ", ".join(SHOWN.get(n, n) for n in self.liger_on))
        if self.attention and not (self.batches and self.batches.padding_free):  # the batches row names it
            over_packed = " (varlen over packed rows)" if self.attention == "flash_attention_2" else ""
            parts.append(f"attention {self.attention}{over_packed}")
        if self.compile:
            mode = self.compile.get("torch_compile_mode")
            parts.append(f"torch.compile {self.compile['torch_compile_backend']}" + (f" ({mode})" if mode else ""))
        return "; ".join(parts)

    def to_dict(self) -> dict:
        return {
            "liger": self.liger_on,
            "attention": self.attention,
            "compile": self.compile,
            "summary": self.describe(),
            "batches": self.batches.to_dict() if self.batches else None,
            "optimizer": self.optimizer,
            "loader": self.loader,
            "generation": self.generation,
            "vllm_share": self.vllm_share,
        }

    def loading_line(self) -> str:
        """The plan's data-loading row."""
        workers = self.loader.get("dataloader_num_workers", 0)
        if not workers:
            return "in the training process (0 workers)" + ("" if self.device == "cuda" else ", CPU rehearsal")
        pinned = self.loader.get("dataloader_pin_memory")
        return (f"{workers} worker(s) per rank collate {self.loader.get('dataloader_prefetch_factor') or 2} batch(es) "
                f"ahead each" + ("; pinned, copied to the GPU with non_blocking" if pinned else ""))  # fmt: skip


def resolve_kernels(recipe, device: str, precision: str, strategy: str | None, flash_attn_installed: bool,
                    varlen_available: bool = True, mesh: dict | None = None,
                    refine_batches: Callable[[Batches], Batches] | None = None) -> Kernels:  # fmt: skip
    """What the recipe's fast-path keys become on this device. Raises UserError for a combination that can't run.
    `refine_batches`: what the model itself allows (the plan reads its config: plan/padding_free.planned_batches),
    applied before the attention is chosen, so the notes speak of the batches the run gets."""
    kernels = Kernels(device, liger=liger_requested(recipe))
    _loss_kernels(recipe, strategy, kernels)
    _plugin_notes(recipe, kernels)
    kernels.batches = resolve_batches(recipe, device, precision, strategy, flash_attn_installed, varlen_available, mesh)
    if refine_batches is not None:
        kernels.batches = refine_batches(kernels.batches)
    kernels.loader = loader_arguments(recipe, device)
    kernels.attention = _attention(recipe, device, precision, strategy, flash_attn_installed, kernels)
    kernels.compile = compile_arguments(recipe, device)
    if recipe.torch_compile and strategy == "pipeline":
        kernels.notes.append(
            "torch_compile: no effect with pipeline_parallel_size > 1 (its own loop, not the HF Trainer)"
        )
    if device != "cuda":
        kernels.off_in_rehearsal = gpu_only_keys(recipe)
        triton = [key for key in kernels.off_in_rehearsal if key.startswith(("liger_", "cut_cross"))]
        if triton:
            kernels.notes.append(f"{', '.join(triton)}: no effect in CPU rehearsal (Triton kernels need a GPU)")
        if recipe.torch_compile:
            kernels.notes.append("torch_compile: no effect in CPU rehearsal (the model is compiled on GPUs only)")
        kernels.liger = dict.fromkeys(kernels.liger, False)
    return kernels


def _loss_kernels(recipe, strategy: str | None, kernels: Kernels) -> None:
    fused = [k for k in ("liger_cross_entropy", "liger_fused_linear_cross_entropy") if getattr(recipe, k)]
    if recipe.use_eaft and (fused or cut_cross_entropy_on(recipe)):
        raise UserError(f"use_eaft computes its own loss from the logits; {', '.join(fused) or 'cut_cross_entropy'} "
                        "replaces that loss", "remove one of them")  # fmt: skip
    if (recipe.reward_model or recipe.process_reward_model) and (fused or cut_cross_entropy_on(recipe)):
        raise UserError(f"{', '.join(fused) or 'cut_cross_entropy'} replaces the language-model loss, which a reward "
                        "model doesn't have (its head scores sequences or steps)", "remove it")  # fmt: skip
    if cut_cross_entropy_on(recipe):
        if recipe.liger_cross_entropy:
            raise UserError("cut_cross_entropy and liger_cross_entropy both replace the loss; choose one")
        kernels.notes.append("cut_cross_entropy: runs as Liger's fused linear cross-entropy (the same saving: no full "
                             "logits tensor); Apple's cut-cross-entropy kernel itself is not used")  # fmt: skip
    if recipe.liger_cross_entropy and recipe.liger_fused_linear_cross_entropy:
        raise UserError("liger_cross_entropy and liger_fused_linear_cross_entropy both replace the loss; choose one",
                        "liger_fused_linear_cross_entropy also saves the logits memory")  # fmt: skip
    fused = kernels.liger["fused_linear_cross_entropy"]
    # Under ZeRO-3 the kernel reads lm_head.weight without calling lm_head: DeepSpeed gathers a partitioned
    # parameter when it is read (tests/integration/test_zero3_direct_weight.py), so it needs nothing here.
    if strategy == "pipeline" and (fused or kernels.liger["cross_entropy"]):
        kernels.liger.update(fused_linear_cross_entropy=False, cross_entropy=False)
        kernels.notes.append("Liger's loss kernels: no effect with pipeline_parallel_size > 1 (the last stage "
                             "computes the loss itself)")  # fmt: skip


def _plugin_notes(recipe, kernels: Kernels) -> None:
    asked = [key for key in LIGER_KEYS if getattr(recipe, key)]
    listed = recipe.plugins or []
    if asked and LIGER_PLUGIN not in listed:
        kernels.notes.append(f"liger_* keys apply without plugins: [{LIGER_PLUGIN}] (Axolotl needs that line; "
                             "llmtune doesn't)")  # fmt: skip
    elif LIGER_PLUGIN in listed and not asked:
        kernels.notes.append("plugins lists the LigerPlugin but no liger_* key is true: no Liger kernel runs")


def _attention(recipe, device: str, precision: str, strategy: str | None, flash_installed: bool, kernels: Kernels):
    """flash_attention_2 where it can run; elsewhere sdpa, which keeps packed examples apart with a block mask."""
    if recipe.attn_implementation != "flash_attention_2":
        return recipe.attn_implementation
    split = kernels.batches is not None and kernels.batches.layout == SEQUENCE_SPLIT
    if split:
        reason = ("context parallelism under DeepSpeed attends with llmtune's varlen attention, which finds the packed "
                  "examples from position_ids (transformers' flash-attn path does so for one row per batch only)")  # fmt: skip
    elif device != "cuda":
        reason = "no effect in CPU rehearsal"
    elif strategy == "pipeline":
        reason = "no effect with pipeline_parallel_size > 1 (stages pass their own block mask)"
    elif precision not in ("bf16", "fp16"):
        reason = f"needs bf16 or fp16, and this run's precision is {precision}"
    elif not flash_installed:
        reason = "flash_attn is not installed here (pip install flash-attn --no-build-isolation)"
    else:
        return "flash_attention_2"
    key = "flash_attention" if recipe.flash_attention else "attn_implementation: flash_attention_2"
    instead = (
        f"{KERNELS[kernels.batches.kernel]} runs instead"
        if split
        else f"{kernels.batches.describe().split('attention: ')[-1]} reads the padding-free batches instead"
        if kernels.batches and kernels.batches.padding_free
        else "sdpa runs instead (or the model's own attention where it has no sdpa path), with the mask that keeps "
        "packed examples apart"
    )
    kernels.attention_fallback = f"{key}: {reason}; {instead}"
    kernels.notes.append(kernels.attention_fallback)
    return "sdpa"


def compile_arguments(recipe, device: str) -> dict:
    """TrainingArguments keys for torch.compile; empty in CPU rehearsal and for pipelines (no HF Trainer there)."""
    if not recipe.torch_compile or device != "cuda" or recipe.pipeline_parallel_size > 1:
        return {}
    arguments = {"torch_compile": True, "torch_compile_backend": recipe.torch_compile_backend or "inductor"}
    if recipe.torch_compile_mode:
        arguments["torch_compile_mode"] = recipe.torch_compile_mode
    return arguments


def fused_optimizer(recipe, device: str, strategy: str | None, deepspeed_steps: bool) -> str | None:
    """adamw_torch_fused where the recipe names plain adamw_torch and the Trainer builds the optimizer on CUDA
    (the same AdamW maths, one fused kernel instead of a loop of small ones); None where nothing changes.
    `deepspeed_steps`: DeepSpeed's own optimizer runs the step (its config's section, or its CPU Adam for an
    offloaded optimizer)."""
    if recipe.optimizer != "adamw_torch" or device != "cuda" or strategy == "pipeline" or deepspeed_steps:
        return None
    fsdp = recipe.resolved_fsdp()
    if fsdp and fsdp[1].offload_params:
        return None  # the step runs on CPU shards
    return "adamw_torch_fused"


def loader_arguments(recipe, device: str) -> dict:
    """Data loading: on GPUs, workers collate the next batches while the GPU runs a step, into pinned memory the
    copy to the GPU reads without blocking; in the CPU rehearsal, in the training process (workers would only
    compete for the same cores)."""
    workers = (
        recipe.dataloader_num_workers if recipe.dataloader_num_workers is not None else (2 if device == "cuda" else 0)
    )
    pinned = bool(recipe.dataloader_pin_memory and device == "cuda")
    arguments = {"dataloader_num_workers": workers, "dataloader_pin_memory": pinned,
                 "dataloader_persistent_workers": workers > 0}  # fmt: skip
    if workers:
        arguments["dataloader_prefetch_factor"] = recipe.dataloader_prefetch_factor or 2
    elif recipe.dataloader_prefetch_factor:
        raise UserError("dataloader_prefetch_factor needs data-loading workers (dataloader_num_workers > 0)",
                        "set dataloader_num_workers, or remove dataloader_prefetch_factor")  # fmt: skip
    return arguments

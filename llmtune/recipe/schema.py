"""The whole recipe: every concern's keys in one flat mapping, as Axolotl writes it."""

from __future__ import annotations

from pydantic import model_validator

from llmtune.recipe.adapter import AdapterKeys
from llmtune.recipe.data import DataKeys
from llmtune.recipe.distributed import DistributedKeys
from llmtune.recipe.mixing import MixingKeys
from llmtune.recipe.model import ModelKeys
from llmtune.recipe.preference import PreferenceKeys
from llmtune.recipe.preference import check as check_preference
from llmtune.recipe.training import TrainingKeys


class Recipe(ModelKeys, AdapterKeys, DataKeys, MixingKeys, TrainingKeys, DistributedKeys, PreferenceKeys):
    """A validated, normalised recipe. Nothing downstream re-reads YAML or re-checks keys."""

    @model_validator(mode="after")
    def _cross_concern_rules(self):
        if self.pipeline_parallel_size > 1 and self.adapter == "qlora":
            raise ValueError("pipeline_parallel_size > 1 with adapter: qlora is not supported; use lora")
        if self.tensor_parallel_size > 1 and (self.adapter or self.qat):
            raise ValueError("tensor_parallel_size > 1 trains the full weights: peft's LoRA layers can't wrap every "
                             "tensor-parallel projection, and qat's fake-quantized layers aren't sharded (remove "
                             f"{'adapter' if self.adapter else 'qat'}, or tensor_parallel_size)")  # fmt: skip
        if self.context_parallel_size > 1:
            self._context_parallel_rules()
        if self.grouped_rates:
            self._grouped_rate_rules()
        self.mixing_rules()
        metric = self.metric_for_best_model
        if metric and not self.rl and not self.process_reward_model:  # what the Trainer's evaluation reports
            reported = ("eval_loss", "eval_accuracy") if self.reward_model else ("eval_loss",)
            if (metric if metric.startswith("eval_") else f"eval_{metric}") not in reported:
                raise ValueError(f"metric_for_best_model: {metric}: this run's evaluation reports "
                                 f"{' and '.join(reported)} only (transformers would stop at the first evaluation)")  # fmt: skip
        if self.lisa_n_layers and self.adapter:
            raise ValueError("lisa_n_layers samples layers of a full fine-tune; remove adapter (or lisa_n_layers)")
        if self.pipeline_parallel_size > 1 and (self.lisa_n_layers or self.use_eaft):
            raise ValueError("lisa_n_layers and use_eaft work through the HF Trainer, which pipeline_parallel_size > 1 "
                             "replaces; use fsdp or deepspeed")  # fmt: skip
        if self.activation_offloading:
            if not self.gradient_checkpointing:
                value = str(self.activation_offloading).lower()
                raise ValueError(f"activation_offloading: {value} moves what checkpointed layers "
                                 "keep: set gradient_checkpointing: true (or remove activation_offloading)")  # fmt: skip
            if self.fsdp_config and getattr(self.fsdp_config, "activation_checkpointing", False):
                raise ValueError("activation_offloading rides on the model's own checkpointing, which "
                                 "fsdp_config.activation_checkpointing replaces; set that to false and keep "
                                 "gradient_checkpointing: true")  # fmt: skip
            if self.pipeline_parallel_size > 1:
                raise ValueError("activation_offloading works through the HF Trainer, which pipeline_parallel_size > "
                                 "1 replaces; use fsdp or deepspeed")  # fmt: skip
        if self.pipeline_parallel_size > 1 and self.qat:
            raise ValueError("qat with pipeline_parallel_size > 1 is not supported; use fsdp or deepspeed")
        if self.streaming and not self.max_steps:
            raise ValueError("streamed data has no length known up front (streaming, or a hub pretraining_dataset): "
                             "set max_steps")  # fmt: skip
        self._reward_rules()
        check_preference(self)
        from llmtune.recipe.passed_kwargs import check_passed_kwargs

        refused = check_passed_kwargs(self)
        if refused:
            raise ValueError(refused)
        kwargs = self.lr_scheduler_kwargs or {}
        if (
            self.lr_scheduler == "cosine_with_min_lr"
            and self.cosine_min_lr_ratio is None
            and not ("min_lr" in kwargs or "min_lr_rate" in kwargs)
        ):
            raise ValueError("lr_scheduler: cosine_with_min_lr needs its floor: set cosine_min_lr_ratio (a fraction "
                             "of learning_rate)")  # fmt: skip
        microbatches = self.pipeline_microbatches
        if self.pipeline_parallel_size > 1 and microbatches is not None and microbatches < self.pipeline_parallel_size:
            raise ValueError(
                f"pipeline_microbatches ({microbatches}) is fewer than pipeline_parallel_size "
                f"({self.pipeline_parallel_size}); stages would sit idle. Use at least {self.pipeline_parallel_size}"
            )
        return self

    def _grouped_rate_rules(self) -> None:
        """LoRA+, embedding_lr(_scale) and lr_groups are optimizers over parameter groups, built by the Trainer."""
        keys = self.grouped_rates
        if self.loraplus_lr_ratio is not None and not self.adapter:
            raise ValueError("loraplus_lr_ratio sets the learning rate of LoRA's B matrices: it needs adapter: lora or "
                             "qlora (remove it for a full fine-tune)")  # fmt: skip
        if "loraplus_lr_ratio" in keys and len(keys) > 1:
            raise ValueError(f"loraplus_lr_ratio and {keys[1]} both set the learning rates of parameter groups, and "
                             "peft's LoRA+ optimizer takes only its own; use one")  # fmt: skip
        key = keys[0]
        what = "peft's LoRA+ AdamW-style optimizer" if key == "loraplus_lr_ratio" else \
            "the Trainer's optimizer over parameter groups"  # fmt: skip
        if self.optimizer == "muon" or self.optimizer.startswith(("galore", "apollo", "lomo", "adalomo")) or \
                self.pipeline_parallel_size > 1 or self.relora:  # fmt: skip
            other = "pipeline_parallel_size > 1" if self.pipeline_parallel_size > 1 else \
                "relora" if self.relora else f"optimizer: {self.optimizer}"  # fmt: skip
            raise ValueError(f"{key} builds {what}, which {other} replaces with its own; remove one of them")
        fsdp = self.resolved_fsdp()
        if fsdp and fsdp[0] == 1 and not fsdp[1].use_orig_params:
            raise ValueError(f"{key} gives parameter groups their own learning rates, which FSDP1 with "
                             "use_orig_params: false flattens into one tensor; set fsdp_config.use_orig_params: true")  # fmt: skip

    def _reward_rules(self) -> None:
        """reward_model / process_reward_model: their data types, their head, and what can't go with them."""
        from llmtune.recipe.data import REWARD_TYPES

        wanted = "reward_model" if self.reward_model else "process_reward_model" if self.process_reward_model else None
        if self.reward_model and self.process_reward_model:
            raise ValueError("reward_model and process_reward_model are both set; use one")
        for group in ("datasets", "test_datasets"):
            for index, spec in enumerate(getattr(self, group) or []):
                needs = REWARD_TYPES.get(spec.type) if isinstance(spec.type, str) else None
                if needs != wanted:
                    raise ValueError(
                        f"{group}[{index}].type {spec.type} needs {needs}: true" if needs else
                        f"{wanted}: true trains on {next(t for t, k in REWARD_TYPES.items() if k == wanted)} data, "
                        f"not {group}[{index}].type {spec.type or 'pretokenized'}"
                    )  # fmt: skip
        mt = self.model_type or ""
        head = "reward_model" if mt.endswith("ForSequenceClassification") else (
            "process_reward_model" if mt.endswith("ForTokenClassification") else None)  # fmt: skip
        if head and head != wanted:
            raise ValueError(f"model_type {mt} trains a classification head: set {head}: true (and its data)")
        if wanted and mt and not head and not mt.startswith("Auto"):
            raise ValueError(f"{wanted} trains a classification head, not model_type {mt}; remove model_type")
        if wanted is None:
            for key in ("num_labels", "center_rewards_coefficient"):
                if getattr(self, key) is not None:
                    raise ValueError(f"{key} belongs to reward_model or process_reward_model training; set one")
            return
        if self.reward_model and self.num_labels not in (None, 1):
            raise ValueError(f"reward_model scores each sequence with one number: num_labels must be 1, not "
                             f"{self.num_labels}")  # fmt: skip
        if self.process_reward_model and self.num_labels == 1:
            raise ValueError("process_reward_model classifies each step: num_labels must be at least 2")
        if self.center_rewards_coefficient is not None and not self.reward_model:
            raise ValueError("center_rewards_coefficient belongs to reward_model training")
        self.num_labels = self.num_labels or (1 if self.reward_model else 2)
        clashes = {"sample_packing": self.sample_packing, "pipeline_parallel_size > 1": self.pipeline_parallel_size > 1,
                   "tensor_parallel_size > 1": self.tensor_parallel_size > 1, "use_eaft": self.use_eaft,
                   "qat": bool(self.qat), "lisa_n_layers": bool(self.lisa_n_layers),
                   "context_parallel_size > 1": self.context_parallel_size > 1}  # fmt: skip
        clash = next((key for key, on in clashes.items() if on), None)
        if clash:
            raise ValueError(f"{wanted} with {clash} is not supported (a classification head trains on whole, "
                             f"unpacked rows through the HF Trainer); remove {clash.split()[0]}")  # fmt: skip

    def _context_parallel_rules(self) -> None:
        """What each context-parallel engine reads: torch's ring attention (FSDP2) takes causal attention over whole
        rows; DeepSpeed's Ulysses gathers whole rows per head group, and llmtune's varlen attention reads each row's
        examples from its position_ids."""
        asked = self.attn_implementation or ("flash_attention_2" if self.flash_attention else None)
        if self.deepspeed is None:
            if self.sample_packing:
                raise ValueError("context parallelism with sample_packing and FSDP2 is not supported: torch's ring "
                                 "attention takes causal attention over whole rows, not the per-example masks of "
                                 "packed rows (set sample_packing: false, or use deepspeed: its Ulysses attention "
                                 "reads packed rows)")  # fmt: skip
            if asked not in (None, "sdpa"):
                raise ValueError(f"context parallelism with {asked} is not supported under FSDP2: torch's ring "
                                 "attention runs on sdpa (attn_implementation: sdpa)")  # fmt: skip
        elif self.use_eaft:
            raise ValueError("use_eaft with context parallelism under DeepSpeed is not supported: Ulysses' loss is "
                             "transformers' sum of each rank's chunk loss weighted by its tokens, which replaces the "
                             "EAFT loss (remove use_eaft, or context_parallel_size)")  # fmt: skip
        elif asked not in (None, "sdpa", "flash_attention_2"):
            raise ValueError(f"context parallelism with {asked} is not supported under DeepSpeed: Ulysses drops the "
                             "attention mask, and llmtune's varlen attention (which reads the rows' boundaries from "
                             "position_ids) replaces sdpa and flash attention only; remove attn_implementation")  # fmt: skip

    @property
    def model_recomputes_for_fsdp(self) -> bool:
        """fsdp_config.activation_checkpointing with an adapter runs as the model's own activation checkpointing:
        under FSDP's checkpoint wrapper PEFT finds none of the adapter's weights (it would save an empty adapter)."""
        fsdp = self.resolved_fsdp()
        return bool(fsdp and self.adapter and fsdp[1].activation_checkpointing)

    @property
    def precision(self) -> str:
        """'bf16', 'fp16' or 'no' ('auto' bf16 is resolved by the planner, which knows the devices)."""
        if self.fp16:
            return "fp16"
        return "bf16" if self.bf16 else "no"

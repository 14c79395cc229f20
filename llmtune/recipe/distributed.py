"""Recipe keys about how training is spread over processes: DeepSpeed, FSDP, pipeline, DDP."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from llmtune.recipe.base import Section, empty_to_none

# Axolotl writes FSDP v1 as a list of words; what each word means for llmtune's FSDP settings.
FSDP_WORDS = {
    "full_shard": {"sharding_strategy": "FULL_SHARD"},
    "shard_grad_op": {"sharding_strategy": "SHARD_GRAD_OP"},
    "hybrid_shard": {"sharding_strategy": "HYBRID_SHARD"},
    "no_shard": {"sharding_strategy": "NO_SHARD"},
    "offload": {"offload_params": True},
    "auto_wrap": {},
}
SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")


class FsdpConfig(Section):
    """FSDP settings; keys may carry Axolotl's older `fsdp_` prefix."""

    version: Literal[1, 2] | None = Field(None, description="Same as the top-level fsdp_version.")
    auto_wrap_policy: Literal["TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"] = Field(
        "TRANSFORMER_BASED_WRAP",
        description="How modules are grouped into FSDP units (SIZE_BASED_WRAP: FSDP1 only; "
        "under FSDP2 accelerate's size rule picks the ModuleList of layers, which fully_shard refuses).",
    )
    transformer_layer_cls_to_wrap: str | None = Field(
        None,
        description="Decoder layer class(es), comma separated or a list (spaces dropped); default: the model's "
        "_no_split_modules.",
    )
    min_num_params: int = Field(100_000_000, gt=0, description="SIZE_BASED_WRAP threshold.")
    sharding_strategy: Literal[SHARDING_STRATEGIES] = Field("FULL_SHARD", description="FSDP1 sharding strategy.")  # type: ignore[valid-type]
    reshard_after_forward: bool | None = Field(
        None, description="Free gathered weights after forward (FSDP2; default from sharding_strategy)."
    )
    offload_params: bool = Field(False, description="Keep parameters and optimizer on CPU.")
    cpu_ram_efficient_loading: bool = Field(False, description="Load weights on rank 0 only, then broadcast.")
    state_dict_type: Literal["FULL_STATE_DICT", "SHARDED_STATE_DICT"] = Field(
        "FULL_STATE_DICT", description="Checkpoint format: one full state dict, or a shard per rank."
    )
    activation_checkpointing: bool = Field(False, description="Recompute activations per wrapped layer.")
    use_orig_params: bool = Field(True, description="FSDP1: expose original parameters (needed for LoRA).")
    sync_module_states: bool = Field(True, description="FSDP1: broadcast rank 0's weights at wrap time.")
    backward_prefetch: Literal["BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH"] = Field(
        "BACKWARD_PRE", description="FSDP1 backward prefetch."
    )
    forward_prefetch: bool = Field(False, description="FSDP1 forward prefetch.")
    limit_all_gathers: bool | None = Field(
        None, description="FSDP1: rate-limit all-gathers to bound memory (accelerate's default: true)."
    )

    @model_validator(mode="before")
    @classmethod
    def _strip_prefix(cls, data: Any) -> Any:
        if isinstance(data, dict):
            data = {
                (k[len("fsdp_") :] if isinstance(k, str) and k.startswith("fsdp_") else k): v for k, v in data.items()
            }
            if "backward_prefetch_policy" in data and "backward_prefetch" not in data:  # accelerate's older name
                data["backward_prefetch"] = data.pop("backward_prefetch_policy")
            classes = data.get("transformer_layer_cls_to_wrap")
            if isinstance(classes, list):  # a YAML list, as some recipes write it
                classes = ",".join(str(name) for name in classes)
            if isinstance(classes, str):  # accelerate splits on "," and keeps any space: "A, B" asks for " B"
                data["transformer_layer_cls_to_wrap"] = ",".join(n.strip() for n in classes.split(",") if n.strip())
        return data


DEEPSPEED_PRESETS = ("zero1", "zero2", "zero3", "zero2_offload", "zero3_offload", "zero3_offload_params", "zero3_nvme")


class DistributedKeys(Section):
    deepspeed: str | dict | None = Field(
        None,
        description="DeepSpeed: a preset (" + ", ".join(DEEPSPEED_PRESETS) + "), a JSON file, or an inline mapping. "
        '"auto" values are filled from the recipe.',
    )
    offload_nvme_path: str | None = Field(None, description="NVMe folder for ZeRO-Infinity offload (zero3_nvme).")
    fsdp: list[str] | None = Field(None, description="Axolotl's FSDP v1 words, e.g. [full_shard, auto_wrap].")
    fsdp_version: Literal[1, 2] | None = Field(
        None, description="FSDP version (default 2; 1 when only Axolotl's `fsdp:` word list is given)."
    )
    fsdp_config: FsdpConfig | None = Field(None, description="FSDP settings (enables FSDP).")
    pipeline_parallel_size: int = Field(1, gt=0, description="Pipeline stages (layers split across ranks).")
    pipeline_microbatches: int | None = Field(None, gt=0, description="Micro-batches per pipeline step.")
    pipeline_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = Field("1f1b", description="Pipeline schedule.")
    pipeline_virtual_stages: int = Field(2, gt=0, description="Stages per rank for interleaved_1f1b.")
    tensor_parallel_size: int = Field(
        1, gt=0, description="Tensor parallelism: each layer's projections split across this many ranks "
        "(transformers' tp_plan); heads and KV heads must divide by it.",
    )  # fmt: skip
    dp_shard_size: int | None = Field(
        None, gt=0, description="With tensor_parallel_size: ranks FSDP2 shards each weight across (default: the rest "
        "of the world with fsdp, else 1).",
    )  # fmt: skip
    dp_replicate_size: int | None = Field(
        None, gt=0, description="With tensor_parallel_size: data-parallel replicas (HSDP across dp_shard groups; "
        "default: whatever world / (tensor_parallel_size x dp_shard_size) leaves).",
    )  # fmt: skip
    context_parallel_size: int = Field(
        1, gt=0, description="Context parallelism: each sequence split across this many ranks. With FSDP2: torch's "
        "ring attention through accelerate (sdpa, unpacked rows); with deepspeed: DeepSpeed's Ulysses (ALST) through "
        "accelerate, packed rows too.",
    )  # fmt: skip
    ddp_timeout: int = Field(1800, gt=0, description="Seconds a collective may wait before the job fails.")
    stall_timeout: int | None = Field(
        None, gt=0, description="Seconds without a finished optimizer step before every rank reports where it is and "
        "the launcher names the rank that is behind and ends the job (default: 5x the median step, at least 5 "
        "minutes; 10 before the first step ends).",
    )  # fmt: skip
    max_restarts: int = Field(
        0,
        ge=0,
        description="After a rank crashes, restart all ranks up to N times "
        "(torchrun's elastic agent); they resume from the last complete checkpoint.",
    )
    rdzv_backend: Literal["static", "c10d", "etcd"] = Field(
        "static",
        description="Rendezvous: static (fixed machine ranks, every machine checks in first), c10d "
        "(torchrun's elastic rendezvous at --main-process-ip:--main-process-port: machines may join in any "
        "order and a restarted machine rejoins; with max_restarts the job survives it; its store lives on "
        "machine 0, so losing machine 0 ends the job) or etcd (the same elastic rendezvous kept in an etcd server "
        "off the training machines, rdzv_endpoint: the job survives the loss of any machine, machine 0 included).",
    )
    rdzv_endpoint: str | None = Field(
        None, description="rdzv_backend: etcd: host:port of the etcd server (its v2 API: etcd --enable-v2=true); "
        "also --rdzv-endpoint.",
    )  # fmt: skip
    min_machines: int | None = Field(
        None,
        gt=0,
        description="With rdzv_backend: c10d, start (and go on) once this many machines have joined, up to "
        "--num-machines; gradient accumulation grows so the global batch stays the same. DDP only.",
    )
    rdzv_timeout: int = Field(
        600,
        gt=0,
        description="Seconds to wait for every machine to join the rendezvous "
        "before failing with the machines that are missing.",
    )
    ddp_find_unused_parameters: bool | None = Field(None, description="DDP: look for parameters without gradients.")
    ddp_bucket_cap_mb: int | None = Field(None, gt=0, description="DDP gradient bucket size.")

    @field_validator("deepspeed", "fsdp", "fsdp_config", "offload_nvme_path", mode="before")
    @classmethod
    def _distributed_empty(cls, value):
        value = empty_to_none(value)
        if value is False or isinstance(value, (list, dict)) and not value:  # `deepspeed: false` in old recipes
            return None
        if isinstance(value, str) and value.strip().lower() in ("false", "no"):
            return None
        return value

    @field_validator("fsdp", mode="before")
    @classmethod
    def _fsdp_words(cls, value):
        if isinstance(value, str) and value.strip().lower() in ("false", "no", ""):  # `fsdp: "false"` in old recipes
            return None
        value = value.split() if isinstance(value, str) else value  # accelerate's "full_shard auto_wrap"
        if value is False:
            return None
        if value is not None and not isinstance(value, list):
            raise ValueError("must be a list of FSDP options, e.g. [full_shard, auto_wrap]")
        for word in value or []:
            if not isinstance(word, str) or word not in FSDP_WORDS:
                raise ValueError(f"'{word}' is not an FSDP option; use some of {', '.join(FSDP_WORDS)}")
        return value

    @model_validator(mode="after")
    def _one_engine(self):
        if self.deepspeed is not None and self.fsdp_enabled:
            raise ValueError("deepspeed and fsdp/fsdp_config are both set; a run uses one sharding engine")
        if self.pipeline_parallel_size > 1 and (self.deepspeed is not None or self.fsdp_enabled):
            raise ValueError("pipeline_parallel_size > 1 combines only with data parallel, not deepspeed or fsdp")
        if self.tensor_parallel_size > 1:
            if self.deepspeed is not None:
                raise ValueError("tensor_parallel_size > 1 runs through transformers' tp_plan with FSDP2, not DeepSpeed "
                                 "(remove deepspeed, or tensor_parallel_size)")  # fmt: skip
            if self.pipeline_parallel_size > 1:
                raise ValueError("tensor_parallel_size and pipeline_parallel_size can't be combined yet; use one")
            if self.fsdp_enabled and (self.resolved_fsdp()[0] == 1):
                raise ValueError("tensor_parallel_size > 1 combines with FSDP2 only; set fsdp_version: 2")
        if self.context_parallel_size > 1:
            others = [name for name, on in (("pipeline_parallel_size", self.pipeline_parallel_size > 1),
                                            ("tensor_parallel_size", self.tensor_parallel_size > 1)) if on]  # fmt: skip
            if others:
                raise ValueError(f"context parallelism with {', '.join(others)} is not supported: llmtune's context "
                                 "parallel runs with FSDP2 (torch's ring attention) or DeepSpeed (Ulysses) alone")  # fmt: skip
            if self.deepspeed is None and (not self.fsdp_enabled or self.resolved_fsdp()[0] != 2):
                raise ValueError("context parallelism needs a sharding engine to split rows with: set fsdp_version: 2 "
                                 "(accelerate's ring attention) or deepspeed (DeepSpeed's Ulysses)")  # fmt: skip
        if self.rdzv_endpoint:  # (etcd without one is refused by the planner: --rdzv-endpoint may still give it)
            host, _, port = self.rdzv_endpoint.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"rdzv_endpoint '{self.rdzv_endpoint}' is not host:port (e.g. 10.0.0.5:2379)")
            if self.rdzv_backend != "etcd":
                raise ValueError("rdzv_endpoint is the etcd server of rdzv_backend: etcd; set that too, or remove it "
                                 "(c10d's endpoint is --main-process-ip:--main-process-port)")  # fmt: skip
        self._check_fsdp_words()
        config = self.fsdp_config
        if config and config.version and self.fsdp_version and config.version != self.fsdp_version:
            raise ValueError(f"fsdp_version is {self.fsdp_version} but fsdp_config.version is {config.version}")
        resolved = self.resolved_fsdp()
        if resolved and resolved[0] == 2 and resolved[1].sharding_strategy == "NO_SHARD":  # was a full shard, silently
            raise ValueError("sharding_strategy NO_SHARD has no FSDP2 form (FSDP2 always shards its parameters): for "
                             "no sharding, remove fsdp/fsdp_config (plain DDP), or use fsdp_version: 1")  # fmt: skip
        return self

    def _check_fsdp_words(self) -> None:
        """Axolotl's word list against itself and fsdp_config: the first word or fsdp_config's key won silently."""
        words = self.fsdp or []
        sharding = [word for word in words if "sharding_strategy" in FSDP_WORDS[word]]
        if len(sharding) > 1:
            raise ValueError(f"fsdp: {' and '.join(sharding)} are two sharding strategies; keep one")
        given = self.fsdp_config.model_dump(exclude_unset=True) if self.fsdp_config else {}
        for word in words:
            for key, value in FSDP_WORDS[word].items():
                if key in given and given[key] != value:
                    raise ValueError(f"fsdp: {word} and fsdp_config.{key}: {given[key]} disagree; keep one")
        strategy = given.get("sharding_strategy") or next((FSDP_WORDS[w]["sharding_strategy"] for w in sharding), None)
        reshard = given.get("reshard_after_forward")
        if (
            strategy in ("FULL_SHARD", "SHARD_GRAD_OP")
            and reshard is not None
            and reshard != (strategy == "FULL_SHARD")
        ):
            raise ValueError(f"sharding_strategy {strategy} and fsdp_config.reshard_after_forward: {reshard} disagree "
                             f"(FSDP2 reads {strategy} as reshard_after_forward: {strategy == 'FULL_SHARD'}); keep one")  # fmt: skip

    @property
    def model_parallel_size(self) -> int:
        """Consecutive ranks that split one model replica's work and read the same rows (tensor x context)."""
        return self.tensor_parallel_size * self.context_parallel_size

    @property
    def least_mesh_ranks(self) -> int:
        """The fewest ranks the recipe's own parallel sizes ask for (unset data-parallel sizes count 1)."""
        return self.model_parallel_size * (self.dp_shard_size or 1) * (self.dp_replicate_size or 1)

    @property
    def fsdp_enabled(self) -> bool:
        return bool(self.fsdp) or self.fsdp_config is not None or self.fsdp_version is not None

    def resolved_fsdp(self) -> tuple[int, FsdpConfig] | None:
        """FSDP version and settings with Axolotl's word list folded in, or None when FSDP is off."""
        if not self.fsdp_enabled:
            return None
        settings = self.fsdp_config.model_dump(exclude_unset=True) if self.fsdp_config else {}
        for word in self.fsdp or []:
            for key, value in FSDP_WORDS[word].items():
                settings.setdefault(key, value)
        config = FsdpConfig(**settings)
        # Axolotl's word list is FSDP1 syntax and Axolotl runs it as FSDP1; otherwise FSDP2 is the default.
        version = self.fsdp_version or config.version or (1 if self.fsdp else 2)
        return version, config

"""Preference training (`rl:`) on TRL's trainers, with llmtune's trainer in front of them.

`LlmtuneTrainer` comes first in each class's MRO, so llmtune's staged checkpoints, non-finite guard, row and token
counts and first-batch check wrap TRL's loss; TRL owns tokenization, the pair layout, the reference model's
placement (DeepSpeed/FSDP preparation) and the reward metrics it logs.

TRL's experimental trainers (ORPO, CPO for SimPO) move between releases: pyproject pins the range tested, and
docs/private-api.md lists what llmtune relies on.
"""

from __future__ import annotations

import os

from llmtune.errors import UserError
from llmtune.recipe.preference import ONLINE_METHODS, TRL_PREFERENCE_KEYS, WITH_REFERENCE, beta, loss_types
from llmtune.train.engine.trainer import LlmtuneTrainer

PAIRED_BATCH = ("dpo", "ipo")  # TRL's DPO collator stacks chosen then rejected: input_ids is [2B, L]


def trl_classes(rl: str) -> tuple[type, type]:
    """(config class, TRL trainer class) for a method."""
    if rl in ONLINE_METHODS:
        from trl import GRPOConfig, GRPOTrainer

        return GRPOConfig, GRPOTrainer
    if rl in ("dpo", "ipo"):
        from trl import DPOConfig, DPOTrainer

        return DPOConfig, DPOTrainer
    if rl == "kto":
        from trl import KTOConfig, KTOTrainer

        return KTOConfig, KTOTrainer
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # the pin and private-api.md say it; once is enough
    if rl == "orpo":
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer

        return ORPOConfig, ORPOTrainer
    from trl.experimental.cpo import CPOConfig, CPOTrainer  # simpo: CPO's trainer with loss_type simpo

    return CPOConfig, CPOTrainer


def online_arguments(recipe, device: str, vllm_share: float | None = None) -> dict:
    """GRPO's config from Axolotl's trl: and vllm: sections. TRL's console table of completions is off: llmtune
    writes the samples to completions.jsonl (llmtune/train/rl/rewards.py)."""
    from dataclasses import fields

    from llmtune.errors import UserError
    from llmtune.recipe.online import aggregation

    config_class = trl_classes(recipe.rl)[0]
    known = {f.name for f in fields(config_class)}
    kwargs: dict = {}
    for key, value in (recipe.trl or {}).items():
        if key in ("reward_funcs", "rollout_func", "log_completions", "num_completions_to_print"):
            continue
        if key not in known:
            import trl

            raise UserError(f"trl.{key} is not a setting of TRL {trl.__version__}'s GRPO", "remove it")
        kwargs[key] = value
    kwargs.update(multi_objective_aggregation=aggregation(recipe), log_completions=False)
    if recipe.chat_template_kwargs and "chat_template_kwargs" in known:  # TRL renders GRPO's prompts itself
        kwargs.setdefault("chat_template_kwargs", dict(recipe.chat_template_kwargs))
    if recipe.rl_beta is not None and "beta" not in kwargs:
        kwargs["beta"] = recipe.rl_beta
    if recipe.dataset_processes:
        kwargs["dataset_num_proc"] = recipe.dataset_processes
    if device != "cuda":  # vLLM needs GPUs: the CPU rehearsal generates in the training process (the plan says so)
        kwargs["use_vllm"] = False
    elif vllm_share and "vllm_gpu_memory_utilization" not in kwargs:  # colocated: the plan's share of each GPU
        kwargs["vllm_gpu_memory_utilization"] = vllm_share
    if device == "cuda" and kwargs.get("use_vllm") and recipe.vllm:
        vllm = recipe.vllm
        if kwargs.get("vllm_mode", "server") == "server":
            kwargs.setdefault("vllm_server_port", vllm.port)
        else:  # colocated: the engine inside each training process splits the model this way
            kwargs.setdefault("vllm_tensor_parallel_size", vllm.tensor_parallel_size)
        if vllm.gpu_memory_utilization:
            kwargs.setdefault("vllm_gpu_memory_utilization", vllm.gpu_memory_utilization)
        if vllm.max_model_len:
            kwargs.setdefault("vllm_max_model_length", vllm.max_model_len)
    if device == "cuda" and kwargs.get("use_vllm") and kwargs.get("vllm_mode", "server") == "server":
        from llmtune.plan.generation import server_address

        kwargs["vllm_server_host"] = server_address(recipe)[0]  # where `llmtune slurm` (or the recipe) put the server
    return kwargs


def config_arguments(recipe, device: str = "cuda", vllm_share: float | None = None) -> dict:
    """The method's keys as TRL's config fields (what TrainingArguments doesn't have)."""
    rl = recipe.rl
    if rl in ONLINE_METHODS:
        return online_arguments(recipe, device, vllm_share)
    kwargs: dict = {"max_length": recipe.sequence_len}
    if recipe.dataset_processes:
        kwargs["dataset_num_proc"] = recipe.dataset_processes
    value = beta(recipe)
    if value is not None:
        kwargs["beta"] = value
    if rl in ("dpo", "ipo"):
        types, weights = loss_types(recipe)
        kwargs.update(loss_type=types, loss_weights=weights, use_weighting=bool(recipe.dpo_use_weighting),
                      label_smoothing=recipe.dpo_label_smoothing or 0.0)  # fmt: skip
    if rl == "kto":
        # KTO's KL term pairs each completion with its neighbour's prompt in a fixed-order batch: TRL requires the
        # sequential sampler (the rows were shuffled once, from the seed, when read)
        kwargs.update(desirable_weight=recipe.kto_desirable_weight or 1.0,
                      undesirable_weight=recipe.kto_undesirable_weight or 1.0, train_sampling_strategy="sequential")  # fmt: skip
    if rl == "simpo":
        kwargs["loss_type"] = "simpo"
        if recipe.simpo_gamma is not None:
            kwargs["simpo_gamma"] = recipe.simpo_gamma
        if recipe.cpo_alpha is not None:
            kwargs["cpo_alpha"] = recipe.cpo_alpha
    if rl in WITH_REFERENCE:
        kwargs["precompute_ref_log_probs"] = bool(recipe.precompute_ref_log_probs)
        kwargs.update(
            {k: v for k, v in (recipe.trl or {}).items() if k in TRL_PREFERENCE_KEYS and k != "beta"}
        )  # TR-DPO
    return kwargs


def needs_reference_copy(recipe) -> bool:
    """A full fine-tune of a method with a reference keeps a frozen copy of the starting model, loaded by llmtune as
    the model was (its tokens, its kernels, ZeRO-3's partitioning at load). With precomputed log-probs TRL keeps
    none; under FSDP it loads its own copy for the precompute and frees it (one it was given would stay)."""
    return recipe.rl in WITH_REFERENCE and not recipe.adapter and not recipe.precompute_ref_log_probs


def freeze(model):
    model.requires_grad_(False)
    return model.eval()


class PreferenceMixin:
    """What llmtune counts of a preference batch: pairs (or KTO completions) as rows, real tokens from the masks;
    of a GRPO batch (its rows before generation): the completions it will generate, a fingerprint of the prompts,
    and, once generated, the prompt and completion tokens the loss reads."""

    def compute_loss(self, model, inputs, *args, **kwargs):
        if model.training and isinstance(inputs, dict) and "completion_mask" in inputs:  # GRPO, after generation
            # a host read per step: generation has synchronised with the device many times over already
            self.tokens_seen += sum(int(inputs[k].sum()) for k in ("prompt_mask", "completion_mask") if k in inputs)
        return super().compute_loss(model, inputs, *args, **kwargs)

    def _batch_view(self, inputs) -> tuple:
        if isinstance(inputs, list):  # GRPO: the micro-batch's rows, each a prompt to complete
            import hashlib

            import torch

            digests = [hashlib.sha256(repr(row.get("prompt")).encode()).digest()[:7] for row in inputs]
            ids = torch.tensor([[int.from_bytes(d, "big") for d in digests]])
            return ids, None, len(inputs), 0, None
        if "input_ids" in inputs:  # DPO (pairs stacked) and KTO
            ids, mask = inputs["input_ids"], inputs.get("attention_mask")
            rows = int(ids.shape[0]) // (2 if self.recipe.rl in PAIRED_BATCH else 1)
            real = int(mask.sum()) if mask is not None else int(ids.numel())
            return ids, mask, rows, real, None
        ids, mask = inputs["chosen_input_ids"], inputs.get("chosen_attention_mask")  # ORPO and CPO
        other = inputs.get("rejected_attention_mask")
        real = sum(int(m.sum()) for m in (mask, other) if m is not None)
        return ids, mask, int(ids.shape[0]), real, None


def trainer_class(rl: str) -> type:
    _, base = trl_classes(rl)
    return type(f"Llmtune{base.__name__}", (PreferenceMixin, LlmtuneTrainer, base), {})


def build_trainer(recipe, model, ref_model, args, data, tokenizer, callbacks):
    from datasets import Dataset
    from datasets.utils.logging import disable_progress_bar

    disable_progress_bar()  # TRL's map() passes (add EOS, tokenize, drop): llmtune's data line reports the rows
    # TRL's own bars (the reference log-probs precomputed before the first step): tqdm reads TQDM_* defaults at each
    # bar, and the downloads, which keep theirs, are over by now
    os.environ["TQDM_DISABLE"] = "1"
    train = Dataset.from_list(list(data.train))
    evaluation = Dataset.from_list(list(data.eval)) if data.eval else None
    if recipe.precompute_ref_log_probs and recipe.rl in WITH_REFERENCE:
        train, evaluation = (_on_shared_disk(recipe, d, name) for name, d in (("train", train), ("eval", evaluation)))
    if recipe.rl in ONLINE_METHODS:
        return _online_trainer(recipe, model, args, train, evaluation, tokenizer, callbacks)
    kwargs = {"ref_model": ref_model} if recipe.rl in WITH_REFERENCE else {}
    trainer = trainer_class(recipe.rl)(model=model, args=args, train_dataset=train, eval_dataset=evaluation,
                                       processing_class=tokenizer, callbacks=callbacks, **kwargs)  # fmt: skip
    _adapter_off_reference(trainer, recipe)
    return trainer


def _on_shared_disk(recipe, dataset, name: str):
    """The rows in an Arrow file under the output folder, which every rank of a machine reads. TRL writes the
    precomputed reference log-probs on rank 0 next to the dataset's own file and every rank reads them there; an
    in-memory dataset's place is a temporary folder of each process's own, where the other ranks found nothing."""
    import shutil
    from pathlib import Path

    from datasets import load_from_disk

    from llmtune.train.checkpoint.manifest import own_disk
    from llmtune.train.runtime import collectives

    if dataset is None:
        return None
    if own_disk():
        raise UserError("precompute_ref_log_probs on machines that don't share output_dir: TRL writes the "
                        "log-probs on the first machine only, where the other machines' ranks can't read them",
                        "put output_dir on a disk every machine mounts, or drop precompute_ref_log_probs")  # fmt: skip
    folder = Path(recipe.output_dir) / "llmtune" / "reference-logps" / name
    if collectives.rank() == 0:
        shutil.rmtree(folder, ignore_errors=True)  # a resumed run's rows and log-probs are made again
        dataset.save_to_disk(str(folder))
    collectives.barrier()
    return load_from_disk(str(folder))


def _online_trainer(recipe, model, args, train, evaluation, tokenizer, callbacks):
    """TRL's GRPOTrainer with the recipe's reward functions (checked, sampled) and rollout function. TRL keeps the
    reference itself: none at beta 0, the adapter switched off for LoRA, else a frozen copy it prepares for the
    strategy (ZeRO-3 partitions it)."""
    from pathlib import Path

    from llmtune.recipe.online import user_functions
    from llmtune.train.rl.rewards import reward_functions

    folder = os.environ.get("LLMTUNE_RECIPE_DIR")
    functions = user_functions(recipe, Path(folder) if folder else None)
    rewards, samples = reward_functions(recipe, functions, Path(recipe.output_dir))
    extra = {"rollout_func": functions["trl.rollout_func"]} if "trl.rollout_func" in functions else {}
    trainer = trainer_class(recipe.rl)(model=model, reward_funcs=rewards, args=args, train_dataset=train,
                                       eval_dataset=evaluation, processing_class=tokenizer, callbacks=callbacks,
                                       **extra)  # fmt: skip
    samples.trainer = trainer
    _adapter_off_reference(trainer, recipe)
    if getattr(trainer, "ref_model", None) is not None:  # TRL's copy keeps requires_grad; it is never trained
        getattr(trainer.ref_model, "module", trainer.ref_model).requires_grad_(False)
    return trainer


def _adapter_off_reference(trainer, recipe) -> None:
    """A fresh LoRA's reference is the base model itself: TRL copies the adapter into a frozen 'ref' adapter, which
    for a new adapter (B = 0) computes exactly the base model; llmtune drops the copy so the reference runs with
    the adapter switched off, with no second set of weights. An adapter loaded from lora_model_dir (the SFT
    result) stays copied: that adapter is the reference."""
    model = trainer.model
    with_reference = recipe.rl in WITH_REFERENCE or (recipe.rl in ONLINE_METHODS and beta(recipe))
    if with_reference and recipe.adapter and not recipe.lora_model_dir:
        if "ref" in getattr(model, "peft_config", {}):
            model.delete_adapter("ref")
            model.set_adapter("default")


def reference_report(trainer) -> dict:
    """What this rank held of the reference, read from the live objects: the engine TRL wrapped it in and the
    parameters this rank keeps (its ZeRO-3 partition or FSDP shard, else the whole copy); none when the adapter's
    base (or precomputed log-probs) is the reference."""
    recipe = trainer.recipe
    online = recipe is not None and recipe.rl in ONLINE_METHODS
    if recipe is None or (recipe.rl not in WITH_REFERENCE and not online):
        return {}
    if online and not beta(recipe):  # GRPO at beta 0 (TRL's default) has no KL term and builds no reference
        return {"reference": "none"}
    ref = getattr(trainer, "ref_model", None)
    if ref is None:
        adapters = sorted(getattr(trainer.model, "peft_config", {}) or {})
        # lora_model_dir's adapter stays copied into a frozen 'ref' adapter, which TRL runs as the reference
        kind = (
            "precomputed"
            if recipe.precompute_ref_log_probs
            else "adapter_copy"
            if "ref" in adapters
            else "adapter_disabled"
        )
        return {"reference": kind, "adapters": adapters}
    from llmtune.train.runtime.ranks import local_parameter_numel

    module = getattr(ref, "module", ref)  # a DeepSpeed engine wraps the model
    stage = ref.zero_optimization_stage() if hasattr(ref, "zero_optimization_stage") else None
    return {"reference": type(ref).__name__, "reference_local_parameters": local_parameter_numel(module),
            "reference_zero_stage": int(stage) if stage is not None else None,
            "reference_trainable": sum(p.numel() for p in module.parameters() if p.requires_grad)}  # fmt: skip


PREFERENCE_METRICS = ("rewards/", "logps/", "logits/", "nll_loss", "log_odds_ratio", "log_odds_chosen", "kl",
                      # GRPO's: the reward (mean, std, per function), the completions' lengths and truncated share,
                      # the policy ratio's clipping, the entropy
                      "reward", "completions/", "clip_ratio/", "entropy", "frac_reward_zero_std")  # fmt: skip


def summary(recipe, log_history: list[dict], reference: dict) -> dict:
    """metrics.json's preference block: the method, TRL's beta, what the reference was, and TRL's metrics (rewards,
    margins, accuracies, log-probs) at the first and the last logged training step, as numbers."""
    logged = [e for e in log_history if "loss" in e and any(k.startswith(PREFERENCE_METRICS) for k in e)]

    def values(entry: dict) -> dict:
        # a metric TRL had nothing to measure at that step is None (every completion truncated, every reward None)
        return {k: float(v) for k, v in entry.items() if k.startswith(PREFERENCE_METRICS) and v is not None}

    return {"method": recipe.rl, "beta": beta(recipe), "reference": reference.get("reference", "none"),
            "first": values(logged[0]) if logged else {}, "last": values(logged[-1]) if logged else {}}  # fmt: skip


def preference_trainer(recipe, plan, model, args, data, tokenizer, source, callbacks, log):
    """TRL's trainer for the method (llmtune's in front); a full fine-tune's frozen reference loaded as the model
    was, so the strategy places it alike (ZeRO-3 partitions it as it loads; TRL prepares it for the engine)."""
    from llmtune.train.model.load import load_model
    from llmtune.train.rl.trainers import build_trainer, freeze, needs_reference_copy

    reference = None
    if needs_reference_copy(recipe):
        reference = freeze(load_model(recipe, source, tokenizer, plan["precision"], device=plan["cluster"]["device"],
                                      frozen=True))  # fmt: skip
        log(f"reference model: a frozen copy of the starting weights ({plan['strategy']})")
    elif recipe.rl in ("dpo", "ipo", "kto"):
        log("reference model: " + ("log-probs precomputed before training" if recipe.precompute_ref_log_probs else
                                   "the base model with the adapter switched off"
                                   if not recipe.lora_model_dir else "the starting adapter, copied and frozen"))  # fmt: skip
    elif recipe.rl in ("grpo", "gdpo"):
        beta = (recipe.trl or {}).get("beta", recipe.rl_beta)
        log("reference model: " + ("none (beta 0, TRL's default: no KL term)" if not beta else
                                   "the starting adapter, copied and frozen" if recipe.lora_model_dir else
                                   "the base model with the adapter switched off" if recipe.adapter else
                                   "a frozen copy TRL loads and places"))  # fmt: skip
    try:
        return build_trainer(recipe, model, reference, args, data, tokenizer, callbacks)
    except ValueError as err:  # TRL refuses a combination when it builds the trainer (e.g. a LoRA on lm_head)
        raise UserError(
            f"rl: {recipe.rl}: TRL refuses this setup: {str(err).splitlines()[0]}", "change the key it names"
        ) from None

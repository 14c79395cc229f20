"""An adapter is never saved empty. Under FSDP's activation checkpointing (torch's checkpoint wrapper around each
decoder layer) PEFT 0.21 finds none of the adapter's weights: a LoRA run ended "saved" with a 0-tensor adapter, and
`llmtune merge` wrote the base model back. The plan gives that recomputation to the model instead, each saved
adapter is counted against the trainable parameters, and merge refuses an empty adapter. (The 2-rank FSDP2 LoRA run
with activation_checkpointing: tests/integration/test_distributed.py::test_two_ranks_match_single_process.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny import make_tiny_model

from llmtune.errors import UserError
from llmtune.plan import make_cluster, make_plan
from llmtune.recipe.loader import recipe_from_mapping
from llmtune.train.engine.arguments import training_arguments
from llmtune.train.runtime.distributed import trainer_fsdp_config

FSDP2 = {"fsdp_version": 2, "fsdp_config": {"activation_checkpointing": True, "state_dict_type": "FULL_STATE_DICT"}}


def recipe(tmp_path: Path, **changes):
    base = {"base_model": "org/model", "datasets": [{"path": "org/data", "type": "alpaca"}],
            "output_dir": str(tmp_path / "run"), "bf16": False, **FSDP2, **changes}  # fmt: skip
    # (fp32: the Trainer's arguments for a GPU plan are built here, on CPU, which refuses bf16)
    return recipe_from_mapping(base, Path("r.yaml"), check_files=False).recipe


def checkpointing(arguments) -> bool:
    return bool(getattr(arguments, "activation_checkpointing", None) or arguments.gradient_checkpointing)


@pytest.mark.parametrize("adapter", ["lora", None], ids=["lora", "full"])
def test_fsdp_checkpointing_goes_to_the_model_for_an_adapter_only(tmp_path, adapter):
    r = recipe(tmp_path, **({"adapter": adapter, "lora_r": 4, "lora_target_linear": True} if adapter else {}))
    plan = make_plan(r, make_cluster(8, device="cuda"))
    section = plan.accelerate_config["fsdp_config"]
    said = [note for note in plan.notes if "activation_checkpointing with an adapter" in note]
    arguments = training_arguments(r, plan.to_dict(), 100, False)
    trainer_fsdp = trainer_fsdp_config(section)  # what the Trainer is given beside the arguments
    if adapter:  # the model's own recomputation, FSDP's wrapper off, and the plan says why
        assert section["fsdp_activation_checkpointing"] is False and len(said) == 1 and "empty" in said[0]
        assert checkpointing(arguments) and trainer_fsdp["activation_checkpointing"] is False
    else:  # a full fine-tune keeps FSDP's own (no PEFT to lose the weights)
        assert section["fsdp_activation_checkpointing"] is True and not said
        assert not checkpointing(arguments) and trainer_fsdp["activation_checkpointing"] is True


def _peft_model(tmp_path: Path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "base"))
    return get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))


def test_an_adapter_saved_under_the_checkpoint_wrapper_is_caught_and_merge_refuses_it(tmp_path):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )  # fmt: skip

    from llmtune.post.merge import merge_run
    from llmtune.train.checkpoint.final import check_saved_adapter

    model = _peft_model(tmp_path)
    model.save_pretrained(tmp_path / "good")
    check_saved_adapter(tmp_path / "good", model)  # 8 tensors for 8 trainable parameters
    layer = type(model.get_base_model().model.layers[0])
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper,
                                   check_fn=lambda module: isinstance(module, layer))  # fmt: skip
    model.save_pretrained(tmp_path / "run")  # as accelerate's FSDP activation_checkpointing leaves the model
    with pytest.raises(RuntimeError, match=r"holds 0 tensors for 8 trainable parameters"):
        check_saved_adapter(tmp_path / "run", model)
    # a run folder with that empty adapter: merge names the file instead of writing the base model back
    (tmp_path / "run" / "llmtune").mkdir()
    plan = {"recipe": {"base_model": str(tmp_path / "base"), "datasets": [{"path": "x.jsonl", "type": "alpaca"}],
                       "adapter": "lora", "output_dir": str(tmp_path / "run")},
            "plan": {"precision": "fp32", "title": "single process", "world_size": 1}}  # fmt: skip
    (tmp_path / "run" / "llmtune" / "plan.json").write_text(json.dumps(plan))
    with pytest.raises(UserError, match="holds no tensors"):
        merge_run(tmp_path / "run", tmp_path / "merged")
    assert not (tmp_path / "merged").exists()

"""The repairs after DeepSpeed's ZeRO-3 universal load (llmtune/train/checkpoint/universal.py), on a torch optimizer left as
DeepSpeed 0.19.8 leaves it: one `step` tensor shared by every sub-group, group 0's hyperparameters on every group."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from llmtune.train.checkpoint.universal import convert, converted_folder, repair_universal_load


def loaded_like_deepspeed(tmp_path):
    """An AdamW over two parameter groups (decay, no decay) and three sub-group tensors after the universal load;
    the converted folder's optimizer_state.pt keeps each group's own values."""
    tensors = [torch.nn.Parameter(torch.zeros(3)) for _ in range(3)]
    inner = torch.optim.AdamW([{"params": tensors[:2], "weight_decay": 0.1, "lr": 1e-3},
                               {"params": tensors[2:], "weight_decay": 0.0, "lr": 2e-3}])  # fmt: skip
    shared = torch.tensor(6.0)
    for t in tensors:
        inner.state[t] = {"step": shared, "exp_avg": torch.zeros(3), "exp_avg_sq": torch.zeros(3)}
    for group in inner.param_groups:  # what the load does: the first group's values everywhere
        group.update(weight_decay=0.1, lr=1e-3)
    folder = tmp_path / "global_step6_universal"
    (folder / "zero").mkdir(parents=True)
    groups = [{"weight_decay": 0.1, "lr": 1e-3, "params": [0, 1]}, {"weight_decay": 0.0, "lr": 2e-3, "params": [2]}]
    torch.save({"optimizer_state_dict": {"param_groups": groups, "state": {}}}, folder / "zero" / "optimizer_state.pt")
    return SimpleNamespace(optimizer=inner), tensors, folder


def test_each_sub_group_steps_its_own_counter_and_each_group_gets_its_hyperparameters(tmp_path):
    zero, tensors, folder = loaded_like_deepspeed(tmp_path)
    assert repair_universal_load(zero, folder, 3) == 2
    inner = zero.optimizer
    steps = [inner.state[t]["step"] for t in tensors]
    assert len({id(s) for s in steps}) == 3 and all(float(s) == 6.0 for s in steps)
    for t in tensors:
        t.grad = torch.ones(3)
    inner.step()  # one optimizer step moves every counter by one, not by the number of sub-groups
    assert [float(inner.state[t]["step"]) for t in tensors] == [7.0, 7.0, 7.0]
    assert [(g["weight_decay"], g["lr"]) for g in inner.param_groups] == [(0.1, 1e-3), (0.0, 2e-3)]


def test_a_group_count_that_doesnt_match_is_an_error_not_a_silent_mix(tmp_path):
    zero, _, folder = loaded_like_deepspeed(tmp_path)
    zero.optimizer.param_groups.pop()
    with pytest.raises(RuntimeError, match="2 saved parameter groups, the optimizer has 1"):
        repair_universal_load(zero, folder, 3)


def test_only_a_finished_conversion_counts(tmp_path):
    checkpoint = tmp_path / "checkpoint-6"
    (checkpoint / "global_step6_universal").mkdir(parents=True)
    assert converted_folder(checkpoint) is None  # half-written: DeepSpeed writes latest_universal last
    (checkpoint / "latest_universal").write_text("global_step6_universal")
    assert converted_folder(checkpoint) == checkpoint / "global_step6_universal"
    assert convert(checkpoint) == checkpoint / "global_step6_universal"  # kept as it is, not converted again
    with pytest.raises(FileNotFoundError, match="no `latest` file"):
        convert(tmp_path / "checkpoint-3")

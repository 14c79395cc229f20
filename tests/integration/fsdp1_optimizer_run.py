"""Under torchrun (CPU, gloo), for tests/integration/test_fsdp1_resume.py. `save DIR`: an FSDP1 model trains two
steps and accelerate saves its sharded optimizer state as the Trainer does, with the full state as the reference.
`load DIR`: a fresh optimizer loaded by accelerate's loader and one loaded by llmtune's; rank 0 prints what each
holds as one JSON line."""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import PartialState
from accelerate.utils import load_fsdp_optimizer, save_fsdp_optimizer
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.fully_sharded_data_parallel import (
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    StateDictType,
)

from llmtune.train.checkpoint.fsdp1 import load_sharded_optimizer

mode, folder = sys.argv[1], Path(sys.argv[2])
PartialState(cpu=True, backend="gloo")  # as the Trainer's: accelerate's save and load log through it
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = FSDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 5)),
             use_orig_params=True, device_id=torch.device("cpu"))  # fmt: skip
plugin = types.SimpleNamespace(fsdp_version=1, state_dict_type=StateDictType.SHARDED_STATE_DICT,
                               state_dict_config=ShardedStateDictConfig(offload_to_cpu=True),
                               optim_state_dict_config=ShardedOptimStateDictConfig(offload_to_cpu=True))  # fmt: skip
accelerator = types.SimpleNamespace(wait_for_everyone=dist.barrier, process_index=rank, is_main_process=rank == 0)
FULL = StateDictOptions(full_state_dict=True)


def optimizer():
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


if mode == "save":
    opt = optimizer()
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 5, generator=g)
        (((model(x.chunk(world)[rank]) - y.chunk(world)[rank]) ** 2).sum() / 8 * world).backward()
        opt.step()
        opt.zero_grad()
    save_fsdp_optimizer(plugin, accelerator, opt, model, str(folder))
    reference = get_optimizer_state_dict(model, opt, options=FULL)
    if rank == 0:
        torch.save(reference, folder / "reference.pt")
else:
    theirs = optimizer()
    load_fsdp_optimizer(plugin, accelerator, theirs, model, str(folder))
    ours = optimizer()
    load_sharded_optimizer(model, ours, folder / "optimizer_0")
    loaded = get_optimizer_state_dict(model, ours, options=FULL)
    if rank == 0:
        reference = torch.load(folder / "reference.pt", weights_only=True)["state"]
        equal = bool(reference) and reference.keys() == loaded["state"].keys() and all(
            torch.equal(torch.as_tensor(reference[k][n]), torch.as_tensor(loaded["state"][k][n]))
            for k in reference for n in reference[k]
        )  # fmt: skip
        steps = sorted({float(s["step"]) for s in loaded["state"].values()})
        print(json.dumps({"world": world, "accelerate_state_entries": len(theirs.state), "llmtune_equal": equal,
                          "llmtune_state_entries": len(ours.state), "steps": steps}), flush=True)  # fmt: skip
dist.barrier()
dist.destroy_process_group()
# leave without interpreter finalization, as llmtune's ranks do (llmtune/train/__main__.py): gloo's threads meeting
# module teardown abort the process ("terminate called without an active exception"), seen once in CI
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)

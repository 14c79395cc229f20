"""Pipeline parallelism for Hugging Face decoder-only LMs, on torch.distributed.pipelining.

The HF Trainer has no pipeline engine, so this is its own loop. The model is split generically:
input embeddings -> decoder layers -> final norm -> output head, found from the model's structure.
Ranks form a (data-parallel x stage) grid; each stage holds only its layers. The loss of a step is
the token-weighted mean over the whole global batch, as in the HF Trainer, so a pipeline run and a
single-process run with the same global batch give the same losses.
"""

from __future__ import annotations

import math
import os
import time

import torch
from torch import nn

from llmtune.errors import UserError
from llmtune.train.checkpoint import stages as stage_files
from llmtune.train.checkpoint.folders import stop_requested
from llmtune.train.data.formats import IGNORE
from llmtune.train.pipeline.stages import Grid, Stage, find_parts, make_grid, owned_names
from llmtune.train.runtime import collectives
from llmtune.train.runtime.progress import step_line


def step_order(rows: int, seed: int, epoch: int) -> list[int]:
    """The same order the HF Trainer's seeded random sampler gives for this epoch."""
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    return torch.randperm(rows, generator=generator).tolist()


def decay_groups(params: dict[str, nn.Parameter], weight_decay: float) -> list[dict]:
    """Weight decay on weights, not on biases or norms (as the HF Trainer groups them)."""
    decay = [p for n, p in params.items() if p.requires_grad and "bias" not in n and "norm" not in n.lower()]
    rest = [p for n, p in params.items() if p.requires_grad and ("bias" in n or "norm" in n.lower())]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def clip_global_norm(params: list[nn.Parameter], max_norm: float, grid: Grid, skip=None) -> float:
    """Clip by the norm over all stages' gradients (replicas hold the same gradients after the DP all-reduce)."""
    grads = [p.grad for p in params if p.grad is not None]
    counted = [p.grad for p in params if p.grad is not None and p is not skip]
    # a stage with no trainable gradient (a frozen LoRA stage's norm) still joins the all-reduce, on the same device
    local = (torch.stack([g.detach().float().pow(2).sum() for g in counted]).sum() if counted
             else collectives.tensor(0.0, dtype=torch.float32))  # fmt: skip
    total = collectives.all_reduce(local, group=grid.pp_group).sqrt().item()
    if max_norm > 0 and total > max_norm:
        for g in grads:
            g.mul_(max_norm / (total + 1e-6))
    return total


def train_pipeline(recipe, plan: dict, model, data, tokenizer, log, checkpoints, resume: str | None) -> dict:
    """Run the pipeline loop, from `resume` (a checkpoint) if given, saving through the checkpoint manager; returns
    metrics for rank 0 (others return what they saw)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    from llmtune.plan.pipeline import split_layers
    from llmtune.train.data.collate import REAL_TOKENS, Collator
    from llmtune.train.objectives.schedule import make_scheduler, run_steps, warmup_steps

    pipe = plan["pipeline"]
    stages, microbatches = pipe["stages"], pipe["microbatches"]
    core = model.get_base_model() if hasattr(model, "get_base_model") else model
    parts = find_parts(core)
    layers = len(parts.layers)
    if stages > layers:
        raise UserError(f"pipeline_parallel_size {stages} is more than the model's {layers} layers", "use fewer stages")
    tied = parts.embed.weight is parts.head.weight
    grid = make_grid(stages, tied)
    sizes = [sum(p.numel() for p in layer.parameters()) for layer in parts.layers]
    # interleaved_1f1b: each rank holds `virtual` chunks, stage r, r + P, r + 2P, ... of P x virtual in all.
    virtual = pipe["virtual_stages"] if pipe["schedule"] == "interleaved_1f1b" else 1
    chunks = stages * virtual
    if chunks > layers:
        raise UserError(f"{stages} stages x {virtual} virtual stages need {chunks} layers; the model has {layers}")
    ranges = split_layers(sizes, parts.embed.weight.numel(), parts.head.weight.numel() if not tied else 0, chunks)
    held = [grid.stage + i * stages for i in range(virtual)]
    stage_module = nn.ModuleList(Stage(parts, ranges[i], i == 0, i == chunks - 1) for i in held)
    params = owned_names(model, stage_module)
    if tied:
        # The first and last stage both hold the shared weight; their gradients are summed each step, so the
        # two copies get identical updates and stay equal.
        log("tied embeddings: the first and last stage keep the shared weight in sync")

    total_tokens_box = [1.0]

    def loss_fn(logits, labels):
        shifted = logits[:, :-1].reshape(-1, logits.shape[-1]).float()
        loss = nn.functional.cross_entropy(shifted, labels[:, 1:].reshape(-1), ignore_index=IGNORE, reduction="sum")
        return loss / total_tokens_box[0]

    device = collectives.device()  # the rank's GPU (or the CPU in rehearsal): P2P buffers and collectives live there
    stage_module.to(device)
    if plan["precision"] == "bf16":  # the CPU rehearsal plans fp32; without this a GPU run would silently be fp32 too
        for stage in stage_module:
            stage.autocast_dtype = torch.bfloat16
    pipeline_stages = [PipelineStage(module, index, chunks, device, group=grid.pp_group)
                       for module, index in zip(stage_module, held, strict=True)]  # fmt: skip
    if virtual > 1:
        schedule = ScheduleInterleaved1F1B(pipeline_stages, microbatches, loss_fn=loss_fn, scale_grads=False)
    else:
        schedule_class = ScheduleGPipe if pipe["schedule"] == "gpipe" else Schedule1F1B
        schedule = schedule_class(pipeline_stages[0], microbatches, loss_fn=loss_fn, scale_grads=False)

    trainable = [p for p in params.values() if p.requires_grad]
    # The last stage's copy of a tied weight is the same parameter as the first stage's: count it once in the norm.
    shared_copy = parts.head.weight if tied and grid.last and not grid.first else None
    optimizer = torch.optim.AdamW(decay_groups(params, recipe.weight_decay), lr=recipe.learning_rate,
                                  betas=(recipe.adam_beta1, recipe.adam_beta2), eps=recipe.adam_epsilon)  # fmt: skip
    global_batch = plan["global_batch_size"]
    per_replica = global_batch // grid.replicas
    rows = data.train
    steps_per_epoch = len(rows) // global_batch
    if steps_per_epoch == 0:
        raise UserError(f"{len(rows)} training rows can't fill one global batch of {global_batch}")
    total_steps = recipe.max_steps or math.ceil(recipe.num_epochs * steps_per_epoch)
    # a logging_steps below 1 is a fraction of the run, as transformers reads it
    logging_interval = (
        max(1, round(recipe.logging_steps * total_steps)) if recipe.logging_steps < 1 else int(recipe.logging_steps)
    )
    warmup = warmup_steps(recipe, run_steps(recipe, steps_per_epoch))  # Axolotl's rule, as the Trainer's runs
    warmup = warmup if isinstance(warmup, int) else math.ceil(warmup * total_steps)
    scheduler = make_scheduler(recipe, optimizer, warmup, total_steps)
    # Stages exchange activations in buffers whose shapes are fixed at the first step: pad every row to sequence_len.
    collate = Collator(tokenizer.pad_token_id, recipe.sequence_len)
    history, tokens_seen, started, start = [], 0, time.time(), 0
    if resume is not None:
        start, history = checkpoints.load_stages(resume, grid, params, optimizer, scheduler)
        log(f"resuming from {resume} at step {start}")
    interval = stage_files.save_interval(recipe, steps_per_epoch, total_steps)
    kill_in = int(os.environ.get("LLMTUNE_TEST_KILL_MID_STEP", 0))  # tests: SIGKILL one rank inside step k
    step_sleep = float(os.environ.get("LLMTUNE_TEST_STEP_SLEEP", 0))  # tests: slow steps, to signal a run mid-way
    stage_module.train()
    for step in range(start, total_steps):
        epoch, index = divmod(step, steps_per_epoch)
        order = step_order(len(rows), recipe.seed, epoch)
        batch_rows = [rows[i] for i in order[index * global_batch : (index + 1) * global_batch]]
        every = collate(batch_rows)
        total_tokens_box[0] = float((every["labels"][:, 1:] != IGNORE).sum())
        tokens_seen += int(every[REAL_TOKENS])
        mine = collate(batch_rows[grid.replica * per_replica : (grid.replica + 1) * per_replica])
        positions = mine.get("position_ids")
        if positions is None:
            positions = torch.arange(mine["input_ids"].shape[1]).expand_as(mine["input_ids"]).contiguous()
        losses: list = []
        if grid.first:
            schedule.step(
                mine["input_ids"].to(device), positions.to(device), target=mine["labels"].to(device), losses=losses
            )
        else:
            schedule.step(target=mine["labels"].to(device), losses=losses)
        if kill_in == step + 1:  # forward and backward done, the update not: the worst moment to lose a rank
            from llmtune.train.runtime.hooks import test_kill as _test_kill

            _test_kill("LLMTUNE_TEST_KILL_MID_STEP", step + 1)
        for p in trainable:
            if p.grad is not None and grid.replicas > 1:
                collectives.all_reduce(p.grad, group=grid.dp_group)
        if grid.tie_group is not None:
            shared = parts.embed.weight if grid.first else parts.head.weight
            if shared.grad is not None:
                collectives.all_reduce(shared.grad, group=grid.tie_group)
        norm = clip_global_norm(trainable, recipe.max_grad_norm, grid, skip=shared_copy)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        # only last stages contribute the loss: the sum over replicas is the global mean. The same all-reduce
        # carries a stop request (SIGUSR1 to the launcher), so every rank stops after the same step.
        asked = stop_requested(plan["config_dir"])
        step_loss, stop_votes = collectives.sum_values(
            [float(sum(part.item() for part in losses)) if grid.last else 0.0, float(asked)]
        )
        entry = {"loss": step_loss, "grad_norm": norm, "learning_rate": scheduler.get_last_lr()[0],
                 "epoch": (step + 1) / steps_per_epoch, "step": step + 1}  # fmt: skip
        history.append(entry)
        time.sleep(step_sleep)
        if (step + 1) % logging_interval == 0 or step == 0:
            elapsed, done = time.time() - started, step + 1 - start
            log(step_line(step + 1, total_steps, entry["loss"], entry["learning_rate"], norm,
                          tokens_seen / elapsed if elapsed else None,
                          elapsed / done * (total_steps - step - 1)).removeprefix("[llmtune] "))  # fmt: skip
        stop = stop_votes > 0 and step + 1 < total_steps
        if (interval and (step + 1) % interval == 0 or stop) and step + 1 < total_steps:
            done = step + 1
            checkpoints.save(done, lambda staged, done=done: stage_files.write(staged, done, grid, params, optimizer,
                                                                               scheduler),
                             lambda done=done: {"step": done, "stages": grid.stages, "history": history})  # fmt: skip
        if stop:
            return {"stopped_at": step + 1}
    seconds = time.time() - started
    return {
        "grid": grid, "params": params, "history": history, "steps": total_steps, "seconds": seconds,
        "tokens_seen": tokens_seen, "rows_seen": total_steps * global_batch,
        "rows_seen_this_run": (total_steps - start) * global_batch, "stage_module": stage_module,
        "resumed_from": resume, "steps_run": total_steps - start, "schedule": type(schedule).__name__,
        "stage_indices": held, "layer_indices": sorted(j for i in held for j in ranges[i]),
        "layers": [r.start for r in ranges] + [layers],
    }  # fmt: skip


def gather_state_dict(result: dict) -> dict | None:
    """Replica 0's stages send their parameters (HF names) to rank 0."""
    grid = result["grid"]
    mine = {n: p.detach().cpu().clone() for n, p in result["params"].items()} if grid.replica == 0 else {}
    pieces = collectives.gather_objects(mine, dst=0)
    if pieces is None:
        return None
    merged: dict = {}
    for piece in pieces:
        merged.update(piece)
    return merged

"""Where GRPO's generations run (rl: grpo | gdpo), and what that takes: torch-free, for the plan and the estimate.

- in-process: transformers' generate in the training processes (the CPU rehearsal, small runs). The generation
  batch's KV cache sits beside the training states while it generates: 2 (keys, values) x layers x KV heads x
  head size x (prompt + completion tokens) x the sequences generated at once, in the compute precision.
- colocate: TRL starts vLLM inside each training process, on the same GPU, with a share of its memory
  (vllm_gpu_memory_utilization). Unless the recipe sets it, llmtune takes what the training estimate leaves free,
  less a margin, so the two fit together.
- server: `llmtune vllm-serve RECIPE` starts TRL's vLLM server on GPUs of its own (the recipe's vllm: section);
  `llmtune train` waits up to vllm_server_timeout for it.
"""

from __future__ import annotations

import os
import shlex

from llmtune.recipe.online import generation_mode, trl_value

GB = 2**30
VLLM_MARGIN = 0.10  # of the GPU, between the training estimate and vLLM's share (fragmentation, CUDA graphs)


def generation_sequences(recipe, data_parallel: int) -> int:
    """Sequences one rank generates at once: its share of TRL's generation batch (per-device micro-batch x steps
    per generation, which defaults to the gradient accumulation)."""
    per_device = trl_value(recipe, "generation_batch_size")
    if per_device:
        return max(1, int(per_device) // max(1, data_parallel))
    steps = trl_value(recipe, "steps_per_generation") or recipe.gradient_accumulation_steps
    return recipe.micro_batch_size * int(steps)


def check_batches(recipe, data_parallel: int) -> None:
    """TRL's GRPOConfig refuses these at launch, after the model loaded: a generation batch (micro-batch x ranks x
    steps per generation, or trl.generation_batch_size) that isn't whole groups of num_generations completions of
    one prompt, and an eval batch over the ranks that isn't either."""
    from llmtune.errors import UserError

    generations = int(trl_value(recipe, "num_generations", 8))
    size, steps = trl_value(recipe, "generation_batch_size"), trl_value(recipe, "steps_per_generation")
    across = recipe.micro_batch_size * data_parallel
    ranks = f"{data_parallel} rank{'s' if data_parallel > 1 else ''}"
    if size and steps:
        raise UserError("trl.generation_batch_size and trl.steps_per_generation both set the generation batch",
                        "set one of them")  # fmt: skip
    if size and int(size) % across:
        raise UserError(f"trl.generation_batch_size {size} is not a multiple of micro_batch_size "
                        f"{recipe.micro_batch_size} x {ranks} ({across})", f"use a multiple of {across}")  # fmt: skip
    if size:
        made, hint = "trl.generation_batch_size", f"make trl.generation_batch_size a multiple of {generations}"
    else:
        steps = int(steps or recipe.gradient_accumulation_steps)
        size = across * steps
        made = f"micro_batch_size {recipe.micro_batch_size} x {ranks} x {steps} step(s) per generation"
        hint = f"e.g. micro_batch_size {_multiple(generations, data_parallel * steps)}"
    if int(size) % generations:
        raise UserError(f"GRPO's generation batch ({made} = {size} completions) is not whole groups of "
                        f"trl.num_generations {generations}: each prompt's completions must come in one batch",
                        f"{hint}, or a num_generations that divides {size}")  # fmt: skip
    has_eval = bool(recipe.val_set_size or recipe.test_datasets) and recipe.eval_strategy != "no"
    eval_generations = int(trl_value(recipe, "num_generations_eval") or generations)
    eval_batch = (recipe.eval_batch_size or recipe.micro_batch_size) * data_parallel
    if has_eval and eval_batch % eval_generations:
        raise UserError(f"GRPO's eval batch (eval_batch_size x {ranks} = {eval_batch}) is not a multiple of the "
                        f"{eval_generations} completions generated per eval prompt",
                        f"set eval_batch_size so that it x {data_parallel} is a multiple of {eval_generations}, or "
                        "trl.num_generations_eval")  # fmt: skip


def _multiple(generations: int, factor: int) -> int:
    """The smallest micro-batch m with m x factor a multiple of generations."""
    from math import gcd

    return generations // gcd(generations, factor)


def kv_cache_bytes(recipe, facts, data_parallel: int, mixed: bool) -> float:
    """The in-process generation batch's KV cache on one rank (at its longest: prompt + the whole completion)."""
    tokens = recipe.sequence_len  # prompts are cut to sequence_len minus the completion budget
    per_token = 2 * facts.num_layers * facts.num_kv_heads * facts.head_dim * (2 if mixed else 4)
    return float(per_token * tokens * generation_sequences(recipe, data_parallel))


def colocate_share(recipe, training_bytes: float, gpu_bytes: float) -> float:
    """vLLM's share of each GPU when colocated: the recipe's, else what training leaves free less a margin."""
    given = trl_value(recipe, "vllm_gpu_memory_utilization") or (recipe.vllm.gpu_memory_utilization if recipe.vllm
                                                                  else None)  # fmt: skip
    if given:
        return float(given)
    return round(max(0.05, min(0.9, 1 - training_bytes / gpu_bytes - VLLM_MARGIN)), 2)


def serve_command(recipe, recipe_path: str) -> list[str]:
    """TRL's vLLM server for the recipe (what `llmtune vllm-serve` runs)."""
    vllm = recipe.vllm
    command = ["trl", "vllm-serve", "--model", recipe.base_model]
    if vllm is not None:
        command += ["--tensor-parallel-size", str(vllm.tensor_parallel_size), "--data-parallel-size",
                    str(vllm.data_parallel_size), "--host", vllm.host, "--port", str(vllm.port), "--dtype", vllm.dtype]  # fmt: skip
        if vllm.gpu_memory_utilization:
            command += ["--gpu-memory-utilization", str(vllm.gpu_memory_utilization)]
        if vllm.max_model_len:
            command += ["--max-model-len", str(vllm.max_model_len)]
        if vllm.enable_prefix_caching is not None:
            command += ["--enable-prefix-caching", str(vllm.enable_prefix_caching)]
    if recipe.trust_remote_code:
        command += ["--trust-remote-code", "True"]
    return command


def describe(recipe, recipe_path: str, training_bytes: float | None, gpu_bytes: float, rehearsal: bool,
             facts=None, data_parallel: int = 1, mixed: bool = True) -> list[str]:  # fmt: skip
    """The plan's lines about generation."""
    generations = trl_value(recipe, "num_generations", 8)
    tokens = trl_value(recipe, "max_completion_length", 512)
    head = f"{generations} completions per prompt, up to {tokens} tokens"
    mode = generation_mode(recipe)
    if rehearsal and mode != "in-process":
        return [f"in the training processes (transformers' generate; vLLM {mode} needs GPUs, so the CPU rehearsal "
                f"generates in-process): {head}"]  # fmt: skip
    if mode == "in-process":
        kv = (
            f"; KV cache about {kv_cache_bytes(recipe, facts, data_parallel, mixed) / GB:.2f} GB per rank"
            if facts
            else ""
        )
        return [f"in the training processes (transformers' generate): {head}, "
                f"{generation_sequences(recipe, data_parallel)} sequences at once per rank{kv}"]  # fmt: skip
    if mode == "colocate":
        share = colocate_share(recipe, training_bytes or 0.0, gpu_bytes)
        return [f"vLLM colocated in each training process: {head}; vLLM takes {share:.0%} of each GPU "
                f"(vllm_gpu_memory_utilization), training the rest"]  # fmt: skip
    host = trl_value(recipe, "vllm_server_host") or (recipe.vllm.host if recipe.vllm else "0.0.0.0")
    port = trl_value(recipe, "vllm_server_port") or (recipe.vllm.port if recipe.vllm else 8000)
    timeout = trl_value(recipe, "vllm_server_timeout", 240)
    gpus = recipe.vllm.tensor_parallel_size * recipe.vllm.data_parallel_size if recipe.vllm else 1
    return [f"a vLLM server at {host}:{port} on {gpus} GPU(s) of its own: {head}; llmtune train waits up to "
            f"{timeout:.0f} s for it",
            f"start it first, on GPUs the training doesn't use: CUDA_VISIBLE_DEVICES=<{gpus} free GPU(s)> llmtune "
            f"vllm-serve {shlex.quote(recipe_path)}   ({shlex.join(serve_command(recipe, recipe_path))})",
            f"on Slurm, `llmtune slurm {shlex.quote(recipe_path)}` places both: the server on the first {gpus} GPU(s) "
            "of one node (the trainers on the rest), or on a node of its own with --nodes 2 or more"]  # fmt: skip


def server_address(recipe) -> tuple[str, int]:
    """Where the trainers reach the vLLM server: `llmtune slurm`'s node for it, else the recipe's host (0.0.0.0,
    where it listens, asked on this machine), and its port."""
    # `llmtune slurm` puts the server on a node of its own and tells the trainers where
    host = os.environ.get("LLMTUNE_VLLM_SERVER_HOST") or trl_value(recipe, "vllm_server_host") or "127.0.0.1"
    host = "127.0.0.1" if host == "0.0.0.0" else host  # the server listens everywhere; the client asks this machine
    port = int(trl_value(recipe, "vllm_server_port") or (recipe.vllm.port if recipe.vllm else 8000))
    return host, port

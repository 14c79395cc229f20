"""Commands for after training: eval, merge, infer, chat, report. Each takes a run's output_dir (or a model)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from llmtune.cli.options import BatchSize, MaxNewTokens, ModelArg, Raw, RunArg, Seed, Temperature, TopP
from llmtune.errors import UserError


def eval_command(
    target: Annotated[
        Path,
        typer.Argument(
            help="A run's output_dir, one of its checkpoint-N folders, a merged "
            "folder, or a recipe (its base model, or --model)."
        ),
    ],
    data: Annotated[Optional[Path], typer.Option("--data", help="Eval file in the recipe's dataset format.")] = None,
    batch_size: BatchSize = 8,
    max_new_tokens: Annotated[Optional[int], typer.Option("--max-new-tokens", min=1)] = None,
    limit: Annotated[Optional[int], typer.Option("--limit", min=1, help="Only the first N examples.")] = None,
    show: Annotated[int, typer.Option("--show", min=0, help="Print N generations.")] = 0,
    model: Annotated[
        Optional[str],
        typer.Option(
            "--model",
            help="With a recipe: measure this model folder, adapter "
            "folder (on the recipe's base) or hub id on the recipe's eval data.",
        ),
    ] = None,
) -> None:
    """Eval loss, perplexity and exact-match accuracy (a preference run: rewards, margins, accuracy); writes eval.json
    (with --data, eval-<data>.json beside it; a run measured with another recipe's --model, eval-<recipe>.json)."""
    from llmtune.post.evaluate import evaluate

    if data is not None and not data.exists():
        raise UserError(f"--data {data} does not exist")
    results = evaluate(target, data, batch_size, max_new_tokens, limit, show, model)
    if results.get("note"):
        typer.echo(f"note: {results['note']}", err=True)
    if "method" in results and "reward" in results:  # online RL: the reward of one completion per eval prompt
        shown = [f"{name.split('/')[1] if '/' in name else 'mean reward'} {value:.4f}" for name, value in
                 results.items() if (name == "reward" or name.startswith("rewards/")) and value is not None]  # fmt: skip
        typer.echo(f"{results['target']} ({results['method']}, {results['examples']} prompts, one greedy completion "
                   "each): " + ", ".join(shown))  # fmt: skip
        typer.echo(f"wrote {results['written_to']}")
        return
    if "method" in results:  # a preference run: its rewards over the eval pairs
        shown = [f"{name.split('/')[-1]} {results[name]:.4f}" for name in ("rewards/margins", "rewards/accuracies",
                 "rewards/chosen", "rewards/rejected") if results.get(name) is not None]  # fmt: skip
        typer.echo(f"{results['target']} ({results['method']}, {results['examples']} rows): " + ", ".join(shown))
        typer.echo(f"wrote {results['written_to']}")
        return
    line = (f"{results['target']}: eval loss {results['eval_loss']:.4f} (per token, {results['eval_tokens']} tokens of "
            f"{results['examples']} rows), perplexity {results['perplexity']:.2f}")  # fmt: skip
    if "exact_match" in results:
        line += f", exact match {results['exact_match']:.1%} ({results['exact_match_examples']} examples)"
    typer.echo(line)
    typer.echo(f"wrote {results['written_to']}")


def merge(
    run: RunArg,
    output: Annotated[
        Optional[Path],
        typer.Option("--output", "-o", help="Where to write (default RUN/merged, RUN/merged-checkpoint-N)."),
    ] = None,
    max_shard_size: Annotated[str, typer.Option("--max-shard-size", help="Largest safetensors shard.")] = "5GB",
    dtype: Annotated[Optional[str], typer.Option("--dtype", help="bf16, fp16 or fp32 (default: the recipe's).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing output folder.")] = False,
) -> None:
    """Fold a LoRA/QLoRA adapter into its base (or consolidate a full fine-tune) into one HF model folder.

    RUN is a run's output_dir (its final save, else its newest complete checkpoint) or one of its checkpoint-N
    folders (that checkpoint's weights)."""
    from llmtune.post.merge import merge_run
    from llmtune.train.runtime.progress import track

    if not run.is_dir():
        raise UserError(f"{run} is not a folder", "pass a run's output_dir")
    result = merge_run(run, output, max_shard_size, dtype, force, track)
    typer.echo(f"merged {result.source}")
    typer.echo(f"wrote {result.output}: {len(result.shards)} shard(s), {result.total_bytes / 1e6:.1f} MB {result.dtype}"
               + (f", {result.merged_modules} LoRA modules folded in" if result.merged_modules else ""))  # fmt: skip


def infer(
    target: ModelArg,
    prompt: Annotated[Optional[list[str]], typer.Option("--prompt", "-p", help="A prompt (repeatable).")] = None,
    file: Annotated[
        Optional[Path], typer.Option("--file", help="prompts.jsonl (prompt/messages/instruction) or .txt")
    ] = None,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Write rows + outputs as JSONL.")] = None,
    batch_size: BatchSize = 8,
    max_new_tokens: MaxNewTokens = 128,
    temperature: Temperature = 0.0,
    top_p: TopP = 1.0,
    seed: Seed = 0,
    raw: Raw = False,
) -> None:
    """Batched generation for prompts given on the command line or in a file."""
    import json

    from llmtune.post.generate import Sampling
    from llmtune.post.generate import infer as run_infer
    from llmtune.train.runtime.progress import track

    if prompt and file:
        raise UserError("--prompt and --file both given", "use one of them")
    if output is not None:  # before the model loads, not after it has generated
        from llmtune.plan.files import check_writable

        check_writable(output)
    sampling = Sampling(max_new_tokens, temperature, top_p, seed=seed)
    results = run_infer(target, prompt or [], file, output, sampling, batch_size, raw, track)
    if output is None:
        for row in results:
            typer.echo(json.dumps(row, ensure_ascii=False))
    else:
        typer.echo(f"wrote {len(results)} outputs to {output}")


def chat(
    target: ModelArg,
    system: Annotated[Optional[str], typer.Option("--system", help="A system message.")] = None,
    max_new_tokens: MaxNewTokens = 256,
    temperature: Temperature = 0.0,
    top_p: TopP = 1.0,
    seed: Seed = 0,
    raw: Raw = False,
) -> None:
    """Talk to a model in the terminal, streamed, with its chat template or the prompt its run trained on (/reset,
    /exit)."""
    from llmtune.post.generate import Sampling
    from llmtune.post.generate import chat as run_chat

    run_chat(target, Sampling(max_new_tokens, temperature, top_p, seed=seed), system, raw)


def report(run: RunArg) -> None:
    """Rebuild RUN/report/: loss curve, throughput, summary."""
    from llmtune.post.report import write_report

    folder = write_report(run)
    typer.echo(f"wrote {folder}: loss.png, throughput.png, summary.md, curves.json")

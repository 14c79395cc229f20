"""Pipeline plan: the stages, their micro-batches, which layers each stage holds, and the bubble."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from llmtune.errors import UserError

if TYPE_CHECKING:
    from llmtune.plan.memory.facts import ModelFacts
    from llmtune.recipe import Recipe


@dataclass
class PipelinePlan:
    stages: int
    microbatches: int
    schedule: str
    virtual_stages: int
    bubble: float
    layers_per_stage: list[list[int]] | None  # [first, last) per stage, when the config is known
    params_per_stage: list[int] | None


def bubble_fraction(stages: int, microbatches: int) -> float:
    """Idle fraction of a GPipe/1F1B step: (p - 1) / (m + p - 1)."""
    return (stages - 1) / (microbatches + stages - 1)


def split_layers(layer_params: list[int], first_extra: int, last_extra: int, stages: int) -> list[range]:
    """Contiguous layer ranges per stage that minimise the largest stage's parameter count.

    The first stage also holds the embeddings (first_extra), the last the norm and head (last_extra).
    Each stage gets at least one layer.
    """
    n = len(layer_params)
    if stages > n:
        raise ValueError(f"{stages} stages but the model has only {n} layers")
    weights = list(layer_params)
    weights[0] += first_extra
    weights[-1] += last_extra
    # best[s][i]: the smallest possible max load splitting the first i layers into s stages.
    inf = float("inf")
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for s in range(1, stages + 1):
        for i in range(s, n + 1):
            for j in range(s - 1, i):
                load = max(best[s - 1][j], prefix[i] - prefix[j])
                if load < best[s][i]:
                    best[s][i], cut[s][i] = load, j
    bounds, i = [], n
    for s in range(stages, 0, -1):
        bounds.append(range(cut[s][i], i))
        i = cut[s][i]
    return bounds[::-1]


def pipeline_plan(recipe: Recipe, world: int, facts: ModelFacts | None) -> PipelinePlan:
    stages = recipe.pipeline_parallel_size
    virtual = recipe.pipeline_virtual_stages if recipe.pipeline_schedule == "interleaved_1f1b" else 1
    if facts and facts.num_layers < stages * virtual:  # the model first: the world-size hint would name this count
        raise UserError(f"pipeline_parallel_size {stages} x {virtual} virtual stages needs at least {stages * virtual} "
                        f"layers, but the model has {facts.num_layers}", "use fewer stages")  # fmt: skip
    if world % stages:
        raise UserError(
            f"world size {world} is not divisible by pipeline_parallel_size {stages} "
            f"(world = stages x data-parallel replicas; {world} / {stages} = {world / stages:.2f})",
            f"use --num-processes {stages * max(1, world // stages) or stages}",
        )
    accumulation = recipe.gradient_accumulation_steps
    if recipe.pipeline_microbatches and accumulation > 1 and recipe.pipeline_microbatches != accumulation:
        raise UserError(
            f"pipeline_microbatches ({recipe.pipeline_microbatches}) and gradient_accumulation_steps "
            f"({accumulation}) disagree",
            "in a pipeline the micro-batches of one step are the accumulation steps: set only pipeline_microbatches",
        )
    microbatches = recipe.pipeline_microbatches or max(accumulation, stages)
    if microbatches < stages:
        raise UserError(f"pipeline_microbatches ({microbatches}) is fewer than pipeline_parallel_size ({stages})")
    layers = params = None
    if facts:
        try:
            ranges = split_layers(
                [facts.layer_params()] * facts.num_layers,
                facts.embedding_params(),
                facts.hidden_size + (0 if facts.tie_word_embeddings else facts.embedding_params()),
                stages * virtual,
            )
        except ValueError:
            raise UserError(
                f"pipeline_parallel_size {stages} x {virtual} virtual stages needs at least {stages * virtual} "
                f"layers, but the model has {facts.num_layers}",
                "use fewer stages",
            ) from None
        layers = [[r.start, r.stop] for r in ranges]
        params = [len(r) * facts.layer_params() for r in ranges]
        params[0] += facts.embedding_params()
        params[-1] += facts.hidden_size + (0 if facts.tie_word_embeddings else facts.embedding_params())
    return PipelinePlan(
        stages, microbatches, recipe.pipeline_schedule, virtual, bubble_fraction(stages, microbatches), layers, params
    )

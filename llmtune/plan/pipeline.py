"""Pipeline arithmetic: which layers each stage holds, and the bubble."""

from __future__ import annotations


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

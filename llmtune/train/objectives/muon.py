"""optimizer: muon, as Axolotl groups it: Muon for the weight matrices of the layers, AdamW (the recipe's betas and
epsilon, the same learning rate) for embeddings, the output head, a peft modules_to_save copy and every parameter
with fewer than 2 dimensions. Norms and biases get no weight decay (the Trainer's decay rule).

Muon step of a matrix W (fan_out x fan_in) with gradient G: momentum M = mu M + G; the update U = G + mu M
(nesterov) or M; O = the orthogonal factor of U by 5 quintic Newton-Schulz iterations; W -= lr wd W; then
W -= lr sqrt(fan_out / fan_in) O (the "spectral_norm" scaling of Axolotl's Muon, which keeps the update's spectral
norm that of a unit-RMS step).

Under FSDP2 a matrix is a DTensor sharded by rows; the orthogonal factor needs the whole matrix, so each rank gathers
the momentum-applied update, orthogonalizes it and keeps its own rows (the same result as one process, at the cost
of every rank computing every matrix's factor).
"""

from __future__ import annotations

import math

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5


def orthogonalize(update: torch.Tensor, steps: int = NS_STEPS, eps: float = 1e-7) -> torch.Tensor:
    """The nearest semi-orthogonal matrix to `update` (approximately: U V^T of its SVD), by quintic Newton-Schulz."""
    a, b, c = NS_COEFFICIENTS
    x = update.float()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (x.norm() + eps)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.T if tall else x).to(update.dtype)


def _full(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def shard_like(full: torch.Tensor, param):
    """`full` laid out as `param` is: itself, or this rank's shard of it (a DTensor's placements)."""
    if not hasattr(param, "device_mesh"):
        return full
    from torch.distributed.tensor import DTensor, Replicate

    replicated = DTensor.from_local(full, param.device_mesh, [Replicate()] * param.device_mesh.ndim, run_check=False)
    return replicated.redistribute(param.device_mesh, param.placements)


class Muon(torch.optim.Optimizer):
    """Groups carry "algorithm": "muon" (lr, weight_decay, momentum, nesterov) or "adamw" (lr, betas, eps,
    weight_decay)."""

    def __init__(self, groups: list[dict], lr: float, momentum: float = 0.95, nesterov: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> None:  # fmt: skip
        defaults = {"lr": lr, "momentum": momentum, "nesterov": nesterov, "betas": betas, "eps": eps,
                    "weight_decay": 0.0, "algorithm": "adamw"}  # fmt: skip
        super().__init__(groups, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if group["algorithm"] == "muon":
                    self._muon(param, group)
                else:
                    self._adamw(param, group)
        return loss

    def _muon(self, param, group) -> None:
        state = self.state[param]
        if "momentum" not in state:
            state["momentum"] = torch.zeros_like(param)
        momentum = state["momentum"]
        momentum.mul_(group["momentum"]).add_(param.grad)
        update = param.grad.add(momentum, alpha=group["momentum"]) if group["nesterov"] else momentum
        fan_out, fan_in = param.shape[0], math.prod(param.shape[1:])
        full = _full(update)
        orthogonal = orthogonalize(full.reshape(fan_out, fan_in)).reshape(full.shape)
        param.mul_(1 - group["lr"] * group["weight_decay"])
        param.add_(shard_like(orthogonal, param), alpha=-group["lr"] * math.sqrt(fan_out / fan_in))

    def _adamw(self, param, group) -> None:
        state = self.state[param]
        if "step" not in state:
            state.update(step=0, exp_avg=torch.zeros_like(param), exp_avg_sq=torch.zeros_like(param))
        state["step"] += 1
        beta1, beta2 = group["betas"]
        grad, step = param.grad, state["step"]
        state["exp_avg"].lerp_(grad, 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denominator = (state["exp_avg_sq"] / (1 - beta2**step)).sqrt_().add_(group["eps"])
        param.mul_(1 - group["lr"] * group["weight_decay"])
        param.addcdiv_(state["exp_avg"], denominator, value=-group["lr"] / (1 - beta1**step))


def _embeddings_and_heads(model) -> set[int]:
    """ids of the parameters of the input embeddings, the output head (a reward model's score/classifier included)
    and every nn.Embedding, whatever the architecture names them."""
    modules = [getattr(model, getter)() for getter in ("get_input_embeddings", "get_output_embeddings")
               if hasattr(model, getter)]  # fmt: skip
    modules += [m for name, m in model.named_modules()
                if isinstance(m, torch.nn.Embedding) or name.split(".")[-1] in ("score", "classifier")]  # fmt: skip
    return {id(p) for module in modules if module is not None for p in module.parameters()}


def muon_groups(model, decay_names: set[str], weight_decay: float) -> list[dict]:
    """Axolotl's grouping (see the module's docstring)."""
    groups: dict[tuple[str, bool], list] = {}
    special = _embeddings_and_heads(model)
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        head = id(param) in special or name.endswith("modules_to_save.default.weight") or "lm_head" in name
        algorithm = "adamw" if head or param.ndim < 2 else "muon"
        groups.setdefault((algorithm, name in decay_names and not head), []).append(param)
    return [{"params": params, "algorithm": algorithm, "weight_decay": weight_decay if decays else 0.0}
            for (algorithm, decays), params in groups.items()]  # fmt: skip


def make_muon(model, trainer_args, decay_names: set[str]) -> Muon:
    return Muon(muon_groups(model, decay_names, trainer_args.weight_decay), lr=trainer_args.learning_rate,
                betas=(trainer_args.adam_beta1, trainer_args.adam_beta2), eps=trainer_args.adam_epsilon)  # fmt: skip

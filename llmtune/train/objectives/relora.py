"""ReLoRA (relora: true): the LoRA is merged into the base weights and restarted every jagged_restart_steps steps.

At a restart (the start of optimizer step N, N a multiple of the cycle, where Axolotl's ReLoRACallback does it):
1. each LoRA layer's delta (peft's get_delta_weight: scaling x B A) is added to its base weight: the model computes
   the same function as before;
2. the adapter is drawn afresh (peft's reset_lora_parameters: A Kaiming-uniform, B zero) from the torch generator
   seeded by the recipe's seed and the step, inside fork_rng: every DDP rank draws the same A, a resumed run draws
   what the first one did, and the training's own random stream (dropout, data) is left as it was;
3. the optimizer's state of the LoRA parameters is pruned: relora_prune_ratio of every state tensor the shape of
   its parameter is zeroed, the smallest values (magnitude) or a seeded random subset (random, reset).
The learning rate around the restarts is schedule.py's jagged multiplier.

On a 4-bit base (adapter: qlora), step 1 requantizes: the layer's 4-bit weight becomes quantize(dequantize(the
weight as loaded) + every cycle's delta so far). The loaded 4-bit weight is kept on the CPU for this, so the rounding
of one restart never carries into the next (requantizing the requantized weight would compound it). An 8-bit
optimizer's state (bitsandbytes' blockwise state1/state2) is pruned dequantized and quantized back.

A checkpoint holds only the adapter of the current cycle. So each restart's merged A and B go to
<output_dir>/relora/restart-<step>.safetensors as they merge (one adapter's size each): a resumed run replays them
onto the base weights, and the final adapter is assembled from them. B1 A1 + B2 A2 = [B1 B2] [A1; A2], so every
cycle's LoRA stacked into one adapter of rank lora_r x cycles (lora_alpha scaled to keep the scaling) is exactly
the trained model on the original base weights: what `llmtune merge`, chat and eval load, with no extra format.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import TrainerCallback

from llmtune.errors import UserError


def is_4bit(layer) -> bool:
    """A LoRA layer over a bitsandbytes 4-bit linear layer (qlora)."""
    return type(layer.get_base_layer().weight).__name__ == "Params4bit"


def lora_layers(model) -> dict[str, object]:
    """The model's LoRA layers by module name; refuses layers a restart can't merge (and tied base weights)."""
    from peft.tuners.lora import Embedding, Linear, LoraLayer

    layers = {name: module for name, module in model.named_modules() if isinstance(module, LoraLayer)}
    uses = Counter(id(param) for _, param in model.named_parameters(remove_duplicate=False))
    for name, layer in layers.items():
        if not isinstance(layer, (Linear, Embedding)) and not is_4bit(layer):
            raise UserError(f"relora: {name} is a {type(layer).__name__} LoRA layer; a restart merges LoRA on linear "
                            "and embedding layers only", "leave that module out of lora_target_modules")  # fmt: skip
        if uses[id(layer.get_base_layer().weight)] > 1:
            raise UserError(f"relora: {name}'s weight is tied to another module, which merging its LoRA would change "
                            "too", "leave that module out of lora_target_modules")  # fmt: skip
    if not layers:
        raise UserError("relora: the model has no LoRA layers to merge", "set adapter: lora with target modules")
    return layers


def factors(layer, adapter: str) -> tuple[torch.nn.Parameter, torch.nn.Parameter]:
    """A (r x in) and B (out x r) of one LoRA layer; an embedding's are oriented alike."""
    if adapter in layer.lora_A:
        return layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
    return layer.lora_embedding_A[adapter], layer.lora_embedding_B[adapter]


@torch.no_grad()
def magnitude_prune_(tensor: torch.Tensor, ratio: float) -> None:
    """Zero the `ratio` fraction of `tensor`'s values smallest in magnitude (ties at the threshold too), in place."""
    count = round(ratio * tensor.numel())
    if count == 0:
        return
    size = tensor.abs().float()
    threshold = size.flatten().kthvalue(count).values  # kthvalue: no size limit, unlike torch.quantile
    tensor.mul_((size > threshold).to(tensor.dtype))


@torch.no_grad()
def random_prune_(tensor: torch.Tensor, ratio: float, generator: torch.Generator) -> None:
    """Zero a random `ratio` fraction of `tensor`'s values (drawn from `generator`), in place."""
    keep = torch.rand(tensor.shape, generator=generator, device=tensor.device) >= ratio
    tensor.mul_(keep.to(tensor.dtype))


def quantized_states(state: dict, param) -> list[tuple[str, str, str]]:
    """bitsandbytes' 8-bit optimizer state of one parameter: (values, absmax, code map) keys of each moment held as
    blockwise uint8 (a parameter under its min_8bit_size keeps 32-bit state, pruned as any other)."""
    found = []
    for n in (1, 2):
        values = state.get(f"state{n}")
        if (torch.is_tensor(values) and values.dtype == torch.uint8 and values.shape == param.shape
                and torch.is_tensor(state.get(f"absmax{n}")) and torch.is_tensor(state.get(f"qmap{n}"))):  # fmt: skip
            found.append((f"state{n}", f"absmax{n}", f"qmap{n}"))
    return found


@torch.no_grad()
def prune_quantized_(state: dict, keys: tuple[str, str, str], prune) -> None:
    """Dequantize one 8-bit moment, prune it (`prune(tensor)` in place), quantize it back into the same tensors."""
    from bitsandbytes.functional import dequantize_blockwise, quantize_blockwise

    name, absmax_key, code_key = keys
    values, absmax, code = state[name], state[absmax_key], state[code_key]
    blocksize = next(b for b in (256, 2048, 4096, 1024, 512, 128, 64, 32) if -(-values.numel() // b) == absmax.numel())
    full = dequantize_blockwise(values, absmax=absmax, code=code, blocksize=blocksize).float()
    prune(full)
    again, quant_state = quantize_blockwise(full, code=code, blocksize=blocksize)
    zero = torch.nonzero(code == 0).flatten()
    if zero.numel():  # the quantizer's search lands a zero on a neighbouring code (2e-5 x absmax): pruned is zero
        again[full == 0] = zero[0].to(again.dtype)
    values.copy_(again)
    absmax.copy_(quant_state.absmax)


def restart_file(folder: Path, step: int) -> Path:
    return folder / f"restart-{step:08d}.safetensors"


class ReLoRA(TrainerCallback):
    """Merges and restarts the LoRA every `cycle` optimizer steps; `restarts` records each (metrics.json)."""

    def __init__(self, model, recipe, output_dir: Path):
        self.model, self.layers = model, lora_layers(model)
        adapters = {name for layer in self.layers.values() for name in layer.active_adapters}
        if len(adapters) != 1:
            raise UserError(f"relora: the model has adapters {sorted(adapters)}; a restart merges exactly one")
        self.adapter = adapters.pop()
        self.cycle, self.seed = recipe.jagged_restart_steps, recipe.seed
        self.method = recipe.relora_prune_method
        self.ratio = recipe.relora_pruned_fraction
        self.folder = Path(output_dir) / "relora"
        self.restarts: list[dict] = []  # {step, delta_norm}: the Frobenius norm of all the layers' merged deltas
        # 4-bit layers: the weight as loaded (on the CPU) and every merged cycle's A and B, for the requantization
        self.loaded: dict[str, tuple[torch.Tensor, object]] = {}
        self.merged: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for name, layer in self.layers.items():
            if is_4bit(layer):
                import copy

                weight = layer.get_base_layer().weight
                state = copy.deepcopy(weight.quant_state)
                state.to("cpu")
                self.loaded[name], self.merged[name] = (weight.data.detach().cpu().clone(), state), []

    # --- the restart ---

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        if state.global_step > 0 and state.global_step % self.cycle == 0:
            self.restart(state.global_step, optimizer, write=state.is_local_process_zero)

    @torch.no_grad()
    def restart(self, step: int, optimizer, write: bool = True) -> None:
        merged, squares = {}, []
        for name, layer in self.layers.items():
            a, b = factors(layer, self.adapter)
            merged[f"{name}.A"], merged[f"{name}.B"] = a.detach().cpu().clone(), b.detach().cpu().clone()
            squares.append(self._merge(name, layer))
        norm = math.sqrt(float(sum(squares)))
        with self._seeded(step):
            for layer in self.layers.values():
                layer.reset_lora_parameters(self.adapter, True)
        if optimizer is not None:
            self.prune(optimizer, step)
        if write:
            self._write(step, merged, norm)
        self.restarts.append({"step": step, "delta_norm": norm})

    def _merge(self, name: str, layer) -> torch.Tensor:
        """The layer's delta added to its base weight; returns the delta's squared norm."""
        delta = layer.get_delta_weight(self.adapter).float()
        if name in self.loaded:
            self._requantize(name, layer)
        else:
            weight = layer.get_base_layer().weight
            weight.copy_(weight.float().add_(delta))  # summed in fp32, rounded once to a bf16 base's dtype
        return delta.pow(2).sum().cpu()

    def _requantize(self, name: str, layer) -> None:
        """A 4-bit weight := quantize(dequantize(as loaded) + scaling x [B1 .. Bk] [A1; ..; Ak]), this cycle's last."""
        import copy

        from bitsandbytes.functional import dequantize_4bit, quantize_4bit

        weight = layer.get_base_layer().weight
        device = weight.device
        a, b = factors(layer, self.adapter)
        self.merged[name].append((a.detach().float().cpu().clone(), b.detach().float().cpu().clone()))
        stacked_a = torch.cat([f[0] for f in self.merged[name]], dim=0).to(device)
        stacked_b = torch.cat([f[1] for f in self.merged[name]], dim=1).to(device)
        data, state = self.loaded[name]
        state = copy.deepcopy(state)
        state.to(device)
        total = dequantize_4bit(data.to(device), state).float()
        total.add_(stacked_b @ stacked_a, alpha=float(layer.scaling[self.adapter]))
        packed, new_state = quantize_4bit(total.to(state.dtype), blocksize=state.blocksize,
                                          compress_statistics=bool(state.nested), quant_type=state.quant_type,
                                          quant_storage=weight.data.dtype)  # fmt: skip
        weight.data = packed
        weight.quant_state = new_state

    @contextmanager
    def _seeded(self, step: int):
        devices = sorted({p.device.index for p in self.model.parameters() if p.device.type == "cuda"})
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(self.seed * 1_000_003 + step)
            yield

    def prune(self, optimizer, step: int) -> None:
        """Prune the LoRA parameters' optimizer state (every tensor the shape of its parameter: Adam's moments,
        momentum buffers) as relora_prune_method says."""
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper holds the torch optimizer
        generators: dict[torch.device, torch.Generator] = {}

        def prune(value: torch.Tensor) -> None:
            if self.method == "magnitude":
                magnitude_prune_(value, self.ratio)
            else:
                if value.device not in generators:
                    generators[value.device] = torch.Generator(value.device).manual_seed(self.seed + step)
                random_prune_(value, self.ratio, generators[value.device])

        for layer in self.layers.values():
            for param in factors(layer, self.adapter):
                state = inner.state.get(param, {})
                pruned = 0
                for value in state.values():
                    if torch.is_tensor(value) and value.is_floating_point() and value.shape == param.shape:
                        prune(value)
                        pruned += 1
                for keys in quantized_states(state, param):
                    prune_quantized_(state, keys, prune)
                    pruned += 1
                if state and not pruned:  # a state layout not known here: never a restart that prunes nothing
                    raise UserError(f"relora: the optimizer's state ({', '.join(sorted(map(str, state)))}) has no "
                                    "tensor of its parameter's shape to prune", "use adamw_torch or "
                                    "adamw_bnb_8bit")  # fmt: skip

    def _write(self, step: int, merged: dict, norm: float) -> None:
        from safetensors.torch import save_file

        self.folder.mkdir(parents=True, exist_ok=True)
        target = restart_file(self.folder, step)
        partial = target.with_name(f"{target.name}.{os.getpid()}.partial")  # machines sharing the folder write alike
        save_file(merged, str(partial), metadata={"step": str(step), "delta_norm": repr(norm)})
        os.replace(partial, target)

    # --- resume: the restarts before the checkpoint, replayed onto the base weights ---

    def on_train_begin(self, args, state, control, **kwargs):
        if state.global_step > 0:
            self.replay(state.global_step)

    @torch.no_grad()
    def replay(self, resumed_at: int) -> None:
        """The restarts of steps before `resumed_at` merged again, from their files (the checkpoint of step N holds
        the adapter as it was before the restart at N, which happens again)."""
        current = {name: self._factors_copy(layer) for name, layer in self.layers.items()}
        for step in range(self.cycle, resumed_at, self.cycle):
            merged, norm = self.read(step)
            for name, layer in self.layers.items():
                self._set_factors(layer, merged[f"{name}.A"], merged[f"{name}.B"])
                self._merge(name, layer)
            self.restarts.append({"step": step, "delta_norm": norm})
        for name, layer in self.layers.items():
            self._set_factors(layer, *current[name])

    def _factors_copy(self, layer) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = factors(layer, self.adapter)
        return a.detach().clone(), b.detach().clone()

    def _set_factors(self, layer, a: torch.Tensor, b: torch.Tensor) -> None:
        live_a, live_b = factors(layer, self.adapter)
        live_a.copy_(a)
        live_b.copy_(b)

    def read(self, step: int) -> tuple[dict, float]:
        from safetensors import safe_open

        path = restart_file(self.folder, step)
        if not path.exists():
            raise UserError(f"relora: resuming after the restart at step {step}, but its merged adapter {path} is "
                            "missing; the checkpoint alone can't rebuild the base weights",
                            "resume from a checkpoint before that step, or train again in a fresh output_dir")  # fmt: skip
        with safe_open(str(path), framework="pt") as file:
            return {key: file.get_tensor(key) for key in file.keys()}, float(file.metadata()["delta_norm"])

    # --- the final adapter: every cycle stacked ---

    def cycles(self) -> int:
        return len(self.restarts) + 1

    def save_adapter(self, output_dir: Path) -> None:
        """Rewrite the adapter the Trainer saved (the last cycle's) as every cycle's LoRA stacked, on the original
        base weights. Run on the main process after trainer.save_model."""
        if not self.restarts:
            return
        from peft.utils import get_peft_model_state_dict
        from safetensors.torch import save_file

        state = get_peft_model_state_dict(self.model, adapter_name=self.adapter)
        key_of = {tensor.data_ptr(): key for key, tensor in state.items()}  # the state dict shares the parameters
        earlier = [self.read(entry["step"])[0] for entry in self.restarts]
        for name, layer in self.layers.items():
            a, b = factors(layer, self.adapter)
            if a.data_ptr() not in key_of or b.data_ptr() not in key_of:
                raise RuntimeError(f"relora: {name}'s LoRA factors are not in peft's adapter state dict")
            state[key_of[a.data_ptr()]] = torch.cat([m[f"{name}.A"] for m in earlier] + [a.detach().cpu()], dim=0)
            state[key_of[b.data_ptr()]] = torch.cat([m[f"{name}.B"] for m in earlier] + [b.detach().cpu()], dim=1)
        output_dir = Path(output_dir)
        weights = output_dir / "adapter_model.safetensors"
        partial = weights.with_name(weights.name + ".partial")
        save_file({key: value.detach().cpu().contiguous() for key, value in state.items()}, str(partial),
                  metadata={"format": "pt"})  # fmt: skip
        config_path = output_dir / "adapter_config.json"
        config = json.loads(config_path.read_text())
        if config.get("rank_pattern") or config.get("alpha_pattern"):
            raise RuntimeError("relora: per-module ranks or alphas can't be stacked")
        # the scaling (alpha / r, or alpha / sqrt(r) with rsLoRA) stays as trained at rank r x cycles
        grow = self.cycles()
        config["r"] = config["r"] * grow
        config["lora_alpha"] = config["lora_alpha"] * (math.sqrt(grow) if config.get("use_rslora") else grow)
        os.replace(partial, weights)
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    def report(self) -> dict:
        """metrics.json's relora entry."""
        rank = next(iter(self.layers.values())).r[self.adapter]
        return {"cycle": self.cycle, "prune": {"method": self.method, "ratio": self.ratio}, "restarts": self.restarts,
                "saved_rank": rank * self.cycles()}  # fmt: skip

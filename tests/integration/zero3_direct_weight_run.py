"""Under torchrun (CPU, gloo), for tests/integration/test_zero3_direct_weight.py: does ZeRO-3 gather a weight that a
forward reads directly, never calling its module (what Liger's fused linear cross-entropy does with lm_head.weight),
and does its gradient come out as when the module is called? Prints one JSON line on rank 0."""

from __future__ import annotations

import json


def main() -> None:
    import deepspeed
    import torch
    import torch.nn.functional as F
    from accelerate import PartialState
    from deepspeed.utils import safe_get_full_grad
    from transformers import LlamaConfig, LlamaForCausalLM

    from llmtune.train.rehearsal import configure

    configure("zero3")  # deepspeed.comm over gloo, formed as the CPU rehearsal forms it (no shared-memory op)
    state = PartialState()

    class Model(LlamaForCausalLM):
        direct = False
        seen: list[int]

        def forward(self, input_ids=None, labels=None, **kwargs):
            hidden = self.model(input_ids=input_ids).last_hidden_state
            if self.direct:  # Liger's way: the weight, not the module
                weight = self.lm_head.weight
                self.seen.append(weight.numel())
                logits = hidden @ weight.t()
            else:
                logits = self.lm_head(hidden)
            return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1))

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)  # fmt: skip
    zero = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": 2,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            "optimizer": {"type": "SGD", "params": {"lr": 0.5}}, "zero_allow_untested_optimizer": True}  # fmt: skip
    batches = torch.randint(0, 128, (3, 2, 32), generator=torch.Generator().manual_seed(1))
    report = {}
    for direct in (False, True):
        torch.manual_seed(0)
        model = Model(config)
        model.direct, model.seen = direct, []
        engine, *_ = deepspeed.initialize(model=model, config=zero, model_parameters=model.parameters())
        losses, norms = [], []
        for batch in batches:
            ids = batch[state.process_index : state.process_index + 1]
            loss = engine(input_ids=ids, labels=ids)
            engine.backward(loss)
            norms.append(float(safe_get_full_grad(engine.module.lm_head.weight).norm()))
            engine.step()
            losses.append(float(loss))
        held = engine.module.lm_head.weight.ds_tensor.numel()  # this rank's partition, outside any forward
        report["direct" if direct else "module"] = {"losses": losses, "lm_head_grad_norms": norms,
                                                    "seen_in_forward": model.seen[:1], "partition": held,
                                                    "full": 128 * 64}  # fmt: skip
        engine.destroy()
    if state.is_main_process:
        print(json.dumps(report), flush=True)
    # end the process group before exit: left to interpreter teardown, rank 0 once aborted there ("terminate called
    # without an active exception") after every assertion's data was printed
    state.wait_for_everyone()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

"""Evaluation as llmtune measures it: eval_loss over every label token of the eval set, on any world size, and every
eval row evaluated."""

from __future__ import annotations

from llmtune.train.data.collate import REAL_TOKENS, ROW_BYTES, ROW_LENGTHS, WHOLE_BATCH


class TokenEvaluation:
    """A mixin of LlmtuneTrainer (before the Trainer, and before TRL's trainers, in the method order)."""

    recipe = None

    def get_eval_dataloader(self, eval_dataset=None):
        """dataloader_drop_last drops training's last partial round of batches; the Trainer would drop eval's last
        batch too, leaving rows unevaluated."""
        drop, self.args.dataloader_drop_last = self.args.dataloader_drop_last, False
        try:
            return super().get_eval_dataloader(eval_dataset)
        finally:
            self.args.dataloader_drop_last = drop

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        if isinstance(inputs, dict):  # (online RL's inputs are the prompt rows, a list)
            for key in (REAL_TOKENS, ROW_BYTES, WHOLE_BATCH, ROW_LENGTHS):
                inputs.pop(key, None)  # (ROW_LENGTHS: the Trainer weighs each eval batch's loss by its batch size)
        if self.recipe is not None and self.recipe.reward_model:  # one margin per pair, not one score per sequence
            import torch

            from llmtune.train.data.reward import pair_margins

            labels = inputs["labels"]
            with torch.no_grad():
                loss, outputs = self.compute_loss(model, dict(inputs), return_outputs=True)
            if prediction_loss_only:
                return loss.detach(), None, None
            margins = pair_margins(outputs.logits.detach(), labels)
            return loss.detach(), margins, torch.ones_like(margins)
        labels = inputs.get("labels") if isinstance(inputs, dict) else None
        loss, logits, out_labels = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        if self._token_eval is not None and loss is not None and labels is not None:
            count = (labels[..., 1:] != -100).sum()  # the tokens the batch's mean loss is over (labels shift by one)
            weighted = loss.detach().double() * count
            self._token_eval[0] += weighted.where(count > 0, weighted.new_zeros(()))  # (a filler-only batch: 0/0)
            self._token_eval[1] += count
        return loss, logits, out_labels

    _token_eval = None  # (loss sum, tokens) of an evaluation in progress, on the rank's device

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix="eval"):  # fmt: skip
        """eval_loss as the mean over every label token of the eval set, summed over the ranks: what `llmtune eval`
        reports, the same on any world size (the Trainer's is a mean of batch means, and on several ranks counts the
        rows it repeats to even the ranks' batches; the worker pads the eval set with label-free rows instead)."""
        import torch

        from llmtune.train.runtime import collectives

        sft = self.recipe is None or not (
            self.recipe.rl or self.recipe.reward_model or self.recipe.process_reward_model
        )
        if sft:
            self._token_eval = [torch.zeros((), dtype=torch.float64, device=self.args.device),
                                torch.zeros((), dtype=torch.int64, device=self.args.device)]  # fmt: skip
        try:
            output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys,
                                             metric_key_prefix)  # fmt: skip
            if sft:
                total, tokens = collectives.sum_values([self._token_eval[0].item(), self._token_eval[1].item()])
                if tokens:
                    output.metrics[f"{metric_key_prefix}_loss"] = total / tokens
                    output.metrics[f"{metric_key_prefix}_tokens"] = int(tokens)
        finally:
            self._token_eval = None
        return output

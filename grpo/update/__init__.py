"""The update, one package around one value: a batch is planned into micro-batches whose `Rows`
(grpo/update/layouts.py) one forward runs (grpo/update/forward.py), for every layout, sequence
parallelism, VLMs, the old logprobs, the reference and grpo.verify.

    step.py     policy_update: passes, optimizer steps, micro-batches; score_tokens (no gradient)
    layouts.py  padded, packed and shared rows: the layout a model runs, the micro-batches, `Rows`
    support.py  what a model can run, probed once per model (packing, shared prompts, its own head)
    forward.py  `Rows` -> per-token logprobs and entropy; the LM head in pieces; attention kernels

Following one micro-batch: step -> layouts -> forward -> grpo/algorithm.py (the loss) -> the
strategy's backward (grpo/parallel/).
"""

from grpo.update.step import accumulate_gradients, loss_norm, policy_update, score_tokens

__all__ = ["accumulate_gradients", "loss_norm", "policy_update", "score_tokens"]

"""What a rank's cross-entropy holds at its peak, beside the activations: the loss workspace.

The loss (``F.cross_entropy(logits.float(), targets)``, as torchtitan and our examples
write it) upcasts the logits to fp32 and saves its fp32 log-softmax for backward. Its
backward holds more than its forward: the saved log-softmax, the dense fp32 gradient
``nll_loss``'s backward makes and the fp32 gradient log-softmax's backward makes from it,
three fp32 tensors of the logits' size. Under torch's ``loss_parallel()`` (vocabulary-split
logits, torch/distributed/tensor/parallel/loss.py) the log-softmax is a decomposition that
holds a shifted copy and its exponent in the forward, and a backward that holds a zeroed
gradient, an exponent, their sum and the product. Counted by the logits' elements,
whatever their dtype: a model may hand back fp32 logits from a bf16 forward (the upcast
copies nothing then; the rest is as large). Each figure was measured with a live-storage
meter on real steps (tests/dist/test_loss_workspace.py). Pure.
"""

from __future__ import annotations

__all__ = ["loss_workspace", "pipeline_loss_workspace"]


def loss_workspace(output_bytes: int, output_numel: int, loss_parallel: bool) -> int:
    """Bytes the loss holds at its peak, the logits included, without a pipeline.

    Forward: the logits, their fp32 copy and the log-softmax (``output_bytes + 8·numel``),
    plus under loss parallel the shifted copy (``+ 4·numel``). Backward, once the logits are
    gone (nothing saves them: ``ToCopyBackward`` keeps no input, and neither
    `fs.forward_backward` nor Lightning's ``training_step`` holds them): three fp32 tensors
    (``12·numel``), four under loss parallel (``16·numel``). The larger counts: the backward
    for bf16 logits, both alike for fp32 ones.

    Examples:
        >>> loss_workspace(2 * 1000, 1000, False), loss_workspace(4 * 1000, 1000, False)
        (12000, 12000)
        >>> loss_workspace(2 * 1000, 1000, True), loss_workspace(4 * 1000, 1000, True)
        (16000, 16000)
    """
    fp32 = 4 * output_numel
    if loss_parallel:
        return int(max(output_bytes + 3 * fp32, 4 * fp32))
    return int(max(output_bytes + 2 * fp32, 3 * fp32))


def pipeline_loss_workspace(output_numel: int, loss_parallel: bool) -> int:
    """Bytes the last stage's loss holds at its peak beyond its logits and log-softmax.

    Those two are held per micro-batch in flight (the stage caches its output in
    ``fwd_cache``, and ``backward_one_chunk`` keeps it in hand through the backward; the
    log-softmax is saved) and counted with the stage's activations. Beyond them, forward:
    the fp32 copy (``4·numel``; under loss parallel also the shifted copy and its exponent,
    ``12·numel``); backward: the two fp32 gradients (``8·numel``; under loss parallel the
    zeroed gradient, the exponent and their sum, ``12·numel``). The larger counts.

    Examples:
        >>> pipeline_loss_workspace(1000, False), pipeline_loss_workspace(1000, True)
        (8000, 12000)
    """
    return int((3 if loss_parallel else 2) * 4 * output_numel)

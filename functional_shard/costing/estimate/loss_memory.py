"""What a rank's cross-entropy holds at its peak, beside the activations: the loss workspace.

The loss is ``F.cross_entropy(logits.float(), targets)``; its backward holds three fp32 tensors of
the logits' size (four under ``loss_parallel()``), counted by the logits' elements whatever their
dtype. Measured on real steps by tests/dist/test_loss_workspace.py; docs/will-it-fit.md has the model.
"""

from __future__ import annotations

__all__ = ["loss_workspace", "pipeline_loss_workspace"]


def loss_workspace(
    output_bytes: int, output_numel: int, loss_parallel: bool, *, compiled: bool = False
) -> int:
    """Bytes the loss holds at its peak, the logits included, without a pipeline.

    The larger of the forward (logits, their fp32 copy, the log-softmax: ``output_bytes + 8·numel``,
    ``+ 4·numel`` under loss parallel) and the backward, logits freed (``12·numel``, ``16·numel``).
    ``compiled`` (``torch.compile``'s fused cross-entropy, without loss parallel): the logits and their
    gradient, in their dtype; it keeps a float32 per row, not per logit (measured: 2 bytes a bf16 logit
    beside them, tests/dist/test_loss_workspace.py).

    Examples:
        >>> loss_workspace(2 * 1000, 1000, False), loss_workspace(4 * 1000, 1000, False)
        (12000, 12000)
        >>> loss_workspace(2 * 1000, 1000, True), loss_workspace(4 * 1000, 1000, True)
        (16000, 16000)
        >>> loss_workspace(2 * 1000, 1000, False, compiled=True)
        4000
    """
    if compiled:
        return 2 * output_bytes
    fp32 = 4 * output_numel
    if loss_parallel:
        return int(max(output_bytes + 3 * fp32, 4 * fp32))
    return int(max(output_bytes + 2 * fp32, 3 * fp32))


def pipeline_loss_workspace(output_numel: int, loss_parallel: bool) -> int:
    """Bytes the last stage's loss holds at its peak beyond its logits and log-softmax.

    Those two count with the stage's activations, per micro-batch in flight. Beyond them the
    backward's two fp32 gradients (``8·numel``; ``12·numel`` under loss parallel) are the larger.

    Examples:
        >>> pipeline_loss_workspace(1000, False), pipeline_loss_workspace(1000, True)
        (8000, 12000)
    """
    return int((3 if loss_parallel else 2) * 4 * output_numel)

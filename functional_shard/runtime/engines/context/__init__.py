"""Context parallel: a sequence cut over the cp axis, attention over the whole of it.

`parallel` cuts batches (`fs.context_chunks`, `fs.sequence_context`) and runs its own
all-gather attention on any backend; `step` runs `fs.forward_backward`'s step on the cut
(whole sequences, or packed rows cut by attention work); `hf` points a Hugging Face model's
attention at the engine; `ring` is torch's ring attention on CUDA (``fs.cp(engine="ring")``);
`arguments` refuses what cannot be cut, before anything is.
"""

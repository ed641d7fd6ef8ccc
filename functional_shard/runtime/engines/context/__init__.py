"""Context parallel: a sequence cut over the cp axis, attention over the whole of it.

`parallel` cuts batches (`fs.context_chunks`, `fs.sequence_context`), runs the step with
the cut and its own all-gather attention on any backend; `ring` is torch's ring attention on
CUDA (``fs.cp(engine="ring")``); `arguments` refuses what cannot be cut, before anything is.
"""

"""`fs.checkpoint.load_hf` holds no more than a rank's shards and one tensor at a time.

On 2 gloo ranks under ``fsdp``, straight from the meta device (the zoo's Llama, from a
folder ``save_pretrained`` wrote): each rank's resident memory (VmHWM, file-mapped pages
included) rises during the load by at most its shards' bytes plus the folder's largest
tensor, plus 10%, plus a fixed allowance for Python and the allocator. Reading the whole
model on every rank (84 MB here, against a bound of about 55 MB) fails it; so does keeping
the mapped file open (a rank's shards resident twice).
bench/load_hf.py measures the same at 2.4 GB, beside ``from_pretrained``.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest

import functional_shard as fs
from functional_shard.runtime.checkpoint.hf.slices import open_folder

from .. import load_hf_cases as cases

pytest.importorskip("transformers")

MB = 10**6
# Python's and the allocator's share of a load (the modules built on meta, the plan, DTensor
# objects, gloo's buffers): 0.55-1.02 MB above the shards on each rank over 10 runs here;
# 4 MB leaves room for other Python versions and allocators, far below the 42 MB that a
# rank reading the whole model would add
ALLOWANCE = 4 * MB


def _peaks_measurable() -> bool:
    # VmHWM is reset by writing 5 to /proc/self/clear_refs (Linux 4.0 on)
    return sys.platform == "linux" and os.access("/proc/self/clear_refs", os.W_OK)


# slow: 14-32 s on 2 shared cores (mostly starting 2 ranks), above the default suite's 20 s
@pytest.mark.slow
@pytest.mark.skipif(
    not _peaks_measurable(), reason="The peak resident size can only be reset and read on Linux."
)
def test_each_rank_holds_its_shards_and_one_tensor_at_most_while_loading(tmp_path: Path) -> None:
    folder = cases.write_memory_folder(tmp_path / "llama")
    files = list(folder.glob("*.safetensors"))
    largest = _largest_tensor_bytes(folder)
    # a world of its own: the resident-size peak is read in fresh processes (a shared world's
    # ranks hold memory other tests freed, which a load could reuse unseen)
    with fs.LocalWorld(2) as world:
        ranks = world.run(cases.peak_during_load, str(folder))
    whole = sum(file.stat().st_size for file in files)
    for rank, found in enumerate(ranks):
        bound = 1.1 * (found["held"] + largest) + ALLOWANCE
        assert found["held"] < whole * 0.6, f"rank {rank} holds {found['held'] / MB:.1f} MB: not sharded"
        assert found["peak"] <= bound, (
            f"rank {rank}: resident memory rose by {found['peak'] / MB:.1f} MB during load_hf, above "
            f"{bound / MB:.1f} MB (shards {found['held'] / MB:.1f} MB, largest tensor "
            f"{largest / MB:.1f} MB, the whole folder {whole / MB:.1f} MB)"
        )


def _largest_tensor_bytes(folder: Path) -> int:
    sources = open_folder(folder, trust=False).sources.values()  # the headers only
    return max(math.prod(source.shape) * source.dtype.itemsize for source in sources if source.dtype)

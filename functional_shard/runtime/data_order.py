"""A data order defined globally, so a run resumes on any plan and world size where it stopped.

`DataOrder` is the pure part: each epoch a permutation from ``seed + epoch``, cut into whole
global batches, each cut into equal contiguous slices, one per data-parallel rank (ranks that
differ only along tp, pp or cp read the same slice). `ResumableSampler` walks that order for
one rank and `ResumableLoader` counts the batches it hands out; their ``state_dict()`` counts
samples globally, so a resume under another data-parallel size continues with the very next
global batch. No process group is needed. A `functional_shard.PackedBatch` is a dataset of its rows:
the loader hands out each step's rows as one `PackedBatch` (`functional_shard.core.packing.collate_packed`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, cast

import torch
from torch.utils.data import DataLoader, DistributedSampler

from functional_shard.core.errors import ShardingError
from functional_shard.core.packing import collate_packed
from functional_shard.core.validate import instance_of, non_negative_int, positive_int, torch_seed

if TYPE_CHECKING:
    from functional_shard.planning.plan.plan import Plan

__all__ = ["DataOrder", "ResumableLoader", "ResumableSampler"]

# what a state_dict holds, in this order; all plain ints and bools (fs.checkpoint's extra)
_STATE_KEYS = ("dataset_len", "global_batch", "seed", "shuffle", "epoch", "consumed", "steps")


@dataclasses.dataclass(frozen=True)
class DataOrder:
    """The global order of a run's samples: which samples each step reads, on any plan.

    Args:
        dataset_len: how many samples the dataset holds.
        global_batch: samples per step over all data-parallel ranks.
        seed: each epoch's permutation comes from ``seed + epoch`` (wrapped to torch's 64-bit seeds).
        shuffle: permute each epoch (else the dataset's own order, every epoch).

    Examples:
        >>> order = DataOrder(10, global_batch=4, shuffle=False)
        >>> order.steps_per_epoch, order.rank_slice(0, step=1, index=1, count=2)
        (2, [6, 7])
    """

    dataset_len: int
    global_batch: int
    seed: int = 0
    shuffle: bool = True

    def __post_init__(self) -> None:
        problems = _value_problems(dataclasses.asdict(self))
        if not problems and self.global_batch > self.dataset_len:
            problems.append(
                f"global_batch={self.global_batch} is larger than dataset_len={self.dataset_len}: "
                "not one whole global batch fits an epoch"
            )
        if problems:
            raise ShardingError(
                f"DataOrder: {'; '.join(problems)}; pass the dataset's length, the samples per step and "
                "the seed as whole numbers, and shuffle as True or False"
            )

    @property
    def steps_per_epoch(self) -> int:
        """Whole global batches per epoch (the tail that fills none is left out)."""
        return self.dataset_len // self.global_batch

    def epoch(self, epoch: int) -> list[int]:
        """The sample indices of ``epoch`` in the order the steps read them (whole batches only).

        Raises:
            ShardingError: ``epoch`` is not an int of at least 0.
        """
        non_negative_int(epoch, "epoch", meaning="epochs count from 0")
        if self.shuffle:
            # torch takes a negative seed as its 64-bit two's complement; wrapping the sum the
            # same way keeps every order it gave and lets the widest seeds reach any epoch
            generator = torch.Generator().manual_seed((self.seed + epoch) % _SEED_SPAN)
            order = torch.randperm(self.dataset_len, generator=generator).tolist()
        else:
            order = list(range(self.dataset_len))
        return order[: self.steps_per_epoch * self.global_batch]

    def rank_slice(self, epoch: int, *, step: int, index: int, count: int) -> list[int]:
        """The samples data-parallel rank ``index`` of ``count`` reads at ``step`` of ``epoch``.

        Raises:
            ShardingError: ``epoch`` or ``step`` is not an int of at least 0, ``step`` is past the
                epoch's last, ``index`` is not one of the ``count`` ranks, or as `local_batch`.
        """
        local = self.local_batch(count)
        non_negative_int(step, "step", meaning="steps count from 0 in each epoch")
        non_negative_int(index, "index", meaning="data-parallel ranks count from 0")
        if step >= self.steps_per_epoch or index >= count:
            raise ShardingError(
                f"DataOrder.rank_slice(step={step}, index={index}, count={count}): an epoch has "
                f"{self.steps_per_epoch} steps (0 to {self.steps_per_epoch - 1}) and {count} ranks read "
                f"each (0 to {count - 1}); pass a step and a rank index within them"
            )
        return _slice(self.epoch(epoch), step, self.global_batch, index, local)

    def local_batch(self, count: int) -> int:
        """Samples per step on each of ``count`` data-parallel ranks; refused unless it divides.

        Raises:
            ShardingError: ``count`` is not a positive int, or does not divide the global batch.
        """
        positive_int(count, "count", meaning="the data-parallel ranks")
        if self.global_batch % count:
            raise ShardingError(
                f"the global batch of {self.global_batch} samples does not divide over {count} data-parallel "
                f"ranks ({self.global_batch} % {count} = {self.global_batch % count}): every rank must read "
                f"as many samples per step; pick a global batch that is a multiple of {count}, or a plan "
                "whose data-parallel size divides it"
            )
        return self.global_batch // count


# the least value of each count a data order or a sampler state holds (None: any whole number)
# each value's check: the validators every public entry point shares
_CHECKS: dict[str, Callable[[Any, str], Any]] = {
    "dataset_len": positive_int,
    "global_batch": positive_int,
    "seed": torch_seed,
    "shuffle": lambda value, name: instance_of(value, bool, name),
    "epoch": non_negative_int,
    "consumed": non_negative_int,
    "steps": non_negative_int,
}
# how many distinct generators torch's seeds give
_SEED_SPAN = 2**64


def _value_problems(values: dict[str, Any]) -> list[str]:
    """What in ``values`` (a `DataOrder`'s fields, or a sampler state) is not a value of its kind.

    Every problem is said, not the first alone: a state edited by hand may have several.
    """
    found = []
    for key, check in _CHECKS.items():
        if key in values:
            try:
                check(values[key], key)
            except ShardingError as problem:
                found.append(str(problem))
    if not found and "consumed" in values and values["consumed"] % values["global_batch"]:
        batch = values["global_batch"]
        found.append(f"consumed={values['consumed']}: a whole number of global batches of {batch} samples")
    return found


class ResumableSampler(DistributedSampler):  # type: ignore[type-arg]
    """This rank's share of a globally defined data order, resumable on any plan.

    Each step reads one global batch of the epoch's permutation (`DataOrder`), cut over the
    plan's data-parallel ranks. Feed it through `loader`; its ``state_dict()`` (or
    `fs.checkpoint.save`'s ``data=``) keeps the position for a resume under any plan or world
    size. A torch ``DistributedSampler``, so Lightning uses it as it is, ``set_epoch`` included.

    Args:
        dataset_len: ``len(dataset)``.
        plan: the run's plan (its data-parallel axes split each global batch); None: one rank.
        rank: this process's global rank (under ``plan``).
        batch_size: the global batch, samples per step over all data-parallel ranks.
        seed: the permutation of epoch ``e`` comes from ``seed + e``.
        shuffle: permute each epoch.

    Raises:
        ShardingError: ``plan`` is not a `Plan`, or is None with a ``rank`` other than 0;
            ``batch_size`` does not divide over the plan's data-parallel ranks, or does not fit the dataset.

    Examples:
        >>> sampler = ResumableSampler(10, batch_size=4, shuffle=False)
        >>> [batch.tolist() for batch in sampler.loader(range(10))]
        [[0, 1, 2, 3], [4, 5, 6, 7]]
        >>> sampler.state_dict()["epoch"], sampler.state_dict()["consumed"]
        (0, 8)
    """

    def __init__(
        self,
        dataset_len: int,
        *,
        plan: Plan | None = None,
        rank: int = 0,
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        from functional_shard.planning.plan.plan import Plan

        if plan is not None:
            instance_of(
                plan,
                Plan,
                "plan",
                meaning="fs.ResumableSampler takes the run's plan, whose data-parallel axes split each batch",
            )
        if plan is None and rank != 0:
            # else every process would read every sample: a run that forgot plan= trains on
            # each batch as many times as it has data-parallel ranks
            raise ShardingError(
                f"ResumableSampler(rank={rank!r}): without a plan there is one rank, 0; pass the run's "
                "plan= to split each batch over its data-parallel ranks"
            )
        self.order = DataOrder(dataset_len, batch_size, seed, shuffle)
        self.index, self.count = plan.data_parallel_rank(rank) if plan is not None else (0, 1)
        self.local_batch = self.order.local_batch(self.count)
        super().__init__(
            cast("Any", range(dataset_len)),  # DistributedSampler takes only its length
            num_replicas=self.count,
            rank=self.index,
            shuffle=shuffle,
            seed=seed,
            drop_last=True,
        )
        self.consumed = 0  # samples of this epoch consumed over all ranks
        self.steps = 0  # global batches handed out since the run began

    def __len__(self) -> int:
        # the whole epoch's share, also mid-epoch: Lightning counts an epoch's batches from
        # len() before it restores the position, and its progress counters go on from there
        return self.order.steps_per_epoch * self.local_batch

    def __iter__(self) -> Iterator[int]:
        """This rank's samples from the next step to the end of the epoch (a new epoch if it ended)."""
        if self.consumed >= self.order.steps_per_epoch * self.order.global_batch:
            self.set_epoch(self.epoch + 1)
        order = self.order.epoch(self.epoch)
        mine = [
            sample
            for step in range(self.consumed // self.order.global_batch, self.order.steps_per_epoch)
            for sample in _slice(order, step, self.order.global_batch, self.index, self.local_batch)
        ]
        return iter(mine)

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its first batch; the current epoch goes on where it is.

        Raises:
            ShardingError: ``epoch`` is not a whole number of at least 0 (a state saved with
                one would not load).
        """
        if problems := _value_problems({"epoch": epoch}):
            raise ShardingError(f"ResumableSampler.set_epoch: {problems[0]}; count epochs from 0")
        if epoch != self.epoch:
            self.epoch, self.consumed = epoch, 0

    def advance(self) -> None:
        """Count one step's global batch as consumed (`ResumableLoader` calls it per batch)."""
        self.consumed += self.order.global_batch
        self.steps += 1

    def state_dict(self) -> dict[str, Any]:
        """Where the run is: epoch, samples consumed in it, steps, seed, global batch (plain values)."""
        o = self.order
        values = (o.dataset_len, o.global_batch, o.seed, o.shuffle, self.epoch, self.consumed, self.steps)
        return dict(zip(_STATE_KEYS, values, strict=True))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where ``state`` (of any plan's sampler over the same data) stopped.

        The saved seed and shuffling are taken (they are the run's order); the dataset
        length and the global batch must match this sampler's.

        Raises:
            ShardingError: as `check_state_dict`; the sampler is then unchanged.
        """
        self.check_state_dict(state)
        self.order = dataclasses.replace(self.order, seed=state["seed"], shuffle=state["shuffle"])
        self.seed, self.shuffle = self.order.seed, self.order.shuffle
        self.epoch, self.consumed, self.steps = state["epoch"], state["consumed"], state["steps"]

    def check_state_dict(self, state: Any) -> None:
        """Refuse a state this sampler cannot continue; change nothing.

        Raises:
            ShardingError: ``state`` is not a sampler state, is of another dataset, or its
                global batch differs from this sampler's or does not divide over this
                plan's data-parallel ranks (both numbers named).

        Examples:
            >>> saved = ResumableSampler(24, batch_size=6).state_dict()
            >>> ResumableSampler(24, batch_size=6).check_state_dict(saved)  # fits: nothing happens
        """
        missing = [key for key in _STATE_KEYS if key not in state] if isinstance(state, dict) else _STATE_KEYS
        if missing:
            raise ShardingError(
                f"ResumableSampler: the state lacks {list(missing)}; pass what "
                "ResumableSampler.state_dict() (or fs.checkpoint.save(data=...)) wrote"
            )
        problems = _value_problems(state)
        if problems:  # a state edited by hand or another program's: its numbers cannot be compared
            raise ShardingError(
                "ResumableSampler cannot resume this state:\n"
                + "\n".join(f"* {p}" for p in problems)
                + "\nPass what ResumableSampler.state_dict() (or fs.checkpoint.save(data=...)) wrote"
            )
        if state["dataset_len"] != self.order.dataset_len:
            problems.append(
                f"it was saved over a dataset of {state['dataset_len']} samples, this sampler has "
                f"{self.order.dataset_len}: resume over the same dataset"
            )
        saved_batch = state["global_batch"]
        if saved_batch % self.count:
            problems.append(
                f"its global batch of {saved_batch} samples does not divide over this plan's {self.count} "
                f"data-parallel ranks; resume under a plan whose data-parallel size divides {saved_batch}"
            )
        elif saved_batch != self.order.global_batch:
            problems.append(
                f"it was saved with a global batch of {saved_batch} samples, this sampler has "
                f"batch_size={self.order.global_batch}: the losses would not continue; pass "
                f"batch_size={saved_batch}"
            )
        if problems:
            raise ShardingError(
                "ResumableSampler cannot resume this state:\n" + "\n".join(f"* {p}" for p in problems)
            )

    def loader(self, dataset: Any, **options: Any) -> ResumableLoader:
        """A DataLoader of ``dataset`` reading this sampler, ``global batch / dp`` samples per step.

        Args:
            dataset: the dataset (``len(dataset)`` as given to the sampler).
            **options: other DataLoader options (``num_workers``, ...), but not those the sampler sets.

        Raises:
            ShardingError: ``dataset`` has no length or another, or an option the sampler sets.

        Examples:
            >>> [b.tolist() for b in ResumableSampler(4, batch_size=2, shuffle=False).loader(range(4))]
            [[0, 1], [2, 3]]
        """
        return ResumableLoader(dataset, self, **options)


def _slice(order: list[int], step: int, global_batch: int, index: int, local: int) -> list[int]:
    start = step * global_batch + index * local
    return order[start : start + local]


class ResumableLoader(DataLoader):  # type: ignore[type-arg]
    """A DataLoader over a `ResumableSampler` that counts the steps it hands out.

    A batch counts as consumed once handed out (workers reading ahead do not move the
    position). ``state_dict()`` / ``load_state_dict()`` are the sampler's, so Lightning's loops
    and `fs.checkpoint.save` / `load` (``data=``) keep the position. Make one with
    `ResumableSampler.loader`. It collates with `functional_shard.core.packing.collate_packed` unless
    given a ``collate_fn``: packed rows come as one `functional_shard.PackedBatch`, the rest as torch's.

    Raises:
        ShardingError: ``dataset`` has no length or another than the sampler's, or an option
            the sampler sets.

    Examples:
        >>> loader = ResumableSampler(6, batch_size=2, shuffle=False).loader(range(6))
        >>> next(iter(loader)).tolist(), loader.state_dict()["consumed"]
        ([0, 1], 2)
        >>> rows = fs.pack([[1, 2], [3, 4], [5]], seq_len=2)  # a PackedBatch: a dataset of 3 rows
        >>> packed = ResumableSampler(len(rows), batch_size=2, shuffle=False).loader(rows)
        >>> step = next(iter(packed))
        >>> step.tokens.tolist(), step.sources
        ([[1, 2], [3, 4]], ((0,), (1,)))
    """

    def __init__(self, dataset: Any, sampler: ResumableSampler, **options: Any) -> None:
        taken = sorted({"batch_size", "sampler", "batch_sampler", "shuffle", "drop_last"} & set(options))
        if taken:
            raise ShardingError(
                f"ResumableLoader: {taken} are the sampler's to set (batch_size is the global batch / the "
                "data-parallel size, drop_last is always on); leave them out"
            )
        if not isinstance(sampler, ResumableSampler):
            raise ShardingError(
                f"ResumableLoader needs a ResumableSampler, got {type(sampler).__name__}; "
                "make one with fs.ResumableSampler(...).loader(dataset)"
            )
        if not hasattr(dataset, "__len__"):  # an iterable dataset: the sampler's indices would go unread
            raise ShardingError(
                f"ResumableLoader: the dataset ({type(dataset).__name__}) has no len(); pass a map-style "
                "dataset, which the sampler reads by index (a list, a torch Dataset with __len__)"
            )
        if len(dataset) != sampler.order.dataset_len:
            raise ShardingError(
                f"ResumableLoader: the dataset holds {len(dataset)} samples, the sampler was made for "
                f"{sampler.order.dataset_len}; pass len(dataset) to ResumableSampler"
            )
        options.setdefault("collate_fn", collate_packed)
        super().__init__(dataset, batch_size=sampler.local_batch, sampler=sampler, drop_last=True, **options)
        self.order_sampler = sampler

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        """The epoch's remaining batches, each counted as consumed when handed out."""
        for batch in super().__iter__():
            self.order_sampler.advance()
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """The sampler's `ResumableSampler.state_dict`."""
        return self.order_sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The sampler's `ResumableSampler.load_state_dict`."""
        self.order_sampler.load_state_dict(state)

    def check_state_dict(self, state: Any) -> None:
        """The sampler's `ResumableSampler.check_state_dict`."""
        self.order_sampler.check_state_dict(state)

"""`mask_without_positions` reads, from a model's source, whether it hands transformers' mask builder
the ``position_ids`` in which transformers finds packed documents: made-up modeling classes, one a way
of handing them (or not), beside the real models refused in ``test_packed_hf.py``."""

from __future__ import annotations

import re
from typing import Any

import pytest

from functional_shard.core.mask_builder_calls import mask_without_positions


def create_causal_mask(*args: Any, **kwargs: Any) -> None:
    """Stands for transformers' builder: the classes below are read, never run."""


def create_sliding_window_causal_mask(*args: Any, **kwargs: Any) -> None:
    """Stands for transformers' sliding-window builder."""


class ByKeyword:
    def forward(self, x: Any, positions: Any) -> None:
        create_causal_mask(config=None, inputs_embeds=x, cache=None, position_ids=positions)


class ByPlace:
    def forward(self, x: Any, positions: Any) -> None:
        create_causal_mask(None, x, None, None, positions)


class InADict:
    def forward(self, x: Any, positions: Any) -> None:
        mask_kwargs = {"config": None, "inputs_embeds": x, "position_ids": positions}
        sliding_kwargs = mask_kwargs.copy()
        create_causal_mask(**mask_kwargs)
        create_sliding_window_causal_mask(**sliding_kwargs)


class AddedToADict:
    def forward(self, x: Any, positions: Any) -> None:
        mask_kwargs = {"config": None, "inputs_embeds": x}
        mask_kwargs["position_ids"] = positions
        create_causal_mask(**mask_kwargs)


class FromElsewhere:
    def forward(self, x: Any, kwargs: dict[str, Any]) -> None:
        create_causal_mask(**kwargs)  # keys unknown here: given the benefit of the doubt


class NoneAtAll:  # as OPT's decoder
    def forward(self, x: Any, positions: Any) -> None:
        create_causal_mask(config=None, inputs_embeds=x, attention_mask=None, cache=None)


class NotInItsDict:  # as GPT-OSS
    def forward(self, x: Any, positions: Any) -> None:
        mask_kwargs = {"config": None, "inputs_embeds": x, "attention_mask": None}
        create_causal_mask(**mask_kwargs)
        create_sliding_window_causal_mask(**mask_kwargs)


class ByAnotherName:  # as Starcoder2's choice of builder, without the positions
    def forward(self, x: Any, sliding: bool) -> None:
        build = create_causal_mask if not sliding else create_sliding_window_causal_mask
        build(config=None, inputs_embeds=x)


class Vision:  # a tower beside the decoder, whose own mask needs no positions
    def forward(self, x: Any) -> None:
        create_causal_mask(config=None, inputs_embeds=x)


@pytest.mark.parametrize("handing", [ByKeyword, ByPlace, InADict, AddedToADict, FromElsewhere])
def test_a_class_that_hands_its_mask_the_positions_passes(handing):
    assert mask_without_positions([handing]) == ""
    assert mask_without_positions([handing, Vision]) == ""  # the decoder, first, decides


@pytest.mark.parametrize("withholding", [NoneAtAll, NotInItsDict, ByAnotherName])
def test_a_class_that_does_not_is_named_with_the_line(withholding):
    where = mask_without_positions([withholding])
    assert re.fullmatch(
        re.escape(f"{__name__}.{withholding.__name__} builds its attention mask (line ")
        + r"\d+ of test_mask_builder_calls\.py\)",
        where,
    ), where
    line = int(where.split("line ")[1].split(" ")[0])
    with open(__file__) as source:
        assert "(" in source.read().splitlines()[line - 1]  # the call itself


def test_a_class_that_builds_no_mask_leaves_it_to_its_module():
    # the decoder builds none here: this module's calls decide, and some withhold the positions
    assert mask_without_positions([int]) == ""  # a builtin's module has no source to read
    assert "builds its attention mask" in mask_without_positions([_Helper])


class _Helper:
    pass

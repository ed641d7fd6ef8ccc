"""Repeated blocks of a model: the FSDP unit finder's units, and what tp("auto") traces."""

from __future__ import annotations

from collections import Counter

from torch import nn

from functional_shard.core.tree import ModelTree

__all__ = ["repeated_blocks"]

_CONTAINERS: tuple[type[nn.Module], ...] = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def repeated_blocks(tree: ModelTree) -> list[tuple[str, str]]:
    """(path, why it is one) of each repeated block of ``tree``, in model order.

    Examples:
        >>> from functional_shard.core.tree import read_model
        >>> tree = read_model(nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)]))
        >>> [path for path, _ in repeated_blocks(tree)]
        ['0', '1']
    """
    # every element of a ModuleList or ModuleDict, and a Sequential's repeating elements that
    # hold modules of their own, wherever they live (layers, encoder and decoder stacks)
    modules = tree.modules
    is_container: dict[type | None, bool] = {None: False}  # a model has a handful of classes
    containers: dict[str, type] = {}
    elements: dict[str, list[tuple[str, type]]] = {}
    found: bool | None
    for path, cls in modules.items():  # in pre-order: a container comes before its elements
        if not path or cls is None:
            found = cls is not None and issubclass(cls, _CONTAINERS)
        else:
            parent = path.rpartition(".")[0]
            if parent in containers:
                elements.setdefault(parent, []).append((path, cls))
            found = is_container.get(cls)
            if found is None:
                found = is_container[cls] = issubclass(cls, _CONTAINERS)
        if found and cls is not None:
            containers[path] = cls
    if not containers:
        return []
    parents = (
        {path.rpartition(".")[0] for path in modules}
        if any(issubclass(cls, nn.Sequential) for cls in containers.values())
        else set()
    )
    chosen = []
    for parent, kids in elements.items():
        container = containers[parent]
        counts = Counter(cls for _, cls in kids)
        if issubclass(container, nn.Sequential):
            kids = [(path, cls) for path, cls in kids if counts[cls] > 1 and path in parents]
            counts = Counter(cls for _, cls in kids)
        where = f"{parent or 'the root'} ({container.__name__})"
        chosen += [
            (path, f"a repeated block: {counts[cls]} × {cls.__name__} in {where}") for path, cls in kids
        ]
    if len(elements) == 1:  # one container's elements come in model order already
        return chosen
    order = {path: index for index, path in enumerate(modules)}
    return sorted(chosen, key=lambda item: order[item[0]])

"""What the commands read from the command line: mesh, model, policy, hardware, memory budget.

Every mistake is an `InputError`, which ``main`` prints as one line with exit code 2.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import pathlib
import re
from typing import TYPE_CHECKING

from functional_shard.core.errors import ShardingError, one_line

if TYPE_CHECKING:
    from torch import nn

    from functional_shard.core.mesh import Mesh
    from functional_shard.costing.time.hardware import Hardware
    from functional_shard.costing.time.kernels import Kernels
    from functional_shard.planning.policy.types import Policy

__all__ = [
    "InputError",
    "load_model",
    "parse_mesh",
    "read_budget",
    "read_hardware",
    "read_kernels",
    "read_policy",
]


class InputError(ShardingError):
    """A bad command-line value: printed as one line."""


def parse_mesh(text: str) -> Mesh:
    """``dp=8,tp=4`` -> ``Mesh(dp=8, tp=4)``.

    Raises:
        ShardingError: empty, not ``axis=size`` pairs, an axis given twice, or a mesh `Mesh` refuses.

    Examples:
        >>> from functional_shard.frontends.cli import parse_mesh
        >>> parse_mesh("dp=8,tp=4")
        Mesh(dp=8, tp=4)
    """
    from functional_shard.core.mesh import Mesh

    if not text.strip():
        raise InputError(f"--mesh {text!r}: empty; write AXIS=SIZE pairs joined by commas, e.g. dp=8,tp=4")
    pairs = [item.strip().partition("=") for item in text.split(",")]
    if any(not name or not sep or not re.fullmatch(r"-?\d+", size.strip()) for name, sep, size in pairs):
        raise InputError(f"--mesh {text!r}: write axis=size pairs joined by commas, e.g. dp=8,tp=4")
    names = [name.strip() for name, _, _ in pairs]
    twice = next((name for i, name in enumerate(names) if name in names[:i]), None)
    if twice is not None:  # a dict would keep the last size without a word
        raise InputError(f"--mesh {text!r}: axis {twice!r} given twice; give each axis once")
    try:
        return Mesh({name: int(size) for name, (_, _, size) in zip(names, pairs, strict=True)})
    except ShardingError as error:
        raise InputError(f"--mesh {text!r}: {one_line(error, 300)}") from None


def _zoo_names() -> list[str]:
    from functional_shard.frontends.model_zoo import CONFIGS

    return sorted(CONFIGS)


def _from_hf_config(path: pathlib.Path) -> nn.Module:
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise InputError(f"--model {str(path)!r}: the folder holds no config.json")
    try:
        import torch
        import transformers
    except ImportError:
        raise InputError(
            f"--model {str(path)!r}: reading a Hugging Face config needs transformers: "
            "pip install 'functional-shard[hf]'"
        ) from None
    try:
        values = json.loads(file.read_text())
    except (OSError, ValueError) as error:
        raise InputError(f"--model {str(file)!r}: not readable JSON ({one_line(error, 300)})") from None
    if not isinstance(values, dict) or "model_type" not in values:
        raise InputError(f"--model {str(file)!r}: not a Hugging Face config (no 'model_type')")
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # config warnings are not about the plan
    try:
        config = transformers.AutoConfig.for_model(**values)
        with torch.device("meta"):  # shapes only: no weights are read or allocated
            return transformers.AutoModelForCausalLM.from_config(config)
    except Exception as error:  # the config's values reach transformers' and huggingface_hub's checks
        raise InputError(
            f"--model {str(file)!r}: transformers cannot build a causal LM from it ({one_line(error, 200)})"
        ) from None
    finally:
        transformers.logging.set_verbosity(verbosity)


def _from_factory(text: str) -> nn.Module:
    import torch
    from torch import nn

    module_name, _, attribute = text.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise InputError(
            f"--model {text!r}: cannot import {module_name!r} ({one_line(error, 300)})"
        ) from None
    except Exception as error:  # the module's own code raised, or a name import_module refuses
        raise InputError(
            f"--model {text!r}: cannot import {module_name!r} "
            f"({type(error).__name__}: {one_line(error, 300)})"
        ) from None
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise InputError(f"--model {text!r}: {module_name} has no function or class {attribute!r}")
    try:
        with torch.device("meta"):  # shapes only, however big the model
            model = factory()
    except Exception as error:  # the user's code: report it in one line, like any bad input
        raise InputError(
            f"--model {text!r}: {attribute}() raised {type(error).__name__}: {one_line(error, 300)} "
            "(the factory is called with no arguments, on the meta device)"
        ) from None
    if not isinstance(model, nn.Module):
        raise InputError(f"--model {text!r}: {attribute}() returned {type(model).__name__}, not an nn.Module")
    return model


def load_model(text: str) -> nn.Module:
    """The model ``--model`` names, built on the meta device (shapes only, no weights).

    Args:
        text: a zoo name (``tiny``, ``llama-7b``, ...), a Hugging Face ``config.json`` or its folder,
            or ``package.module:factory`` (called with no arguments).

    Raises:
        ShardingError: none of these, naming what was tried.

    Examples:
        >>> from functional_shard.frontends.cli import load_model
        >>> load_model("tiny").embed_tokens.weight.device
        device(type='meta')
    """
    if text in _zoo_names():
        from functional_shard.frontends.model_zoo import llama

        return llama(text)
    path = pathlib.Path(text)
    if path.exists():
        return _from_hf_config(path)
    if re.fullmatch(r"[\w.]+:\w+", text):
        return _from_factory(text)
    if text.endswith(".json") or "/" in text:
        raise InputError(f"--model {text!r}: no such file or folder")
    raise InputError(
        f"--model {text!r}: not a zoo model ({', '.join(_zoo_names())}), a config.json or a folder "
        "holding one, or package.module:factory"
    )


def read_policy(text: str, model: nn.Module | None) -> Policy:
    """The policy ``--policy`` writes (see `functional_shard.planning.policy.parse`).

    Args:
        text: a policy expression, such as ``"fsdp(dp) + tp(llama, tp) + bf16"``.
        model: the model it is for (class names in ``checkpointing(...)`` resolve against it), or None.

    Raises:
        ShardingError: the text is empty or not a policy; the message names the wrong part.

    Examples:
        >>> read_policy("fsdp(dp) + bf16", None).options.param_dtype
        'bfloat16'
    """
    from functional_shard.planning.policy.parse import parse_policy

    if not text.strip():  # an empty value is a mistake, not a request for the default
        raise InputError(
            f'--policy {text!r}: empty; write a policy, e.g. "fsdp(dp) + tp(llama, tp)", '
            "or none for no policy"
        )
    try:
        return parse_policy(text, model)
    except ShardingError as error:
        raise InputError(f"--policy: {one_line(error, limit=1000)}") from None


def read_hardware(name: str) -> Hardware:
    """The accelerator ``--hardware`` names (see `functional_shard.costing.time.hardware`).

    Raises:
        ShardingError: no such hardware; the message lists the names there are.

    Examples:
        >>> read_hardware("h100").memory_bytes
        80000000000
    """
    from functional_shard.costing.time.hardware import hardware

    try:
        return hardware(name)
    except ShardingError as error:
        raise InputError(f"--hardware {name!r}: {one_line(error, 300)}") from None


def read_kernels(text: str) -> Kernels:
    """The `fs.Kernels` that ``--kernels`` names, comma-separated (its fields set to True).

    Raises:
        ShardingError: an unknown name, or one its option refuses (float8 without compile).

    Examples:
        >>> read_kernels("compile,float8").names
        ('torch.compile', 'Float8 linears')
    """
    from functional_shard.costing.time.kernels import Kernels

    names = [name.strip() for name in text.split(",") if name.strip()]
    known = tuple(field.name for field in dataclasses.fields(Kernels))
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise InputError(f"--kernels {text!r}: name some of {', '.join(known)}, comma-separated")
    try:
        return Kernels(**dict.fromkeys(names, True))
    except ShardingError as error:
        raise InputError(f"--kernels {text!r}: {one_line(error, 300)}") from None


def read_documents(text: str) -> list[int]:
    """The document lengths of one row that ``--documents`` gives, comma-separated.

    Examples:
        >>> read_documents("2048, 2048,4096")
        [2048, 2048, 4096]
        >>> read_documents("2048,half")
        Traceback (most recent call last):
        ...
        functional_shard.frontends.cli.inputs.InputError: --documents '2048,half': write positive ...
    """
    pieces = [piece.strip() for piece in text.split(",")]
    if not all(piece.isdigit() and int(piece) > 0 for piece in pieces):
        raise InputError(
            f"--documents {text!r}: write positive whole numbers of tokens joined by commas, "
            "e.g. 2048,2048,4096"
        )
    return [int(piece) for piece in pieces]


def read_budget(text: str) -> int:
    """Bytes per device that ``--budget`` gives, as ``80GiB`` or ``512MB``.

    Raises:
        ShardingError: not a memory size.

    Examples:
        >>> read_budget("80GiB")
        85899345920
    """
    from functional_shard.core.units import parse_bytes

    try:
        return int(parse_bytes(text))
    except ShardingError as error:
        raise InputError(f"--budget {text!r}: {one_line(error, 300)}") from None

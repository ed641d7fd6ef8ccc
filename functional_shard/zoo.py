"""Small, real models with Hugging Face naming: `functional_shard.frontends.zoo`, at its old path.

Examples:
    >>> from functional_shard.zoo import llama
    >>> len(llama("tiny").layers)
    2
"""

from .frontends.zoo import CONFIGS as CONFIGS
from .frontends.zoo import MLP as MLP
from .frontends.zoo import Attention as Attention
from .frontends.zoo import Block as Block
from .frontends.zoo import Llama as Llama
from .frontends.zoo import LlamaConfig as LlamaConfig
from .frontends.zoo import llama as llama

__all__ = ["CONFIGS", "MLP", "Attention", "Block", "Llama", "LlamaConfig", "llama"]

"""Small, real models with Hugging Face naming: `functional_shard.frontends.model_zoo`, at a short path.

Examples:
    >>> from functional_shard.zoo import llama
    >>> len(llama("tiny").layers)
    2
"""

from .frontends.model_zoo import CONFIGS as CONFIGS
from .frontends.model_zoo import MLP as MLP
from .frontends.model_zoo import Attention as Attention
from .frontends.model_zoo import Block as Block
from .frontends.model_zoo import Llama as Llama
from .frontends.model_zoo import LlamaConfig as LlamaConfig
from .frontends.model_zoo import llama as llama

__all__ = ["CONFIGS", "MLP", "Attention", "Block", "Llama", "LlamaConfig", "llama"]

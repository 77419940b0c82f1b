"""kvpack: compressed KV caches for transformer language models, with measured memory.

Entry points: :func:`attach` (a resident method's cache for a model, in a ``with`` block),
:func:`get_method` (any method, resident or storage, under one protocol), :func:`load_model`.
"""

from .config import MethodConfig
from .hf.attach import attach
from .hf.cache import KVPackCache
from .hf.models import load_model
from .methods import Method, available_methods, get_method
from .registry import register_method

__version__ = "0.1.0"

__all__ = ["KVPackCache", "Method", "MethodConfig", "attach", "available_methods", "get_method", "load_model",
           "register_method"]

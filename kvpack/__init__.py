"""kvpack: compressed KV caches for transformer language models, with measured memory.

Entry points: :func:`attach` (the recommended cache for a model at a byte budget, or any resident method or
preset, in a ``with`` block), :func:`get_method` (any method or preset, resident or storage, under one
protocol), :func:`recommend` (what the default picks, and why), :func:`load_model`.
"""

from .config import MethodConfig
from .hf.cache import KVPackCache
from .hf.models import load_model
from .methods import Method, available_methods, available_presets, get_method
from .methods.attach import attach
from .methods.recommend import recommend
from .registry import register_method

__version__ = "0.1.0"

__all__ = ["KVPackCache", "Method", "MethodConfig", "attach", "available_methods", "available_presets", "get_method",
           "load_model", "recommend", "register_method"]

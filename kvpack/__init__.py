"""kvpack: compressed KV caches for transformer language models, with measured memory."""

from .codecs import Codec, CodecConfig, available_codecs, get_codec, register_codec

__version__ = "0.1.0"


def load_model(name_or_path: str = "smollm2", **kwargs):
    """Load a model and tokenizer offline; see :func:`kvpack.hf.models.load_model`."""
    from .hf.models import load_model as _load

    return _load(name_or_path, **kwargs)


def KVPackCache(model, codec="full", **config):  # noqa: N802 - factory named like the class it returns
    """A transformers cache compressed by ``codec``; see :class:`kvpack.hf.cache.KVPackCache`."""
    from .hf.cache import KVPackCache as _Cache

    return _Cache(model, codec, **config)


__all__ = ["Codec", "CodecConfig", "KVPackCache", "available_codecs", "get_codec", "load_model", "register_codec"]

"""LMCache's quantizing serdes (TurboQuant, fp8) as a storage peer: :class:`.codec.LMCacheQuantCodec`."""

from .codec import LMCacheQuantCodec, LMCacheQuantConfig

__all__ = ["LMCacheQuantCodec", "LMCacheQuantConfig"]

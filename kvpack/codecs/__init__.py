"""Resident codecs: each compresses one layer's KV of one sequence into a store attention reads."""

from .base import CODECS, Codec, CodecConfig, LayerLayout, LayerStore, available_codecs, get_codec, register_codec

__all__ = ["CODECS", "Codec", "CodecConfig", "LayerLayout", "LayerStore", "available_codecs", "get_codec",
           "register_codec"]

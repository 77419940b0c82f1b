"""Imports every codec module so that each registers itself (see ``base.register_codec``)."""

from . import anchor, evict, full, puzzle, quant, svd, transform  # noqa: F401

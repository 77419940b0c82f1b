"""Imports every codec module so that each registers itself (see ``base.register_codec``)."""

from . import full, puzzle  # noqa: F401

"""Typed reads of a blob's JSON header: every field is checked for presence, type and range before
it is used, and every violation is a :class:`BlobError` that names the field.

A header passed its checksum, so it is not corrupted by accident; these checks are for headers that
are well-formed JSON but not what kvpack wrote (another tool, an older or newer format, a hostile
writer). Nothing here trusts a number before it is bounded: integers are limited to ``MAX_INT``
(no ``OverflowError`` when a shape reaches torch), strings to ``MAX_TEXT`` characters, nesting to
``MAX_DEPTH`` levels.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

MAX_HEADER_BYTES = 16 << 20  # a kvtc header is a few KB; its token ids are a section, not JSON
MAX_DEPTH = 8  # the deepest header kvpack writes nests 5 levels (allocation -> groups -> group)
MAX_INT = 1 << 48  # bounds every count, size, offset and shape entry (256 TiB)
MAX_TEXT = 256


class BlobError(ValueError):
    """A blob that cannot be read: truncated, corrupted, foreign, malformed or from an unknown format version."""


class ForeignBlobError(BlobError):
    """An intact blob made for another model or calibration than the one given."""


def check_fields(record: Mapping, allowed: set[str], where: str = "blob header") -> None:
    """Refuse fields this format does not define (a newer writer, a mutation, a typo)."""
    unknown = sorted(set(record) - allowed)
    if unknown:
        raise BlobError(f"{where} has fields this kvpack does not know: {', '.join(map(str, unknown))[:120]}")


def parse_header(raw: bytes) -> dict:
    """The header's JSON object, refused when it is too large, not UTF-8 JSON, not an object or
    nested deeper than ``MAX_DEPTH``."""
    if len(raw) > MAX_HEADER_BYTES:
        raise BlobError(f"blob header is {len(raw)} bytes, more than the {MAX_HEADER_BYTES} allowed")
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError, or an integer of 4300+ digits
        raise BlobError(f"blob header is not valid JSON: {exc}") from None
    except RecursionError:  # the C parser guards its own recursion
        raise BlobError(f"blob header nests deeper than {MAX_DEPTH} levels") from None
    if not isinstance(header, dict):
        raise BlobError(f"blob header is a JSON {type(header).__name__}, not an object")
    level = [header]
    for _ in range(MAX_DEPTH):  # breadth-first, one nesting level per step
        level = [child for node in level
                 for child in (node.values() if isinstance(node, dict) else node)
                 if isinstance(child, dict | list)]
        if not level:
            return header
    raise BlobError(f"blob header nests deeper than {MAX_DEPTH} levels")


def _get(record: Mapping, key: str, where: str):
    if not isinstance(record, Mapping):
        raise BlobError(f"{where} is a {type(record).__name__}, not an object")
    if key not in record:
        raise BlobError(f"{where} lacks field {key!r}")
    return record[key]


def get_int(record: Mapping, key: str, where: str = "blob header", minimum: int = 0,
            maximum: int = MAX_INT) -> int:
    """``record[key]`` as an int in ``[minimum, maximum]`` (bools are not ints here)."""
    value = _get(record, key, where)
    if isinstance(value, bool) or not isinstance(value, int):
        raise BlobError(f"{where} field {key!r} must be an integer, got {value!r:.60}")
    if not minimum <= value <= maximum:
        raise BlobError(f"{where} field {key!r} must be in [{minimum}, {maximum}], got {value!r:.60}")
    return value


def get_str(record: Mapping, key: str, where: str = "blob header", pattern: str | None = None,
            choices: tuple[str, ...] | None = None) -> str:
    """``record[key]`` as a string of at most ``MAX_TEXT`` characters, matching ``pattern`` (whole)
    or one of ``choices`` when given."""
    value = _get(record, key, where)
    if not isinstance(value, str) or len(value) > MAX_TEXT:
        raise BlobError(f"{where} field {key!r} must be a string of at most {MAX_TEXT} characters, got {value!r:.60}")
    if choices is not None and value not in choices:
        raise BlobError(f"{where} field {key!r} must be one of {choices}, got {value!r:.60}")
    if pattern is not None and not re.fullmatch(pattern, value):
        raise BlobError(f"{where} field {key!r} is not of the expected form, got {value!r:.60}")
    return value


def get_int_list(record: Mapping, key: str, where: str = "blob header", minimum: int = 0,
                 maximum: int = MAX_INT, max_len: int = 1 << 16) -> list[int]:
    """``record[key]`` as a list of at most ``max_len`` ints, each in ``[minimum, maximum]``."""
    value = _get(record, key, where)
    if not isinstance(value, list) or len(value) > max_len:
        raise BlobError(f"{where} field {key!r} must be a list of at most {max_len} integers, got {value!r:.60}")
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int) or not minimum <= item <= maximum:
            raise BlobError(f"{where} field {key!r} must hold integers in [{minimum}, {maximum}], got {item!r:.60}")
    return value


def get_object(record: Mapping, key: str, where: str = "blob header") -> dict:
    """``record[key]``, which must be a JSON object."""
    value = _get(record, key, where)
    if not isinstance(value, dict):
        raise BlobError(f"{where} field {key!r} must be an object, got {type(value).__name__}")
    return value


def get_list(record: Mapping, key: str, where: str = "blob header", max_len: int = 1 << 16) -> list:
    """``record[key]``, which must be a JSON array of at most ``max_len`` items."""
    value = _get(record, key, where)
    if not isinstance(value, list) or len(value) > max_len:
        raise BlobError(f"{where} field {key!r} must be a list of at most {max_len} items, got "
                        f"{type(value).__name__}")
    return value

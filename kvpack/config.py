"""Method configs: validated, versioned, JSON-serialisable dataclasses with declarative field rules.

Every method's config is a dataclass deriving from :class:`MethodConfig`. A field's type, range and
help text are declared once, where the field is defined::

    page_size: int = option(32, integer(minimum=1), "tokens per page P")

:meth:`MethodConfig.validate` checks every declared rule (and then :meth:`MethodConfig.check`, the
hook for rules that relate several fields); it never changes a field. A violation raises
``ValueError`` naming the config, the field, the allowed range and the value given. The CLI reads
the same declarations (defaults and help) for ``--help`` and ``--set`` parsing, so a default lives
in exactly one place.

This module is the bottom of kvpack's layers: it imports nothing of kvpack.
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from dataclasses import dataclass
from typing import Any, ClassVar

STORAGE_DTYPE_NAMES = ("bfloat16", "float16", "float32", "auto")  # "auto": the model's own dtype


# --------------------------------------------------------------------------------------------
# Field rules
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """What one config field accepts. Build it with :func:`integer`, :func:`number`, :func:`boolean`,
    :func:`choice`; ``optional`` admits None."""

    kind: str  # "int" | "number" | "bool" | "choice" | "text"
    optional: bool = False
    minimum: float | None = None
    maximum: float | None = None
    low_open: bool = False  # minimum excluded (numbers)
    odd: bool = False
    multiple_of: int | None = None
    choices: tuple = ()

    def allowed(self) -> str:
        """The allowed values in words (for error messages and ``--help``)."""
        if self.kind == "bool":
            text = "true or false"
        elif self.kind == "text":
            text = "a non-empty string"
        elif self.kind == "choice":
            text = f"one of {self.choices}"
        elif self.kind == "number" and self.minimum is not None and self.maximum is not None:
            text = f"a number in {'(' if self.low_open else '['}{_num(self.minimum)}, {_num(self.maximum)}]"
        else:
            parts = ["an integer" if self.kind == "int" else "a number"]
            if self.minimum is not None:
                parts.append(f"{'>' if self.low_open else '>='} {_num(self.minimum)}")
            if self.maximum is not None:
                parts.append(f"<= {_num(self.maximum)}")
            if self.odd:
                parts.append("odd")
            if self.multiple_of:
                parts.append(f"a multiple of {self.multiple_of}")
            text = ", ".join(parts)
        return text + (", or none" if self.optional else "")

    def error(self, name: str, value: Any) -> str | None:
        """None when ``value`` is allowed, else the message naming ``name``, the rule and the value."""
        if value is None:
            return None if self.optional else f"{name} is required ({self.allowed()})"
        if self.kind == "bool":
            return None if isinstance(value, bool) else f"{name} must be true or false, got {value!r}"
        if self.kind == "text":
            return None if isinstance(value, str) and value else f"{name} must be {self.allowed()}, got {value!r}"
        if self.kind == "choice":
            if value in self.choices and not isinstance(value, bool):
                return None
            return f"{name} must be {self.allowed()}, got {value!r}"
        if self.kind == "int" and (isinstance(value, bool) or not isinstance(value, int)):
            return f"{name} must be an integer ({self.allowed()}), got {value!r}"
        if self.kind == "number" and (isinstance(value, bool) or not isinstance(value, (int, float))):
            return f"{name} must be a number ({self.allowed()}), got {value!r}"
        ranged = self.kind == "number" and self.minimum is not None and self.maximum is not None
        if ranged:
            low_ok = value > self.minimum if self.low_open else value >= self.minimum
            if not (math.isfinite(value) and low_ok and value <= self.maximum):
                return f"{name} must be in {self.allowed().removeprefix('a number in ')}, got {value}"
            return None
        if self.kind == "number" and not math.isfinite(value):
            return f"{name} must be finite ({self.allowed()}), got {value}"
        if self.minimum is not None and (value <= self.minimum if self.low_open else value < self.minimum):
            return f"{name} must be {'>' if self.low_open else '>='} {_num(self.minimum)}, got {value}"
        if self.maximum is not None and value > self.maximum:
            return f"{name} must be <= {_num(self.maximum)}, got {value}"
        if self.odd and value % 2 == 0:
            return f"{name} must be odd ({self.allowed()}), got {value}"
        if self.multiple_of and value % self.multiple_of:
            return f"{name} must be a multiple of {self.multiple_of} ({self.allowed()}), got {value}"
        return None


def _num(x: float) -> str:
    return f"{x:g}"


def integer(minimum: int | None = None, maximum: int | None = None, *, odd: bool = False,
            multiple_of: int | None = None, optional: bool = False) -> Rule:
    return Rule("int", optional, minimum, maximum, odd=odd, multiple_of=multiple_of)


def number(minimum: float | None = None, maximum: float | None = None, *, low_open: bool = False,
           optional: bool = False) -> Rule:
    return Rule("number", optional, minimum, maximum, low_open=low_open)


def boolean() -> Rule:
    return Rule("bool")


def choice(*values, optional: bool = False) -> Rule:
    return Rule("choice", optional, choices=tuple(values))


def text(optional: bool = False) -> Rule:
    return Rule("text", optional)


def option(default: Any, rule: Rule, help: str = "") -> Any:  # noqa: A002 - argparse's word
    """A dataclass field with its rule and help text (read by :meth:`MethodConfig.validate` and the CLI)."""
    return dataclasses.field(default=default, metadata={"rule": rule, "help": help})


def validate_fields(obj) -> None:
    """Check every declared field rule of the dataclass ``obj``; ``ValueError`` on the first violation."""
    for f in dataclasses.fields(obj):
        rule = f.metadata.get("rule")
        if rule is not None:
            message = rule.error(f.name, getattr(obj, f.name))
            if message is not None:
                raise ValueError(f"{type(obj).__name__}: {message}")


# --------------------------------------------------------------------------------------------
# The base config
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MethodConfig:
    """Fields every method shares. Subclasses add fields with :func:`option` and relate them in
    :meth:`check`.

    Attributes:
        budget: target fraction of the dense bf16 bytes, in (0, 1]; None = use the method's own
            parameters as given. Each method maps it onto its parameters and never exceeds it.
        storage_dtype: dtype of dense regions and float factors: ``bfloat16`` (default),
            ``float16``, ``float32`` or ``auto`` (the model's dtype).
        seed: seed for every random choice the method makes.
        check_finite: refuse chunks whose keys or values hold NaN or Inf (default). On a GPU the
            check reads a flag back to the host: a synchronisation per tensor checked, on every
            layer and decode step, which also rules out capturing decode steps in a CUDA graph;
            ``false`` skips it (shapes and dtypes are still checked).

    Example:
        >>> from kvpack.methods import method_config_class
        >>> config = method_config_class("puzzle")(budget=0.4, page_size=64)
        >>> config.to_dict()["page_size"]
        64
        >>> method_config_class("puzzle")(budget=2.0)
        Traceback (most recent call last):
        ...
        ValueError: PuzzleConfig: budget must be in (0, 1], or none, got 2.0
    """

    VERSION: ClassVar[int] = 1

    budget: float | None = option(None, number(0.0, 1.0, low_open=True, optional=True),
                                  "target fraction of the dense bf16 KV bytes")
    storage_dtype: str = option("bfloat16", choice(*STORAGE_DTYPE_NAMES), "dtype of dense regions and factors")
    seed: int = option(0, integer(minimum=0), "seed of every random choice")
    check_finite: bool = option(True, boolean(), "refuse NaN/Inf keys and values")

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first invalid field. Never changes a field."""
        validate_fields(self)
        self.check()

    def check(self) -> None:
        """Rules relating several fields (subclasses extend it); raise ``ValueError`` naming them."""

    def error(self, message: str) -> ValueError:
        """A ``ValueError`` prefixed with this config's name, for :meth:`check`."""
        return ValueError(f"{type(self).__name__}: {message}")

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.VERSION, **dataclasses.asdict(self)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MethodConfig:
        data = dict(data)
        version = data.pop("version", cls.VERSION)
        if version != cls.VERSION:
            raise ValueError(f"{cls.__name__}: config version {version} is not supported (expected {cls.VERSION})")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown field(s) {unknown}; known fields: {sorted(names)}")
        return cls(**data)

    @classmethod
    def parse_overrides(cls, items: list[str]) -> dict[str, Any]:
        """Parse ``["key=value", ...]`` (CLI ``--set``) into typed field values."""
        hints = typing.get_type_hints(cls)
        names = {f.name for f in dataclasses.fields(cls)}
        out: dict[str, Any] = {}
        for item in items:
            key, sep, raw = item.partition("=")
            key = key.strip()
            if not sep:
                raise ValueError(f"--set expects key=value, got {item!r}")
            if key not in names:
                raise ValueError(f"{cls.__name__}: unknown field {key!r}; known fields: {sorted(names)}")
            out[key] = parse_value(key, raw.strip(), hints[key])
        return out

    @classmethod
    def help_lines(cls) -> list[str]:
        """One line per field: name, default, allowed values and help (for ``--help`` texts)."""
        lines = []
        for f in dataclasses.fields(cls):
            rule = f.metadata.get("rule")
            allowed = f"; {rule.allowed()}" if rule else ""
            lines.append(f"{f.name}={f.default!r}{allowed}. {f.metadata.get('help', '')}".rstrip())
        return lines


def parse_value(key: str, raw: str, hint) -> Any:
    """A ``--set`` value parsed as the field's annotated type (``none``/``null`` for optional fields)."""
    args = typing.get_args(hint)
    optional = type(None) in args
    base = next((a for a in args if a is not type(None)), hint) if args else hint
    if optional and raw.lower() in ("none", "null", ""):
        return None
    try:
        if base is bool:
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if base is int:
            return int(raw)
        if base is float:
            return float(raw)
    except ValueError:
        raise ValueError(f"field {key!r}: cannot parse {raw!r} as {base.__name__}") from None
    return raw

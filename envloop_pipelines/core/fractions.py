"""Named fractions that sum to 1: the shared base of split fractions and the benchmark's variant mix.

A subclass is a frozen dataclass whose fields, in order, are the names (each a
fraction in [0, 1]) and which sets two class attributes used in messages:
``label``, the configuration field that holds it, and ``item``, what one name
is::

    @dataclass(frozen=True)
    class VariantMix(Fractions):
        label = "variant_mix"
        item = "variant"
        clean: float = 0.4
        ...

Every error names the field and lists the allowed names.
"""

from __future__ import annotations

from dataclasses import fields
from typing import ClassVar, Self

#: The fractions must sum to 1 within this (float sums such as 0.6 + 0.1 * 4 are not exactly 1).
SUM_TOLERANCE = 1e-6


class Fractions:
    """Base of a frozen dataclass of named fractions in [0, 1] that sum to 1 (see the module docstring)."""

    #: The configuration field that holds these fractions (``fractions``, ``variant_mix``): the
    #: prefix of every message, as in ``variant_mix.clean must be ...``.
    label: ClassVar[str]
    #: What one name is (``split``, ``variant``), as in ``unknown variant 'hard'``.
    item: ClassVar[str]

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The names, in field order."""
        return tuple(f.name for f in fields(cls))  # type: ignore[arg-type]  # subclasses are dataclasses

    def __post_init__(self) -> None:
        for name in self.names():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                raise ValueError(f"{self.label}.{name} must be a number in [0, 1], got {value!r}")
        total = sum(self.as_dict().values())
        if abs(total - 1.0) > SUM_TOLERANCE:
            raise ValueError(f"{self.label} must sum to 1 over {', '.join(self.names())}, "
                             f"got {total:.6f} ({self.as_dict()})")

    def as_dict(self) -> dict[str, float]:
        """Name → fraction, in field order."""
        return {name: getattr(self, name) for name in self.names()}

    @classmethod
    def parse(cls, text: str) -> Self:
        """Parse ``"name=0.6,other=0.4"``; omitted names are 0.

        Raises:
            ValueError: for an unknown name (listing the allowed ones), a value that is not a
                number, or values out of [0, 1] or not summing to 1.
        """
        values = {name: 0.0 for name in cls.names()}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, _, number = part.partition("=")
            if name not in values:
                raise ValueError(f"{cls.label}: unknown {cls.item} {name!r} in {text!r}; "
                                 f"allowed: {', '.join(cls.names())}")
            try:
                values[name] = float(number)
            except ValueError:
                raise ValueError(f"{cls.label}.{name}: {number!r} is not a number") from None
        return cls(**values)


__all__ = ["SUM_TOLERANCE", "Fractions"]

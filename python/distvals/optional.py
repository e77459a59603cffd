"""``Optional``: a value that may be absent (``tf.experimental.Optional``).

``DistributedIterator.get_next_as_optional()`` returns one: ``has_value()`` says whether
the iterator had another element, ``get_value()`` gives it (InvalidArgumentError, a
ValueError, when there is none, as TensorFlow's InvalidArgumentError).
"""

from __future__ import annotations

from typing import Any

from .errors import InvalidArgumentError

__all__ = ["Optional"]

_NOTHING = object()


class Optional:
    """A value or nothing; build one with ``Optional.from_value(v)`` or
    ``Optional.empty(element_spec)``."""

    __slots__ = ("_element_spec", "_value")

    def __init__(self, value: Any = _NOTHING, element_spec: Any = None) -> None:
        self._value = value
        self._element_spec = element_spec

    @staticmethod
    def from_value(value: Any, element_spec: Any = None) -> Optional:
        """An Optional holding ``value``."""
        if element_spec is None:
            from .specs import spec_of

            try:
                element_spec = spec_of(value)
            except Exception:  # noqa: BLE001 - a value without a describable shape
                element_spec = None
        return Optional(value, element_spec)

    @staticmethod
    def empty(element_spec: Any = None) -> Optional:
        """An Optional holding nothing (of the given element_spec)."""
        return Optional(_NOTHING, element_spec)

    def has_value(self) -> bool:
        """True when this Optional holds a value."""
        return self._value is not _NOTHING

    def get_value(self) -> Any:
        """The value; InvalidArgumentError when there is none."""
        if self._value is _NOTHING:
            raise InvalidArgumentError("the Optional does not have a value (check has_value() first)")
        return self._value

    @property
    def element_spec(self) -> Any:
        """The spec of the value it holds (or would hold)."""
        return self._element_spec

    def __repr__(self) -> str:
        return f"Optional({'has a value' if self.has_value() else 'empty'})"

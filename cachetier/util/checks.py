"""Checks that config ``__post_init__`` methods share (no I/O, no imports of our own)."""

from __future__ import annotations


def positive_int(name: str, value: object) -> int:
    """Check that a setting is a positive ``int`` (a ``bool`` is not one).

    Args:
        name: the setting's name, for the message.
        value: its value.

    Returns:
        ``value``, for use in an expression.

    Raises:
        ValueError: ``value`` is not an ``int`` greater than 0.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def fraction(name: str, value: object) -> float:
    """Check that a setting is a number in ``[0, 1)`` (a share of a capacity that leaves room).

    Args:
        name: the setting's name, for the message.
        value: its value.

    Returns:
        ``value`` as a float.

    Raises:
        ValueError: ``value`` is not a number in ``[0, 1)``.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError(f"{name} must be a number in [0, 1), got {value!r}")
    return float(value)

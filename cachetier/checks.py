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

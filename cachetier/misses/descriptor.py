"""``NamespaceDescriptor``: the parts of a namespace, kept apart so that a mismatch can be named.

A block key is chained from ``Namespace.fingerprint``, one digest of the model, the layout and
the tenant; two engines that differ in any of them miss each other's blocks, and the digest
alone cannot say why. A descriptor keeps each part (and the record format version, which the
fingerprint leaves to the record header), so ``differs_from`` can name the parts, and the
message after a rolling upgrade can say "dtype bfloat16 asked, float16 held".
"""

from __future__ import annotations

from dataclasses import dataclass

from cachetier.primitives.keys import DTYPE_BYTES, Namespace
from cachetier.record import FORMAT_VERSION
from cachetier.util.checks import positive_int

PART_NAMES = {
    "model_fingerprint": "model fingerprint",
    "dtype": "dtype",
    "record_tokens": "block size (tokens a record)",
    "arrangement": "layout arrangement",
    "kv_shape": "KV shape (layers, KV heads, head dim)",
    "format_version": "record format version",
    "tenant": "tenant",
}
"""Each part's name in a message, in the order messages list them."""


@dataclass(frozen=True, slots=True)
class NamespaceDescriptor:
    """What a namespace is made of, part by part.

    Args:
        model_fingerprint: identity of the weights and config.
        dtype: the KV dtype name (``DTYPE_BYTES``).
        record_tokens: tokens a record holds (the block size keys are chained over).
        arrangement: the canonical layout arrangement name.
        format_version: the record format version the writer writes.
        tenant: tenant name or cache salt ("" for none).
        kv_shape: ``(num_layers, num_kv_heads, head_dim)``; ``()`` where not known.
    """

    model_fingerprint: str
    dtype: str
    record_tokens: int
    arrangement: str
    format_version: int
    tenant: str = ""
    kv_shape: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("model_fingerprint", "arrangement"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(DTYPE_BYTES)}")
        positive_int("record_tokens", self.record_tokens)
        positive_int("format_version", self.format_version)
        if not isinstance(self.tenant, str):
            raise TypeError(f"tenant must be a str, got {type(self.tenant).__name__}")
        if not isinstance(self.kv_shape, tuple) or len(self.kv_shape) not in (0, 3):
            raise ValueError(
                "kv_shape must be (num_layers, num_kv_heads, head_dim) or (), "
                f"got {self.kv_shape!r}"
            )
        for size in self.kv_shape:
            positive_int("kv_shape entry", size)

    @classmethod
    def from_namespace(
        cls, namespace: Namespace, format_version: int = FORMAT_VERSION
    ) -> NamespaceDescriptor:
        """The descriptor of a namespace built on a record layout (``keys.record_layout``).

        Args:
            namespace: the namespace keys are chained from.
            format_version: the record format version its writer writes (this build's by
                default).

        Returns:
            Its parts.
        """
        layout = namespace.layout
        return cls(
            model_fingerprint=namespace.model_fingerprint,
            dtype=layout.dtype,
            record_tokens=layout.block_size,
            arrangement=layout.arrangement,
            format_version=format_version,
            tenant=namespace.tenant,
            kv_shape=(layout.num_layers, layout.num_kv_heads, layout.head_dim),
        )

    def differs_from(self, other: NamespaceDescriptor) -> list[str]:
        """The names of the parts in which ``other`` differs (field names, ``PART_NAMES``
        order); empty when they are equal.

        Args:
            other: another descriptor.
        """
        if not isinstance(other, NamespaceDescriptor):
            raise TypeError(f"other must be a NamespaceDescriptor, got {type(other).__name__}")
        return [name for name in PART_NAMES if getattr(self, name) != getattr(other, name)]

    def describe_difference(self, held: NamespaceDescriptor) -> str:
        """What differs, in words, with this descriptor as the one asking: e.g. "dtype
        'bfloat16' asked, 'float16' held; tenant 'a' asked, 'b' held".

        Args:
            held: the descriptor the blocks are held under.
        """
        parts = []
        for name in self.differs_from(held):
            asked, kept = _shown(name, getattr(self, name)), _shown(name, getattr(held, name))
            parts.append(f"{PART_NAMES[name]} {asked} asked, {kept} held")
        return "; ".join(parts) if parts else "nothing differs"


def _shown(name: str, value: object) -> str:
    # A model fingerprint is a long digest: its head tells two apart in a log line.
    if name == "model_fingerprint" and isinstance(value, str) and len(value) > 16:
        return repr(value[:16] + "...")
    return repr(value)

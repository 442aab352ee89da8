"""What an admission policy decided for one tier: blocks and bytes admitted and refused."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class AdmissionStats:
    """Decisions of one tier's admission, counted since the policy was built.

    Args:
        admitted: blocks the tier was allowed to write.
        refused: blocks kept out of the tier.
        bytes_admitted: payload bytes of the admitted blocks.
        bytes_refused: payload bytes of the refused blocks: the writes saved.
    """

    admitted: int = 0
    refused: int = 0
    bytes_admitted: int = 0
    bytes_refused: int = 0

    def add(self, admitted: bool, nbytes: int) -> None:
        """Count one decision.

        Args:
            admitted: the verdict.
            nbytes: the block's payload bytes.
        """
        if admitted:
            self.admitted += 1
            self.bytes_admitted += nbytes
        else:
            self.refused += 1
            self.bytes_refused += nbytes

    def copy(self) -> AdmissionStats:
        """A snapshot that later decisions do not change."""
        return AdmissionStats(self.admitted, self.refused, self.bytes_admitted, self.bytes_refused)

    def as_dict(self) -> dict[str, int]:
        """The counts by name (for JSON, ``/metrics`` and the report)."""
        return {
            "admitted": self.admitted,
            "refused": self.refused,
            "bytes_admitted": self.bytes_admitted,
            "bytes_refused": self.bytes_refused,
        }

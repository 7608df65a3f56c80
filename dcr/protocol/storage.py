"""What a receiver's storage holds, and the storage safety rules that protect G1.

The rules hold even against a faulty coordinator:

* a receiver whose storage may hold a partial write refuses a mixed-mode attempt (XOR masks
  assume the committed bits);
* it reopens its gate only at a record it verifiably holds: the target of an attempt it fully
  applied and acknowledged, a record it restored by dense refit, or its committed record when
  nothing was written since (:meth:`Storage.holds`).
"""

from __future__ import annotations

from dataclasses import dataclass

from dcr.protocol.types import CommitRecord

__all__ = ["Storage"]


@dataclass(slots=True)
class Storage:
    """A receiver's storage: the committed record it holds and what may have changed since."""

    held: CommitRecord | None
    """The committed record the storage holds (exactly, unless :attr:`dirty`)."""
    dirty: bool = False
    """Whether an attempt's writes may have landed since :attr:`held`."""
    acked: CommitRecord | None = None
    """The target of the attempt this receiver fully applied and acknowledged, if any."""

    def holds(self, *, record: object = None) -> str | None:
        """Guard: ``None`` when the storage verifiably holds ``record``, else why not."""
        if record == self.acked or (record == self.held and not self.dirty):
            return None
        return (
            f"storage does not hold {record} "
            f"(held {self.held}, acked {self.acked}, dirty={self.dirty})"
        )

    def restored(self, record: CommitRecord) -> None:
        """The storage holds ``record`` exactly (the gate reopened at it, or a dense refit)."""
        self.held = record
        self.dirty = False
        self.acked = None

"""Typed fault injection for tests (`peer join --fault KIND@R`), parsed once when the peer starts.

    stall-sync@R     blocks inside round R's reduce (or exchange), before this peer sends its part;
                     the test then kills the process group
    late-announce@R  announces round R only after its manifest was written without this peer
    late-start@R     announces R ahead as usual but starts R's sync only once its manifest exists
    drift-phi@R      moves every φ value by 1e-3 after round R (the drift check's tests)
    rebalance@R      pipelines: one rebalancing check after this peer's R-th round

"@R+" instead of "@R" fires at every round from R on, so a stall comes in the first round from R
this peer is a member of (one left out of round R on a loaded machine never reaches R's reduce).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Fault(enum.Enum):
    STALL_SYNC = "stall-sync"
    LATE_ANNOUNCE = "late-announce"
    LATE_START = "late-start"
    DRIFT_PHI = "drift-phi"
    REBALANCE = "rebalance"


@dataclass(frozen=True)
class FaultPlan:
    kind: Fault | None = None
    round: int = 0
    onwards: bool = False  # "@R+": every round from R on

    @classmethod
    def parse(cls, text: str | None) -> FaultPlan:
        """``KIND@R`` or ``KIND@R+`` (R may be written ``rR``); None or "" is no fault."""
        if not text:
            return cls()
        name, sep, at = text.partition("@")
        kinds = ", ".join(f.value for f in Fault)
        try:
            kind = Fault(name)
        except ValueError:
            raise ValueError(f"unknown fault {name!r} in {text!r}: use one of {kinds}, as KIND@ROUND") from None
        onwards = at.endswith("+")
        digits = at.rstrip("+").lstrip("r")
        if not sep or not digits.isdigit():
            raise ValueError(f"fault {text!r} names no round: write {name}@ROUND or {name}@ROUND+")
        return cls(kind, int(digits), onwards)

    def at(self, kind: Fault, round_: int) -> bool:
        """Whether the fault ``kind`` fires at ``round_``."""
        if self.kind is not kind:
            return False
        return round_ >= self.round if self.onwards else round_ == self.round

    def __str__(self) -> str:
        return "" if self.kind is None else f"{self.kind.value}@{self.round}{'+' if self.onwards else ''}"

"""The one shape every "why not" takes: a stable key, what to change, and this occurrence's detail.

Every fallback, refusal and degraded path of the plugin is a ``Reason``. Its ``key`` is short and
never formatted with values: it is the stats key an operator counts by and the text a WARNING
leads with. Values that differ per occurrence (a layer name, a shape, an exception) go into
``detail``, which the first log line shows and the counter ignores. ``hint`` says what to change
to get the fast path back; it is written once, where the reason is defined.

A gate (an eligibility check) returns the first ``Reason`` that applies, or None::

    NOT_CUDA = Reason("not CUDA", "run on a CUDA GPU")
    ...
    return NOT_CUDA.because(f"device is {device}")
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Reason:
    key: str  # stable: the stats key and the log's reason
    hint: str  # what to change to get the fast path
    detail: str = ""  # this occurrence: not part of the key

    def because(self, detail: object) -> "Reason":
        """This reason with ``detail`` (anything; its ``str`` is kept, shortened to 300 chars)."""
        text = str(detail)
        return dataclasses.replace(self, detail=text if len(text) <= 300 else text[:297] + "...")

    def same(self, other: "Reason | None") -> bool:
        """Whether ``other`` is this reason, whatever its detail."""
        return other is not None and other.key == self.key

    def describe(self) -> str:
        """``key (detail)``: one line for a log or a load summary."""
        return f"{self.key} ({self.detail})" if self.detail else self.key

    def __str__(self) -> str:
        return self.key

"""Fault injection points: aim a test at one abort window instead of at luck.

The field report's pin took hours of real load to appear. These points make each
window (W1-W5) happen on purpose: pause a transfer between chunks, delay or drop
a KvReady notification or a TransferResult, fail a prefill after its first
chunk, hold an Abort. They are OFF unless named explicitly, by `--faults SPEC` or
the PDMESH_FAULTS environment variable (which `pdmesh up` passes to its children),
and a member with any fault active says so loudly in its log.

SPEC is a comma-separated list of `name=value`, each optionally prefixed by a
member name and a colon so it applies to that member only:

    pause_between_chunks=2.0,decode-0:delay_notifications=0.5
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

ENV = "PDMESH_FAULTS"


@dataclass(frozen=True)
class Faults:
    # prefill
    pause_between_chunks: float = 0.0  # seconds between computing a non-final chunk and its write
    delay_kv_ready: float = 0.0  # seconds to hold the final, notifying write
    drop_kv_ready: bool = False  # the final write carries no notification
    delay_transfer_result: float = 0.0  # seconds to hold the TransferResult
    drop_transfer_result: bool = False  # the stream ends without its TransferResult
    fail_prefills: int = 0  # the first N Prefill calls fail (UNAVAILABLE) after one chunk
    delay_abort: float = 0.0  # seconds an Abort waits before it cancels anything
    stall_forward: float = 0.0  # seconds the compute thread blocks before each forward pass
    # decode
    delay_notifications: float = 0.0  # seconds each received notification is held
    stall_step: float = 0.0  # seconds the compute thread blocks before each decode step

    @property
    def active(self) -> bool:
        return self != Faults()

    @classmethod
    def parse(cls, spec: str | None, member: str) -> Faults:
        """The faults of `spec` that apply to `member`; ValueError names a bad entry."""
        values: dict[str, object] = {}
        fields = {f.name: f.type for f in dataclasses.fields(cls)}
        for entry in (spec or "").split(","):
            entry = entry.strip()
            if not entry:
                continue
            target, _, assignment = entry.rpartition(":")
            if target and target != member:
                continue
            name, sep, raw = assignment.partition("=")
            name = name.strip()
            if not sep or name not in fields:
                known = ", ".join(fields)
                raise ValueError(f"bad fault {entry!r}: expected NAME=VALUE, NAME one of {known}")
            kind = fields[name]
            try:
                if kind == "bool":
                    values[name] = raw.strip().lower() in ("1", "true", "yes", "on")
                elif kind == "int":
                    values[name] = int(raw)
                else:
                    values[name] = float(raw)
            except ValueError:
                raise ValueError(f"bad fault {entry!r}: {raw!r} is not a {kind}") from None
        return cls(**values)

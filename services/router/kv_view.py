"""The router's view of what each member holds in its prefix cache.

Built from the members' KvEvents streams (libs/member/kv_events.py): a SNAPSHOT replaces
a member's view, STORED and REMOVED change it. An event is applied only when it names the
epoch the router paired with and the model of that registration; any other is ignored and
counted by reason (``epoch``, ``model``), so a restarted member's or another model's pages
never steer a request. A member that (re)joins starts from an empty view.

The view is a hint, never a promise: the member's own cache decides what is served (and
verifies token ids), so a stale view costs only a worse placement. The router also
remembers its own recent placements (``predict``): the pages of a prompt it just sent to
a pair whose caches are on count as held there for ``ttl`` seconds, which covers the
moment between a turn's end and its pages' STORED events, so the next turn of the
conversation follows it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pdmesh.v1 import kvevents_pb2 as kpb

MAX_KEYS = 1_000_000  # per member: past this a view is dropped (a member can't hold more)


@dataclass
class MemberView:
    epoch: int
    model: str
    keys: set[bytes] = field(default_factory=set)
    predicted: dict[bytes, float] = field(default_factory=dict)  # key -> expiry
    synced: bool = False  # a SNAPSHOT of this epoch arrived
    enabled: bool = False  # the member said its prefix cache is on


class KvView:
    def __init__(self, ttl: float = 10.0, clock: Callable[[], float] = time.monotonic,
                 on_ignored: Callable[[str], None] = lambda reason: None) -> None:
        self.ttl = ttl
        self.clock = clock
        self.on_ignored = on_ignored
        self.members: dict[str, MemberView] = {}
        self.ignored: dict[str, int] = {}

    def join(self, name: str, epoch: int, model: str) -> None:
        """A member (re)registered: its view starts empty."""
        self.members[name] = MemberView(epoch, model)

    def leave(self, name: str, epoch: int) -> None:
        view = self.members.get(name)
        if view is not None and view.epoch <= epoch:
            del self.members[name]

    def apply(self, name: str, event: kpb.KvCacheEvent) -> bool:
        """Apply one event of ``name``'s stream; False (and counted) if it is ignored."""
        view = self.members.get(name)
        if view is None or event.member.name != name or event.member.epoch != view.epoch:
            return self._ignore("epoch")
        if event.model != view.model:
            return self._ignore("model")
        keys = event.page_keys
        if event.kind == kpb.KvCacheEvent.SNAPSHOT:
            view.keys = set(keys)
            view.synced, view.enabled = True, event.enabled
        elif event.kind == kpb.KvCacheEvent.STORED:
            view.keys.update(keys)
        elif event.kind == kpb.KvCacheEvent.REMOVED:
            view.keys.difference_update(keys)
            for key in keys:
                view.predicted.pop(key, None)
        else:
            return self._ignore("kind")
        if len(view.keys) > MAX_KEYS:
            view.keys.clear()
        return True

    def _ignore(self, reason: str) -> bool:
        self.ignored[reason] = self.ignored.get(reason, 0) + 1
        self.on_ignored(reason)
        return False

    def held(self, name: str, keys: Sequence[bytes]) -> int:
        """How many leading pages of ``keys`` the member holds (or was just sent)."""
        view = self.members.get(name)
        if view is None:
            return 0
        now = self.clock()
        n = 0
        for key in keys:
            if key in view.keys:
                n += 1
                continue
            expiry = view.predicted.get(key)
            if expiry is None or expiry < now:
                break
            n += 1
        return n

    def predict(self, name: str, keys: Sequence[bytes]) -> None:
        """The router placed a prompt of these pages on ``name``: count them held there for
        ``ttl`` seconds, and forget expired predictions. Not for a member that has not said
        its cache is on (no snapshot yet, or --prefix-cache off): it will hold nothing."""
        view = self.members.get(name)
        if view is None or not view.enabled:
            return
        now = self.clock()
        if len(view.predicted) > 4 * len(keys) + 1024:
            view.predicted = {k: t for k, t in view.predicted.items() if t >= now}
        expiry = now + self.ttl
        for key in keys:
            view.predicted[key] = expiry

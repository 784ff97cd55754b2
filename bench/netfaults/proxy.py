"""A loopback TCP fault proxy: the fallback where network namespaces cannot be made, and
for delay where the kernel has no sch_netem.

Each proxy listens on one loopback address and forwards to one service. A member
advertises the proxy's address (--advertise-address), so every gRPC call to it crosses
the proxy; its --bootstrap names another proxy, so its link to the bootstrap can fail on
its own. NIXL's own connection (UCX) does not cross a proxy: in this mode the KV link
is faulted only through the processes (freeze, kill).

Faults: cut (every connection closed, new ones closed at once), partition (connections
stay open and carry nothing, like a silent drop; they are closed when it clears, since
bytes were lost), delay (every chunk held for a fixed time, order kept) and loss (a chunk
is held for a retransmission timeout with the given probability: what TCP turns packet
loss into).
"""

from __future__ import annotations

import asyncio
import random
import threading
from dataclasses import dataclass, field

RETRANSMIT_SECONDS = 0.2  # Linux's minimum TCP retransmission timeout


@dataclass
class Proxy:
    listen: tuple[str, int]
    target: tuple[str, int]
    mode: str = "pass"  # pass | cut | partition | delay | loss
    delay: float = 0.0
    loss: float = 0.0
    writers: set = field(default_factory=set)
    server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._accept, *self.listen)

    async def _accept(self, reader, writer) -> None:
        if self.mode == "cut":
            writer.close()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        pair = {writer, up_writer}
        self.writers |= pair
        try:
            await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer))
        finally:
            for w in pair:
                self.writers.discard(w)
                w.close()

    async def _pump(self, reader, writer) -> None:
        rng = random.Random()
        try:
            while data := await reader.read(65536):
                if self.mode == "partition":
                    continue  # silently dropped
                if self.mode == "delay":
                    await asyncio.sleep(self.delay)
                elif self.mode == "loss" and rng.random() < self.loss:
                    await asyncio.sleep(RETRANSMIT_SECONDS)
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    def close_all(self) -> None:
        for w in list(self.writers):
            w.close()


class Proxies:
    """Proxies run on their own event loop thread, so the load beside them cannot delay
    them and the faults are set from any thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.by_name: dict[str, Proxy] = {}

    def add(self, name: str, listen: tuple[str, int], target: tuple[str, int]) -> None:
        proxy = Proxy(listen, target)
        asyncio.run_coroutine_threadsafe(proxy.start(), self.loop).result(10)
        self.by_name[name] = proxy

    def set(self, names: list[str], mode: str, delay: float = 0.0, loss: float = 0.0) -> None:
        def apply() -> None:
            for name in names:
                proxy = self.by_name[name]
                was = proxy.mode
                proxy.mode, proxy.delay, proxy.loss = mode, delay, loss
                if mode == "cut" or (was == "partition" and mode == "pass"):
                    proxy.close_all()
        self.loop.call_soon_threadsafe(apply)

    def close(self) -> None:
        def stop() -> None:
            for proxy in self.by_name.values():
                proxy.close_all()
                if proxy.server is not None:
                    proxy.server.close()
            self.loop.stop()
        self.loop.call_soon_threadsafe(stop)
        self.thread.join(5)

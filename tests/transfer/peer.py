"""A decode-side peer run in a separate (spawned) process for the real-NIXL tests.

It owns a poisoned pool and answers commands on a pipe; nothing here is faked.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from multiprocessing.connection import Connection
from typing import Any

POISON = 0xA5


def serve(conn: Connection, name: str, num_pages: int, page_bytes: int) -> None:
    """Child main: publish metadata and layout, then answer commands until "exit"."""
    import torch

    from libs.transfer import KvAgent

    pool = torch.full((num_pages, page_bytes), POISON, dtype=torch.uint8)
    agent = KvAgent(name, pool, page_bytes)
    conn.send((agent.metadata(), agent.layout().to_dict()))
    pending: list[tuple[str, bytes]] = []
    while True:
        # Poll notifications between commands, as a decode loop does; with no NIXL progress
        # thread this is also what drives UCX on the receiving side.
        if not conn.poll(0.001):
            pending.extend(agent.get_notifs())
            continue
        cmd, arg = conn.recv()
        if cmd == "notifs":
            end = time.monotonic() + float(arg)
            while not pending and time.monotonic() < end:
                pending.extend(agent.get_notifs())
                time.sleep(0.001)
            conn.send(pending)
            pending = []
        elif cmd == "pool":
            conn.send(pool.clone())
        elif cmd == "exit":
            agent.close()
            conn.send("bye")
            return


class Peer:
    """Parent-side handle of one spawned decode peer."""

    def __init__(self, name: str, num_pages: int, page_bytes: int) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(child, name, num_pages, page_bytes))
        self.proc.start()
        if not self.conn.poll(30):
            self.kill()
            raise TimeoutError("peer did not start")
        self.metadata, self.layout_dict = self.conn.recv()

    def call(self, cmd: str, arg: object = None, timeout: float = 10.0) -> Any:
        self.conn.send((cmd, arg))
        if not self.conn.poll(timeout):
            raise TimeoutError(f"peer did not answer {cmd}")
        return self.conn.recv()

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("exit")
            except (TimeoutError, OSError, EOFError):
                pass
        self.kill()

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)

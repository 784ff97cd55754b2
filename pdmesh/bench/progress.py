"""A one-line progress bar on stderr: requests done, tokens, tokens/s, elapsed.

Redrawn in place at most ten times a second on a terminal; written once, when the run
ends, anywhere else (a log file gets one line per run, not thousands).
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

WIDTH = 24


class Progress:
    def __init__(self, label: str, total: int, stream: TextIO | None = None) -> None:
        self.label, self.total = label, total
        self.stream = stream or sys.stderr
        self.live = self.stream.isatty()
        self.done = self.tokens = 0
        self.started = time.perf_counter()
        self._drawn = 0.0

    def add(self, tokens: int = 0, done: int = 0) -> None:
        self.tokens += tokens
        self.done += done
        if self.live and time.perf_counter() - self._drawn >= 0.1:
            self._draw("\r")

    def close(self) -> None:
        self._draw("\r" if self.live else "")
        self.stream.write("\n")
        self.stream.flush()

    def line(self) -> str:
        elapsed = time.perf_counter() - self.started
        filled = WIDTH * self.done // max(1, self.total)
        rate = self.tokens / elapsed if elapsed > 0 else 0.0
        return (f"{self.label:<22} [{'#' * filled}{'.' * (WIDTH - filled)}] "
                f"{self.done}/{self.total} requests, {self.tokens} tokens, "
                f"{rate:,.0f} tok/s, {elapsed:.1f}s")

    def _draw(self, prefix: str) -> None:
        self._drawn = time.perf_counter()
        self.stream.write(prefix + self.line())
        self.stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

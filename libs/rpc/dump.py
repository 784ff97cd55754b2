"""Stacks of every thread and every asyncio task of this process, for `pdmesh debug dump`."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import traceback

from pdmesh.v1 import common_pb2 as cpb


def thread_stacks() -> list[cpb.StackDump]:
    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():
        stack = "".join(traceback.format_stack(frame))
        out.append(cpb.StackDump(name=f"{names.get(ident, '?')} ({ident})", stack=stack))
    return out


def task_stacks() -> list[cpb.StackDump]:
    """Each task's whole await chain (Task.get_stack stops at the outermost coroutine)."""
    out = []
    for task in asyncio.all_tasks():
        lines = [f"{task!r}\n"]
        awaitable = task.get_coro()
        while awaitable is not None:
            frame = _frame_of(awaitable)
            if frame is not None:
                code = frame.f_code
                lineno = frame.f_lineno or code.co_firstlineno
                lines.append(f'  File "{code.co_filename}", line {lineno}, in {code.co_name}\n')
            awaitable = _awaited_by(awaitable)
        out.append(cpb.StackDump(name=task.get_name(), stack="".join(lines)))
    return out


def _frame_of(awaitable):
    for attr in ("cr_frame", "gi_frame", "ag_frame"):
        frame = getattr(awaitable, attr, None)
        if frame is not None:
            return frame
    return None


def _awaited_by(awaitable):
    for attr in ("cr_await", "gi_yieldfrom", "ag_await"):
        inner = getattr(awaitable, attr, None)
        if inner is not None:
            return inner
    return None


def dump(name: str) -> cpb.DumpReply:
    return cpb.DumpReply(name=name, pid=os.getpid(), threads=thread_stacks(), tasks=task_stacks())

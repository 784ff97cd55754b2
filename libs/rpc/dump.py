"""Stacks of every thread, every asyncio task and every suspended Python coroutine chain of
this process, for `pdmesh debug dump`."""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import threading
import traceback
from types import AsyncGeneratorType, CoroutineType

from pdmesh.v1 import common_pb2 as cpb


def thread_stacks() -> list[cpb.StackDump]:
    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():
        stack = "".join(traceback.format_stack(frame))
        out.append(cpb.StackDump(name=f"{names.get(ident, '?')} ({ident})", stack=stack))
    return out


def task_stacks() -> list[cpb.StackDump]:
    """Each task's whole await chain (Task.get_stack stops at the outermost coroutine),
    then the Python coroutine chains that no task's chain reaches (see below)."""
    out, walked = [], set()
    for task in asyncio.all_tasks():
        lines = [f"{task!r}\n", *_chain(task.get_coro(), walked)]
        out.append(cpb.StackDump(name=task.get_name(), stack="".join(lines)))
    return out + _unreached_chains(walked)


def _chain(awaitable, walked: set[int]) -> list[str]:
    """One await chain, outermost first; records the ids of what it walked."""
    lines = []
    while awaitable is not None:
        walked.add(id(awaitable))
        frame = _frame_of(awaitable)
        if frame is not None:
            code = frame.f_code
            lineno = frame.f_lineno or code.co_firstlineno
            lines.append(f'  File "{code.co_filename}", line {lineno}, in {code.co_name}\n')
        awaitable = _awaited_by(awaitable)
    return lines


def _unreached_chains(walked: set[int]) -> list[cpb.StackDump]:
    """grpc.aio runs every RPC handler under its own Cython coroutine, which hides what it
    awaits: a task's chain ends there, and a request handler's frames would not show. So
    find the suspended Python coroutines and async generators no chain reached, and show
    each chain from its outermost one. An async generator's consumer awaits an `asend`
    object that hides the generator too, so a request through generators shows as several
    chains (the innermost says where it waits)."""
    live = [o for o in gc.get_objects()
            if isinstance(o, (CoroutineType, AsyncGeneratorType)) and _frame_of(o) is not None]
    inner: set[int] = set()
    for o in live:
        awaited = _awaited_by(o)
        while awaited is not None:
            inner.add(id(awaited))
            awaited = _awaited_by(awaited)
    out = []
    for o in live:
        if id(o) in walked or id(o) in inner:
            continue
        kind = "async generator" if isinstance(o, AsyncGeneratorType) else "coroutine"
        lines = [f"<{kind} {o.__qualname__}, reached by no task's chain>\n", *_chain(o, walked)]
        out.append(cpb.StackDump(name=f"{kind} {o.__qualname__}", stack="".join(lines)))
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

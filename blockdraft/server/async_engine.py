"""Drives one LLMEngine from a background thread on behalf of many asyncio handlers.

The engine is not thread-safe, so exactly one thread touches it: the loop below. Handlers never
call the engine; they queue commands (add, abort) under a lock, and the loop applies them
between steps. Handing commands over (instead of letting handlers take an engine lock) matters
because a step can take a long time: a handler waiting on such a lock would stall the event loop,
and CPython locks are not fair, so a loop that re-takes the lock right after releasing it could
starve the handlers indefinitely.

Outputs travel back through `loop.call_soon_threadsafe`, one call per step for the whole batch.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from blockdraft.engine.llm_engine import LLMEngine
from blockdraft.outputs import RequestOutput
from blockdraft.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class QueueFullError(Exception):
    """Every slot is busy and the waiting queue is at its bound."""


class RequestAborted(Exception):
    """The request was aborted (its client went away) before it finished."""


class EngineError(RuntimeError):
    """The engine raised while stepping; every request in flight at the time fails."""


_ABORTED = object()  # queue sentinel


class RequestHandle:
    """The handler's side of one request: outputs arrive on an asyncio queue."""

    def __init__(self, request_id: str, engine: AsyncEngine) -> None:
        self.request_id = request_id
        self.finished = False  # the engine reported the final output
        self.aborted = False
        self._engine = engine
        self._queue: asyncio.Queue[RequestOutput | BaseException | object] = asyncio.Queue()

    def _push(self, item: RequestOutput | BaseException | object) -> None:
        self._queue.put_nowait(item)

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs until the request finishes. A consumer slower than the engine
        gets only the newest state of several steps: each output already contains the earlier
        ones."""
        while not self.finished:
            if self.aborted:
                raise RequestAborted(self.request_id)
            item = await self._queue.get()
            while not self._queue.empty() and isinstance(item, RequestOutput):
                item = self._queue.get_nowait()
            if item is _ABORTED:
                raise RequestAborted(self.request_id)
            if isinstance(item, BaseException):
                raise item
            assert isinstance(item, RequestOutput)
            if item.finished:
                self.finished = True
            yield item

    async def result(self) -> RequestOutput:
        final = None
        async for out in self.outputs():
            final = out
        assert final is not None
        return final

    def abort(self) -> None:
        """Stops the request in the engine (freeing its KV blocks) and wakes the consumer."""
        if not self.finished and not self.aborted:
            self.aborted = True
            self._engine._abort(self.request_id)
            self._push(_ABORTED)


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    done: concurrent.futures.Future[None]


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_waiting: int) -> None:
        if max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {max_waiting}")
        self.engine = engine
        self.max_waiting = max_waiting
        self._cond = threading.Condition()
        self._commands: list[_Add | str] = []  # guarded by _cond; a str is an abort
        self._handles: dict[str, RequestHandle] = {}  # guarded by _cond
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.error: BaseException | None = None  # set if the loop thread itself died

    # -- lifecycle -----------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="blockdraft-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- state, read from the event loop -------------------------------------------------
    @property
    def num_in_flight(self) -> int:
        return len(self._handles)

    @property
    def num_running(self) -> int:
        return self.engine.num_running

    @property
    def num_waiting(self) -> int:
        # Requests handed over but not yet applied wait too. Both reads are racy snapshots of
        # another thread's state, which is all a gauge or an admission check needs.
        return self.engine.num_waiting + sum(isinstance(c, _Add) for c in self._commands)

    # -- requests, called from the event loop ------------------------------------------
    async def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> RequestHandle:
        """Queues a request. Raises QueueFullError when all `max_num_seqs` slots are taken and
        `max_waiting` requests already wait; ValueError when the engine rejects the request."""
        if self._loop is None or not self.is_alive:
            raise EngineError("the engine loop is not running")
        in_flight = self.num_in_flight
        if (
            in_flight >= self.engine.config.max_num_seqs
            and in_flight - self.num_running >= self.max_waiting
        ):
            raise QueueFullError
        handle = RequestHandle(request_id, self)
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        with self._cond:
            if request_id in self._handles:
                raise ValueError(f"request id {request_id!r} is already in use")
            # Registered before the engine sees the request, so no output can miss it.
            self._handles[request_id] = handle
            self._commands.append(_Add(request_id, prompt_token_ids, params, done))
            self._cond.notify()
        try:
            await asyncio.wrap_future(done)
        except BaseException:
            # Rejected by the engine, or the handler was cancelled while waiting: either way
            # nothing may stay behind (an abort of an unknown id is a no-op).
            handle.aborted = True
            self._abort(request_id)
            raise
        return handle

    def _abort(self, request_id: str) -> None:
        with self._cond:
            self._handles.pop(request_id, None)
            self._commands.append(request_id)
            self._cond.notify()

    # -- the engine thread ---------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop_forever()
        except BaseException as e:  # not expected: step errors are handled per step
            logger.exception("blockdraft engine loop died")
            self.error = e
            self._fail_all(EngineError(f"the engine loop died: {e!r}"))

    def _loop_forever(self) -> None:
        engine = self.engine
        busy = False
        while True:
            with self._cond:
                while not (self._stopping or self._commands or busy):
                    self._cond.wait()
                if self._stopping:
                    return
                commands, self._commands = self._commands, []
            for command in commands:
                self._apply(command)
            if engine.has_unfinished_requests():
                try:
                    outputs = engine.step()
                except Exception as e:
                    logger.exception("engine step failed; failing the requests in flight")
                    self._recover(EngineError(f"engine step failed: {e!r}"))
                    outputs = []
                if outputs:
                    self._deliver(outputs)
            busy = engine.has_unfinished_requests()

    def _apply(self, command: _Add | str) -> None:
        if isinstance(command, str):
            self.engine.abort_request(command)
            return
        if not command.done.set_running_or_notify_cancel():
            return  # the handler gave up waiting; its abort follows in the queue
        try:
            self.engine.add_request(command.request_id, command.prompt_token_ids, command.params)
        except Exception as e:  # ValueError for bad input; anything else fails this one only
            command.done.set_exception(e)
        else:
            command.done.set_result(None)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        with self._cond:
            batch = [(self._handles.get(o.request_id), o) for o in outputs]
            for out in outputs:
                if out.finished:
                    self._handles.pop(out.request_id, None)
        batch = [(h, o) for h, o in batch if h is not None]
        if batch and self._loop is not None:
            self._loop.call_soon_threadsafe(_dispatch, batch)

    def _recover(self, error: EngineError) -> None:
        # The engine's state may be inconsistent after a failed step; dropping every request
        # returns its blocks and lets later requests start clean.
        for request_id in list(self.engine.requests):
            self.engine.abort_request(request_id)
        self._fail_all(error)

    def _fail_all(self, error: BaseException) -> None:
        with self._cond:
            handles = list(self._handles.values())
            self._handles.clear()
            pending = [c for c in self._commands if isinstance(c, _Add)]
            self._commands = [c for c in self._commands if not isinstance(c, _Add)]
        for command in pending:
            if command.done.set_running_or_notify_cancel():
                command.done.set_exception(error)
        if handles and self._loop is not None:
            self._loop.call_soon_threadsafe(_dispatch, [(h, error) for h in handles])


def _dispatch(batch: list[tuple[RequestHandle, RequestOutput | BaseException]]) -> None:
    for handle, item in batch:
        handle._push(item)

"""Tensor-parallel worker processes: started, fed and stopped by the driver (rank 0).

The engine of rank 0 (the driver) keeps the scheduler, the requests and their outputs. With
`tensor_parallel_size` N > 1 it starts N - 1 workers itself (torch.multiprocessing spawn, one
per GPU, no torchrun), each of which builds the same engine on its rank's shard
(blockdraft/distributed/tensor_parallel.py) and then runs, step by step, the device work the
driver launches (`LLMEngine.launch_step`) on the chunks the driver scheduled: the driver sends
each step's plan once (`broadcast_object_list`: new requests' sampling parameters, the requests
that left, each chunk's rows and block table, the step's N). Every rank samples from the same
gathered logits, so the sampled tokens, the accepted counts and the drafts are the same on
every rank and stay on the device: nothing comes back from the workers.

Two process groups: the device group (NCCL on GPUs, gloo on CPUs) carries the layers'
collectives; a gloo group carries the plans, with no practical timeout, since a worker waits
there for as long as the driver has no work.

Failures end the engine rather than hang it: a worker that dies (killed, or an exception, which
it prints before exiting) is seen by a watcher thread of the driver, which aborts an NCCL group
so that a collective waiting for it returns; gloo collectives fail as soon as the peer's
sockets close. The step that fails raises a RuntimeError naming the worker, and the engine
stops the others. A worker whose driver dies exits at once (a watcher thread of its own).
`shutdown` (the engine's, at `LLM` shutdown, deletion or exit) sends the workers a stop and
joins them, killing any that do not stop.
"""

from __future__ import annotations

import contextlib
import copy
import multiprocessing.connection
import os
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from blockdraft.config import EngineConfig, tensor_parallel_devices
from blockdraft.distributed.tensor_parallel import TensorParallel
from blockdraft.engine.model_loader import check_tensor_parallel
from blockdraft.engine.scheduler import ScheduledChunk
from blockdraft.engine.sequence import Sequence
from blockdraft.kernels.forward_context import use_kernel_policy
from blockdraft.sampling_params import SamplingParams
from blockdraft.spec_decode.draft_launch import LaunchedDrafts
from blockdraft.spec_decode.drafts import PendingDrafts

HOST = "127.0.0.1"
# A live peer that does not answer a collective for this long is stuck: the collective fails.
# Dead peers are seen at once (see the module doc); this covers the rest, with room for a
# rank's slower weight loading or compiles between two collectives at start.
COLLECTIVE_TIMEOUT = timedelta(minutes=5)
# Workers wait for the next plan however long the driver idles.
PLAN_TIMEOUT = timedelta(days=365)
STARTUP_TIMEOUT_S = 600.0  # for the workers to import torch and reach the rendezvous
STOP_TIMEOUT_S = 10.0  # for a worker to leave after a stop, before it is terminated


@dataclass
class ChunkPlan:
    request_id: str
    start: int
    token_ids: list[int]
    num_drafts: int  # trailing verify rows
    num_tokens: int  # the request's tokens (its sampling position, whether the chunk completes)
    block_table: list[int]
    state_slot: int | None  # hybrid targets: the request's linear-attention state slot


@dataclass
class StepPlan:
    """One step as the driver sends it: what a worker needs to launch the same device work."""

    gone: list[str]  # requests the workers forget (finished or aborted)
    new: list[tuple[str, SamplingParams, int]]  # (id, parameters, seed) of requests new to them
    chunks: list[ChunkPlan]
    num_drafts: int  # N the step proposes (speculative engines)
    window_updates: tuple[list[int], list[int]] | None  # drafter window pages (blocks, pages)
    write_deferred_first: bool  # the drafter writes its deferred context first (draft_launch.py)


@dataclass(eq=False)  # hashed by identity, as the Sequences it stands for (sampling cache keys)
class RequestMirror:
    """A worker's copy of what the device work reads of a request (see `Sequence`)."""

    request_id: str
    params: SamplingParams
    seed: int
    num_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    state_slot: int | None = None
    drafts: PendingDrafts | None = None


def _join_group(
    rank: int, size: int, store: dist.Store, device: torch.device
) -> tuple[TensorParallel, dist.ProcessGroup]:
    """Joins the device group (the default group) and the plans' gloo group."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT
    )
    control = dist.new_group(backend="gloo", timeout=PLAN_TIMEOUT)
    return TensorParallel(rank, size, dist.group.WORLD), control


def _ready_key(rank: int) -> str:
    return f"blockdraft/ready/{rank}"


class TensorParallelWorkers:
    """The driver's side: the worker processes, the group, the plans it sends them."""

    def __init__(self, config: EngineConfig) -> None:
        """Checks the config's shapes, starts the workers and joins the group with them as
        rank 0."""
        check_tensor_parallel(config)  # before any worker starts
        size = config.tensor_parallel_size
        device = torch.device(tensor_parallel_devices(config.device, size)[0])
        if device.type == "cuda":
            torch.cuda.set_device(device)
        store = dist.TCPStore(HOST, 0, world_size=size, is_master=True, wait_for_workers=False)
        ctx = torch.multiprocessing.get_context("spawn")
        threads = torch.get_num_threads()
        self.procs = [
            ctx.Process(
                target=_worker_main,
                args=(rank, size, store.port, config, threads),
                name=f"blockdraft-tp-rank{rank}",
                daemon=True,
            )
            for rank in range(1, size)
        ]
        for proc in self.procs:
            proc.start()
        self._state = _DriverState(self.procs)
        self._stop = weakref.finalize(self, _stop_workers, self._state)
        try:
            self._wait_ready(store, size)
            self.tp, self._state.control = _join_group(0, size, store, device)
        except BaseException:
            self.abort("the workers did not start")
            raise
        self._state.group = self.tp.group
        self._state.abort_on_death = device.type == "cuda"
        threading.Thread(target=_watch, args=(self._state,), daemon=True).start()
        self._known: dict[str, Sequence] = {}  # requests the workers hold a mirror of

    def _wait_ready(self, store: dist.Store, size: int) -> None:
        """Waits for every worker to reach the rendezvous, failing at once if one dies first
        (the group's own rendezvous would wait for it until its timeout)."""
        keys = [_ready_key(r) for r in range(1, size)]
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not store.check(keys):
            self.raise_if_dead()
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"tensor-parallel workers did not start within {STARTUP_TIMEOUT_S:.0f} s"
                )
            time.sleep(0.02)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def dead_worker(self) -> str | None:
        """A description of the first worker that has exited, None while all run."""
        for rank, proc in enumerate(self.procs, start=1):
            if not proc.is_alive():
                return f"rank {rank} (pid {proc.pid}, exit code {proc.exitcode})"
        return None

    def raise_if_dead(self) -> None:
        dead = self.dead_worker()
        if dead is not None:
            raise RuntimeError(
                f"tensor-parallel worker {dead} has died (its error, if any, is on stderr); "
                "the engine cannot continue: start a new one"
            )

    def send_step(
        self,
        chunks: list[ScheduledChunk],
        num_drafts: int,  # N proposed this step
        requests: dict[str, Sequence],  # the engine's live requests
        window_updates: tuple[list[int], list[int]] | None = None,
        write_deferred_first: bool = False,
    ) -> None:
        """Sends the step's plan to every worker (one broadcast)."""
        self.raise_if_dead()
        known = self._known
        gone = [rid for rid, seq in known.items() if requests.get(rid) is not seq]
        for rid in gone:
            del known[rid]
        new = []
        for c in chunks:
            seq = c.seq
            if seq.request_id not in known:
                known[seq.request_id] = seq
                new.append((seq.request_id, seq.params, seq.seed))
        plan = StepPlan(
            gone,
            new,
            [
                ChunkPlan(
                    c.seq.request_id,
                    c.start,
                    c.token_ids,
                    c.num_drafts,
                    c.seq.num_tokens,
                    c.seq.block_table,
                    c.seq.state_slot,
                )
                for c in chunks
            ],
            num_drafts,
            window_updates,
            write_deferred_first,
        )
        dist.broadcast_object_list([plan], src=0, group=self._state.control)

    @contextlib.contextmanager
    def failing_loudly(self) -> Iterator[None]:
        """Around a step: any failure in it (a worker died, a collective failed, an interrupt)
        stops the workers, whose next collectives would no longer match the driver's, and
        raises a RuntimeError that names a dead worker (an interrupt goes on as it is)."""
        if self._state.failed is not None:
            raise RuntimeError(self._state.failed)
        try:
            yield
        except BaseException as e:
            # A collective can fail a moment before the dead peer's exit is visible here.
            deadline = time.monotonic() + 2.0
            while self.dead_worker() is None and time.monotonic() < deadline:
                time.sleep(0.02)
            dead = self.dead_worker()
            message = (
                f"tensor-parallel worker {dead} has died (its error, if any, is on stderr)"
                if dead is not None
                else f"a tensor-parallel step failed ({type(e).__name__}: {e})"
            )
            self._state.failed = f"{message}; the engine stopped: start a new one"
            self.shutdown()
            if not isinstance(e, Exception):
                raise
            raise RuntimeError(self._state.failed) from e

    @contextlib.contextmanager
    def aborting_on_failure(self) -> Iterator[None]:
        """Around the driver engine's start: a failure kills the workers, which would wait for
        the driver's next collective."""
        try:
            yield
        except BaseException:
            self.abort("the engine failed to start")
            raise

    def shutdown(self) -> None:
        """Stops the workers (a second call does nothing)."""
        self._stop()

    def abort(self, reason: str) -> None:
        """Kills the workers at once: they may wait in a collective the driver never joins."""
        self._state.failed = self._state.failed or reason
        self._stop()


class _DriverState:
    """What stopping the workers needs, apart from the driver object (its finalizer's)."""

    def __init__(self, procs: list[multiprocessing.Process]) -> None:
        self.procs = procs
        self.control: dist.ProcessGroup | None = None
        self.group: dist.ProcessGroup | None = None
        self.abort_on_death = False
        self.stopping = False
        self.failed: str | None = None


def _watch(state: _DriverState) -> None:
    """Waits for a worker to exit; one that exits before a stop is a death: on NCCL the group
    is aborted, so that the driver's collective waiting for the dead rank fails now instead of
    at its timeout (gloo's fail by themselves when the peer's sockets close)."""
    multiprocessing.connection.wait([p.sentinel for p in state.procs])
    if state.stopping or not state.abort_on_death:
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is not None:
        with contextlib.suppress(Exception):
            abort(state.group)


def _stop_workers(state: _DriverState) -> None:
    state.stopping = True
    live = [p for p in state.procs if p.is_alive()]
    # After a failure the workers may wait in a collective that never completes: no stop.
    graceful = state.control is not None and state.failed is None
    if live and graceful:
        with contextlib.suppress(Exception):
            dist.broadcast_object_list([None], src=0, group=state.control)
    deadline = time.monotonic() + (STOP_TIMEOUT_S if graceful else 0.0)
    for proc in live:
        proc.join(max(deadline - time.monotonic(), 0.0))
    for proc in live:
        if proc.is_alive():
            proc.kill()
            proc.join()
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


# -- the worker process ---------------------------------------------------------------------
def _worker_main(rank: int, size: int, port: int, config: EngineConfig, num_threads: int) -> None:
    """A worker's life: join the group, build the engine's rank shard, run the driver's steps
    until it says stop. Errors are printed and end the process (the driver sees it exit)."""
    torch.set_num_threads(num_threads)
    threading.Thread(target=_exit_with_driver, daemon=True).start()
    try:
        device = tensor_parallel_devices(config.device, size)[rank]
        if torch.device(device).type == "cuda":
            torch.cuda.set_device(device)
        store = dist.TCPStore(HOST, port, world_size=size, is_master=False)
        store.set(_ready_key(rank), "1")
        tp, control = _join_group(rank, size, store, torch.device(device))
        # The worker builds the driver's engine (same start-up, graphs and warm-up, so the
        # collectives line up); imported here, as it imports this module.
        from blockdraft.engine.llm_engine import LLMEngine

        config = copy.copy(config)
        config.device = device
        engine = LLMEngine(config, tp=tp)
        WorkerLoop(engine, control).run()
    except KeyboardInterrupt:  # Ctrl-C reaches the whole process group: the driver's too
        sys.exit(130)
    except Exception as e:
        print(f"blockdraft tensor-parallel worker rank {rank} failed: {e!r}", file=sys.stderr)
        traceback.print_exc()
        sys.exit(1)
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def _exit_with_driver() -> None:
    """Ends the worker as soon as the driver's process ends, whatever the worker waits for (a
    collective on NCCL would otherwise wait for its timeout)."""
    multiprocessing.connection.wait([multiprocessing.parent_process().sentinel])
    os._exit(1)


class WorkerLoop:
    """Runs the driver's plans on a worker's engine; keeps a mirror of each live request."""

    def __init__(self, engine: object, control: dist.ProcessGroup) -> None:
        self.engine, self.control = engine, control
        self.requests: dict[str, RequestMirror] = {}

    def run(self) -> None:
        while True:
            box: list[StepPlan | None] = [None]
            dist.broadcast_object_list(box, src=0, group=self.control)
            if box[0] is None:
                return
            self.execute(box[0])

    def execute(self, plan: StepPlan) -> None:
        for rid in plan.gone:
            del self.requests[rid]
        for rid, params, seed in plan.new:
            self.requests[rid] = RequestMirror(rid, params, seed)
        chunks = []
        for c in plan.chunks:
            mirror = self.requests[c.request_id]
            mirror.num_tokens, mirror.block_table = c.num_tokens, c.block_table
            mirror.state_slot = c.state_slot
            chunks.append(ScheduledChunk(mirror, c.start, c.token_ids, c.num_drafts))
        with torch.inference_mode(), use_kernel_policy(self.engine.kernel_policy):
            self.engine.apply_window_updates(plan.window_updates)
            drafts = self.engine.launch_step(chunks, plan.num_drafts, plan.write_deferred_first)[1]
        mirror_drafts(chunks, drafts)


def mirror_drafts(chunks: list[ScheduledChunk], drafts: LaunchedDrafts | None) -> None:
    """A worker's drafts bookkeeping, as the driver's `_process_step` does it: a verify
    consumes the request's drafts, a proposer holds its new row."""
    for c in chunks:
        if c.num_drafts:
            c.seq.drafts = None
    if drafts is not None:
        for i, pending in drafts.pending():
            chunks[i].seq.drafts = pending

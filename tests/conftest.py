import contextlib
import os
import random
import zlib
from collections.abc import Callable, Iterator

# Triton reads TRITON_INTERPRET when it is first imported, and other modules (torch's FlexAttention
# and inductor) may import it before the kernel tests do: on a machine without a GPU the
# Triton kernels can only run in the interpreter, so turn it on before anything else loads.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from blockdraft import threads  # noqa: E402
from blockdraft.kernels.forward_context import use_kernel_policy  # noqa: E402
from blockdraft.kernels.policy import KernelPolicy  # noqa: E402

from sampling_checks import BASE_SEED, Ctx  # noqa: E402


def _round_interpreted_bf16_casts_to_nearest() -> None:
    """Make the interpreter's float32 -> bfloat16 casts round to nearest even, as the GPU's do.

    Triton's interpreter truncates them: errors of one sign that a norm can blow up (a
    near-cancelling Gated DeltaNet head came out 9x further from float32 than torch's same
    roundings), so a kernel compared with its torch twin failed now and then on CPU only."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    truncating_cast = getattr(builder, "cast_impl", None)
    if truncating_cast is None:  # another Triton: its casts as they are
        return

    def cast_impl(self, src, dst_type):  # noqa: ANN001, ANN202 (the interpreter's signature)
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            values = np.array(src.data, dtype=np.float32)  # a contiguous copy, scalars kept 0-d
            rounded = torch.from_numpy(values).to(torch.bfloat16)
            return interpreter.TensorHandle(rounded.view(torch.int16).numpy().view(np.uint16),
                                            tl.bfloat16)  # fmt: skip
        return truncating_cast(self, src, dst_type)

    builder.cast_impl = cast_impl


_round_interpreted_bf16_casts_to_nearest()

# Tests check numerics in float32 on the CPU with tiny models, where extra threads only spin:
# one thread was 15x faster than two on a loaded 2-core machine.
torch.set_num_threads(1)


# A test worker (pytest-xdist) peaked at 6.3 GiB resident over the whole suite (the tests that
# hold the embedded SmolLM2 target in float32 beside transformers' copy); most of its time it
# holds far less, so two peaks seldom meet.
WORKER_MEMORY_BYTES = 6 << 30


def _usable_cpus() -> int:
    """CPUs this process may run on (the engine's count: its affinity mask), within a cgroup v2
    CPU quota if any."""
    cpus = threads._usable_cpus()
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()
    except (OSError, ValueError):
        return cpus
    return cpus if quota == "max" else max(1, min(cpus, int(quota) // int(period)))


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None
    return kib << 10


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: a worker per usable CPU (every test keeps to one thread, so hyperthreads count;
    pytest-xdist's own count takes psutil's physical cores, one on a 2-vCPU machine of one
    core's two threads, or a container's host's), and no more than memory holds."""
    workers = _usable_cpus()
    memory = _available_memory()
    if memory is not None:
        workers = min(workers, max(1, memory // WORKER_MEMORY_BYTES))
    return workers


@pytest.fixture(autouse=True)
def one_thread_after_each_test() -> Iterator[None]:
    """A test that starts an engine on more threads (`num_threads=2`) leaves the process on
    them: the tests after it go back to one."""
    yield
    torch.set_num_threads(1)


@pytest.fixture
def rng() -> torch.Generator:
    """Fresh randomness per run; the seed is printed so a failure can be replayed. (Its seed is
    not drawn with `torch.seed()`, which would reseed the global generator that the module's
    random checkpoints come from.)"""
    env = os.environ.get("BLOCKDRAFT_TEST_SEED")
    seed = int(env) if env else random.SystemRandom().randrange(2**31)
    print(f"test seed: {seed} (set BLOCKDRAFT_TEST_SEED to replay)")
    return torch.Generator().manual_seed(seed)


@pytest.fixture(scope="module", autouse=True)
def seeded_global_generator(request: pytest.FixtureRequest) -> None:
    """The global generator, which random checkpoints draw their weights from (`seed=None`),
    starts each module from BASE_SEED mixed with the module's name: fresh weights each run,
    the same again under BLOCKDRAFT_TEST_SEED=BASE_SEED (a statistical test's failure names it)."""
    torch.manual_seed(BASE_SEED ^ zlib.crc32(request.module.__name__.encode()))


@pytest.fixture
def py_rng(rng: torch.Generator) -> random.Random:
    """A Python `random.Random` seeded from `rng` (so BLOCKDRAFT_TEST_SEED replays it too)."""
    return random.Random(int(torch.randint(0, 2**31, (1,), generator=rng)))


@pytest.fixture
def set_policy() -> Iterator[Callable[..., KernelPolicy]]:
    """`set_policy(**fields)`: kernels follow `KernelPolicy(**fields)` for the rest of the test
    (or until the next call), as the engine's forwards follow its config's."""
    with contextlib.ExitStack() as stack:

        def enter(**fields: object) -> KernelPolicy:
            policy = KernelPolicy(**fields)
            stack.enter_context(use_kernel_policy(policy))
            return policy

        yield enter


@pytest.fixture
def ctx(request: pytest.FixtureRequest) -> Ctx:
    # Mixing in the test id gives each (parametrised) test its own inputs while one
    # environment variable still replays the whole run.
    seed = BASE_SEED ^ zlib.crc32(request.node.nodeid.encode())
    print(f"BLOCKDRAFT_TEST_SEED={BASE_SEED}")
    return Ctx(torch.Generator().manual_seed(seed), f"[BLOCKDRAFT_TEST_SEED={BASE_SEED}]")

"""One engine configuration, validated once in __post_init__.

The one environment variable blockdraft reads, here and nowhere else:

    BLOCKDRAFT_KERNELS=auto|torch|triton

the kernel backend of `EngineConfig`'s default `kernel_policy` (read when the config is made;
unset or "auto": Triton on CUDA when it imports, the torch twins elsewhere; "torch" / "triton"
force one, e.g. to compare the two paths; Triton on the CPU needs TRITON_INTERPRET=1). Every
other kernel choice is a field of `blockdraft.kernels.policy.KernelPolicy`.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from blockdraft.assets import DEFAULT_DRAFTER, default_drafter_path
from blockdraft.kernels.policy import BACKENDS, KernelPolicy
from blockdraft.models.draft_vocab import check_token_map_path
from blockdraft.spec_decode.draft_schedule import check_draft_schedule, is_positive_int

KERNELS_ENV_VAR = "BLOCKDRAFT_KERNELS"


def default_kernel_policy() -> KernelPolicy:
    """`KernelPolicy()` with the backend BLOCKDRAFT_KERNELS names (unset: "auto")."""
    backend = os.environ.get(KERNELS_ENV_VAR, "").strip().lower() or "auto"
    if backend not in BACKENDS:
        raise ValueError(f"{KERNELS_ENV_VAR} must be one of {', '.join(BACKENDS)}; got {backend!r}")
    return KernelPolicy(backend=backend)


@dataclass
class SpeculativeConfig:
    model: str  # drafter directory or .gguf; "default": the drafter shipped for the default target
    method: str = "dflash"
    # default: the drafter's block_size - 1; at most 3 on the CPU (draft_schedule.py says why)
    num_speculative_tokens: int | None = None
    # Draft tokens per step by batch size, {at least this many running requests: N}, e.g.
    # {1: 15, 24: 7}; below the smallest key N is num_speculative_tokens; N = 0: no drafts.
    # "auto": N chosen each step from the requests' acceptance and the measured step costs
    # (blockdraft.spec_decode.draft_length), at most {24: 7} on CUDA, {4: 0} on the CPU
    # (blockdraft.spec_decode.draft_schedule); None: fixed N.
    num_speculative_tokens_by_batch: dict[int, int] | str | None = "auto"
    # Benchmark only: accept each draft with this probability instead of verifying it, so speed
    # can be measured at a chosen acceptance length with random weights. Output is meaningless.
    synthetic_acceptance_rate: float | None = None
    # The target tokens the drafter may propose (SGLang's speculative_token_map, after
    # FR-Spec): its head scores only those, a fraction of the vocabulary's cost
    # (blockdraft/models/draft_vocab.py). A .pt or .json file of token ids; "auto": the
    # drafter directory's own token_map.pt if it has one (the shipped drafter does); None: the
    # whole vocabulary.
    token_map: str | None = "auto"

    def __post_init__(self) -> None:
        check_token_map_path(self.token_map)
        rate = self.synthetic_acceptance_rate
        if rate is not None and not 0 <= rate <= 1:
            raise ValueError(f"synthetic_acceptance_rate must be in [0, 1], got {rate}")
        if self.method != "dflash":
            raise ValueError(f"speculative method {self.method!r} is not supported; use 'dflash'")
        n = self.num_speculative_tokens
        if n is not None and not is_positive_int(n):
            raise ValueError(f"num_speculative_tokens must be a positive integer, got {n!r}")
        check_draft_schedule(self.num_speculative_tokens_by_batch, n)

    @classmethod
    def coerce(cls, value: SpeculativeConfig | dict | None) -> SpeculativeConfig | None:
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError("speculative_config must be a dict or SpeculativeConfig")
        unknown = set(value) - {
            "model",
            "method",
            "num_speculative_tokens",
            "num_speculative_tokens_by_batch",
            "synthetic_acceptance_rate",
            "token_map",
        }
        if unknown:
            raise ValueError(f"unknown speculative_config keys: {sorted(unknown)}")
        if "model" not in value:
            raise ValueError("speculative_config needs 'model' (the drafter directory)")
        return cls(**value)


@dataclass
class EngineConfig:
    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct GGUF
    dtype: str = "auto"  # auto: bfloat16 on GPU, float32 on CPU
    device: str = "auto"
    max_num_seqs: int = 64
    max_model_len: int | None = None
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from memory
    kv_cache_memory_gib: float = 2.0  # CPU pool size when num_kv_blocks is None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    seed: int = 0
    load_format: str = "auto"  # "auto" | "dummy" (random weights from config.json alone)
    enforce_eager: bool = False  # True: no CUDA graphs on GPU
    # "auto": the drafter shipped for the default target when that target runs on the CPU,
    # where it is measured faster than plain decoding (BENCHMARKS.md: 1.24-1.48x at T = 0 on
    # GSM8K, AIME, HumanEval and MT-Bench, ~1.05x at T = 1); nothing otherwise (on a GPU it is
    # faster at T = 0 but ~0.6x at T = 1). None: no speculation.
    speculative_config: SpeculativeConfig | dict | str | None = "auto"
    # True: plain decode steps are pipelined ("async scheduling"): step t+1 is launched before
    # step t is read back, its input ids taken on the device from step t's sampled tokens, so
    # the host's bookkeeping overlaps the GPU's work. Same outputs as False; steps that are not
    # plain decode of an unchanged batch run as usual. No effect with speculative_config.
    # None: on for CUDA (measured on an H200: 4.78 -> 4.43 ms a Qwen3-8B decode step at batch
    # 1), off on the CPU, where the host does the forward itself and nothing overlaps.
    async_decode: bool | None = None
    # Every kernel choice (blockdraft/kernels/policy.py); the default's backend comes from
    # BLOCKDRAFT_KERNELS.
    kernel_policy: KernelPolicy = field(default_factory=default_kernel_policy)
    # torch intra-op threads for this process (torch.set_num_threads is process-wide). None:
    # chosen at start from the cores free at that moment (blockdraft/threads.py says why).
    num_threads: int | None = None
    # Ranks the model is split over (vLLM's tensor_parallel_size): the engine starts N - 1
    # worker processes, one per GPU from `device` on (gloo processes on the CPU), and shards
    # every layer over them (blockdraft/engine/tp_workers.py). 1: one process, no collectives.
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.kernel_policy, KernelPolicy):
            raise ValueError(
                f"kernel_policy must be a KernelPolicy, got {type(self.kernel_policy).__name__}"
            )
        if self.async_decode is not None and not isinstance(self.async_decode, bool):
            raise ValueError(
                f"async_decode must be True, False or None (auto), got {self.async_decode!r}"
            )
        if self.num_threads is not None and not is_positive_int(self.num_threads):
            raise ValueError(f"num_threads must be a positive integer, got {self.num_threads!r}")
        if not is_positive_int(self.tensor_parallel_size):
            size = self.tensor_parallel_size
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {size!r}")
        self.device = resolve_device(self.device)
        if self.tensor_parallel_size > 1 and self.async_decode:
            raise ValueError(
                "async_decode is not supported with tensor_parallel_size > 1: leave it unset"
            )
        if self.async_decode is None:
            # Workers replay the driver's launched steps, not the steps it launches ahead.
            on_cuda = torch.device(self.device).type == "cuda"
            self.async_decode = on_cuda and self.tensor_parallel_size == 1
        dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
        if self.dtype == "auto":
            self.dtype = "bfloat16" if self.device.startswith("cuda") else "float32"
        if self.dtype not in dtypes:
            raise ValueError(f"dtype must be one of auto, {', '.join(dtypes)}; got {self.dtype!r}")
        self.torch_dtype = dtypes[self.dtype]
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            value = getattr(self, name)
            if not is_positive_int(value):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("max_model_len", "num_kv_blocks"):  # None: sized automatically
            value = getattr(self, name)
            if value is not None and not is_positive_int(value):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        if not _is_number(self.gpu_memory_utilization) or not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}"
            )
        if not _is_number(self.kv_cache_memory_gib) or self.kv_cache_memory_gib <= 0:
            raise ValueError(
                f"kv_cache_memory_gib must be a positive number, got {self.kv_cache_memory_gib!r}"
            )
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if isinstance(self.speculative_config, str):
            if self.speculative_config != "auto":
                raise ValueError(
                    f"speculative_config must be a dict, 'auto' or None, got "
                    f"{self.speculative_config!r}"
                )
            on = self.model is None and self.load_format == "auto"
            on = on and torch.device(self.device).type == "cpu"
            self.speculative_config = {"method": "dflash", "model": DEFAULT_DRAFTER} if on else None
        self.speculative_config = SpeculativeConfig.coerce(self.speculative_config)
        spec = self.speculative_config
        if spec is not None and spec.model == DEFAULT_DRAFTER:
            if self.model is not None:
                raise ValueError(
                    f"speculative model {DEFAULT_DRAFTER!r} is the drafter trained for the "
                    f"default SmolLM2 target; for {self.model} give a drafter directory"
                )
            self.speculative_config = dataclasses.replace(spec, model=default_drafter_path())
        if spec is not None and spec.token_map not in (None, "auto"):
            if self.tensor_parallel_size > 1:
                raise ValueError(
                    "token_map is not supported with tensor_parallel_size > 1 (each rank holds "
                    "another slice of the head): drop it"
                )


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def resolve_device(device: str) -> str:
    """The device to run on: `auto` is cuda when torch sees a GPU, else cpu; other names must
    be cpu, cuda or cuda:N (whether this machine has them: `check_device_available`)."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        kind = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {device!r}: use auto, cpu, cuda or cuda:N") from None
    if kind.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r} is not supported: use auto, cpu, cuda or cuda:N")
    return device


def check_tensor_parallel_shape(size: int, what: str, cfg: object) -> None:
    """Whether a model (`what`: "the target", "the drafter") splits over `size` ranks: its
    query heads, its KV heads (or, fewer KV heads than ranks, the ranks over them: each KV head
    is then replicated on the ranks of its query heads), the intermediate size of its dense
    MLPs and, for a mixture of experts, its experts (each rank holds whole experts, whatever
    their width) and its shared expert's intermediate size; for a hybrid, the key and value
    heads of its Gated DeltaNet layers. `cfg` has num_heads, num_kv_heads, intermediate_size
    and optionally num_layers, moe, layer_types and linear_num_{key,value}_heads (a models
    TransformerConfig)."""
    if size == 1:
        return
    heads, kv_heads, inter = cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    moe = getattr(cfg, "moe", None)
    problems = []
    if heads % size:
        problems.append(f"its {heads} attention heads")
    if kv_heads % size and size % kv_heads:
        problems.append(f"its {kv_heads} KV heads (nor is it a multiple of them)")
    dense = moe is None or any(not moe.is_sparse(i) for i in range(cfg.num_layers))
    if dense and inter % size:
        problems.append(f"its intermediate_size {inter}")
    if "linear_attention" in getattr(cfg, "layer_types", ()):
        for kind in ("key", "value"):
            linear_heads = getattr(cfg, f"linear_num_{kind}_heads")
            if linear_heads % size:
                problems.append(f"its {linear_heads} Gated DeltaNet {kind} heads")
    if moe is not None and moe.num_experts % size:
        problems.append(f"its {moe.num_experts} experts")
    if moe is not None and moe.shared_expert_intermediate_size % size:
        problems.append(
            f"its shared_expert_intermediate_size {moe.shared_expert_intermediate_size}"
        )
    if problems:
        raise ValueError(
            f"tensor_parallel_size {size} does not divide {' and '.join(problems)} of {what}: "
            "pick a size that does"
        )


def tensor_parallel_devices(device: str, size: int) -> list[str]:
    """Each rank's device: consecutive GPUs from `device`'s on CUDA, the CPU for every rank
    off it."""
    kind = torch.device(device)
    if kind.type != "cuda":
        return [device] * size
    first = kind.index or 0
    return [f"cuda:{first + r}" for r in range(size)]


def check_can_run(config: EngineConfig) -> None:
    """What a configuration alone does not tell: whether this machine has its device and its
    model and drafter paths hold checkpoints. Checked before an engine starts (LLM, serve)."""
    check_device_available(config.device, config.tensor_parallel_size)
    if config.model is not None:
        check_model_path(config.model)
    if config.speculative_config is not None:
        check_drafter_path(config.speculative_config.model)


def check_device_available(device: str, tensor_parallel_size: int = 1) -> None:
    """Whether this torch build and machine can run on `device` (and the GPUs after it, one per
    tensor-parallel rank), checked before an engine or a trainer starts, so that a wrong one
    fails in one line instead of deep inside torch."""
    kind = torch.device(device)
    if kind.type != "cuda":
        return
    if torch.version.cuda is None:
        raise ValueError(
            f"device {device!r} needs a CUDA build of torch, but torch {torch.__version__} "
            "is CPU-only: use device cpu (or auto), or install torch from a CUDA wheel index"
        )
    count = torch.cuda.device_count()
    if count == 0:
        raise ValueError(
            f"device {device!r}: torch sees no CUDA GPU on this machine (driver missing, "
            "or CUDA_VISIBLE_DEVICES empty): use device cpu (or auto)"
        )
    if kind.index is not None and kind.index >= count:
        raise ValueError(
            f"device {device!r}: this machine has {count} CUDA GPU(s), cuda:0 to cuda:{count - 1}"
        )
    available = count - (kind.index or 0)
    if tensor_parallel_size > available:
        raise ValueError(
            f"tensor_parallel_size {tensor_parallel_size} needs {tensor_parallel_size} GPUs from "
            f"{device}, but this machine has {available} there ({count} in all)"
        )


def check_model_path(model: str) -> None:
    """A target must be a .gguf file or a Hugging Face directory with config.json."""
    if not isinstance(model, str | os.PathLike):
        raise ValueError(f"model must be a path (str), got {model!r}")
    path = Path(model).expanduser()
    fix = "give a Hugging Face checkpoint directory or a .gguf file (unset: SmolLM2-135M)"
    if not path.exists():
        raise ValueError(f"model path {model!r} does not exist: {fix}")
    if path.is_file() and path.suffix != ".gguf":
        raise ValueError(f"model path {model!r} is a file but not a .gguf: {fix}")
    if path.is_dir() and not (path / "config.json").is_file():
        raise ValueError(f"model directory {model!r} has no config.json: {fix}")


def check_drafter_path(model: str) -> None:
    """A drafter is a directory (z-lab's or vLLM speculators' format: config.json and
    safetensors) or a llama.cpp .gguf file."""
    if not isinstance(model, str | os.PathLike):
        raise ValueError(f"the drafter's model must be a path (str), got {model!r}")
    path = Path(model).expanduser()
    fix = "give a DFlash drafter directory (config.json, model.safetensors), a .gguf, or 'default'"
    if path.is_file() and path.suffix == ".gguf":
        return
    if not path.is_dir():
        raise ValueError(f"drafter directory {model!r} does not exist: {fix}")
    if not (path / "config.json").is_file():
        raise ValueError(f"drafter directory {model!r} has no config.json: {fix}")

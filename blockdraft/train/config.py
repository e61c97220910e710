"""What a drafter training run is asked to do (`TrainConfig`, checked and completed on
construction) and what it reports (`StepStats` per optimizer step, `TrainResult` at the end).

Apart from the `Trainer` (`trainer.py`) so that the run's settings read on their own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from blockdraft.config import (
    check_device_available,
    check_drafter_path,
    check_model_path,
    resolve_device,
)
from blockdraft.models.dflash2_drafter import DFlash2Config
from blockdraft.models.dflash_drafter import DFlashConfig
from blockdraft.train.drafter import DFlash2Shape, check_fused_loss_device

# --arch -> the drafter architecture it trains (config.json's `architectures`)
ARCHS = {"dflash": DFlashConfig.architecture, "dflash2": DFlash2Config.architecture}
DFLASH2_OPTIONS = (*DFlash2Shape.__dataclass_fields__, "selector_loss_weight")

# Loss decay per block size from the DFlash paper; other sizes scale with the block.
DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


@dataclass
class TrainConfig:
    out_dir: str
    data: str  # prompt file (regenerated first, into out_dir/data.jsonl) or a regenerated shard
    model: str | None = None  # target; None: the embedded SmolLM2-135M-Instruct
    load_format: str = "auto"  # "dummy": random target weights from config.json (benchmarks)
    # drafter shape (a fresh drafter; or start from `init_drafter`, a z-lab checkpoint)
    arch: str = "dflash"  # "dflash" | "dflash2" (convolutions + candidate selector)
    num_layers: int = 1
    block_size: int = 16
    mask_token_id: int | None = None  # None: an unused special token of the target
    target_layer_ids: list[int] | None = None  # None: z-lab's default rule
    num_target_features: int | None = None  # number of default target layers (None: num_layers)
    # DFlash2 only. None: the published drafters' values (DFlash2Shape) for a fresh drafter
    # (or one grown from a DFlash init_drafter), a DFlash2 init_drafter's (which set values
    # must equal)
    conv_kernel_size: int | None = None
    conv_group_size: int | None = None
    selector_rank: int | None = None
    selector_top_k: int | None = None
    selector_loss_weight: float | None = None  # None: 1.0 (DFlash2 only)
    init_drafter: str | None = None
    # layers added on top of `init_drafter`'s, each starting as the identity (its attention and
    # MLP output projections zero): a deeper drafter that begins where the trained one is
    grow_layers: int = 0
    # regeneration (when `data` holds prompts)
    num_prompts: int | None = None
    regen_max_tokens: int = 512
    max_prompt_tokens: int = 1024
    regen_temperature: float = 0.0
    regen_batch_size: int = 1024  # prompts per engine call (and per resumable chunk)
    regen_max_num_seqs: int = 1024
    # optimisation
    steps: int | None = None  # optimizer steps; None: `epochs` over the data
    epochs: float = 1.0
    batch_size: int = 8  # sequences per micro-batch
    grad_accum: int = 1
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    anchors: int = 512  # blocks per sequence (fewer when the response is shorter)
    loss_gamma: float | None = None  # None: 7 for B=16 (DEFAULT_GAMMA)
    max_seq_len: int = 2048  # longer sequences are cut
    seed: int = 0
    # runtime
    device: str = "auto"
    attention: str = "auto"  # "dense" | "flex" | "auto" (flex on GPU, dense on CPU)
    compile: bool | None = None  # compile FlexAttention (None: on GPU)
    loss_chunk_rows: int = 8192
    # LM head + cross-entropy fused in a Triton kernel over bf16 logits (no float32 copy, no
    # recompute); None: on CUDA. Only for a plain linear head (else the float32 path). On the
    # H200 a step at batch 16 took 108 ms instead of 207 (benchmarks/train_bench.py).
    fused_loss: bool | None = None
    save_every: int = 0  # steps between checkpoints (0: only at the end)
    keep_checkpoints: int = 2
    resume: bool = False
    stop_after: int | None = None  # stop (with a checkpoint) at this step, to resume later
    # Wall-clock budget of the whole run (regeneration included): training stops, with a
    # resumable checkpoint, once it is spent. For jobs with a fixed time slot.
    time_limit_s: float | None = None
    save_dtype: str = "auto"  # auto: bfloat16 on GPU, float32 on CPU
    # held-out evaluation of the engine's acceptance length
    eval_holdout: int = 0  # regenerated samples kept out of training, their prompts evaluated
    eval_prompts: str | None = None  # or a prompt file
    eval_num_prompts: int = 64
    eval_max_tokens: int = 256
    eval_every: int = 0  # steps between evaluations (0: only at the end)
    use_tqdm: bool = True

    def __post_init__(self) -> None:
        self.device = resolve_device(self.device)
        check_device_available(self.device)
        # Paths fail now, not after regeneration or training.
        if self.model is not None:
            check_model_path(self.model)
        if self.init_drafter is not None:
            check_drafter_path(self.init_drafter)
            if not Path(self.init_drafter).expanduser().is_dir():
                raise ValueError(f"init_drafter {self.init_drafter!r}: give a z-lab directory")
        if self.eval_prompts is not None and not Path(self.eval_prompts).is_file():
            raise ValueError(f"eval prompt file {self.eval_prompts} does not exist")
        if self.attention == "auto":
            self.attention = "flex" if self.device.startswith("cuda") else "dense"
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.attention not in ("dense", "flex"):
            raise ValueError(f"attention must be dense, flex or auto, got {self.attention!r}")
        if self.attention == "flex" and not self.device.startswith("cuda"):
            # torch's FlexAttention has no CPU backward (forward only: see Trainer.batch_loss).
            raise ValueError("attention='flex' trains on the GPU only; use 'dense' on the CPU")
        if self.compile is None:
            self.compile = self.attention == "flex" and self.device.startswith("cuda")
        for name in ("num_layers", "batch_size", "grad_accum", "anchors", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive")
        if self.block_size < 2:
            raise ValueError("block_size must be at least 2")
        if self.grow_layers < 0 or (self.grow_layers and not self.init_drafter):
            raise ValueError("grow_layers must be >= 0 and needs init_drafter")
        if self.steps is not None and self.steps < 1:
            raise ValueError("steps must be positive")
        if self.fused_loss:
            check_fused_loss_device(self.device)
        self._check_arch()
        if self.loss_gamma is None:
            self.loss_gamma = DEFAULT_GAMMA.get(self.block_size, 7.0 * self.block_size / 16)

    def _check_arch(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"arch must be one of {', '.join(ARCHS)}, got {self.arch!r}")
        given = [name for name in DFLASH2_OPTIONS if getattr(self, name) is not None]
        if self.arch == "dflash" and given:
            raise ValueError(f"{', '.join(given)}: DFlash2 options; set arch='dflash2'")
        for name in given:
            if getattr(self, name) < (0 if name == "selector_loss_weight" else 1):
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.arch == "dflash2" and self.selector_loss_weight is None:
            self.selector_loss_weight = 1.0
        if self.init_drafter is None:
            return
        hf = json.loads((Path(self.init_drafter).expanduser() / "config.json").read_text())
        archs = hf.get("architectures") or []
        # A DFlash drafter may grow into a DFlash2 one (`upgrades_init_drafter`), not back.
        known = [ARCHS[self.arch]] + ([ARCHS["dflash"]] if self.arch == "dflash2" else [])
        if not set(known) & set(archs):
            raise ValueError(
                f"init_drafter {self.init_drafter!r} has architectures {archs!r}; arch="
                f"{self.arch!r} starts from a {' or a '.join(known)}"
            )
        if self.upgrades_init_drafter:
            return
        # The shape comes with the checkpoint: an option may only repeat its value.
        dflash = hf.get("dflash_config") or {}
        for name in given:
            saved = dflash.get(name, hf.get(name))
            if name in DFlash2Shape.__dataclass_fields__ and saved != getattr(self, name):
                raise ValueError(
                    f"{name}={getattr(self, name)} differs from init_drafter's {saved}; leave "
                    "it unset to keep the checkpoint's"
                )

    @property
    def upgrades_init_drafter(self) -> bool:
        """Whether training starts a DFlash2 drafter from a DFlash `init_drafter`: its layers
        as they are, identity convolutions and a selector that adds nothing yet around them."""
        if self.arch != "dflash2" or self.init_drafter is None:
            return False
        hf = json.loads((Path(self.init_drafter).expanduser() / "config.json").read_text())
        return ARCHS["dflash2"] not in (hf.get("architectures") or [])

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def on_gpu(self) -> bool:
        return self.torch_device.type == "cuda"


@dataclass
class StepStats:
    step: int
    loss: float
    accuracy: list[float]  # per block offset 1..B-1
    acceptance_length: float  # block_acceptance_length(accuracy)
    lr: float
    seconds: float
    selector_loss: float | None = None  # DFlash2: the selector's loss term (unweighted)
    candidate_recall: float | None = None  # DFlash2: share of labels among the top-K candidates


@dataclass
class TrainResult:
    out_dir: Path
    step: int
    history: list[StepStats] = field(default_factory=list)
    eval_acceptance_length: float | None = None

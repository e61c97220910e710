"""DFlash drafter training (as in the DFlash paper and SpecForge).

Per micro-batch of regenerated sequences:
1. random anchors in each response (re-drawn every epoch), one block `[anchor, MASK x (B-1)]`
   each (`blocks.py`);
2. the frozen target runs over the whole sequences and yields the features at
   `target_layer_ids` (no grad);
3. one drafter forward over all blocks, packed: keys are the context rows (fc/hidden_norm of
   the features, every position) and the blocks; the block mask keeps each block to the
   context before its anchor and to itself (dense SDPA on CPU, FlexAttention on GPU);
4. cross-entropy of block offsets k = 1..B-1 against the sequence's tokens at anchor + k,
   weighted exp(-(k-1)/gamma): early offsets matter most, since a draft step's accepted length
   stops at the first miss.
AdamW, cosine schedule with warm-up, gradient clipping, bf16 autocast on GPU. Checkpoints
(`checkpoints/step_N/`) are loadable drafters and carry the optimizer, scheduler, step and RNG
state for `resume`; the final drafter goes to `out_dir`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from blockdraft.config import (
    check_device_available,
    check_drafter_path,
    check_model_path,
    resolve_device,
)
from blockdraft.models.dflash_drafter import DFlashConfig, DFlashDrafter
from blockdraft.models.loader import iter_checkpoint_tensors, load_weights, read_checkpoint
from blockdraft.train.blocks import (
    IGNORE_INDEX,
    BlockLayout,
    MaskTensors,
    build_block_mask,
    build_flex_block_mask,
    pack_blocks,
    sample_anchors,
    to_device,
)
from blockdraft.train.data import (
    Sample,
    is_sample_file,
    load_prompts,
    load_samples,
    regenerate,
    render_prompt,
)
from blockdraft.train.drafter import (
    Attend,
    TargetFeatures,
    block_loss,
    check_fused_loss_device,
    default_mask_token_id,
    dense_attend,
    drafter_hf_config,
    drafter_train_forward,
    flex_attend,
    init_drafter_weights,
    load_target,
    save_drafter,
    trainable_parameters,
)
from blockdraft.train.evaluate import block_acceptance_length, evaluate_acceptance

# Loss decay per block size from the DFlash paper; other sizes scale with the block.
DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}
STATE_FILE = "trainer_state.pt"


@dataclass
class TrainConfig:
    out_dir: str
    data: str  # prompt file (regenerated first, into out_dir/data.jsonl) or a regenerated shard
    model: str | None = None  # target; None: the embedded SmolLM2-135M-Instruct
    load_format: str = "auto"  # "dummy": random target weights from config.json (benchmarks)
    # drafter shape (a fresh drafter; or start from `init_drafter`, a z-lab checkpoint)
    num_layers: int = 1
    block_size: int = 16
    mask_token_id: int | None = None  # None: an unused special token of the target
    target_layer_ids: list[int] | None = None  # None: z-lab's default rule
    num_target_features: int | None = None  # number of default target layers (None: num_layers)
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
        if self.loss_gamma is None:
            self.loss_gamma = DEFAULT_GAMMA.get(self.block_size, 7.0 * self.block_size / 16)

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


@dataclass
class TrainResult:
    out_dir: Path
    step: int
    history: list[StepStats] = field(default_factory=list)
    eval_acceptance_length: float | None = None


# ---------------------------------------------------------------------------------------------
# Data order
# ---------------------------------------------------------------------------------------------


class BatchSchedule:
    """Which samples and anchors micro-batch m uses: a pure function of (seed, m), so a resumed
    run sees exactly the batches the uninterrupted run would have seen. Each epoch is a fresh
    permutation, and every visit of a sequence draws fresh anchors."""

    def __init__(self, samples: list[Sample], cfg: TrainConfig) -> None:
        self.samples, self.cfg = samples, cfg
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + epoch)
            self._perms = {epoch: torch.randperm(len(self.samples), generator=g)}
        return self._perms[epoch]

    def micro_batch(self, m: int) -> tuple[list[Sample], list[torch.Tensor]]:
        n, bs = len(self.samples), self.cfg.batch_size
        chosen, anchors = [], []
        for i in range(m * bs, (m + 1) * bs):
            epoch, idx = divmod(i, n)
            sample = self.samples[int(self._perm(epoch)[idx])]
            seed = ((self.cfg.seed * 1_000_003 + epoch) * 1_000_033 + idx) % 2**62
            g = torch.Generator().manual_seed(seed)
            chosen.append(sample)
            anchors.append(
                sample_anchors(len(sample.input_ids), sample.loss_start, self.cfg.anchors, g)
            )
        return chosen, anchors


def prepare_samples(samples: list[Sample], max_seq_len: int) -> list[Sample]:
    """Cuts sequences to max_seq_len and drops those left without an anchor."""
    out = []
    for s in samples:
        ids = s.input_ids[:max_seq_len]
        if len(ids) - s.loss_start >= 2:
            out.append(Sample(ids, s.loss_start, s.key))
    return out


# ---------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------


def _checkpoint_dirs(out_dir: Path) -> list[Path]:
    root = out_dir / "checkpoints"
    found = [p for p in root.glob("step_*") if (p / STATE_FILE).is_file()] if root.is_dir() else []
    return sorted(found, key=lambda p: int(p.name.removeprefix("step_")))


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------


class Trainer:
    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.started = time.monotonic()
        self.out_dir = Path(cfg.out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.device = cfg.torch_device
        self.samples, self.eval_ids = self._load_data()

        max_len = max(len(s.input_ids) for s in self.samples)
        self.max_positions = max_len + cfg.block_size
        target_dtype = torch.bfloat16 if cfg.on_gpu else torch.float32
        self.target, self.tokenizer, target_hf = load_target(
            cfg.model, target_dtype, self.device, self.max_positions, cfg.load_format
        )
        self.hf_config = self._drafter_config(target_hf)
        dcfg = DFlashConfig.from_hf(self.hf_config)
        dcfg.check_fits(self.target.cfg)
        self.dcfg = dcfg
        self.target.capture_layer_ids = dcfg.target_layer_ids
        self.features = TargetFeatures(self.target)
        with torch.device(self.device):
            # Default dtype float32: master weights; bf16 only inside autocast. (No `.float()`:
            # it would also cast the target's shared embedding and LM head.)
            self.drafter = DFlashDrafter(dcfg, self.target, self.max_positions)
        self._init_weights()
        self.drafter.train()
        params = list(trainable_parameters(self.drafter).values())
        for p in params:
            p.requires_grad_(True)

        self.total_steps = cfg.steps or max(
            1,
            math.ceil(cfg.epochs * len(self.samples) / (cfg.batch_size * cfg.grad_accum)),
        )
        self.optimizer = torch.optim.AdamW(
            params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95)
        )
        warmup = max(1, math.ceil(cfg.warmup_ratio * self.total_steps))
        total = self.total_steps

        def schedule(step: int) -> float:  # LR factor after `step` optimizer steps
            if step < warmup:
                return (step + 1) / warmup
            progress = (step - warmup) / max(1, total - warmup)
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule)
        self.schedule = BatchSchedule(self.samples, cfg)
        b = cfg.block_size
        k = torch.arange(b, dtype=torch.float32)
        self.offset_weights = torch.exp(-(k - 1).clamp(min=0) / cfg.loss_gamma).to(self.device)
        self.step = 0
        if cfg.resume:
            self._resume()
        # FlexAttention runs on fixed padded lengths: one compiled kernel for every batch.
        self._flex: Callable[..., torch.Tensor] | None = None
        resp = max(len(s.input_ids) - s.loss_start - 1 for s in self.samples)
        self.pad_context = _round_up(cfg.batch_size * max_len, 128)
        self.pad_queries = _round_up(cfg.batch_size * min(cfg.anchors, resp) * b, 128)

    # -- setup ------------------------------------------------------------------------------
    def _load_data(self) -> tuple[list[Sample], list[list[int]]]:
        cfg = self.cfg
        path = Path(cfg.data)
        if not is_sample_file(path):
            path = regenerate(
                path,
                self.out_dir / "data.jsonl",
                model=cfg.model,
                max_tokens=cfg.regen_max_tokens,
                max_prompt_tokens=cfg.max_prompt_tokens,
                temperature=cfg.regen_temperature,
                seed=cfg.seed,
                batch_size=cfg.regen_batch_size,
                limit=cfg.num_prompts,
                use_tqdm=cfg.use_tqdm,
                device=cfg.device,
                max_num_seqs=cfg.regen_max_num_seqs,
            )
            _release_memory()
        samples = load_samples(path)
        held = samples[len(samples) - cfg.eval_holdout :] if cfg.eval_holdout else []
        train = prepare_samples(samples[: len(samples) - len(held)], cfg.max_seq_len)
        if not train:
            raise ValueError(f"{path} has no sequence with at least two response tokens")
        eval_ids = [s.input_ids[: s.loss_start] for s in held][: cfg.eval_num_prompts]
        return train, eval_ids

    def _drafter_config(self, target_hf: dict) -> dict:
        cfg = self.cfg
        if cfg.init_drafter:
            hf = json.loads((Path(cfg.init_drafter) / "config.json").read_text())
            hf.pop("torch_dtype", None)
            return grow_drafter_config(hf, cfg.grow_layers)
        mask = cfg.mask_token_id
        if mask is None:
            mask = default_mask_token_id(self.tokenizer, target_hf)
        return drafter_hf_config(
            target_hf,
            num_layers=cfg.num_layers,
            block_size=cfg.block_size,
            mask_token_id=mask,
            target_layer_ids=cfg.target_layer_ids,
            num_target_features=cfg.num_target_features,
        )

    def _init_weights(self) -> None:
        cfg = self.cfg
        if not cfg.init_drafter:
            init_drafter_weights(self.drafter, cfg.seed)
            return
        params = trainable_parameters(self.drafter)
        num_layers = self.dcfg.body.num_layers
        new = tuple(f"layers.{i}." for i in range(num_layers - cfg.grow_layers, num_layers))
        if new:
            init_drafter_weights(self.drafter, cfg.seed)
        load_weights(
            {name: p for name, p in params.items() if not name.startswith(new)},
            iter_checkpoint_tensors(read_checkpoint(cfg.init_drafter)),
            cfg.init_drafter,
            ignore=lambda name: (
                name.startswith(("embed_tokens.", "lm_head.")) or "rotary_emb" in name
            ),
        )
        with torch.no_grad():
            for name, p in params.items():
                if name.startswith(new) and name.endswith(OUTPUT_PROJECTIONS):
                    p.zero_()

    def _resume(self) -> None:
        found = _checkpoint_dirs(self.out_dir)
        if not found:
            return  # nothing saved yet: a fresh start
        # On the CPU: the RNG states must stay CPU byte tensors; the optimizer moves its own state.
        state = torch.load(found[-1] / STATE_FILE, map_location="cpu", weights_only=False)
        if state["hf_config"] != self.hf_config:
            raise ValueError(f"{found[-1]} holds a drafter of another shape; cannot resume")
        params = trainable_parameters(self.drafter)
        with torch.no_grad():
            for name, tensor in state["drafter"].items():
                params[name].copy_(tensor)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        _set_rng_state(state["rng"])

    # -- one step ---------------------------------------------------------------------------
    def _attend(self, layout: BlockLayout, attention: str) -> Attend:
        kinds = set(zip(self.dcfg.layer_causal, self.dcfg.layer_window, strict=True))
        if attention == "dense":
            return dense_attend(self.drafter, {k: build_block_mask(layout, *k) for k in kinds})
        if self._flex is None:
            from torch.nn.attention.flex_attention import flex_attention

            self._flex = (
                torch.compile(flex_attention, dynamic=False) if self.cfg.compile else flex_attention
            )
        tensors = MaskTensors.from_layout(layout, self.pad_context, self.pad_queries)
        # On the GPU the mask is evaluated tile by tile in a compiled kernel; the dense
        # [Q', C'+Q'] mask would not fit.
        block_masks = {
            k: build_flex_block_mask(tensors, *k, compile_mask=self.cfg.on_gpu) for k in kinds
        }
        return flex_attend(
            self.drafter,
            block_masks,
            layout.num_context,
            layout.num_queries,
            self.pad_context,
            self.pad_queries,
            self._flex,
        )

    def batch_loss(
        self, m: int, attention: str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Forward of micro-batch m: (weighted loss, correct drafts [B], counted drafts [B]),
        per block offset. `attention` overrides the configured kernel (tests compare them)."""
        cfg, b = self.cfg, self.cfg.block_size
        samples, anchors = self.schedule.micro_batch(m)
        ids = [s.input_ids for s in samples]
        layout_cpu = pack_blocks(ids, anchors, b, self.dcfg.mask_token_id)
        # The labelled rows, found on the host: `nonzero` on the device would wait for the GPU.
        rows = to_device((layout_cpu.labels != IGNORE_INDEX).nonzero().squeeze(1), self.device)
        layout = layout_cpu.to(self.device)
        features = self.features(layout.input_ids, layout.seq_lens)
        attend = self._attend(layout, attention or cfg.attention)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=cfg.on_gpu):
            hidden = drafter_train_forward(
                self.drafter, features, layout.ctx_pos, layout.block_ids, layout.q_pos, attend
            )
            offsets = layout.offsets[rows]
            weights = self.offset_weights[offsets]
            loss_sum, correct = block_loss(
                self.drafter,
                hidden[rows],
                layout.labels[rows],
                weights,
                cfg.loss_chunk_rows,
                fused=cfg.fused_loss,
            )
            loss = loss_sum / weights.sum()
        hits = torch.zeros(b, device=self.device).index_add_(0, offsets, correct.float())
        counts = torch.zeros(b, device=self.device).index_add_(0, offsets, torch.ones_like(weights))
        return loss, hits, counts

    def train_step(self) -> StepStats:
        cfg = self.cfg
        t0 = time.perf_counter()
        b = cfg.block_size
        loss_total = torch.zeros((), device=self.device)
        hits = torch.zeros(b, device=self.device)
        counts = torch.zeros(b, device=self.device)
        for micro in range(cfg.grad_accum):
            loss, h, c = self.batch_loss(self.step * cfg.grad_accum + micro)
            (loss / cfg.grad_accum).backward()
            loss = loss.detach()
            loss_total += loss / cfg.grad_accum
            hits += h
            counts += c
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        accuracy = (hits[1:] / counts[1:].clamp(min=1)).tolist()  # one host sync per step
        return StepStats(
            step=self.step,
            loss=float(loss_total),
            accuracy=accuracy,
            acceptance_length=block_acceptance_length(accuracy),
            lr=lr,
            seconds=time.perf_counter() - t0,
        )

    # -- checkpoints and evaluation ----------------------------------------------------------
    def _save_dtype(self) -> torch.dtype:
        if self.cfg.save_dtype == "auto":
            return torch.bfloat16 if self.cfg.on_gpu else torch.float32
        return {"float32": torch.float32, "bfloat16": torch.bfloat16}[self.cfg.save_dtype]

    def save_checkpoint(self) -> Path:
        path = self.out_dir / "checkpoints" / f"step_{self.step:06d}"
        save_drafter(self.drafter, self.hf_config, path, self._save_dtype())
        state = {
            "step": self.step,
            "hf_config": self.hf_config,
            "drafter": {
                k: v.detach().clone() for k, v in trainable_parameters(self.drafter).items()
            },
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": _rng_state(),
            "train_config": dataclasses.asdict(self.cfg),
        }
        tmp = path / (STATE_FILE + ".tmp")
        torch.save(state, tmp)
        tmp.replace(path / STATE_FILE)  # the state file marks a complete checkpoint
        for old in _checkpoint_dirs(self.out_dir)[: -self.cfg.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
        return path

    def evaluate(self, drafter_dir: Path) -> float | None:
        prompts = self.eval_ids
        if self.cfg.eval_prompts:
            chats = load_prompts(self.cfg.eval_prompts, self.cfg.eval_num_prompts)
            prompts = [render_prompt(self.tokenizer, c) for c in chats]
        if not prompts:
            return None
        return evaluate_acceptance(
            self.cfg.model,
            drafter_dir,
            prompts,
            max_tokens=self.cfg.eval_max_tokens,
            device=self.cfg.device,
        )

    def fit(self) -> TrainResult:
        cfg = self.cfg
        result = TrainResult(self.out_dir, self.step)
        last = min(self.total_steps, cfg.stop_after or self.total_steps)
        log = (self.out_dir / "train_log.jsonl").open("a", encoding="utf-8")
        bar = tqdm(
            total=self.total_steps,
            initial=self.step,
            desc="Training drafter",
            disable=not cfg.use_tqdm,
        )
        deadline = self.started + cfg.time_limit_s if cfg.time_limit_s else math.inf
        try:
            while self.step < last and time.monotonic() < deadline:
                stats = self.train_step()
                result.history.append(stats)
                log.write(json.dumps(dataclasses.asdict(stats)) + "\n")
                log.flush()
                bar.set_postfix(
                    loss=f"{stats.loss:.3f}",
                    tau=f"{stats.acceptance_length:.2f}",
                    acc=",".join(f"{round(100 * a)}" for a in stats.accuracy),
                    refresh=False,
                )
                bar.update(1)
                saved = None
                if cfg.save_every and self.step % cfg.save_every == 0:
                    saved = self.save_checkpoint()
                if cfg.eval_every and self.step % cfg.eval_every == 0 and self.step < last:
                    saved = saved or self.save_checkpoint()
                    tau = self.evaluate(saved)
                    if tau is not None:
                        bar.write(f"step {self.step}: engine acceptance length {tau:.3f}")
        finally:
            bar.close()
            log.close()
        result.step = self.step
        if self.step < self.total_steps:  # stopped early on purpose: leave a resumable state
            if not _checkpoint_dirs(self.out_dir) or _checkpoint_dirs(self.out_dir)[-1].name != (
                f"step_{self.step:06d}"
            ):
                self.save_checkpoint()
            return result
        if not cfg.save_every or self.step % cfg.save_every:
            self.save_checkpoint()  # the end is always resumable (e.g. to train further)
        save_drafter(self.drafter, self.hf_config, self.out_dir, self._save_dtype())
        result.eval_acceptance_length = self.evaluate(self.out_dir)
        if result.eval_acceptance_length is not None:
            summary = {"step": self.step, "eval_acceptance_length": result.eval_acceptance_length}
            (self.out_dir / "eval.json").write_text(json.dumps(summary) + "\n")
        return result


# A layer whose residual branches end in zeros adds nothing to the stream: the identity.
OUTPUT_PROJECTIONS = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


def grow_drafter_config(hf: dict, grow_layers: int) -> dict:
    """`hf` (a drafter's config.json) with `grow_layers` more layers, each of the last layer's
    attention type; the target layers it reads are pinned (z-lab's default rule depends on the
    layer count)."""
    if not grow_layers:
        return hf
    layer_ids = list(DFlashConfig.from_hf(hf).target_layer_ids)
    hf = dict(hf)
    hf["dflash_config"] = {**hf.get("dflash_config", {}), "target_layer_ids": layer_ids}
    n = hf["num_hidden_layers"]
    hf["num_hidden_layers"] = n + grow_layers
    if hf.get("layer_types"):
        hf["layer_types"] = list(hf["layer_types"]) + [hf["layer_types"][-1]] * grow_layers
    if hf.get("max_window_layers") == n:
        hf["max_window_layers"] = n + grow_layers
    return hf


def train_drafter(cfg: TrainConfig) -> TrainResult:
    """Regenerates the data if needed, trains, saves the drafter to `cfg.out_dir` (z-lab
    format) and evaluates its acceptance length in the engine on held-out prompts."""
    return Trainer(cfg).fit()


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _release_memory() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

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
   stops at the first miss. DFlash2 drafters (`arch="dflash2"`) add their candidate selector's
   loss, weighted `selector_loss_weight` (`selector_loss.py`).
AdamW, cosine schedule with warm-up, gradient clipping, bf16 autocast on GPU. Checkpoints
(`checkpoints/step_N/`) are loadable drafters and carry the optimizer, scheduler, step and RNG
state for `resume`; the final drafter goes to `out_dir`.

This file is the `Trainer` (setup, one optimizer step, the loop with its checkpoints and
evaluations); the run's settings and reports are in `config.py`, the data order in
`schedule.py`, the checkpoint state in `checkpoint.py`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm.auto import tqdm

from blockdraft.models.dflash2_drafter import DFlash2Config
from blockdraft.models.loader import iter_checkpoint_tensors, load_weights, read_checkpoint
from blockdraft.models.registry import resolve_drafter
from blockdraft.train.blocks import (
    IGNORE_INDEX,
    BlockLayout,
    MaskTensors,
    build_block_mask,
    build_flex_block_mask,
    pack_blocks,
    to_device,
)
from blockdraft.train.checkpoint import (
    OUTPUT_PROJECTIONS,
    STATE_FILE,
    checkpoint_dirs,
    grow_drafter_config,
    rng_state,
    set_rng_state,
)
from blockdraft.train.config import StepStats, TrainConfig, TrainResult
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
    DFlash2Shape,
    TargetFeatures,
    block_loss,
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
from blockdraft.train.schedule import BatchSchedule, prepare_samples
from blockdraft.train.selector_loss import selector_loss, true_predecessors


@dataclasses.dataclass
class BatchLoss:
    loss: torch.Tensor  # [] the weighted loss the step minimises
    hits: torch.Tensor  # [B] correct drafts per block offset
    counts: torch.Tensor  # [B] counted drafts per block offset
    selector_loss: torch.Tensor | None = None  # [] DFlash2: the selector's term, unweighted
    candidate_recall: torch.Tensor | None = None  # [] DFlash2: labels among the candidates


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
        dcfg, drafter_class = resolve_drafter(self.hf_config)
        dcfg.check_fits(self.target.cfg)
        self.dcfg = dcfg
        self.target.capture_layer_ids = dcfg.target_layer_ids
        self.features = TargetFeatures(self.target)
        with torch.device(self.device):
            # Default dtype float32: master weights; bf16 only inside autocast. (No `.float()`:
            # it would also cast the target's shared embedding and LM head.)
            self.drafter = drafter_class(dcfg, self.target, self.max_positions)
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
        dflash2 = None
        if cfg.arch == "dflash2":
            given = {
                name: getattr(cfg, name)
                for name in DFlash2Shape.__dataclass_fields__
                if getattr(cfg, name) is not None
            }
            dflash2 = DFlash2Shape(**given)
        if cfg.init_drafter:
            hf = json.loads((Path(cfg.init_drafter) / "config.json").read_text())
            hf.pop("torch_dtype", None)
            if cfg.upgrades_init_drafter:
                hf["architectures"] = [DFlash2Config.architecture]
                hf["dflash_config"] = {**hf.get("dflash_config", {}), **dataclasses.asdict(dflash2)}
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
            dflash2=dflash2,
        )

    def _init_weights(self) -> None:
        cfg = self.cfg
        if not cfg.init_drafter:
            init_drafter_weights(self.drafter, cfg.seed)
            return
        params = trainable_parameters(self.drafter)
        num_layers = self.dcfg.body.num_layers
        new = tuple(f"layers.{i}." for i in range(num_layers - cfg.grow_layers, num_layers))

        def fresh(name: str) -> bool:  # not in the init drafter: starts as init_drafter_weights'
            upgrade = "_conv." in name or name.startswith("candidate_selector.")
            added = cfg.upgrades_init_drafter and upgrade
            return name.startswith(new) or added

        if any(fresh(name) for name in params):
            init_drafter_weights(self.drafter, cfg.seed)
        tensors = iter_checkpoint_tensors(read_checkpoint(cfg.init_drafter))
        load_weights(
            {name: p for name, p in params.items() if not fresh(name)},
            ((self.drafter.checkpoint_name(name), t) for name, t in tensors),
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
        found = checkpoint_dirs(self.out_dir)
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
        set_rng_state(state["rng"])

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

    def batch_loss(self, m: int, attention: str | None = None) -> BatchLoss:
        """Forward of micro-batch m. `attention` overrides the configured kernel (tests compare
        them). A DFlash2 draft is correct when the selector, after the true predecessor, picks
        the true token (what its path walk drafts while the block is right so far)."""
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
                self.drafter,
                features,
                layout.ctx_pos,
                layout.block_ids,
                layout.q_pos,
                attend,
                block_len=b,
            )
            offsets = layout.offsets[rows]
            weights = self.offset_weights[offsets]
            labels = layout.labels[rows]
            loss_sum, correct = block_loss(
                self.drafter,
                hidden[rows],
                labels,
                weights,
                cfg.loss_chunk_rows,
                fused=cfg.fused_loss,
            )
            loss = loss_sum / weights.sum()
            selector = candidates = None
            if cfg.arch == "dflash2":
                predecessors = true_predecessors(
                    layout.block_ids, layout.labels, layout.offsets, rows
                )
                selector, in_candidates, correct = selector_loss(
                    self.drafter, hidden[rows], predecessors, labels, weights, cfg.loss_chunk_rows
                )
                loss = loss + cfg.selector_loss_weight * selector
                candidates = in_candidates.float().mean()
        hits = torch.zeros(b, device=self.device).index_add_(0, offsets, correct.float())
        counts = torch.zeros(b, device=self.device).index_add_(0, offsets, torch.ones_like(weights))
        return BatchLoss(loss, hits, counts, selector, candidates)

    def train_step(self) -> StepStats:
        cfg = self.cfg
        t0 = time.perf_counter()
        b = cfg.block_size
        # loss, selector loss, candidate recall: means over the micro-batches
        means = torch.zeros(3, device=self.device)
        hits = torch.zeros(b, device=self.device)
        counts = torch.zeros(b, device=self.device)
        for micro in range(cfg.grad_accum):
            out = self.batch_loss(self.step * cfg.grad_accum + micro)
            (out.loss / cfg.grad_accum).backward()
            means[0] += out.loss.detach() / cfg.grad_accum
            if out.selector_loss is not None:
                means[1] += out.selector_loss.detach() / cfg.grad_accum
                means[2] += out.candidate_recall / cfg.grad_accum
            hits += out.hits
            counts += out.counts
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        values = torch.cat([hits[1:] / counts[1:].clamp(min=1), means]).tolist()  # one sync
        *accuracy, loss, selector, recall = values
        dflash2 = cfg.arch == "dflash2"
        return StepStats(
            step=self.step,
            loss=loss,
            accuracy=accuracy,
            acceptance_length=block_acceptance_length(accuracy),
            lr=lr,
            seconds=time.perf_counter() - t0,
            selector_loss=selector if dflash2 else None,
            candidate_recall=recall if dflash2 else None,
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
            "rng": rng_state(),
            "train_config": dataclasses.asdict(self.cfg),
        }
        tmp = path / (STATE_FILE + ".tmp")
        torch.save(state, tmp)
        tmp.replace(path / STATE_FILE)  # the state file marks a complete checkpoint
        for old in checkpoint_dirs(self.out_dir)[: -self.cfg.keep_checkpoints]:
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
            if not checkpoint_dirs(self.out_dir) or checkpoint_dirs(self.out_dir)[-1].name != (
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

"""GPU benchmark on a model shape (benchmarks/shapes.py; Qwen3-8B by default) with random bf16
weights made on the device.

    python benchmarks/gpu_bench.py [--shape qwen3-8b] [--prompt-len 512] [--new-tokens 256]
        [--json out.json]

a. batch-1 autoregressive decode tok/s: ours (through `generate`, and steady: one over the
   decode step of b.), the memory-bandwidth roofline (weight bytes /
   measured copy bandwidth), transformers `generate`, z-lab's `dflash_generate` at block 1;
b. step-cost ratio (verify 1+N + draft) / (one decode step) at N = 15, batch 1, 8, 32;
c. DFlash tok/s with synthetic acceptance (p = 0.86, mean acceptance 6.5 at N = 15) at
   concurrency 1, 4, 8, 16, 32 next to our autoregressive throughput: the default draft
   schedule (N by batch size, as users get it) as the main column, fixed N = 15 next to it,
   and fixed N = 7 (`--small-block 8`) at the two top concurrencies;
d. the embedded SmolLM2-135M-Instruct with its shipped drafter, real acceptance, greedy: mean
   acceptance length and tok/s against our autoregressive mode on a few prompts of each
   public prompt set installed (`blockdraft bench`'s sets; skipped when none is, or without
   the embedded model; `--skip-drafter`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import (  # noqa: E402
    TritonCompileLog,
    device_kernels,
    hardware,
    now,
    print_table,
    start_requests,
    stop_requests,
)
from benchmarks.shapes import SHAPES, expected_distinct_experts, moe_bytes_per_step  # noqa: E402
from blockdraft import LLM, SamplingParams  # noqa: E402
from blockdraft.kernels.policy import KernelPolicy  # noqa: E402


def load_skinny_configs(path: str) -> None:
    """Replaces the skinny GEMM's default launch table with the measured best configs."""
    from blockdraft.kernels import triton_linear

    report = json.loads(Path(path).read_text())
    for row in report["results"]:
        if row["best"] and row["best"]["us"] < row["cublas_us"]:
            key = (triton_linear.m_bucket(row["m"]), row["n"], row["k"])
            triton_linear.DEFAULT_CONFIGS[key] = triton_linear.SkinnyConfig(**row["best"]["config"])


def copy_bandwidth() -> float:
    x = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    t0 = now()
    for _ in range(10):
        y.copy_(x)
    elapsed = now() - t0
    del x, y
    return 2 * 2 * 1024**3 * 10 / elapsed  # bytes read + written per second


def shipped_drafter_bench(
    num_prompts: int, max_tokens: int, device: str = "cuda", repeats: int = 3
) -> list[dict] | None:
    """d. The default target with its shipped drafter (real acceptance, T = 0) against our AR
    mode on `num_prompts` prompts of each installed prompt set, each engine's median tok/s of
    `repeats` alternating passes (one pass let a cold start fall on the first set: AR 514 tok/s
    on GSM8K against ~1,200 on the others, H200); None, with the reason printed, when no set is
    installed or the default target cannot be loaded."""
    from blockdraft.bench import (
        PROMPT_SETS,
        format_table,
        load_prompt_set,
        results_json,
        run_bench,
    )

    gc.collect()  # the 8B engines' memory back before two more engines size their caches
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    sets = {}
    for name in PROMPT_SETS:
        try:
            sets[name] = load_prompt_set(name, num_prompts)
        except ValueError as e:  # its package is not installed
            print(f"d. {e}")
    if not sets:
        print("d. skipped: no prompt set installed")
        return None
    try:
        dflash = LLM(device=device, speculative_config={
            "model": "default", "num_speculative_tokens_by_batch": None})  # fmt: skip
        ar = LLM(device=device, speculative_config=None)
    except (ImportError, OSError, ValueError) as e:
        print(f"d. skipped: the embedded default target did not load ({e})")
        return None
    results = run_bench(ar, dflash, sets, [0.0], max_tokens, repeats=repeats)
    print("\nd. SmolLM2-135M-Instruct + its shipped DFlash drafter, T = 0, batch 1")
    print(format_table(results))
    return results_json(results)


def conc_reps(concurrency: int, fixed: int | None = None) -> int:
    """Timed passes at a concurrency: a pass at concurrency 1 is one request whose synthetic
    acceptance draws alone moved its tok/s by +-10% between runs (run XII), so few requests
    get more passes (24 at 1, 6 at 4, 3 from 8 on; each pass is a fraction of a second).
    `fixed` (--conc-reps): that many at every concurrency, for long requests."""
    return fixed if fixed is not None else max(3, 24 // concurrency)


@contextlib.contextmanager
def running_at_most(llm: LLM, batch: int) -> Iterator[None]:
    """The engine's scheduler runs at most `batch` requests at once inside the block."""
    scheduler = llm.engine.scheduler
    cap, scheduler.max_num_seqs = scheduler.max_num_seqs, min(scheduler.max_num_seqs, batch)
    try:
        yield
    finally:
        scheduler.max_num_seqs = cap


def decode_tok_s(
    llm: LLM,
    prompt: list[int],
    batch: int,
    new_tokens: int,
    reps: int = 3,
    log: TritonCompileLog | None = None,
    phase: str = "",
    waves: int = 1,
) -> float:
    """Median tok/s of `reps` timed generations of `batch` copies of `prompt` (kernels first
    specialised while they run are logged under `phase`). `waves` > 1: `waves * batch` copies
    with at most `batch` running at once, a new one starting as one finishes (a serving
    benchmark's fixed concurrency: one ramp-down per pass, not one per `batch` requests)."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    # Twice: the second call takes the cached-prefix prefill path, which the timed call takes
    # too; Triton compiles each kernel variant on first use, and that must not be timed.
    for _ in range(2):
        llm.generate(
            [prompt] * batch,
            SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
            use_tqdm=False,
        )
    rates = []
    timed = log.timed(phase) if log is not None else contextlib.nullcontext()
    with running_at_most(llm, batch), timed:
        for _ in range(reps):  # one short pass (64 tokens) spread by up to ~20% run to run
            t0 = now()
            outs = llm.generate([prompt] * (batch * waves), params, use_tqdm=False)
            rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / (now() - t0))
    return statistics.median(rates)


def mean_step_ms(
    llm: LLM,
    prompt: list[int],
    batch: int,
    steps: int,
    temperature: float = 0.0,
    log: TritonCompileLog | None = None,
    phase: str = "",
) -> float:
    engine = llm.engine
    start_requests(llm, prompt, batch, temperature)
    with log.timed(phase) if log is not None else contextlib.nullcontext():
        t0 = now()
        for _ in range(steps):
            engine.step()
        elapsed = now() - t0
    stop_requests(llm, batch)
    return elapsed / steps * 1e3


# (engine, name, KernelPolicy fields that differ from the defaults, extra); "DFlash" rows time
# the N = 15 step (verify 16 rows + draft). extra: "async" = async_decode, "t1" = temperature 1.
CUBLAS = dict(skinny_max_rows=0, fuse_silu_mul_into_down=False, fuse_norm_into_skinny=False,
              fuse_kv_store_into_rope=False)  # fmt: skip
SKINNY2 = dict(skinny_max_rows=2, fuse_kv_store_into_rope=False)
ABLATION = [
    ("AR", "cuBLAS", CUBLAS, ""),
    ("AR", "skinny <= 2 rows", dict(CUBLAS, skinny_max_rows=2), ""),
    ("AR", "+ SiLU·mul prologue", dict(SKINNY2, fuse_norm_into_skinny=False), ""),
    ("AR", "+ RMSNorm prologue", dict(SKINNY2, fuse_silu_mul_into_down=False), ""),
    ("AR", "+ both prologues", SKINNY2, ""),
    ("AR", "+ KV store in RoPE", dict(skinny_max_rows=2), ""),
    ("AR", "+ async decode", dict(skinny_max_rows=2), "async"),
    ("AR", "all, skinny <= 16 rows (prologues <= 2)", {}, ""),
    ("AR", "T = 1", dict(skinny_max_rows=2), "t1"),
    ("DFlash", "cuBLAS", CUBLAS, ""),
    ("DFlash", "skinny <= 2 rows, prologues", SKINNY2, ""),
    ("DFlash", "+ KV store in RoPE", dict(skinny_max_rows=2), ""),
    ("DFlash", "all, skinny <= 16 rows (prologues <= 2)", {}, ""),
    ("DFlash", "T = 1", dict(skinny_max_rows=2), "t1"),
    # Programmatic dependent launch (blockdraft.kernels.pdl): the defaults put it in decode
    # forwards only (a DFlash step has none at batch 1 and 8).
    ("AR", "defaults (PDL in decode forwards)", {}, "async"),
    ("AR", "PDL off", dict(pdl=False), "async"),
    (
        "AR",
        "norms as kernels of their own (no RMSNorm prologue)",
        dict(fuse_norm_into_skinny=False),
        "async",
    ),
    ("DFlash", "defaults (PDL in decode forwards)", {}, ""),
    ("DFlash", "PDL in forwards of <= 16 query rows", dict(pdl_max_query_len=16), ""),
    (
        "AR",
        "split-K decode attention merged by a second kernel",
        dict(fuse_decode_split_merge=False),
        "async",
    ),
    (
        "AR",
        "q/k norm + RoPE + KV store in a kernel before attention",
        dict(rope_in_attention_max_query_len=0),
        "async",
    ),
    (
        "DFlash",
        "q/k norm + RoPE + KV store in verify / drafter attention",
        dict(rope_in_attention_max_query_len=16),
        "",
    ),
    ("AR", "SiLU·mul prologue <= 16 rows", dict(silu_mul_prologue_max_rows=16), "async"),
    ("DFlash", "SiLU·mul prologue <= 16 rows", dict(silu_mul_prologue_max_rows=16), ""),
    (
        "DFlash",
        "Gated DeltaNet verify and commit by the layer's torch steps (hybrid targets)",
        dict(fuse_gated_deltanet_verify=False),
        "",
    ),
]


def ablate(
    target: Path,
    drafter: Path,
    kw: dict,
    prompt: list[int],
    steps: int,
    accept: float,
    only: list[str] | None = None,
) -> list[dict]:
    """Step time at batch 1 and 8 for each kernel variant (the GEMMs, their prologues, the KV
    store fused into RoPE, async decode, PDL, the attention's fusions, T = 1) of the AR engine
    and of DFlash at N = 15, one engine at a time, each with its own `KernelPolicy` (`kw`'s
    with the row's fields replaced; random weights made again for each, so the greedy tokens
    compare only in shape). `only`: keep the rows whose "engine variant" contains one of
    these."""
    base = kw.get("kernel_policy", KernelPolicy())
    rows = []
    todo = [r for r in ABLATION if only is None or any(o in f"{r[0]} {r[1]}" for o in only)]
    for engine, name, fields, extra in tqdm(todo, "ablation"):
        policy = dataclasses.replace(base, **fields)
        temperature = 1.0 if "t1" in extra.split() else 0.0
        engine_kw = {**kw, "async_decode": "async" in extra.split(), "kernel_policy": policy}
        if engine == "AR":
            llm = LLM(str(target), **engine_kw)
        else:
            llm = dflash_llm(target, drafter, 15, None, accept, engine_kw)
        step1 = mean_step_ms(llm, prompt, 1, steps, temperature)
        step8 = mean_step_ms(llm, prompt, 8, steps, temperature)
        rows.append(
            {"engine": engine, "variant": name, "kernel_policy": dataclasses.asdict(policy),
             "extra": extra, "step_ms_batch1": step1, "step_ms_batch8": step8}
        )  # fmt: skip
        llm.shutdown()
    print_table(
        "step time by kernel variant (ms)",
        ["engine", "variant", "batch 1", "batch 8"],
        [[r["engine"], r["variant"], r["step_ms_batch1"], r["step_ms_batch8"]] for r in rows],
    )
    return rows


def profile_steps(
    llm: LLM, prompt: list[int], steps: int, label: str, batch: int = 1, top: int = 8
) -> list[list]:
    """The `top` CUDA kernels and the host/device split of `steps` engine steps of `batch`
    requests."""
    from torch.profiler import ProfilerActivity, profile

    start_requests(llm, prompt, batch, warm_steps=8)
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():  # else a CPU smoke run: host rows only, no kernels
        torch.cuda.synchronize()
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        t0 = now()
        for _ in range(steps):
            llm.engine.step()
        wall_ms = (now() - t0) * 1e3 / steps
    stop_requests(llm, batch)
    kernels = device_kernels(prof)
    gpu_ms = sum(e.self_device_time_total for e in kernels) / 1e3 / steps
    launches = sum(e.count for e in kernels) / steps
    rows = [[label, "step wall", wall_ms], [label, "GPU busy", gpu_ms]]
    rows.append([label, "kernels a step (count)", launches])
    rows += [[label, e.key[:60], e.self_device_time_total / 1e3 / steps] for e in kernels[:top]]
    return rows


def dflash_llm(
    target: Path, drafter: Path, n: int, by_batch: object, accept: float, kw: dict
) -> LLM:
    """DFlash with N draft tokens, by batch size as `by_batch` says ("auto": the default
    schedule; None: always N), accepting each draft with probability `accept`."""
    return LLM(
        str(target),
        speculative_config={
            "method": "dflash",
            "model": str(drafter),
            "num_speculative_tokens": n,
            "num_speculative_tokens_by_batch": by_batch,
            "synthetic_acceptance_rate": accept,
        },
        **kw,
    )


def moe_step_reads(cfg: dict, bandwidth: float) -> list[list[float]]:
    """For one request's decode (1 row) and verifies of 8 and 16 rows: the distinct experts a
    layer reads and the weight GB the step reads when each chosen expert is read once per step
    and routing is uniform (as random weights route), that over a decode's, and the bandwidth
    bound in ms."""
    decode = moe_bytes_per_step(cfg, 1)
    rows = []
    for n in (1, 8, 16):
        experts = expected_distinct_experts(cfg["num_experts"], cfg["num_experts_per_tok"], n)
        read = moe_bytes_per_step(cfg, n)
        rows.append([n, experts, read / 1e9, read / decode, 1e3 * read / bandwidth])
    return rows


def chooser_costs_ms(llm: LLM) -> dict[str, float]:
    """The step times the "auto" chooser measured: "bucket b, N" -> ms (bucket b holds batches
    2^(b-1) .. 2^b - 1)."""
    measured = llm.engine.draft_length.costs.measured
    return {f"bucket {b}, N={n}": 1e3 * t for (b, n), t in sorted(measured.items())}


def schedule_text(llm: LLM) -> str:
    s = llm.engine.draft_schedule
    steps = zip(s.min_batches, s.num_drafts_at, strict=True)
    return ", ".join(f"N={n} from batch {b}" for b, n in steps)


def hf_and_zlab(model_dir: Path, prompt: list[int], new_tokens: int) -> tuple[float, float]:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(model_dir)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    ids = torch.tensor([prompt], device="cuda")
    model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    t0 = now()
    out = model.generate(
        ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0
    )
    hf = (out.shape[1] - ids.shape[1]) / (now() - t0)
    zlab = float("nan")
    try:
        import dflash.model as zl
        from transformers import Qwen3Config

        zl._cuda_time = now
        dcfg = Qwen3Config(
            **{**cfg.to_dict(), "num_hidden_layers": 1, "layer_types": ["full_attention"]}
        )
        dcfg.num_target_layers = cfg.num_hidden_layers
        dcfg.block_size = 16
        dcfg.dflash_config = {"mask_token_id": 0, "target_layer_ids": [18]}
        with torch.device("cuda"):
            drafter = zl.DFlashDraftModel(dcfg).to(torch.bfloat16).eval()
        for n in (8, new_tokens):
            t0 = now()
            zl.dflash_generate(
                drafter, model, ids, max_new_tokens=n, stop_token_ids=None, block_size=1
            )
        zlab = new_tokens / (now() - t0)
    except Exception as e:  # the peer is optional: report why it did not run
        print(f"z-lab dflash_generate did not run: {type(e).__name__}: {e}")
    del model
    torch.cuda.empty_cache()
    return hf, zlab


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    p.add_argument(
        "--conc-tokens",
        type=int,
        default=None,
        help="new tokens per request in the concurrency runs (default: --new-tokens; runs "
        "before 2026-12-03 used 64, where the prefill weighs on the figure)",
    )
    p.add_argument(
        "--conc-reps",
        type=int,
        default=None,
        help="timed passes at every concurrency (default: 24 at 1, fewer above; a pass of long "
        "requests at concurrency 1 takes seconds on a large model)",
    )
    p.add_argument(
        "--conc-waves",
        type=int,
        default=1,
        help="requests per pass as a multiple of the concurrency, at most that many running at "
        "once (default 1: one wave, all starting and ending together)",
    )
    p.add_argument("--accept", type=float, default=0.86)
    p.add_argument("--skip-peers", action="store_true")
    p.add_argument(
        "--small-block",
        type=int,
        default=8,
        help="also run DFlash with this block size at the two top concurrencies",
    )
    p.add_argument("--profile", action="store_true", help="profile steps (--profile-batches)")
    p.add_argument(
        "--profile-batches",
        type=int,
        nargs="+",
        default=[1],
        help="with --profile: batch sizes whose AR, N = 15 and default steps are profiled",
    )
    p.add_argument("--skip-drafter", action="store_true", help="skip d. (the shipped drafter)")
    p.add_argument("--drafter-prompts", type=int, default=5, help="d.: prompts per set")
    p.add_argument(
        "--drafter-repeats", type=int, default=3, help="d.: alternating passes, median tok/s"
    )
    p.add_argument("--drafter-tokens", type=int, default=192, help="d.: new tokens per prompt")
    p.add_argument(
        "--ablate",
        action="store_true",
        help="only the decode step of each kernel variant (cuBLAS, skinny, its prologues, the "
        "KV store in RoPE)",
    )
    p.add_argument(
        "--ablate-only",
        nargs="+",
        default=None,
        help="with --ablate: rows whose 'engine variant' has one of these",
    )
    p.add_argument(
        "--skinny-rows",
        type=int,
        default=None,
        help="linears of at most this many rows run the Triton skinny GEMM (0: cuBLAS only)",
    )
    p.add_argument(
        "--skinny-configs",
        default=None,
        help="JSON written by benchmarks/gemv_bench.py: its best configs replace the defaults",
    )
    p.add_argument(
        "--fuse-silu-mul",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="skinny down projections form the MLP's silu(gate) * up in their loads "
        "(KernelPolicy.fuse_silu_mul_into_down)",
    )
    p.add_argument(
        "--silu-mul-prologue-rows",
        type=int,
        default=None,
        help="the down projection forms SiLU·mul in its loads up to this many rows "
        "(KernelPolicy.silu_mul_prologue_max_rows)",
    )
    p.add_argument(
        "--fuse-norm",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="skinny q/k/v and gate/up projections form the residual add + RMSNorm before them "
        "in their loads (KernelPolicy.fuse_norm_into_skinny)",
    )
    p.add_argument(
        "--fuse-kv-store",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the q/k norm + RoPE kernel also writes the keys and values into the paged cache "
        "(KernelPolicy.fuse_kv_store_into_rope)",
    )
    p.add_argument(
        "--fuse-gdn-decode",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="hybrid targets: a Gated DeltaNet layer's decode step in one kernel "
        "(KernelPolicy.fuse_gated_deltanet_decode)",
    )
    p.add_argument(
        "--fuse-gdn-verify",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="hybrid targets: a Gated DeltaNet layer's verify forward in one kernel and its "
        "state commit in one more (KernelPolicy.fuse_gated_deltanet_verify)",
    )
    p.add_argument(
        "--chunked-gdn-verify-min-rows",
        type=int,
        default=None,
        help="hybrid targets: verify blocks of at least this many rows take that kernel in the "
        "delta rule's chunked form (KernelPolicy.chunked_gated_deltanet_verify_min_rows; "
        "17: never)",
    )
    p.add_argument(
        "--async-decode",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="launch each plain decode step before reading the last one back (async_decode; "
        "default: the engine's, on for CUDA; runs before 2026-12-03 VIII-b had it off)",
    )
    p.add_argument(
        "--pdl-max-query-len",
        type=int,
        default=None,
        help="PDL in forwards of at most this many query rows a request "
        "(KernelPolicy.pdl_max_query_len; 1: decode forwards only)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="the engines' share of the GPU (27B shapes on an 80 GB H100 need ~0.97)",
    )
    p.add_argument("--json", default=None)
    args = p.parse_args()
    conc_tokens = args.conc_tokens or args.new_tokens
    if args.skinny_configs:
        load_skinny_configs(args.skinny_configs)
    flags = {
        "skinny_max_rows": args.skinny_rows,
        "fuse_silu_mul_into_down": args.fuse_silu_mul,
        "fuse_norm_into_skinny": args.fuse_norm,
        "fuse_kv_store_into_rope": args.fuse_kv_store,
        "silu_mul_prologue_max_rows": args.silu_mul_prologue_rows,
        "pdl_max_query_len": args.pdl_max_query_len,
        "fuse_gated_deltanet_decode": args.fuse_gdn_decode,
        "fuse_gated_deltanet_verify": args.fuse_gdn_verify,
        "chunked_gated_deltanet_verify_min_rows": args.chunked_gdn_verify_min_rows,
    }  # None: the default policy's
    policy = KernelPolicy(**{k: v for k, v in flags.items() if v is not None})
    results: dict = {"hardware": hardware(), "date": time.strftime("%Y-%m-%d")}
    results["conc_tokens"] = conc_tokens
    results["conc_waves"] = args.conc_waves
    results["async_decode"] = "auto" if args.async_decode is None else args.async_decode
    results["kernel_policy"] = dataclasses.asdict(policy)
    shape = SHAPES[args.shape]
    results["shape"] = shape.name
    target, drafter = shape.dirs()
    prompt = torch.randint(1000, 100_000, (args.prompt_len,)).tolist()

    bandwidth = copy_bandwidth()
    roofline = bandwidth / shape.bytes_per_token(shape.config)
    results["copy_bandwidth_TBps"] = bandwidth / 1e12
    results["roofline_tok_s"] = roofline
    kw = dict(
        load_format="dummy",
        max_model_len=args.prompt_len + args.new_tokens + 64,
        max_num_seqs=max(args.concurrency + args.batches + args.profile_batches),
        async_decode=args.async_decode,
        kernel_policy=policy,
        gpu_memory_utilization=args.gpu_memory_utilization,
    )
    if args.ablate:
        results["ablation"] = ablate(
            target, drafter, kw, prompt, args.steps, args.accept, args.ablate_only
        )
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(results, indent=1))
        return
    hf = zlab = float("nan")
    if not args.skip_peers:
        # Before our engine holds the device: two copies of a 30B-A3B's weights (61 GB each)
        # and our KV pool would not fit one GPU together.
        hf, zlab = hf_and_zlab(target, prompt, min(64, args.new_tokens))
    results["transformers_tok_s"], results["zlab_block1_tok_s"] = hf, zlab
    compiles = TritonCompileLog()
    t0 = time.perf_counter()
    ar = LLM(str(target), **kw)
    print(
        f"target loaded in {time.perf_counter() - t0:.1f} s "
        f"(CUDA graphs captured in {ar.engine.capture_time_s:.1f} s, eager kernels warmed up "
        f"in {ar.engine.warmup_time_s:.1f} s)",
        flush=True,
    )
    results["capture_time_s"] = ar.engine.capture_time_s
    results["warmup_time_s"] = ar.engine.warmup_time_s
    results["ar_batch1_tok_s"] = decode_tok_s(
        ar, prompt, 1, args.new_tokens, log=compiles, phase="a. AR batch 1"
    )
    ar_steps = {
        b: mean_step_ms(ar, prompt, b, args.steps, log=compiles, phase=f"b. AR step {b}")
        for b in tqdm(args.batches, "AR steps")
    }

    def by_concurrency(
        llm: LLM, label: str, concurrency: list[int] = args.concurrency
    ) -> dict[int, float]:
        return {
            c: decode_tok_s(
                llm,
                prompt,
                c,
                conc_tokens,
                conc_reps(c, args.conc_reps),
                log=compiles,
                phase=f"c. {label} {c}",
                waves=args.conc_waves,
            )
            for c in tqdm(concurrency, label)
        }

    ar_conc = by_concurrency(ar, "AR conc")
    ar.shutdown()  # memory back before the next engine sizes its caches
    sd = dflash_llm(target, drafter, 15, None, args.accept, kw)
    sd_steps = {
        b: mean_step_ms(sd, prompt, b, args.steps, log=compiles, phase=f"b. SD step {b}")
        for b in tqdm(args.batches, "SD steps")
    }
    fixed_conc = by_concurrency(sd, "N=15 conc")
    fixed_tau = sd.engine.spec_stats.mean_acceptance_length
    sd.shutdown()  # memory back before the next engine sizes its caches
    # The default: N by batch size, as users get it.
    auto = dflash_llm(target, drafter, 15, "auto", args.accept, kw)
    results["draft_schedule"] = schedule_text(auto)
    sd_conc = by_concurrency(auto, "SD conc")
    results["step_ms"] = {"ar": ar_steps, "dflash": sd_steps}
    results["concurrency_tok_s"] = {"ar": ar_conc, "dflash": sd_conc, "dflash_n15": fixed_conc}
    results["mean_acceptance_length"] = auto.engine.spec_stats.mean_acceptance_length
    results["mean_acceptance_length_n15"] = fixed_tau
    results["auto_steps_by_n"] = dict(sorted(auto.engine.spec_stats.steps_by_num_drafts.items()))
    results["auto_step_ms"] = chooser_costs_ms(auto)
    auto.shutdown()  # memory back before the next engine sizes its caches
    small_conc: dict[int, float] = {}
    small_tau = float("nan")
    if args.small_block:
        top = sorted(args.concurrency)[-2:]
        small = dflash_llm(target, drafter, args.small_block - 1, None, args.accept, kw)
        small_conc = by_concurrency(small, f"block {args.small_block} conc", top)
        small_tau = small.engine.spec_stats.mean_acceptance_length
        small.shutdown()
    results["small_block"] = {
        "block_size": args.small_block,
        "tok_s": small_conc,
        "mean_acceptance_length": small_tau,
    }

    print(
        f"\n{results['hardware']}, {results['date']}; {results['shape']} shapes, "
        "random bf16 weights, "
        f"prompt {args.prompt_len}, {args.new_tokens} new tokens ({conc_tokens} in c, "
        f"{args.conc_waves} wave(s) of requests a pass)"
    )
    # The generate figure includes each call's start and its prefix-cached prefill; the steady
    # figure is one decode step's (b.'s batch-1 decode), what the roofline bounds.
    steady = 1e3 / ar_steps[1] if 1 in ar_steps else float("nan")
    results["ar_batch1_steady_tok_s"] = steady
    print_table(
        "a. batch-1 decode tok/s (generate; steady = 1 / b.'s decode step)",
        ["roofline", "blockdraft AR", "% roofline", "AR steady", "% roofline", "transformers",
         "z-lab block 1"],
        [[roofline, results["ar_batch1_tok_s"], 100 * results["ar_batch1_tok_s"] / roofline,
          steady, 100 * steady / roofline, hf, zlab]],
    )  # fmt: skip
    print_table(
        "b. step cost (ms) and ratio",
        ["batch", "decode", "verify16+draft", "ratio"],
        [[b, ar_steps[b], sd_steps[b], sd_steps[b] / ar_steps[b]] for b in args.batches],
    )
    if "num_experts" in shape.config:
        results["moe_step_reads"] = reads = moe_step_reads(shape.config, bandwidth)
        print_table(
            "b'. weights one request's step reads (expected, random routing)",
            ["rows", "experts / layer", "GB", "x decode", "roofline ms"],
            reads,
        )
    print_table(
        f"c. tok/s, synthetic acceptance p={args.accept}; DFlash: default schedule "
        f"({results['draft_schedule']}; mean acceptance "
        f"{results['mean_acceptance_length']:.2f}), N=15: fixed (mean acceptance {fixed_tau:.2f})",
        ["concurrency", "AR", "DFlash", "speedup", "DFlash N=15", "speedup N=15"],
        [
            [
                c,
                ar_conc[c],
                sd_conc[c],
                sd_conc[c] / ar_conc[c],
                fixed_conc[c],
                fixed_conc[c] / ar_conc[c],
            ]
            for c in args.concurrency
        ],
    )
    print(
        f"default schedule: steps by chosen N {results['auto_steps_by_n']}; step ms it measured "
        + ", ".join(f"{k} {v:.2f}" for k, v in results["auto_step_ms"].items())
    )
    if small_conc:
        print_table(
            f"c'. fixed N={args.small_block - 1}, block {args.small_block} "
            f"(mean acceptance {small_tau:.2f})",
            ["concurrency", "AR", f"DFlash block {args.small_block}", "speedup"],
            [[c, ar_conc[c], v, v / ar_conc[c]] for c, v in small_conc.items()],
        )
    # A kernel first specialised inside a timed pass is a stall in that figure.
    stalls = compiles.by_phase()
    results["triton_compiles_in_timed_phases"] = stalls if compiles.installed else None
    if not compiles.installed:
        print("\n(triton has no post-compile hook here: compiles in timed phases not logged)")
    else:
        print_table(
            "Triton kernels first specialised inside timed passes (stalls)",
            ["phase", "count", "kernels"],
            [[p, len(k), ", ".join(sorted(set(k)))[:90]] for p, k in stalls.items()]
            or [["none", 0, ""]],
        )
    if not args.skip_drafter:
        results["shipped_drafter"] = shipped_drafter_bench(
            args.drafter_prompts, args.drafter_tokens, repeats=args.drafter_repeats
        )
    # Profiles only after every timing (part d. included), each engine made again: the profiler
    # leaves CUPTI attached to the process when it stops (pytorch/pytorch#144455), and what
    # runs after it runs slower (SmolLM2: an engine timed after another's profile, 1.14 ms a
    # step against 0.70 without, H100).
    prof_rows = []
    profiled = {
        "AR": lambda: LLM(str(target), **kw),
        "N=15": lambda: dflash_llm(target, drafter, 15, None, args.accept, kw),
        "auto": lambda: dflash_llm(target, drafter, 15, "auto", args.accept, kw),
    }
    for label, make in profiled.items() if args.profile else []:
        llm = make()
        for b in args.profile_batches:
            prof_rows += profile_steps(llm, prompt, args.steps, f"{label} b{b}", batch=b)
        llm.shutdown()
    if prof_rows:
        results["profile_ms"] = prof_rows
        print_table("profile, ms per step", ["mode", "what", "ms"], prof_rows)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

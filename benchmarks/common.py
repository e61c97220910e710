"""Shared pieces of the benchmark scripts: timing, tables, a random DFlash drafter config."""

from __future__ import annotations

import json
import math
import platform
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import save_file

# The embedded default target's shapes (SmolLM2-135M-Instruct), for random-weight benchmarks.
SMOLLM2_135M = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "vocab_size": 49152,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def now() -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def hardware() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"


def add_turn_taking_args(ap: object) -> None:
    """The arguments of the scripts whose engines take turns over passes on one target:
    --repeats, --threads, --model, --draft, --json."""
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (unset: the default)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft", default="default")
    ap.add_argument("--json", default=None)


def print_table(title: str, header: list[str], rows: list[list[object]]) -> None:
    cells = [[str(c) for c in header]] + [
        [f"{c:.2f}" if isinstance(c, float) else str(c) for c in row] for row in rows
    ]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    print(f"\n{title}")
    for i, row in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
        if i == 0:
            print("  ".join("-" * w for w in widths))


class TritonCompileLog:
    """Triton kernels specialised for the first time in this process while a timed phase ran:
    each one is a compile (or a disk-cache load) inside that phase's figure, i.e. a stall.
    Installs triton's post-compile hook; `installed` is False where triton has no such hook."""

    def __init__(self) -> None:
        self.phase: str | None = None  # the timed phase running now; None: untimed
        # (phase, kernel name, triton's repr of the call: the specialised argument types)
        self.events: list[tuple[str, str, str]] = []
        try:
            from triton import knobs

            knobs.runtime.jit_post_compile_hook = self._hook
            self.installed = True
        except (ImportError, AttributeError):
            self.installed = False

    def _hook(self, *args: object, **kwargs: object) -> None:
        # Any signature: a hook that raised would break the compile it reports on.
        if self.phase is not None:
            fn = kwargs.get("fn")
            kernel = str(getattr(fn, "name", fn))
            self.events.append((self.phase, kernel, str(kwargs.get("repr", ""))))

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        self.phase = phase
        try:
            yield
        finally:
            self.phase = None

    def by_phase(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for phase, kernel, _ in self.events:
            out.setdefault(phase, []).append(kernel)
        return out


def write_dummy_drafter(
    out_dir: Path,
    target_hf: dict,
    num_layers: int = 1,
    block_size: int = 16,
    with_weights: bool = True,
    dflash2: dict | None = None,
    sliding_window: int | None = None,
) -> Path:
    """A DFlash drafter shaped for `target_hf` with random weights (or only its config.json, for
    load_format="dummy", where the engine makes the weights on the device). `dflash2`: a DFlash2
    drafter instead, with these conv/selector fields (DFLASH2_FIELDS, the published ones).
    `sliding_window`: every layer but the last windowed, as z-lab's drafters for hybrid targets."""
    out_dir.mkdir(parents=True, exist_ok=True)
    heads = target_hf["num_attention_heads"]
    n_target = target_hf["num_hidden_layers"]
    ids = (
        [n_target // 2]
        if num_layers == 1
        else [round(1 + i * (n_target - 4) / (num_layers - 1)) for i in range(num_layers)]
    )
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "hidden_size": target_hf["hidden_size"],
        # An all-MoE target (Qwen3.5-MoE) has no dense MLP width: 3x hidden stands in.
        "intermediate_size": target_hf.get("intermediate_size") or 3 * target_hf["hidden_size"],
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": target_hf.get("num_key_value_heads", heads),
        "head_dim": target_hf.get("head_dim") or target_hf["hidden_size"] // heads,
        "rms_norm_eps": target_hf.get("rms_norm_eps", 1e-6),
        "rope_theta": target_hf.get("rope_theta", 10000.0),
        "vocab_size": target_hf["vocab_size"],
        "max_position_embeddings": target_hf.get("max_position_embeddings", 4096),
        "num_target_layers": n_target,
        "block_size": block_size,
        "dflash_config": {"mask_token_id": 0, "target_layer_ids": ids},
    }
    if sliding_window is not None:
        cfg["use_sliding_window"], cfg["sliding_window"] = True, sliding_window
        cfg["layer_types"] = ["sliding_attention"] * (num_layers - 1) + ["full_attention"]
    if dflash2 is not None:
        cfg["architectures"] = ["DFlash2DraftModel"]
        cfg["dflash_config"].update(dflash2)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    if with_weights:
        save_file(random_drafter_weights(cfg), str(out_dir / "model.safetensors"))
    return out_dir


def random_drafter_weights(cfg: dict, std: float = 0.02) -> dict[str, torch.Tensor]:
    h, d, inter = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    shapes = {"fc.weight": (h, h * len(cfg["dflash_config"]["target_layer_ids"]))}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
                p + "mlp.gate_proj.weight": (inter, h),
                p + "mlp.up_proj.weight": (inter, h),
                p + "mlp.down_proj.weight": (h, inter),
            }
        )
    weights = {name: torch.randn(shape) * std for name, shape in shapes.items()}
    norms = ["hidden_norm.weight", "norm.weight"]
    for i in range(cfg["num_hidden_layers"]):
        norms += [f"layers.{i}.{n}.weight" for n in ("input_layernorm", "post_attention_layernorm")]
        weights[f"layers.{i}.self_attn.q_norm.weight"] = torch.ones(d)
        weights[f"layers.{i}.self_attn.k_norm.weight"] = torch.ones(d)
    weights.update({name: torch.ones(h) for name in norms})
    dflash2 = cfg["dflash_config"].get("selector_rank")
    if dflash2:
        weights.update(random_dflash2_weights(cfg, std))
    return weights


# The conv and selector fields of z-lab's published DFlash2 drafters.
DFLASH2_FIELDS = {
    "conv_kernel_size": 2,
    "conv_group_size": 16,
    "selector_rank": 256,
    "selector_top_k": 16,
}


def random_dflash2_weights(cfg: dict, std: float = 0.02) -> dict[str, torch.Tensor]:
    """The tensors a DFlash2 drafter adds to a DFlash one, codebooks named as published."""
    dc, h, vocab = cfg["dflash_config"], cfg["hidden_size"], cfg["vocab_size"]
    kernel, groups = dc["conv_kernel_size"], h // dc["conv_group_size"]
    rank = dc["selector_rank"]
    shapes = {
        "candidate_selector.predecessor_codebook": (vocab, rank),
        "candidate_selector.successor_codebook": (vocab, rank),
        "candidate_selector.hidden_projection.weight": (rank, h),
    }
    for i in range(cfg["num_hidden_layers"]):
        for conv in ("attention_conv", "mlp_conv"):
            shapes[f"layers.{i}.{conv}.base_kernel"] = (2, kernel, h)
            shapes[f"layers.{i}.{conv}.kernel_projection.weight"] = (2 * kernel * groups, h)
    return {name: torch.randn(shape) * std for name, shape in shapes.items()}


def start_requests(
    llm: object, prompt: list[int], batch: int, temperature: float = 0.0, warm_steps: int = 3
) -> None:
    """Adds `batch` endless requests (`probe0..`; seeded when sampling), runs them past their
    prefill and `warm_steps` more steps: the steps after this are steady ones to time."""
    from blockdraft import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=temperature, seed=0, max_tokens=100_000, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"probe{i}", prompt, params)
    while engine.num_waiting or any(
        s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running
    ):
        engine.step()
    for _ in range(warm_steps):
        engine.step()


def stop_requests(llm: object, batch: int) -> None:
    for i in range(batch):
        llm.engine.abort_request(f"probe{i}")


def device_kernels(prof: object) -> list[object]:
    """The GPU kernels and copies of a finished torch.profiler run, by device time, largest
    first (graph launches and the profiler's own entries left out)."""
    events = [
        e
        for e in prof.key_averages()
        if e.device_time_total > 0 and e.key != "Activity Buffer Request"
    ]
    kernels = [e for e in events if not e.key.startswith(("cudaGraphLaunch", "ProfilerStep"))]
    return sorted(kernels, key=lambda e: e.self_device_time_total, reverse=True)


def time_graph(calls: list, iters: int, reps: int) -> float:
    """ms per call: one CUDA graph of `iters` calls cycling through `calls`, best replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and allocate outside the capture
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(iters):
            calls[i % len(calls)]()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = math.inf
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / iters)
    return best


def time_eager(calls: list, reps: int) -> float:
    """ms per call, eager (the twins sync on the host; on the CPU everything is eager)."""
    if torch.cuda.is_available():
        import triton.testing

        state = {"i": 0}

        def cycle() -> None:
            calls[state["i"] % len(calls)]()
            state["i"] += 1

        return triton.testing.do_bench(cycle, warmup=5, rep=max(reps, 1) * 20)
    calls[0]()  # compile / warm up
    start = time.perf_counter()
    for i in range(reps):
        calls[i % len(calls)]()
    return (time.perf_counter() - start) * 1e3 / reps

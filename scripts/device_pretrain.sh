#!/usr/bin/env bash
# Continue pretraining the shipped tiny model (issue A: its quality is below target) on an accelerator, or on the
# CPU (slowly: the same commands run there), then evaluate it the way the README's quality table does.
# Made for a short GPU lease: it stops by itself after MINUTES of training with a checkpoint, and every file it
# leaves in OUT_DIR is < 16 MB (the big resumable checkpoints/, ≈ 55 MB each, stay in RUN_DIR).
#
#   usage: scripts/device_pretrain.sh OUT_DIR [MINUTES=7] [STEPS=20000] [BATCH=256]
#   env:   RUN_DIR (default: a temp folder), LR (3e-4), EVAL_THREADS (8), EVAL_LIMIT (all 524 test lines)
#
# Needs only the core dependencies (torch, numpy, scipy, pyyaml, safetensors, tqdm, pillow); runs from this
# checkout's src/ without installing. The schedule: warm-up 500, constant lr to STEPS/2, linear decay to lr/10 at
# STEPS, time shift 1 (as the last phases of the shipped model; see src/flowcredit/models/assets/*.json).
# Size STEPS so that it ends within MINUTES (the decay matters): on the CPU ≈ 2-3 steps/s at batch 64.
# Then: copy OUT_DIR/model.{safetensors,json} over src/flowcredit/models/assets/tiny_shapes32.* if the eval
# summaries beat the README's table, and redo that table and the main-job numbers.
set -euo pipefail
OUT=${1:?usage: scripts/device_pretrain.sh OUT_DIR [MINUTES] [STEPS] [BATCH]}
MIN=${2:-7}
STEPS=${3:-20000}
BATCH=${4:-256}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
RUN=${RUN_DIR:-$(mktemp -d)/pretrain}
NPROC=$(nproc)
WORKERS=$(( NPROC > 4 ? NPROC - 3 : 0 ))   # render in worker processes only where there are cores to spare
mkdir -p "$OUT"

python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
python3 -m flowcredit.cli.main pretrain --init shipped --out_dir "$RUN" --steps "$STEPS" --batch_size "$BATCH" \
  --lr "${LR:-3e-4}" --warmup 500 --decay_start $((STEPS / 2)) --lr_final "$(python3 -c "print(${LR:-3e-4} / 10)")" \
  --time_shift 1 --device auto --workers "$WORKERS" --max_minutes "$MIN" --checkpoint_every 2000 --log_every 100 \
  --threads 2 2> "$RUN.progress" || { tail -c 2000 "$RUN.progress"; exit 1; }

last=$(ls "$RUN"/ema/*.safetensors | sort | tail -1)
cp "$last" "$OUT/model.safetensors"
cp "${last%.safetensors}.json" "$OUT/model.json"
cp "$RUN/log.jsonl" "$OUT/pretrain_log.jsonl"
python3 - "$OUT/pretrain_log.jsonl" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
if rows:
    r = rows[-1]
    print(f"step {r['step']} after {r['elapsed_s']:.0f} s ({r['step'] / r['elapsed_s']:.1f} steps/s), loss {r['loss']:.4f}")
EOF

for cfg in 1.0 4.5; do
  python3 -m flowcredit.cli.main eval --checkpoint "$OUT/model.safetensors" --cfg "$cfg" --precision bf16 \
    --threads "${EVAL_THREADS:-8}" ${EVAL_LIMIT:+--limit "$EVAL_LIMIT"} --out "$RUN/eval_cfg$cfg" >/dev/null
  cp "$RUN/eval_cfg$cfg/summary.json" "$OUT/eval_cfg$cfg.json"
  python3 - "$OUT/eval_cfg$cfg.json" "$cfg" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))
print(f"cfg {sys.argv[2]}: reward {s['reward_mean']:.3f} strict {s['strict_overall']:.3f} "
      f"correct {s['correct_overall']:.3f} strict by tag {json.dumps(s['strict_by_tag'])}")
EOF
done

#!/usr/bin/env bash
# Rebuild the shipped demo (demo_model/) from scratch on one GPU: the exact commands that made it.
#   specserve/train/build_demo.sh OUT base    tokenizer, target, dense draft model   (~6 min on an H200)
#   specserve/train/build_demo.sh OUT heads   EAGLE-3 head and DFlash drafter        (needs OUT/target)
# Set SPECSERVE="python3 -m specserve.cli.main" (default) or the installed `specserve`.
# Time limits only cap a slow machine: the LR schedule then finishes its decay by the limit.
set -euo pipefail
OUT=${1:?usage: build_demo.sh OUT base|heads}
STAGE=${2:?usage: build_demo.sh OUT base|heads}
DEV=${DEVICE:-cuda}
SPECSERVE=${SPECSERVE:-python3 -m specserve.cli.main}
SD="--sd-prompts 2048 --sd-prompt-len 64 --sd-new-tokens 128 --sd-batch-size 256 --sd-cache ${SD_CACHE:-/tmp/specserve_sd}"
mkdir -p "$OUT"
case "$STAGE" in
  base)
    $SPECSERVE train tokenizer --out "$OUT/tokenizer" --vocab-size 4096
    $SPECSERVE train target --tokenizer "$OUT/tokenizer" --out "$OUT/target" --device "$DEV" \
      --steps 3000 --batch-size 64 --seq-len 512 --lr 3e-3 --eval-every 500 --time-limit-s "${TARGET_LIMIT_S:-150}"
    $SPECSERVE train draft --family model --target "$OUT/target" --out "$OUT/model" --device "$DEV" \
      --steps 2000 --batch-size 64 --lr 3e-3 --time-limit-s "${DRAFT_LIMIT_S:-70}" $SD
    ;;
  heads)
    $SPECSERVE train draft --family eagle3 --target "$OUT/target" --out "$OUT/eagle3" --device "$DEV" \
      --steps 2000 --batch-size 64 --lr 2e-3 --time-limit-s "${DRAFT_LIMIT_S:-80}" $SD
    $SPECSERVE train draft --family dflash --target "$OUT/target" --out "$OUT/dflash" --device "$DEV" \
      --steps 2000 --batch-size 64 --lr 2e-3 --time-limit-s "${DRAFT_LIMIT_S:-80}" $SD
    ;;
  *) echo "unknown stage $STAGE (base|heads)" >&2; exit 2 ;;
esac

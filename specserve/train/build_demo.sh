#!/usr/bin/env bash
# Rebuild the shipped demo (demo_model/) from scratch on one GPU: the exact commands that made it.
#   specserve/train/build_demo.sh OUT base    tokenizer, target, dense draft model
#   specserve/train/build_demo.sh OUT eagle3  EAGLE-3 head (needs OUT/target)
#   specserve/train/build_demo.sh OUT dflash  DFlash drafter (needs OUT/target)
#   specserve/train/build_demo.sh OUT heads   eagle3 and dflash at once (two processes on one GPU)
#   specserve/train/build_demo.sh OUT dspark  DSpark drafter (needs OUT/target; its block starts at DSPARK_INIT,
#                                             default OUT/dflash)
#   specserve/train/build_demo.sh OUT mtp     DeepSeek-V3 MTP layer (needs OUT/target; the shipped one: DEVICE=cpu)
#   specserve/train/build_demo.sh OUT eval    acceptance + lossless check -> OUT/acceptance.json
# Set SPECSERVE to the command (default: python3 -m specserve.cli.main; run it outside the repo root
# when the package is installed elsewhere). Time limits only cap a slow machine: the LR schedule then
# finishes its decay by the limit (train_info.json records whether steps or time stopped a run).
# The DFlash arch reads the target's embeddings and lm_head (shared_target_head: not saved, hidden =
# the target's 256), trains each block output only on greedy-chain blocks (chain_labels) and draws most
# anchors on such blocks (chain_anchors). DFLASH_ARCH adds more --arch overrides (the shipped one:
# given_tokens=3 in its last stage, see demo_model/README.md); DFLASH_LR sets its peak learning rate
# (default 2e-3); DFLASH_INIT=DIR continues training a saved DFlash of that arch (not OUT/dflash).
set -euo pipefail
OUT=${1:?usage: build_demo.sh OUT base|eagle3|dflash|heads|dspark|mtp|eval}
STAGE=${2:?usage: build_demo.sh OUT base|eagle3|dflash|heads|dspark|mtp|eval}
DEV=${DEVICE:-cuda}
SPECSERVE=${SPECSERVE:-python3 -m specserve.cli.main}
SD="--sd-prompts 2048 --sd-prompt-len 64 --sd-new-tokens 128 --sd-batch-size 256 --sd-cache ${SD_CACHE:-/tmp/specserve_sd}"
mkdir -p "$OUT"
# heads read a larger self-distilled set than the draft LM, with 256-token prompts: sequences of 384
# tokens cover the positions the held-out prompts reach (prompt + 64 new tokens); heads trained on
# 192-token sequences lost agreement past position 192
HSD="--sd-prompt-len 256 --sd-new-tokens 128"
LIMIT=${HEADS_LIMIT_S:-360}
eagle3() {
  $SPECSERVE train draft --family eagle3 --target "$OUT/target" --out "$OUT/eagle3" --device "$DEV" \
    --steps 20000 --batch-size 64 --lr 2e-3 --time-limit-s "$LIMIT" --sd-prompts 8192 $HSD --sd-batch-size 1024 \
    --sd-cache "${SD_CACHE:-/tmp/specserve_sd}_eagle3"
}
dflash() {
  $SPECSERVE train draft --family dflash --target "$OUT/target" --out "$OUT/dflash" --device "$DEV" \
    --steps 20000 --batch-size 64 --lr "${DFLASH_LR:-2e-3}" --time-limit-s "$LIMIT" --sd-prompts 32768 $HSD --sd-batch-size 4096 \
    --arch shared_target_head=1 --arch num_layers=3 --arch head_dim=64 --arch intermediate_size=640 \
    --arch chain_labels=1 --arch chain_anchors=0.8 ${DFLASH_ARCH:-} --sd-cache "${SD_CACHE:-/tmp/specserve_sd}_dflash" \
    ${DFLASH_INIT:+--init-from "$DFLASH_INIT"}
}
# DSpark: DFlash's block arch (one pass: no given_tokens), its block starting at the DFlash drafter DSPARK_INIT (default
# OUT/dflash), the Markov head of rank 32 and the confidence head trained beside it (specserve/train/draft_dspark.py);
# DSPARK_LR its peak learning rate (default 1e-3), the same self-distilled sequences as DFlash's (its --sd-cache)
dspark() {
  $SPECSERVE train draft --family dspark --target "$OUT/target" --out "$OUT/dspark" --device "$DEV" \
    --steps 20000 --batch-size 64 --lr "${DSPARK_LR:-1e-3}" --time-limit-s "$LIMIT" --sd-prompts "${DSPARK_SD_PROMPTS:-32768}" \
    $HSD --sd-batch-size 4096 \
    --arch shared_target_head=1 --arch num_layers=3 --arch head_dim=64 --arch intermediate_size=640 \
    --arch chain_anchors=0.8 --arch markov_rank=32 ${DSPARK_ARCH:-} --sd-cache "${SD_CACHE:-/tmp/specserve_sd}_dflash" \
    --init-from "${DSPARK_INIT:-$OUT/dflash}"
}
# the MTP layer was trained on a shared 2-core CPU (DEVICE=cpu) in two stages (demo_model/README.md): MTP_STEPS small
# steps of 3 passes (default 90) or its time limit MTP_LIMIT_S (default 780 s), whichever comes first, at peak
# learning rate MTP_LR (default 3e-3); MTP_INIT=DIR continues a saved MTP layer (not OUT/mtp). On a GPU, as the other
# drafters: MTP_BATCH (default 8), MTP_SD_PROMPTS (default 256) and MTP_GROUP (default 8) size it up (README.md)
mtp() {
  $SPECSERVE train draft --family mtp --target "$OUT/target" --out "$OUT/mtp" --device "$DEV" \
    --steps "${MTP_STEPS:-90}" --batch-size "${MTP_BATCH:-8}" --lr "${MTP_LR:-3e-3}" --time-limit-s "${MTP_LIMIT_S:-780}" \
    --sd-prompts "${MTP_SD_PROMPTS:-256}" $HSD --sd-batch-size 256 --arch group="${MTP_GROUP:-8}" \
    --sd-cache "${SD_CACHE:-/tmp/specserve_sd}_mtp" ${MTP_INIT:+--init-from "$MTP_INIT"}
}
case "$STAGE" in
  base)
    $SPECSERVE train tokenizer --out "$OUT/tokenizer" --vocab-size 4096
    $SPECSERVE train target --tokenizer "$OUT/tokenizer" --out "$OUT/target" --device "$DEV" \
      --steps 700 --batch-size 64 --seq-len 512 --lr 3e-3 --eval-every 100 --time-limit-s 80
    $SPECSERVE train draft --family model --target "$OUT/target" --out "$OUT/model" --device "$DEV" \
      --steps 1200 --batch-size 64 --lr 3e-3 --time-limit-s 50 $SD
    ;;
  eagle3) eagle3 ;;
  dflash) dflash ;;
  dspark) dspark ;;
  mtp) mtp ;;
  heads)
    # each trainer is launch-bound: two processes share one GPU well
    eagle3 & EAGLE=$!
    dflash & DFLASH=$!
    wait $EAGLE
    wait $DFLASH
    ;;
  eval)
    $SPECSERVE train eval-acceptance --demo-dir "$OUT" --device "$DEV" --k 4 --max-new-tokens 64 \
      --num-prompts "${NUM_PROMPTS:-16}" --out-json "$OUT/acceptance.json"
    ;;
  *) echo "unknown stage $STAGE (base|eagle3|dflash|heads|dspark|mtp|eval)" >&2; exit 2 ;;
esac

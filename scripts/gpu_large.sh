#!/usr/bin/env bash
# Large images and large models on one GPU: `vitscale bench` against timm in PyTorch (eager,
# and torch.compile with PEERS=compile) for the shapes of the large-image table, in one call,
# then a table with the ratios (scripts/large_table.py).
#   scripts/gpu_large.sh BIN OUTDIR [ROWS]
# ROWS picks rows by number (default all), e.g. "1 2 4"; PEERS is "eager", "compile" or
# "eager compile" (default eager); PROFILE=1 adds a per-kernel profile of each vitscale row.
# Rows whose vitscale run checkpoints the blocks ("blocks", "blocks_full") run the peer with timm's activation
# checkpointing too (scripts/peer_checkpointed.py), so that both sides do the same work.
BIN=$1; O=$2; ROWS=${3:-"1 2 3 4 5 6 7"}
PEER=${PEER:-peers/vit_bench.py}; PEERS=${PEERS:-eager}
here=$(cd "$(dirname "$0")" && pwd)
export PYTHONUNBUFFERED=1
mkdir -p "$O"
# number | timm model | image px | micro | vitscale recompute policy
table='1 vit_large_patch16_224 224 128 auto
2 vit_huge_patch14_224 224 64 auto
3 vit_base_patch16_224 512 32 auto
4 vit_base_patch16_224 1024 4 auto
5 vit_large_patch16_224 384 32 auto
6 vit_base_patch16_224 1024 16 auto
7 vit_large_patch16_224 1024 16 blocks'
t0=$SECONDS
echo "$table" | while read -r num model img micro rec; do
  case " $ROWS " in *" $num "*) ;; *) continue ;; esac
  prof=""; [ "${PROFILE:-0}" = 1 ] && prof="--profile"
  timeout 120 "$BIN" bench --json --model "$model" --img "$img" --micro "$micro" --classes 10 --steps 10 --warmup 3 --recompute "$rec" $prof > "$O/v_$num.log" 2>&1
  echo "row $num $model $img micro $micro: vitscale rc $? ($((SECONDS - t0)) s) $(grep 'ms/step' "$O/v_$num.log" | sed 's/.*micro/micro/')"
  [ -n "$prof" ] && grep -A14 "profile of" "$O/v_$num.log" | head -15
  tail -n 1 "$O/v_$num.log" | grep '^{' | python3 -c "import json,sys; r=json.loads(sys.stdin.read()); r['row']=$num; r['recompute_policy']='$rec'; print(json.dumps(r))" >> "$O/vitscale.jsonl"
  for mode in $PEERS; do
    flag=""; to=90; [ "$mode" = compile ] && { flag="--compile"; to=200; }
    wrap=""; case $rec in blocks*) wrap="$here/peer_checkpointed.py" ;; esac
    timeout $to python3 $wrap "$PEER" --mode torch $flag --model "$model" --img "$img" --micro "$micro" --steps 10 --warmup 3 2>> "$O/peer.err" \
      | python3 -c "import json,sys
for l in sys.stdin:
    if l.startswith('{'): r=json.loads(l); r['row']=$num; print(json.dumps(r))" | tee -a "$O/peer.jsonl" | cut -c1-220
    echo "   peer $mode done ($((SECONDS - t0)) s)"
  done
done
tail -3 "$O/peer.err" 2>/dev/null | cut -c1-300
python3 "$here/large_table.py" "$O" | tee "$O/table.md"

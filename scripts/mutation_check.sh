#!/usr/bin/env bash
# Breaks the training loop on purpose, one way at a time, and checks that the test suite notices:
# each mutation below must make the named tests fail. The source is restored after each one
# (also on Ctrl-C). Run from anywhere inside the repository:
#
#   scripts/mutation_check.sh            # every mutation
#   scripts/mutation_check.sh clip       # only those whose name contains "clip"
#
# A mutation whose pattern is no longer in the source is reported as STALE (the code moved:
# update the pattern here), never as caught. Exit status: 0 when every mutation was caught.
set -u
cd "$(dirname "$0")/.."
filter=${1:-}

# name | file | perl substitution | tests that must fail (cargo test arguments)
mutations=(
  "lr-schedule-one-step-late|src/train/trainer.rs|s/schedule::lr_at\(cfg\.scheduler\.as_ref\(\), cfg\.optimizer\.lr\(\), step, \*total_steps\)/schedule::lr_at(cfg.scheduler.as_ref(), cfg.optimizer.lr(), step + 1, *total_steps)/|--test train_reference"
  "clipping-ignored|src/train/step.rs|s/clip_norm: self\.clip \}/clip_norm: 0.0 * self.clip }/|--test train_reference"
  "label-smoothing-ignored|src/train/trainer.rs|s/smoothed_targets\(&batch\.labels\[start\.\.start \+ n\], k, label_smoothing\)/smoothed_targets(&batch.labels[start..start + n], k, 0.0)/|--test train_reference"
  "weight-decay-skip-ignored|src/train/trainer.rs|s/DecayGroups::new\(&vit\.table, &cfg\.train\.weight_decay_skip\)/DecayGroups::new(\&vit.table, \&crate::config::DecaySkip { bias: false, norm: false, pos_embed: false, cls_token: false })/|--test train_reference"
  "gas-loss-scale-per-micro-batch|src/train/step.rs|s/forward_staged\(be, n, Some\(1\.0 \/ self\.plan\.global_batch as f32\)\)/forward_staged(be, n, Some(1.0 \/ (n * self.plan.world_size) as f32))/g|--test train_reference"
  "zero-clip-norm-of-own-shard-only|src/train/zero.rs|s/self\.comm\.all_reduce_host\(&mut own\)\?;/let _ = &mut own;/|--test dist_zero sgd_stages"
  "zero-updated-weights-not-gathered|src/train/zero.rs|s/works\.push\(self\.start\(Collective::AllGather, gathered, prefix\)\?\);/let _ = prefix;/|--test dist_zero sgd_stages"
  "zero-bucket-tail-not-reduced|src/train/zero.rs|s/works\.push\(self\.start_gradients\(Collective::AllReduce\(ReduceOp::Sum\), grads, tail\)\?\);/let _ = tail;/|--test dist_zero sgd_stages"
  "adam-second-moment-uncorrected|src/backend/cpu/optim.rs|s/let denom = \(v\[i\] \/ bc2\)\.sqrt\(\) \+ eps;/let denom = v[i].sqrt() + eps;/|--test train_reference --test timm_parity"
)

tmp=$(mktemp -d)
restore() { for f in "$tmp"/*.orig; do [ -e "$f" ] || continue; cp "$f" "$(cat "${f%.orig}.path")"; done; }
trap 'restore; rm -rf "$tmp"' EXIT INT TERM

caught=0; missed=0; stale=0
for m in "${mutations[@]}"; do
  IFS='|' read -r name file subst tests <<<"$m"
  [[ -n "$filter" && "$name" != *"$filter"* ]] && continue
  key=$(echo "$file" | tr / _)
  cp "$file" "$tmp/$key.orig"; echo "$file" > "$tmp/$key.path"
  perl -0pi -e "$subst" "$file"
  if cmp -s "$file" "$tmp/$key.orig"; then
    echo "STALE   $name: pattern not found in $file"; stale=$((stale + 1)); continue
  fi
  # shellcheck disable=SC2086
  if cargo test --release -q $tests >"$tmp/$name.log" 2>&1; then
    echo "MISSED  $name: cargo test --release $tests passed with the mutation"; missed=$((missed + 1))
  elif grep -q "^error\(\[E[0-9]*\]\)\?:" "$tmp/$name.log" && ! grep -q "test result" "$tmp/$name.log"; then
    echo "STALE   $name: the mutated source does not compile (see below)"; sed -n 1,20p "$tmp/$name.log"; stale=$((stale + 1))
  else
    echo "caught  $name: $(grep -m1 -E "panicked at|FAILED" "$tmp/$name.log" | cut -c1-150)"; caught=$((caught + 1))
  fi
  cp "$tmp/$key.orig" "$file"; rm -f "$tmp/$key.orig"
done
echo "mutations caught $caught, missed $missed, stale $stale"
[[ $missed -eq 0 && $stale -eq 0 ]]

#!/usr/bin/env bash
# The CPU 2-rank training under the launchers users have, for real: Open MPI's `mpirun -np 2`
# (Debian's openmpi-bin) and SLURM's `srun -n 2` (a single-node SLURM from Debian's
# slurm-wlm, started here with munge), each compared with the `vitscale launch` run of the
# same configuration by the final `weights_hash`, which must be equal.
#
#   scripts/real_launchers.sh OUT_DIR
#
# Needs root for apt-get (skipped when the tools are installed) and to run slurmctld/slurmd.
# Writes OUT_DIR/results.txt and each run's directory and log; prints PASS or FAIL per
# launcher. Exit status: 0 all equal; 1 a run failed or a hash differs (vitscale's fault);
# 2 the environment could not provide the launchers (no root, apt-get, munge or the SLURM
# daemons failed), so nothing was compared. The daemons it starts are stopped at exit.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: $0 OUT_DIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
BIN=$PWD/target/release/vitscale
[ -x "$BIN" ] || cargo build --release
RES=$OUT/results.txt
: > "$RES"
# each run writes a fresh run directory (a directory holding a run is never reused)
rm -rf "$OUT/launch" "$OUT/mpirun" "$OUT/srun" "$OUT/slurm"
log() { echo "$*" | tee -a "$RES"; }

need=()
command -v mpirun >/dev/null || need+=(openmpi-bin)
command -v srun >/dev/null || need+=(slurm-wlm)
command -v munged >/dev/null || need+=(munge)
if [ ${#need[@]} -gt 0 ] && [ "$(id -u)" != 0 ]; then
  log "SKIP: ${need[*]} missing and not root to install them"; exit 2
fi
if [ ${#need[@]} -gt 0 ]; then
  log "installing ${need[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${need[@]}" >"$OUT/apt.log" 2>&1 \
    || { apt-get update >>"$OUT/apt.log" 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${need[@]}" >>"$OUT/apt.log" 2>&1; } \
    || { log "FAIL: apt-get install ${need[*]} (see apt.log)"; exit 2; }
fi

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
# One thread per rank everywhere, so the three runs do the same arithmetic.
export RAYON_NUM_THREADS=1
TRAIN=(train --device cpu --json --set data.train_size=512 --set data.val_size=128
       --set train_batch_size=64 --set train.steps=6 --set train.comm_timeout_s=60)
hash_of() { grep -o '"weights_hash":"[0-9a-f]*"' "$1" | tail -1 | cut -d'"' -f4; }

status=0
timeout 300 "$BIN" launch --nproc-per-node 2 -- "${TRAIN[@]}" --run-dir "$OUT/launch" >"$OUT/launch.log" 2>&1
REF=$(hash_of "$OUT/launch.log")
if [ -z "$REF" ]; then log "FAIL: vitscale launch gave no weights_hash (launch.log)"; exit 1; fi
log "vitscale launch --nproc-per-node 2: weights_hash $REF"

compare() { # name log
  local h; h=$(hash_of "$2")
  if [ -z "$h" ]; then log "FAIL: $1 gave no weights_hash ($(basename "$2"))"; status=1
  elif [ "$h" = "$REF" ]; then log "PASS: $1: weights_hash $h equals vitscale launch"
  else log "FAIL: $1: weights_hash $h differs from vitscale launch's $REF"; status=1; fi
}

# ---- Open MPI
MPI_ROOT=()
[ "$(id -u)" = 0 ] && MPI_ROOT=(--allow-run-as-root)
PORT=$(free_port)
timeout 300 mpirun "${MPI_ROOT[@]}" --oversubscribe -np 2 -x RAYON_NUM_THREADS -x MASTER_PORT="$PORT" \
  "$BIN" "${TRAIN[@]}" --run-dir "$OUT/mpirun" >"$OUT/mpirun.log" 2>&1
compare "mpirun -np 2 ($(mpirun --version 2>/dev/null | head -1))" "$OUT/mpirun.log"

# ---- SLURM: munge + slurmctld + slurmd on this machine, configuration in OUT_DIR/slurm
S=$OUT/slurm
mkdir -p "$S/state" "$S/spool" /run/munge /var/log/munge /var/lib/munge /etc/munge
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null; done
  for f in "$S/slurmd.pid" "$S/slurmctld.pid" "$S/munged.pid"; do
    [ -f "$f" ] && kill "$(cat "$f")" 2>/dev/null
  done
}
trap cleanup EXIT
if [ ! -s /etc/munge/munge.key ]; then
  dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 2>/dev/null
fi
chmod 400 /etc/munge/munge.key
if ! munge -n >/dev/null 2>&1; then
  munged --force --pid-file="$S/munged.pid" --socket=/run/munge/munge.socket.2 >"$S/munged.log" 2>&1 \
    || { log "FAIL: munged did not start ($S/munged.log)"; exit 2; }
fi
HOST=$(hostname -s)
CPUS=$(nproc)
cat >"$S/slurm.conf" <<EOF
ClusterName=vitscale-check
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$S/state
SlurmdSpoolDir=$S/spool
SlurmctldPidFile=$S/slurmctld.pid
SlurmdPidFile=$S/slurmd.pid
SlurmctldLogFile=$S/slurmctld.log
SlurmdLogFile=$S/slurmd.log
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS State=UNKNOWN
PartitionName=check Nodes=$HOST Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
export SLURM_CONF=$S/slurm.conf
slurmctld -f "$S/slurm.conf" >>"$S/slurmctld.out" 2>&1 || { log "FAIL: slurmctld did not start ($S/slurmctld.log)"; exit 2; }
slurmd -f "$S/slurm.conf" >>"$S/slurmd.out" 2>&1 || { log "FAIL: slurmd did not start ($S/slurmd.log)"; exit 2; }
for _ in $(seq 60); do
  sinfo -h -o %t 2>/dev/null | grep -qE '^(idle|mix|alloc)' && break
  sleep 1
done
if ! sinfo -h -o %t 2>/dev/null | grep -qE '^(idle|mix|alloc)'; then
  log "FAIL: the SLURM node did not come up ($(sinfo -h 2>&1 | head -1); see $S/*.log)"; exit 2
fi
PORT=$(free_port)
MASTER_ADDR=127.0.0.1 MASTER_PORT=$PORT timeout 300 srun -n 2 -N 1 --overcommit "$BIN" "${TRAIN[@]}" --run-dir "$OUT/srun" >"$OUT/srun.log" 2>&1
compare "srun -n 2 ($(srun --version 2>/dev/null))" "$OUT/srun.log"

[ $status = 0 ] && log "ALL PASS" || log "SOME FAILED"
exit $status

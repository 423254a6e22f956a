#!/usr/bin/env bash
# Behaviour unchanged, shown bit for bit: builds BASE's keel in a git worktree outside the clone,
# runs a fixed matrix of small trainings with BASE's binary and with this tree's (the same command
# lines, the same inputs, one after the other on this machine), and compares each pair with
# scripts/compare_runs.py: summary.json's losses and outcome, metrics.jsonl's per-step losses,
# and every tensor of the final checkpoint step (all shards of all ranks: model, optimizer, rank
# state), bit for bit.
#
#   scripts/compare_behaviour.sh BASE [HEAD_BUILD_DIR]
#   scripts/compare_behaviour.sh HEAD~1            # the parent commit against build/keel
#   KEEL_COMPARE_BASE=main scripts/compare_behaviour.sh
#
# BASE: a commit-ish (default $KEEL_COMPARE_BASE). Its binary is built by its own
# scripts/setup.sh in ${XDG_CACHE_HOME:-~/.cache}/keel/compare/<sha>/ (a detached `git worktree`,
# reused when present; ccache shares the objects with this clone's build). HEAD_BUILD_DIR
# (default build) holds this tree's binary; `scripts/setup.sh keel` builds it when it is missing.
#
# The matrix: mlp, cnn, gpt, gpt2 and llama; 1 and 2 ranks; dist.zero 0-3; eager and
# compile.mode = inductor (two runs: they package for about a minute each); fp32 and bf16; a
# resume. Tiny models on data that needs no download (synthetic images, a text file of the
# system, a token file made from it). Each run has its own directory under a fresh temporary
# root and, with 2 ranks, its own free port; a run that exits nonzero on either side is a FAIL
# with the end of its log. Output: the two commits, the runs, then one line per run
# (`same  NAME  (N losses, M tensors)`, `DIFF  NAME: ...`, `FAIL  NAME: ...`) and a tally.
# Exit status: 0 when every run is the same, 1 otherwise, 2 on bad usage.
#
# Environment: KEEL_COMPARE_BASE, KEEL_COMPARE_KEEP=1 keeps the temporary root (kept anyway
# when a run differs or fails), KEEL_COMPARE_ONLY (a grep -E pattern: only the runs it matches),
# KEEL_COMPARE_TIMEOUT (seconds per run, default 900), KEEL_VENV.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD

log() { printf '[compare] %s\n' "$*" >&2; }
die() {
  printf 'compare_behaviour.sh: %s\n' "$*" >&2
  exit 2
}

base_ref="${1:-${KEEL_COMPARE_BASE:-}}"
[ -n "$base_ref" ] || die "usage: scripts/compare_behaviour.sh BASE [HEAD_BUILD_DIR] (or set KEEL_COMPARE_BASE)"
head_build="${2:-build}"
timeout_s="${KEEL_COMPARE_TIMEOUT:-900}"
venv="${KEEL_VENV:-$HOME/.cache/keel/venv}"
py="$venv/bin/python"
[ -x "$py" ] || py=python3

base_sha=$(git rev-parse --verify --quiet "${base_ref}^{commit}") || die "$base_ref: not a commit of $repo"
head_sha=$(git rev-parse HEAD)
head_state="$head_sha"
[ -z "$(git status --porcelain --untracked-files=no)" ] || head_state="$head_sha + uncommitted changes"
started=$SECONDS

# ---- the two binaries ---------------------------------------------------------------------
head_bin="$(cd "$(dirname "$head_build/keel")" 2>/dev/null && pwd)/keel" || head_bin=""
if [ ! -x "$head_bin" ]; then
  log "no $head_build/keel: building it (scripts/setup.sh keel)"
  KEEL_BUILD_DIR="$head_build" scripts/setup.sh keel
  head_bin="$(cd "$head_build" && pwd)/keel"
fi

cache="${XDG_CACHE_HOME:-$HOME/.cache}/keel/compare"
worktree="$cache/$base_sha"
mkdir -p "$cache"
exec 8>"$worktree.lock"
flock 8 # one build of a worktree at a time
if [ -e "$worktree/.git" ] && [ "$(git -C "$worktree" rev-parse HEAD 2>/dev/null)" = "$base_sha" ]; then
  log "reusing the worktree of $base_sha: $worktree"
else
  [ ! -e "$worktree" ] || die "$worktree exists but is not a worktree at $base_sha: remove it (and run git worktree prune)"
  git worktree prune
  log "git worktree add --detach $worktree $base_sha"
  git worktree add --quiet --detach "$worktree" "$base_sha"
fi
build_log="$cache/$base_sha.build.log"
log "building $base_sha's keel there (KEEL_BUILD_DIR=build scripts/setup.sh keel; log: $build_log)"
t0=$SECONDS
if ! (cd "$worktree" && KEEL_BUILD_DIR=build scripts/setup.sh keel) >"$build_log" 2>&1; then
  tail -n 30 "$build_log" >&2
  die "the build of $base_sha failed (log: $build_log)"
fi
log "built in $((SECONDS - t0)) s"
flock -u 8

# ---- inputs, the same files for both sides --------------------------------------------------
root=$(mktemp -d "${TMPDIR:-/tmp}/keel-compare.XXXXXX")
case "$root" in *[[:space:]]*) die "the temporary root $root holds whitespace (set TMPDIR)" ;; esac
in="$root/inputs"
mkdir -p "$in" "$root/base" "$root/head" "$root/bin"
# Copies of the two binaries, so that a rebuild of either during the runs changes nothing (their
# RUNPATH is absolute; each still packages with its own tree's aot_package.py, a path built in).
cp "$worktree/build/keel" "$root/bin/base-keel"
cp "$head_bin" "$root/bin/head-keel"
base_bin="$root/bin/base-keel"
head_bin_copy="$root/bin/head-keel"
cp -r "$repo/configs" "$in/configs" # this tree's experiment files, for both binaries
if [ -f /usr/share/common-licenses/GPL-3 ]; then
  cp /usr/share/common-licenses/GPL-3 "$in/text.txt"
else
  cat "$repo"/docs/*.md >"$in/text.txt"
fi
# A raw uint16 token file: the text's bytes as tokens (vocabulary 256).
"$py" -c 'import array, sys; open(sys.argv[2], "wb").write(array.array("H", list(open(sys.argv[1], "rb").read())).tobytes())' \
  "$in/text.txt" "$in/tokens.bin"

# ---- the matrix ------------------------------------------------------------------------------
# One entry: NAME RANKS STEPS FIRST_STEPS ARGS... (FIRST_STEPS: "-", or the steps of a first run
# whose checkpoints the run then resumes from, with the same command and train.steps = STEPS).
# Every run checkpoints (at least the final step) under ckpt/ and writes run/.
common="--run.seed=7 --run.dir=run --checkpoint.dir=ckpt --run.peak_tflops=1 --dist.timeout_s=120 --train.log_interval=4 --train.eval_interval=4 --train.warmup_steps=2"
images="--data.name=synthetic --data.synthetic_size=512 --data.eval_batch_size=128 --train.batch_size=8"
mlp="--config=$in/configs/fashion_mnist_mlp.toml $images --model.width=64 --model.depth=3"
cnn="--config=$in/configs/fashion_mnist_cnn.toml $images"
gpt="--config=$in/configs/gpt_text.toml --data.path=$in/text.txt --data.eval_samples=64 --model.width=64 --model.depth=2 --model.heads=4 --model.context=32 --train.batch_size=4"
tokens="--data.name=tokens --data.path=$in/tokens.bin --data.token_dtype=uint16 --data.test_path= --data.test_fraction=0.1 --data.eval_samples=64 --model.vocab=256 --model.width=64 --model.depth=2 --model.heads=4 --model.context=32 --train.batch_size=4"
gpt2="--config=$in/configs/gpt2_small.toml $tokens" # sets amp.dtype and train.grad_accum: each run says its own
llama="--config=$in/configs/llama_tiny.toml $tokens --model.kv_heads=2"
read -r -a common_args <<<"$common" # added to every entry's arguments
runs=(
  "mlp_1r_fp32_sgd 1 12 - $mlp --train.optimizer=sgd --train.lr=0.05 --train.grad_clip=1.0"
  "mlp_1r_fp32_inductor 1 8 - $mlp --compile.mode=inductor"
  "mlp_2r_z1_sgd_accum 2 12 - $mlp --dist.zero=1 --train.optimizer=sgd --train.lr=0.05 --train.grad_accum=2"
  "mlp_2r_z2_bf16 2 12 - $mlp --dist.zero=2 --amp.dtype=bf16 --train.grad_clip=1.0"
  "cnn_1r_bf16_scaled 1 12 - $cnn --amp.dtype=bf16 --amp.loss_scaling=dynamic --amp.init_scale=1024"
  "cnn_2r_z0_fp32_accum 2 12 - $cnn --dist.zero=0 --train.grad_accum=2"
  "cnn_2r_z1_fp32 2 12 - $cnn --dist.zero=1"
  "gpt_1r_fp32 1 12 - $gpt"
  "gpt_2r_z0_late_bf16hook 2 12 - $gpt --dist.zero=0 --dist.consensus=late --dist.comm_hook=bf16 --model.dropout=0.1"
  "gpt_2r_z3_bf16_accum 2 12 - $gpt --dist.zero=3 --amp.dtype=bf16 --train.grad_accum=2"
  "gpt_2r_z1_bf16_inductor 2 8 - $gpt --dist.zero=1 --amp.dtype=bf16 --compile.mode=inductor"
  "gpt2_1r_bf16 1 12 - $gpt2 --amp.dtype=bf16 --train.grad_accum=1"
  "gpt2_2r_z0_fp32_accum 2 12 - $gpt2 --dist.zero=0 --amp.dtype=off --train.grad_accum=2"
  "llama_1r_fp32 1 12 - $llama"
  "llama_2r_z3_bf16_untied 2 12 - $llama --dist.zero=3 --amp.dtype=bf16 --model.tie_embeddings=false"
  "llama_2r_z2_fp32_resume 2 12 6 $llama --dist.zero=2 --train.schedule=constant --checkpoint.interval=3 --checkpoint.async=true --model.dropout=0.1"
)
# Fashion-MNIST itself (Debian's dataset-fashion-mnist, which scripts/setup.sh installs), when present.
fmnist=/usr/share/datasets/fashion-mnist
if [ -d "$fmnist" ]; then
  runs+=("cnn_2r_z2_fashion_mnist 2 12 - --config=$in/configs/fashion_mnist_cnn.toml --data.path=$fmnist --data.eval_samples=512 --train.batch_size=8 --dist.zero=2")
else
  log "no $fmnist (dataset-fashion-mnist): the Fashion-MNIST run is left out"
fi

if [ -n "${KEEL_COMPARE_ONLY:-}" ]; then # a subset, by name (grep -E), e.g. to rerun a failure
  chosen=()
  for entry in "${runs[@]}"; do
    ! grep -Eq -- "$KEEL_COMPARE_ONLY" <<<"${entry%% *}" || chosen+=("$entry")
  done
  [ ${#chosen[@]} -gt 0 ] || die "KEEL_COMPARE_ONLY=$KEEL_COMPARE_ONLY matches no run"
  runs=("${chosen[@]}")
fi

# ---- running one side of one entry -------------------------------------------------------------
declare -A used_ports=()
free_port() { # a port nothing listens on, never handed out twice by this script
  local p
  while :; do
    p=$("$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    [ -z "${used_ports[$p]:-}" ] && break
  done
  used_ports[$p]=1
  echo "$p"
}

# Launchers' variables of the caller's shell (a torchrun, srun or mpirun around this script), and
# the script overrides that would make both binaries run the same tree's Python.
clean_env=(-u RANK -u WORLD_SIZE -u LOCAL_RANK -u LOCAL_WORLD_SIZE -u MASTER_ADDR -u MASTER_PORT
  -u TORCHELASTIC_RESTART_COUNT -u TORCHELASTIC_USE_AGENT_STORE -u SLURM_PROCID -u SLURM_NTASKS
  -u SLURM_LOCALID -u SLURM_NTASKS_PER_NODE -u OMPI_COMM_WORLD_RANK -u OMPI_COMM_WORLD_SIZE
  -u OMPI_COMM_WORLD_LOCAL_RANK -u OMPI_COMM_WORLD_LOCAL_SIZE -u KEEL_AOT_SCRIPT
  -u KEEL_REFERENCE_MODELS -u KEEL_TOKENIZE_SCRIPT)

# launch DIR RANKS LOG_PREFIX BINARY ARGS...: `BINARY train ARGS` in DIR on RANKS ranks (each rank's
# output in DIR/LOG_PREFIX.rank<R>.txt; the compile cache under DIR/cache). On failure writes
# DIR/FAILED (each failing rank's exit status and the end of its log) and returns 1.
launch() {
  local dir=$1 ranks=$2 prefix=$3 bin=$4
  shift 4
  local port=0 r pids=() codes=() failed=()
  [ "$ranks" = 1 ] || port=$(free_port)
  for ((r = 0; r < ranks; r++)); do
    local rank_env=()
    [ "$ranks" = 1 ] || rank_env=(RANK="$r" WORLD_SIZE="$ranks" LOCAL_RANK="$r" LOCAL_WORLD_SIZE="$ranks"
      MASTER_ADDR=127.0.0.1 MASTER_PORT="$port")
    # The subshell outlives the rank (no implicit exec), so that a rank killed by a signal is
    # reported by it, into the rank's log, and not by this script.
    (
      cd "$dir" && env "${clean_env[@]}" XDG_CACHE_HOME="$dir/cache" "${rank_env[@]}" \
        timeout --kill-after=10 "$timeout_s" "$bin" train "$@"
      rc=$?
      exit "$rc"
    ) >"$dir/$prefix.rank$r.txt" 2>&1 &
    pids+=($!)
  done
  for r in "${!pids[@]}"; do
    codes[r]=0
    wait "${pids[$r]}" || codes[r]=$?
    [ "${codes[r]}" = 0 ] || failed+=("$r")
  done
  [ ${#failed[@]} -gt 0 ] || return 0
  {
    local what=()
    for r in "${failed[@]}"; do
      case "${codes[r]}" in
        124) what+=("rank $r timed out after $timeout_s s") ;;
        13[0-9] | 1[4-9][0-9]) what+=("rank $r exit ${codes[r]} (signal $((codes[r] - 128)))") ;;
        *) what+=("rank $r exit ${codes[r]}") ;;
      esac
    done
    local joined
    printf -v joined '%s; ' "${what[@]}"
    echo "failed on $ranks rank(s): ${joined%; }"
    for r in "${failed[@]}"; do
      echo "rank $r's log ($dir/$prefix.rank$r.txt) ends:"
      tail -n 12 "$dir/$prefix.rank$r.txt"
    done
  } >"$dir/FAILED"
  return 1
}

# run_entry SIDE BINARY NAME RANKS STEPS FIRST_STEPS ARGS...
run_entry() {
  local side=$1 bin=$2 name=$3 ranks=$4 steps=$5 first=$6
  shift 6
  local dir="$root/$side/$name"
  mkdir "$dir" # fresh: never shared with another run
  set -- "$@" "${common_args[@]}"
  if [ "$first" != - ]; then
    printf '%s\n' "$*" "--train.steps=$first" >"$dir/command.first.txt"
    launch "$dir" "$ranks" first "$bin" "$@" "--train.steps=$first" || return 0
    cp "$dir/run/summary.json" "$dir/summary.first.json" 2>/dev/null || true
  fi
  printf '%s\n' "$*" "--train.steps=$steps" >"$dir/command.txt"
  launch "$dir" "$ranks" train "$bin" "$@" "--train.steps=$steps" || return 0
  rm -rf "$dir/cache" # the compile cache (hundreds of MB with inductor); kept when the run failed
}

# ---- the runs ----------------------------------------------------------------------------------
sha() { sha256sum "$1" | cut -c1-16; }
echo "base: $base_sha ($base_ref): $worktree/build/keel (sha256 $(sha "$base_bin")...)"
echo "head: $head_state: $head_bin (built $(date -r "$head_bin" '+%F %T'), sha256 $(sha "$head_bin_copy")...)"
! cmp -s "$base_bin" "$head_bin_copy" || echo "(the two binaries are the same bytes)"
echo "runs (${#runs[@]}; the same command lines on both sides, in $root/{base,head}/NAME/; each with $common):"
names=()
for entry in "${runs[@]}"; do
  read -r -a f <<<"$entry"
  names+=("${f[0]}")
  resume=""
  [ "${f[3]}" = - ] || resume=", resuming at step ${f[3]}"
  printf '  %-26s %s rank(s), %s steps%s: %s\n' "${f[0]}" "${f[1]}" "${f[2]}" "$resume" "${f[*]:4}"
done
for entry in "${runs[@]}"; do
  read -r -a f <<<"$entry"
  t0=$SECONDS
  run_entry base "$base_bin" "${f[@]}"
  t1=$SECONDS
  run_entry head "$head_bin_copy" "${f[@]}"
  log "$(printf '%-26s base %3d s, head %3d s' "${f[0]}" $((t1 - t0)) $((SECONDS - t1)))"
done

echo "comparison (base = $base_sha, head = $head_state):"
rc=0
"$py" "$repo/scripts/compare_runs.py" --roots "$root/base" "$root/head" "${names[@]}" || rc=$?
echo "wall time: $((SECONDS - started)) s"
if [ "$rc" = 0 ] && [ "${KEEL_COMPARE_KEEP:-0}" != 1 ]; then
  rm -rf "$root"
else
  echo "runs kept in $root"
fi
exit "$rc"

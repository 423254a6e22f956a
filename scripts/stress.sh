#!/usr/bin/env bash
# Runs keel's multi-rank tests (dist/, checkpoint/, faults, restarts, two hosts, Slurm) N rounds under ctest -j2
# with a CPU burner beside them (one busy process per core), and prints every failure. Not
# part of CI: run it after touching anything multi-rank, before calling it done.
#   scripts/stress.sh            # 5 rounds
#   scripts/stress.sh 10 'Fault' # 10 rounds of the tests matching a ctest -R regex
#   scripts/stress.sh 10 'Hardening\.(Signals|ASecondRun)'  # issue 23's signal and lock tests
# Needs a built tree (scripts/setup.sh). Exit 0 only when every round passed.
set -uo pipefail
cd "$(dirname "$0")/.."
rounds="${1:-5}"
regex="${2:-^(Collectives|Ddp|Launch|AmpDist|Fault[A-Za-z]*|Checkpoint[A-Za-z]*|TrainerCheckpoints|KeelInspect|Restart|TwoNode|Slurm|Zero|Hardening)\.}"
build="${KEEL_BUILD_DIR:-build}"
[ -x "$build/tests/keel_tests" ] || { echo "stress: $build/tests/keel_tests missing; run scripts/setup.sh"; exit 1; }
logs=$(mktemp -d /tmp/keel-stress.XXXXXX)
burners=()
for _ in $(seq "$(nproc)"); do (while :; do :; done) & burners+=($!); done
trap 'kill "${burners[@]}" 2>/dev/null' EXIT
echo "stress: $rounds rounds of ctest -j2 -R '$regex' beside $(nproc) CPU burners; logs in $logs"
failed_rounds=0
for r in $(seq "$rounds"); do
  t0=$(date +%s)
  (cd "$build" && ctest -j2 -R "$regex" --output-on-failure > "$logs/round$r.log" 2>&1)
  rc=$?
  summary=$(grep -E "tests passed|tests failed" "$logs/round$r.log" | tail -1)
  echo "round $r: ${summary:-no summary} ($(( $(date +%s) - t0 )) s)"
  if [ $rc -ne 0 ]; then
    failed_rounds=$((failed_rounds + 1))
    grep -E "^\s+[0-9]+ - " "$logs/round$r.log" | sed 's/^/    FAILED /'
  fi
done
echo "stress: $failed_rounds of $rounds rounds had failures"
[ $failed_rounds -eq 0 ]

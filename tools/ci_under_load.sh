#!/usr/bin/env bash
# CI under load: N consecutive `bash .ci/run` (what CI runs: make test) in a fresh clone of one commit, beside a
# bounded CPU load of its own, printing each run's time and result (issue #45: the suite must pass on a busy
# 2-core machine every time).
#
#   tools/ci_under_load.sh [COMMIT] [N] [LOAD]
#     COMMIT  what to clone and check out (default HEAD of this checkout)
#     N       consecutive runs in that one clone (default 5; the first also installs .venv, as CI's does)
#     LOAD    busy-loop processes beside the runs (default 4), each ended when the runs end (and, whatever
#             happens, by its own time limit: LOAD_MAX_S, default 3 h)
#
# Environment: CLONE_DIR (default a new folder under ${TMPDIR:-/tmp}, kept for the logs: run-<i>.log there),
# PIP_CACHE_DIR and the like pass through to make install. Exit status: 0 when every run passed, else 1.
set -euo pipefail

here="$(cd "$(dirname "$0")/.." && pwd)"
commit="${1:-HEAD}"
runs="${2:-5}"
load="${3:-4}"
max_s="${LOAD_MAX_S:-10800}"
commit="$(git -C "$here" rev-parse --verify "$commit^{commit}")"
dir="${CLONE_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/ci-under-load.XXXXXX")}"

echo "ci_under_load: commit $commit, $runs runs, CPU load $load, clone in $dir"
git clone --quiet --no-checkout "$here" "$dir/repo"
git -C "$dir/repo" checkout --quiet --detach "$commit"

pids=()
stop_load() {
    for pid in "${pids[@]}"; do
        kill "$pid" 2>/dev/null || true
    done
    for pid in "${pids[@]}"; do
        wait "$pid" 2>/dev/null || true
    done
    pids=()
}
trap stop_load EXIT
trap 'exit 130' INT TERM
for _ in $(seq "$load"); do
    timeout "$max_s" sh -c 'while :; do :; done' &
    pids+=("$!")
done

failed=0
for i in $(seq "$runs"); do
    log="$dir/run-$i.log"
    start=$(date +%s)
    if (cd "$dir/repo" && bash .ci/run) >"$log" 2>&1; then
        result=passed
    else
        result="FAILED (rc $?)"
        failed=1
    fi
    end=$(date +%s)
    summary="$(grep -E '^[0-9]+ (passed|failed)|(passed|failed|error).* in [0-9.]+s' "$log" | tail -1 || true)"
    echo "run $i/$runs: $result in $((end - start)) s; load average $(cut -d' ' -f1-3 /proc/loadavg); ${summary:-no pytest summary} (log: $log)"
done
stop_load
echo "ci_under_load: $([ "$failed" = 0 ] && echo "all $runs runs passed" || echo "a run failed")"
exit "$failed"

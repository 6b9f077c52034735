#!/usr/bin/env bash
# `make gpu-check`: shoal on one CUDA GPU in at most 8 minutes, without Ray or MLflow.
#
#   1. the GPU-gated tests (pytest)                                   <= 90 s
#   2. the largest ladder GPT that fits, bf16 + compile, ~100 steps   <= 240 s
#   3. the same size at fp8 (torchao), 50 steps                       the rest (>= 130 s)
#   4. the One GPU section of BENCHMARKS.md, from bench/results_gpu.json
#
# Without a CUDA GPU it says so in one line and exits 0. Python packages the GPU machine lacks
# (pydantic, pytest, torchao) are installed from bench/wheels (`make gpu-wheels`) into a
# directory of their own put first on PYTHONPATH; that machine's site-packages is left alone.
# Exit 0: every phase passed (fp8 may be skipped: no torchao, or a GPU below capability 8.9).
# Settings: PYTHON (default .venv/bin/python if there, else python3), GPU_CHECK_BUDGET_S (480),
# GPU_CHECK_RESULTS (bench/results_gpu.json), GPU_CHECK_OUT (BENCHMARKS.md).
set -uo pipefail
cd "$(dirname "$0")/.."

BUDGET_S=${GPU_CHECK_BUDGET_S:-480}
RESULTS=${GPU_CHECK_RESULTS:-bench/results_gpu.json}
MARKDOWN=${GPU_CHECK_OUT:-BENCHMARKS.md}
WHEELS=bench/wheels
SITE=${TMPDIR:-/tmp}/shoal-gpu-check-site
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi

why=$("$PYTHON" -c 'import torch; print("" if torch.cuda.is_available() else "torch.cuda.is_available() is False")' 2>/dev/null) \
    || why="$PYTHON cannot import torch"
if [ -n "$why" ]; then
    echo "gpu-check: no CUDA GPU on this machine ($why); nothing to do"
    exit 0
fi

# The time left for a phase: at most $1 seconds, keeping $2 seconds for the phases after it.
allot() {
    local left=$((BUDGET_S - SECONDS - $2))
    echo $((left < $1 ? left : $1))
}

# Import names missing here, of those given (pydantic older than 2.7 counts as missing).
missing() {
    local name probe
    for name in "$@"; do
        case $name in
            pydantic) probe='import pydantic, sys; sys.exit(tuple(map(int, pydantic.VERSION.split(".")[:2])) < (2, 7))' ;;
            *) probe="import $name" ;;
        esac
        "$PYTHON" -c "$probe" 2>/dev/null || echo "$name"
    done
}

absent=$(missing numpy yaml pyarrow)
if [ -n "$absent" ]; then
    echo "gpu-check: $PYTHON lacks $(echo $absent) (shoal needs them; bench/wheels does not carry them)"
    exit 1
fi
install=$(missing pydantic pytest torchao)
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
installed="none needed"
if [ -n "$install" ]; then
    rm -rf "$SITE"
    # shellcheck disable=SC2086  # one word per package
    if ! "$PYTHON" -m pip install --quiet --no-index --find-links "$WHEELS" --target "$SITE" $install; then
        install=$(echo $install | sed 's/torchao//')  # optional: without it fp8 is reported as skipped
        if [ -n "${install// /}" ] && ! "$PYTHON" -m pip install --quiet --no-index --find-links "$WHEELS" --target "$SITE" $install; then
            echo "gpu-check: $(echo $install) missing and not installable from $WHEELS: run \`make gpu-wheels\` where PyPI is reachable, and carry $WHEELS"
            exit 1
        fi
    fi
    [ -n "${install// /}" ] && installed="$(echo $install) from $WHEELS into $SITE"
fi
export PYTHONPATH="$SITE:$PWD/platform:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# torchao's C++ extensions are built for one torch; float8 training needs none of them.
export TORCHAO_FORCE_SKIP_LOADING_SO_FILES=${TORCHAO_FORCE_SKIP_LOADING_SO_FILES:-1}

check() { "$PYTHON" bench/gpu_check.py "$@" --results "$RESULTS"; }

check start --command "bash bench/gpu_check.sh" --budget-s "$BUDGET_S" --wheels "$installed" || exit 1

limit=$(allot 90 370)
timeout -k 5 $((limit + 5)) "$PYTHON" bench/gpu_check.py tests --results "$RESULTS" --timeout-s "$limit"

# Train at precision $1 for at most $2 seconds, keeping $3 for what follows; the exit status goes
# to $rc (not-run: less than a minute was left).
train() {
    local limit
    limit=$(allot "$2" "$3")
    rc=not-run
    if [ "$limit" -ge 60 ]; then
        timeout -k 5 "$limit" "$PYTHON" bench/gpu_check.py train --precision "$1" --results "$RESULTS" \
            --budget-s $((limit - 20))
        rc=$?
    fi
}
train bf16 240 130
rc_bf16=$rc
train fp8 200 10
rc_fp8=$rc

check render --out "$MARKDOWN" --phase-rc "bf16=$rc_bf16" "fp8=$rc_fp8"
status=$?
echo "gpu-check: ${SECONDS} s in all (budget ${BUDGET_S} s)"
exit $status

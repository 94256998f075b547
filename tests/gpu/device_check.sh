#!/usr/bin/env bash
# The GPU check of aiodist_cuda (issue 6), run once on the device machine (one H200, CuPy and
# NCCL installed, no network), from the repo root. Run it with the device tool as:
#
#   run(command="bash tests/gpu/device_check.sh", carry=[".whl"], timeout_s=420)
#
# (.whl holds the pytest-asyncio wheel, and a pytest wheel used only if the machine's pytest is
# older than pytest-asyncio needs; fetch them first, from the repo root, with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_17_x86_64 --platform any -d .whl pytest-asyncio==1.5.0 pytest==9.2.0
# .whl is ignored by git through .git/info/exclude.)
# Rerun some steps only: `bash tests/gpu/device_check.sh 2 3` (steps: 1 pytest, 2 multiproc, 3 bench).
#
# Steps, each under its own `timeout` (worst case about 6.5 minutes in all; a run is usually 2-3):
#   0. install the carried wheels into /tmp/site; print python, cupy, NCCL, nvidia-smi -L
#   1. python3 -m pytest -m cuda tests/gpu          (1-rank communicators: every op, dtype, ReduceOp)
#   2. python3 tests/gpu/multiproc.py               (2 and 3 processes on the one GPU, NCCL_MULTI_RANK_GPU_ENABLE=1)
#   3. python3 -m aiodist_cuda.bench                (loop responsiveness + overhead vs the raw CuPy NCCL call)
# Every step's output is teed into $OUT/*.log (8 files at most: env.log, pytest.log, pytest.xml,
# multiproc.log, multiproc.json, bench.log, bench.json, summary.txt). A failing step never stops
# the others; the exit status is the number of failed steps.
set -u

OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
cd "$(dirname "$0")/../.." || exit 99
STEPS="${*:-1 2 3}"
FAILED=0
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"

note() { echo "$*" | tee -a "$SUMMARY"; }
want() { case " $STEPS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
record() { # record NAME RC
    if [ "$2" -eq 0 ]; then note "step $1: ok"; else note "step $1: FAILED (exit $2${3:+, $3})"; FAILED=$((FAILED + 1)); fi
}

# -- 0. environment ---------------------------------------------------------------------------------
{
    echo "== $(date -u) in $PWD, OUT=$OUT, steps: $STEPS"
    SITE=/tmp/site
    rm -rf "$SITE" && mkdir -p "$SITE"
    WHEELS=$(ls .whl/pytest_asyncio-*.whl 2>/dev/null)
    if ! timeout 20 python3 -c 'import pytest,sys; sys.exit(0 if tuple(map(int, pytest.__version__.split(".")[:2])) >= (8, 4) else 1)'; then
        echo "the machine's pytest is older than 8.4 (pytest-asyncio 1.5 needs it): installing the carried one"
        WHEELS="$WHEELS $(ls .whl/pytest-[0-9]*.whl 2>/dev/null)"
    fi
    if [ -z "$WHEELS" ]; then
        echo "no .whl/pytest_asyncio-*.whl: was the run started with carry=[\".whl\"]?"
    elif ! timeout 60 python3 -m pip install -q --no-index --no-deps --target "$SITE" $WHEELS; then
        echo "pip install failed; unpacking the (pure-Python) wheels instead"
        timeout 30 python3 -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' "$SITE" $WHEELS
    fi
    export PYTHONPATH="$SITE:$PWD"
    timeout 60 python3 - <<'EOF'
import sys
print("python", sys.version.split()[0], sys.executable)
import pytest, pytest_asyncio, numpy
print("pytest", pytest.__version__, "pytest-asyncio", pytest_asyncio.__version__, pytest_asyncio.__file__, "numpy", numpy.__version__)
try:
    import cupy
    from cupy.cuda import nccl
    print("cupy", cupy.__version__, "cuda runtime", cupy.cuda.runtime.runtimeGetVersion(), "driver", cupy.cuda.runtime.driverGetVersion())
    print("nccl", nccl.get_version(), "build", nccl.get_build_version())
except Exception as exc:
    print("cupy/nccl:", type(exc).__name__, exc)
try:
    import ml_dtypes
    print("ml_dtypes", ml_dtypes.__version__)
except ImportError:
    print("ml_dtypes: not installed")
import aiodist_cuda
print("aiodist_cuda.is_available():", aiodist_cuda.is_available(), repr(aiodist_cuda.unavailable_reason()), "nccl_version", aiodist_cuda.nccl_version())
EOF
    timeout 20 python3 -m pip list 2>/dev/null | grep -i -E "^(cupy|nvidia-nccl|pytest|numpy|uvloop|ml.dtypes)" || true
    timeout 20 nvidia-smi -L || echo "nvidia-smi failed"
} 2>&1 | tee "$OUT/env.log"
export PYTHONPATH="/tmp/site:$PWD"
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"

# -- 1. the GPU test suite --------------------------------------------------------------------------
if want 1; then
    timeout -k 10 150 python3 -m pytest -m cuda tests/gpu -v -rfEs --durations=8 -p no:cacheprovider --junitxml="$OUT/pytest.xml" 2>&1 | tee "$OUT/pytest.log"
    rc=${PIPESTATUS[0]}
    record "1 pytest -m cuda tests/gpu" "$rc" "$([ "$rc" -eq 124 ] && echo timed out)"
fi

# -- 2. several processes on the one GPU --------------------------------------------------------------
if want 2; then
    timeout -k 10 110 python3 tests/gpu/multiproc.py --seconds 35 --max-ctas 2 --json "$OUT/multiproc.json" 2>&1 | tee "$OUT/multiproc.log"
    rc=${PIPESTATUS[0]}
    record "2 multiproc (2 and 3 ranks, one GPU)" "$rc" "$([ "$rc" -eq 124 ] && echo timed out)"
fi

# -- 3+4. loop responsiveness and per-op overhead ------------------------------------------------------
if want 3; then
    timeout -k 10 80 python3 -m aiodist_cuda.bench --budget 50 --mode-timeout 20 --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
    rc=${PIPESTATUS[0]}
    record "3 bench (responsiveness, overhead)" "$rc" "$([ "$rc" -eq 124 ] && echo timed out)"
fi

note "failed steps: $FAILED (files in $OUT)"
exit "$FAILED"

#!/usr/bin/env bash
# The GPU check, in one command of at most ten minutes on a CUDA device machine with no network:
# install verst's missing dependencies from the wheels carried in .whl/ (bench/gpu_wheels.sh made
# them on a machine with PyPI; the device image has torch and transformers) into the image's
# Python, then run bench/gpu_check.py, whose steps are each timed and bounded and
# whose failures are recorded without stopping the rest. Everything lands in one JSON file,
# $OUT/gpu_check.json (or the --out given), beside each step's log and install.log.
#
#   bench/gpu_wheels.sh                      # here, once: .whl/ (and the demo's model, prebuilt)
#   bash bench/gpu_check.sh                  # there, with .whl carried; $OUT comes back
#   PYTHON=.venv/bin/python bash bench/gpu_check.sh --smoke    # here: tiny, on the CPU, no install
set -uo pipefail
cd "$(dirname "$0")/.."
started=$(date +%s)
TOTAL_S=${GPU_CHECK_TOTAL_S:-570}  # the whole command, install included: under a 600 s call
INSTALL_LIMIT_S=${GPU_CHECK_INSTALL_S:-180}
PYTHON=${PYTHON:-python3}
OUT_DIR=${OUT:-runs/gpu_check}
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do  # --out DIR wins over $OUT, as in gpu_check.py
    if [[ "${args[$i]}" == "--out" && $((i + 1)) -lt ${#args[@]} ]]; then OUT_DIR=${args[$((i + 1))]}; fi
done
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [[ -d .whl/verst-cache ]]; then export VERST_CACHE="$PWD/.whl/verst-cache"; fi  # the demo's model

install() {
    # Into the image's own interpreter (the machine is a fresh one each time): pip finds nothing
    # but .whl/, so the image's torch and transformers stay as they are. Wheels first, together,
    # so that pip resolves them against each other and the image's packages.
    local pip=("$PYTHON" -m pip install --no-index --find-links .whl --disable-pip-version-check)
    if "$PYTHON" -m pip install --help | grep -q -- --break-system-packages; then
        pip+=(--break-system-packages)
    fi
    "${pip[@]}" .whl/*.whl || return 1
    local sdist
    for sdist in .whl/*.tar.gz; do  # DeepSpeed: its ops are JIT-compiled when used, not built here
        [[ -e "$sdist" ]] || continue
        DS_BUILD_OPS=0 "${pip[@]}" --no-build-isolation "$sdist" || return 1
    done
}

install_report="$OUT_DIR/install.json"
rm -f "$install_report"
if [[ " $* " == *" --smoke "* ]]; then
    printf '{"status": "skipped", "reason": "--smoke: the environment it runs in"}\n' >"$install_report"
elif [[ -d .whl ]] && compgen -G ".whl/*.whl" >/dev/null; then
    t0=$(date +%s)
    export -f install
    export PYTHON
    status=ok why=""
    if ! timeout --kill-after=5 "$INSTALL_LIMIT_S" bash -c install >"$OUT_DIR/install.log" 2>&1; then
        status=failed  # recorded; the steps run all the same and say what they lack
        why="pip failed or ran past ${INSTALL_LIMIT_S}s: see the log"
    fi
    printf '{"status": "%s", "seconds": %d, "log": "%s", "error": "%s"}\n' "$status" \
        $(($(date +%s) - t0)) "$OUT_DIR/install.log" "$why" >"$install_report"
    echo "gpu_check.sh: install $status in $(($(date +%s) - t0))s (log: $OUT_DIR/install.log)"
else
    printf '{"status": "skipped", "reason": "no wheels in .whl/ (run bench/gpu_wheels.sh and carry .whl)"}\n' \
        >"$install_report"
fi
left=$((TOTAL_S - ($(date +%s) - started) - 10))
if ((left < 30)); then left=30; fi
exec timeout --kill-after=5 $((left + 5)) "$PYTHON" bench/gpu_check.py --budget-s "$left" \
    --install-report "$install_report" "$@"

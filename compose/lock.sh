#!/usr/bin/env bash
# Regenerates compose/requirements.lock: every Python package of the image but torch, pinned with
# hashes, resolved for Linux x86_64 and Python 3.11 against the CPU build of torch (the image
# installs torch first from the index of its variant: CPU, CUDA or ROCm; see compose/Dockerfile).
#   pip install uv && compose/lock.sh
# TORCH_FIND_LINKS: where the CPU torch wheel of TORCH_VERSION is listed (a page or a directory).
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
TORCH_FIND_LINKS="${TORCH_FIND_LINKS:-https://download.pytorch.org/whl/cpu/torch/}"
constraint="$(mktemp)"
trap 'rm -f "$constraint"' EXIT
echo "torch==${TORCH_VERSION}+cpu" >"$constraint"
uv pip compile pyproject.toml \
    --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
    --generate-hashes --no-emit-package torch \
    --constraint "$constraint" --find-links "$TORCH_FIND_LINKS" \
    --custom-compile-command "compose/lock.sh" \
    --output-file compose/requirements.lock
# The tools that build the lock's sdists (deepspeed, pycosat, ...) inside the image, at the same
# versions, installed before it.
printf 'setuptools\nwheel\npackaging\n' | uv pip compile - \
    --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
    --generate-hashes --constraint compose/requirements.lock \
    --custom-compile-command "compose/lock.sh" \
    --output-file compose/build-tools.lock

#!/usr/bin/env bash
# Wheels for serving on a GPU machine that has no internet and no FastAPI stack (the H200 visits): run here, where
# PyPI is reachable; the wheels land in .whl/ (git-ignored), which a device call carries with the working tree.
#
#     bash scripts/fetch_serve_wheels.sh            # here: download (CPython 3.12, manylinux x86_64)
#     pip install --no-index --find-links .whl fastapi uvicorn sse-starlette httpx openai   # there: install
#
# The versions are those constraints.txt pins (the ones CI tests); PYTHON_VERSION overrides 3.12. Only wheels are
# taken (--only-binary=:all:), for the device's interpreter and platform, not this machine's: pydantic-core and
# jiter are compiled, the rest pure Python. A device call carries at most 64 MiB in all; the script prints the
# total and refuses to leave more than 24 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON_VERSION:-3.12}"
DEST=.whl
PACKAGES=(fastapi uvicorn sse-starlette httpx openai)
mkdir -p "$DEST"
python3 -m pip download --quiet --dest "$DEST" --only-binary=:all: --python-version "$PY" \
    --implementation cp --abi "cp${PY/./}" \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --constraint constraints.txt "${PACKAGES[@]}"
kib=$(du -sk "$DEST" | cut -f1)
echo "$(ls "$DEST" | wc -l) wheels in $DEST: $((kib / 1024)).$(((kib % 1024) * 10 / 1024)) MiB"
ls "$DEST"
if [ "$kib" -gt $((24 * 1024)) ]; then
    echo "error: $DEST holds more than 24 MiB; a device call carries at most 64 MiB with the working tree" >&2
    exit 1
fi

#!/usr/bin/env bash
# The H200 part of issue 16: the Triton backend verified on both small checkpoints (must PASS), a faulted checkpoint
# and a faulted backend (must FAIL, naming the stage), verify kernels, and the GPU test suite. Writes every report and
# log under OUT (default data/results/h200/verify) and prints a summary table last.
#
#     bash scripts/h200_verify.sh [OUT [PART ...]]     # from the repository root on the GPU machine
#
# PART: models (the two passing runs), faults (the three failing ones), kernels (verify kernels), tests (pytest -m gpu);
# all four when none is given, so a long visit can be split over calls. Exit status: 0 when every outcome run is the
# expected one.
set -u
OUT=${1:-data/results/h200/verify}
shift $(( $# > 0 ? 1 : 0 ))
PARTS=${*:-models faults kernels tests}
want() { [[ " $PARTS " == *" $1 "* ]]; }
mkdir -p "$OUT/logs"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/logs/install.log" 2>&1
python3 -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__,
'triton', triton.__version__, torch.cuda.get_device_name())" | tee "$OUT/logs/versions.log"
git rev-parse HEAD >> "$OUT/logs/versions.log" 2>/dev/null

summary=()
check() {  # name, expected exit status, command...
    local name=$1 want=$2
    shift 2
    local t0=$SECONDS
    "$@" > "$OUT/logs/$name.log" 2>&1
    local rc=$?
    local verdict="as expected"
    [ "$rc" -eq "$want" ] || verdict="UNEXPECTED"
    summary+=("$(printf '%-40s exit %s (want %s) %4ss  %s — %s' "$name" "$rc" "$want" $((SECONDS - t0)) "$verdict" \
        "$(grep -E '^(PASS|FAIL)|first divergence|passed|failed' "$OUT/logs/$name.log" | tail -2 | tr '\n' ' ')")")
}

if want models; then
    check verify_model_tiny-py 0 python3 -m dsv4lab verify model --checkpoint data/tiny-py --backend triton \
        --device cuda --out "$OUT/verify_model_tiny-py"
    check verify_model_tiny 0 python3 -m dsv4lab verify model --checkpoint data/tiny --backend triton --device cuda \
        --out "$OUT/verify_model_tiny"
fi
if want faults; then
    python3 -m dsv4lab repair data/tiny --inject-fault paper_w2_one_expert --out /tmp/tiny-w2one --overwrite \
        > "$OUT/logs/inject.log" 2>&1
    check verify_model_tiny_w2_one_expert 1 python3 -m dsv4lab verify model --checkpoint /tmp/tiny-w2one \
        --golden data/golden/tiny.json --backend triton --device cuda --skip-trajectory \
        --out "$OUT/verify_model_tiny_w2_one_expert"
    check verify_model_tiny-py_bf16_accumulation 1 python3 -m dsv4lab verify model --checkpoint data/tiny-py \
        --backend triton --device cuda --backend-fault bf16_accumulation --skip-trajectory \
        --out "$OUT/verify_model_tiny-py_bf16_accumulation"
    check verify_layers_tiny-py_w2_one_expert 1 python3 -m dsv4lab verify layers --checkpoint data/tiny-py \
        --backend triton --device cuda --backend-fault w2_one_expert --out "$OUT/verify_layers_tiny-py_w2_one_expert"
fi
if want kernels; then
    check verify_kernels 0 python3 -m dsv4lab verify kernels --device cuda --out "$OUT/verify_kernels"
fi
if want tests; then
    check pytest_gpu 0 python3 -m pytest -m gpu -q -rs tests
fi

printf '%s\n' "${summary[@]}" | tee -a "$OUT/summary.txt"
! printf '%s\n' "${summary[@]}" | grep -q UNEXPECTED

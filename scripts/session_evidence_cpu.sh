#!/usr/bin/env bash
# (scripts/session_evidence_cpu.sh → data/results/host/logs/evidence_cpu_<commit>.log; the SIGINT part needs ~2 min)
# The CPU evidence of this session's closing note, one command after another (run from the repository root).
set -u
PY=.venv/bin/python
echo "== commit $(git rev-parse --short HEAD)   $(date -u)"
echo "== pytest -p no:xdist -s tests/test_decode_step.py -k fused_static"
$PY -m pytest -q -p no:xdist -s tests/test_decode_step.py -k fused_static 2>&1 | grep -E "decode step, tiny|passed|failed" | cut -c1-220
echo "== dsv4lab verify kernels --backend triton (the new and the changed ops)"
$PY -m dsv4lab verify kernels --backend triton --op attention_norms --op query_heads --op compressor_pair --op projections \
    --op expert_down --op expert_mlp --op linear_group --op kv_norm_rope --op head_rms_rope --op indexer_query --op rms_norm \
    --op compressor_step --op attention_from_caches --out /tmp/evidence_verify 2>&1 | tail -1
echo "== pytest -p no:xdist tests/test_kernels_fusion.py"
$PY -m pytest -q -p no:xdist tests/test_kernels_fusion.py 2>&1 | tail -1
echo "== the GPU test's body at Flash widths, under the interpreter (rows 1)"
(cd tests && TRITON_INTERPRET=1 OMP_NUM_THREADS=1 ../$PY -c "
import sys, time; sys.path.insert(0, '.')
import conftest, test_kernels_fusion as t
t0 = time.time(); t.test_gpu_fused_paths_are_their_parts_at_flash_widths(1); print('ok', round(time.time() - t0, 1), 's')" 2>&1 | tail -1)
echo "== pytest tests/test_bench_e2e.py tests/test_bench_e2e_fusions.py tests/test_figures.py tests/test_docs.py tests/test_notebooks.py"
OMP_NUM_THREADS=1 $PY -m pytest -q -n 2 tests/test_bench_e2e.py tests/test_bench_e2e_fusions.py tests/test_figures.py tests/test_docs.py tests/test_notebooks.py 2>&1 | tail -1
echo "== the single GEMV's registers and spills (sm_90) before this session's change (9882fc6) and now"
rm -rf /tmp/old_wt && git worktree add -q /tmp/old_wt 9882fc6
for k in /tmp/old_wt/kernels kernels; do echo "-- $k"; $PY scripts/gemv_registers.py $k 2>&1 | grep -E "^(qkv|w2|dot)"; done
echo "== SIGINT: reproduce at 9882fc6 started with SIGINT ignored (what a pytest-xdist worker does), then at HEAD"
cp tests/test_cli_hardening.py /tmp/old_wt/tests/test_cli_hardening.py  # the test that starts the run with SIGINT ignored
(cd /tmp/old_wt && /work/main/$PY -m pytest -q -p no:xdist tests/test_cli_hardening.py -k "signal_ends and SIGINT" 2>&1 | tail -1)
$PY -m pytest -q -p no:xdist tests/test_cli_hardening.py -k "signal_ends" 2>&1 | tail -1
echo "== the same decode-step count at 9882fc6 (before this session's fused paths)"
(cd /tmp/old_wt && PYTHONPATH=/tmp/old_wt:/tmp/old_wt/kernels /work/main/$PY -m pytest -q -p no:xdist -s \
    tests/test_decode_step.py -k fused_static 2>&1 | grep -E "decode step, tiny|passed|failed" | cut -c1-220)
git worktree remove --force /tmp/old_wt

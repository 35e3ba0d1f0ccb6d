#!/usr/bin/env bash
# One H200 visit: the named parts, in order, each under its own time limit, every log and JSON under runs/h200/,
# packed into $OUT/h200_runs.tgz (when OUT is set) with a summary table printed last.
#
#     DSV4LAB_COMMIT=<sha> bash scripts/h200_visit.sh PART[:SECONDS] ...   # repository root, GPU machine
#
# Triton's compilation is most of a fresh machine's first e2e (oracle 65 s, graph check 57 s, TTFT 34 s at 1c4402a
# against 2 / 2 / 3 s with the cache warm) and of its GPU suite: the visit packs its cache — binaries and metadata
# only, the IR text (.ttir/.ttgir/.llir/.ptx/.source) left out: a cache hit reads the metadata and the binary alone
# (Triton 3.6, compiler.py) — into $OUT/triton_cache.txz.partNN (15 MiB pieces; nothing when the whole is over
# 16 MiB, which with the ~44 MiB working tree and the 6.7 MB of .whl/ would pass the 64 MiB a call may carry), and
# unpacks .carry/triton_cache.t{xz,gz}* first when the call carried them — copy the returned pieces there (and nothing
# else) and pass carry=[".carry"] (the cache is keyed by each kernel's source and options: a changed kernel
# recompiles). The files go in sorted by name — the cubins of one kernel's specializations side by side — through
# xz: the f3de19f visit's cache (2,467 files) is 4.4 MB so against 20.3 MB through gzip, whose window sees one cubin
# at a time (data/results/host/logs/triton_cache_pack_f3de19f.log); gzip where the machine has no xz. summary.txt's last line says what was packed.
#
# PART (default limit in seconds):
#   tests (300)     pytest -m gpu over the whole suite (WORKERS=8 processes: Triton compilation on the CPU is the
#                   cost; TESTS= narrows it);
#                   give it 420 for the whole suite: the speculative tests build the model twice
#   verify (300)    verify model with the Triton backend on data/tiny-py and data/tiny (must PASS), and the three
#                   faulted runs (must FAIL naming the stage) — scripts/h200_verify.sh models faults
#   generate (90)   dsv4lab generate (triton, graph-captured decode) on the golden trajectory's prompt: its hash
#                   must be the golden's
#   decode (180)    bench kernels --suite decode --quick (DECODE_SECTIONS / DECODE_BATCHES narrow it as below, e.g.
#                   DECODE_SECTIONS=gemv DECODE_BATCHES=2,4: a verify step's rows); its choices go into the visit's tuned file
#                   ($R/tuned_h200.json, over the GPU's committed kernels/dsv4lab_kernels/tuned/<gpu>.json), which
#                   is copied over the committed one: what the backend reads from here on
#   decode_full     bench kernels --suite decode (full, --budget-s = limit − 30; DECODE_SECTIONS=mhc,attention
#                   narrows it to those sections, DECODE_BATCHES=16,32 to those rows; the visit's tuned file keeps the
#                   entries it does not measure)
#   prefill (150)   bench kernels --suite prefill --quick (only its mHC choice goes into the visit's tuned file:
#                   --tuned-ops prefill.mhc_rows; PREFILL_SECTIONS=glue narrows it to the mHC/RoPE glue)
#   prefill_full    bench kernels --suite prefill (full; every prefill choice into the visit's tuned file)
#   e2e (300)       bench e2e --nproc 1 --layers 30 (E2E_ARGS adds options; DSV4LAB_TUNED points at the visit's
#                   tuned file when a bench part before it in the same visit wrote one). It times the decode step's
#                   fused paths off / each alone / all on at batches 1 and 8 (the JSON's 'fusions'; ids differing
#                   from the unfused step's fail the part) and merges the recommended decode.fusion entries into
#                   the visit's tuned file ($T, --tuned-out): a later e2e or e2e_nopdl part of the visit runs with
#                   them (E2E_ARGS=--fusion-batches= skips the A/B, E2E_ARGS="--fusion-batches 1" halves it)
#   e2e_nopdl (300) the same with --no-pdl (decode kernels launched without programmatic dependent launch, which is
#                   on by default on sm_90+; E2E_NOPDL_ARGS adds options), written to e2e_1gpu_nopdl.json
#   spec (150)      scripts/measure_speculative.py --gpu-step-cost --layers 30
#   serve (300)     bench serve with the openai client against an in-process server of the generated 30-layer cut
#                   (triton, concurrency 1/8/32, speculation off and mtp; SERVE_ARGS adds options), with the FastAPI
#                   stack the visit installs from the carried .whl/ first (scripts/fetch_serve_wheels.sh;
#                   carry=[".carry", ".whl"]: the tests part's serve tests need it too, else they skip);
#                   written to runs/h200/serve_flash.json
#   diag_sort (60)  scripts/diag_moe_sort.py: the MoE sorter's event, host-issue and GPU-kernel time at prefill sizes
#   diag_prefill (240) scripts/diag_prefill_after_decode.py: a prefill before/after decoding on every decode ×
#                   prefill path × PDL, and the split-K GEMV (jobs) launches repeated and against each other
#   diag_uninit (200) scripts/diag_uninitialized_reads.py: the static prefill step with every fresh buffer poisoned,
#                   op by op (which kernel reads bytes it never wrote)
#   diag_gemm (90)  scripts/diag_gemm_determinism.py: the prefill GEMM configurations called 20 times each
set -u
cd "$(dirname "$0")/.."
R=runs/h200
T=$R/tuned_h200.json  # the visit's tuned file: every bench part merges its choices into it
mkdir -p "$R"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=$PWD/runs/triton-cache
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$R/install.log" 2>&1
if compgen -G ".whl/*.whl" > /dev/null; then  # the FastAPI stack for serve and its tests (no internet there)
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/serve-site .whl/*.whl \
        >> "$R/install.log" 2>&1 && export PYTHONPATH=/tmp/serve-site${PYTHONPATH:+:$PYTHONPATH}
fi
if compgen -G ".carry/triton_cache.txz*" > /dev/null; then  # one file or its pieces, in name order
    cat .carry/triton_cache.txz* | xz -dc | tar xf - -C runs \
        && echo "triton cache: $(find runs/triton-cache -type f | wc -l) files carried in" >> "$R/install.log"
elif compgen -G ".carry/triton_cache.tgz*" > /dev/null; then
    cat .carry/triton_cache.tgz* | tar xzf - -C runs \
        && echo "triton cache: $(find runs/triton-cache -type f | wc -l) files carried in" >> "$R/install.log"
fi
{ python3 -c "import torch, triton, sys; print('python', sys.version.split()[0], '| torch', torch.__version__,
'| triton', triton.__version__, '|', torch.cuda.get_device_name())";   nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader; } \
    | tee "$R/versions.log"
echo "commit ${DSV4LAB_COMMIT:-unknown}" >> "$R/versions.log"
# the committed tuned file of this GPU (h200.json on an H200, h100_80gb_hbm3.json on an H100): what a decode part
# replaces with its measured choices
GPU_TUNED=$(python3 -c "import torch; from dsv4lab.engine.dispatch import tuned_path
print(tuned_path(torch.cuda.get_device_name()))" 2>/dev/null)

tuned_base() {  # the base a bench part merges over: the visit's tuned file once a part wrote it
    [ -f "$T" ] && echo "--tuned-base $T"
}
summary=()
part() {  # name limit command...
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" > "$R/$name.log" 2>&1
    local rc=$?
    local tail_line
    tail_line=$(grep -E 'PASS|FAIL|passed|failed|wrote|error|Error|as expected|UNEXPECTED' "$R/$name.log" | tail -2 \
        | tr '\n' ' ' | cut -c1-220)
    summary+=("$(printf '%-14s rc=%-3s %4ss  %s' "$name" "$rc" $((SECONDS - t0)) "$tail_line")")
    pack  # after every part: a call stopped by its time limit still returns what was measured
}

pack() {
    printf '%s\n' "${summary[@]}" > "$R/summary.txt"
    if [ -n "${OUT:-}" ]; then
        tar czf "$OUT/h200_runs.tgz" "$R" 2>/dev/null
        cp "$R/summary.txt" "$OUT/summary.txt"
        if [ -d runs/triton-cache ]; then  # what the next visit carries in (see the top)
            local ext=txz squeeze="xz -6 -T0"
            command -v xz > /dev/null || { ext=tgz; squeeze="gzip -6"; }
            (cd runs && find triton-cache -type f ! -name '*.ttir' ! -name '*.ttgir' ! -name '*.llir' \
                ! -name '*.ptx' ! -name '*.source' | awk -F/ '{print $NF "\t" $0}' | sort | cut -f2) \
                > runs/triton_cache.files
            tar cf - -C runs -T runs/triton_cache.files 2>/dev/null | $squeeze > "runs/triton_cache.$ext"
            local size
            size=$(stat -c %s "runs/triton_cache.$ext")
            if [ "$size" -le $((16 * 1024 * 1024)) ]; then
                rm -f "$OUT"/triton_cache.t*
                split -b 15M -d "runs/triton_cache.$ext" "$OUT/triton_cache.$ext.part"
                echo "triton cache: $size bytes packed ($(find runs/triton-cache -type f | wc -l) files)" \
                    > "$R/cache_pack.txt"
            else  # an earlier part's pack, if any, stays: the cache of the parts before this one
                echo "triton cache: $size bytes after part $name, over 16 MiB: the last pack kept" >> "$R/cache_pack.txt"
            fi
            cat "$R/cache_pack.txt" >> "$OUT/summary.txt"
        fi
    fi
}

for spec in "$@"; do
    name=${spec%%:*}
    limit=${spec#*:}
    [ "$limit" = "$spec" ] && limit=""
    case $name in
        tests) workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n ${WORKERS:-8}")  # compilation (CPU) is the cost
            # SIGINT 20 s before the limit: pytest stops and still prints its failures (a killed run prints none)
            part tests "${limit:-300}" timeout -s INT -k 10 $(( ${limit:-300} - 20 )) python3 -m pytest -m gpu -v \
                -rfs --tb=short -p no:cacheprovider $workers --timeout=360 ${TESTS:-tests} ;;
        verify) part verify "${limit:-300}" bash scripts/h200_verify.sh "$R/verify" models faults ;;
        generate) part generate "${limit:-90}" python3 scripts/generate_golden.py --checkpoint data/tiny-py \
            --backends triton ;;  # the reference leg (256 tokens at full precision) does not fit a short part
        decode) part decode "${limit:-180}" python3 -m dsv4lab bench kernels --suite decode --quick \
            ${DECODE_SECTIONS:+--sections "$DECODE_SECTIONS"} ${DECODE_BATCHES:+--batches "$DECODE_BATCHES"} \
            --out "$R/decode_kernels_quick.json" --tuned-out "$T" $(tuned_base)
            # the measured choices are what the backend reads from here on
            [ -s "$T" ] && [ -n "$GPU_TUNED" ] && cp "$T" "$GPU_TUNED" ;;
        decode_full) part decode_full "${limit:-420}" python3 -m dsv4lab bench kernels --suite decode \
            ${DECODE_SECTIONS:+--sections "$DECODE_SECTIONS"} ${DECODE_BATCHES:+--batches "$DECODE_BATCHES"} \
            --budget-s $(( ${limit:-420} - 30 )) \
            --out "$R/decode_kernels.json" --tuned-out "$T" $(tuned_base) ;;  # entries a budget-cut run misses are kept
        prefill) part prefill "${limit:-150}" python3 -m dsv4lab bench kernels --suite prefill --quick \
            ${PREFILL_SECTIONS:+--sections "$PREFILL_SECTIONS"} --budget-s $(( ${limit:-150} - 30 )) \
            --out "$R/prefill_kernels_quick.json" --tuned-out "$T" $(tuned_base) --tuned-ops prefill.mhc_rows ;;
        prefill_full) part prefill_full "${limit:-420}" python3 -m dsv4lab bench kernels --suite prefill \
            --budget-s $(( ${limit:-420} - 30 )) --out "$R/prefill_kernels.json" --tuned-out "$T" $(tuned_base) ;;
        e2e) [ -f "$T" ] && [ -z "${DSV4LAB_TUNED:-}" ] \
                && export DSV4LAB_TUNED="$PWD/$T"  # the choices this visit's bench parts measured
            part e2e "${limit:-300}" python3 -m dsv4lab bench e2e --nproc 1 --layers 30 \
            --budget-s $(( ${limit:-300} - 60 )) ${E2E_ARGS:-} --out "$R/e2e_1gpu.json" \
            --tuned-out "$T" $(tuned_base) ;;  # the fused paths it recommends, for the parts after it
            # (a part overrunning the budget by --overrun-s, 30 s, is stopped: the JSON is written in time)
        e2e_nopdl) [ -f "$T" ] && [ -z "${DSV4LAB_TUNED:-}" ] && export DSV4LAB_TUNED="$PWD/$T"
            part e2e_nopdl "${limit:-300}" python3 -m dsv4lab bench e2e --nproc 1 --layers 30 --no-pdl \
            --budget-s $(( ${limit:-300} - 40 )) ${E2E_NOPDL_ARGS:-} --out "$R/e2e_1gpu_nopdl.json" ;;
        serve) part serve "${limit:-300}" python3 -m dsv4lab bench serve --generate flash --layers 30 --model-seed 0 \
                --backend triton --speculative off,mtp --concurrency 1,8,32 --num-prompts 32 --input-len 128 \
                --output-len 64 --max-model-len 4096 ${SERVE_ARGS:-} --out "$R/serve_flash.json" ;;
        diag_sort) part diag_sort "${limit:-60}" python3 scripts/diag_moe_sort.py --out "$R/moe_sort_diag.json" ;;
        diag_prefill) part diag_prefill "${limit:-240}" python3 scripts/diag_prefill_after_decode.py \
            --out "$R/diag_prefill_after_decode.json" ;;
        diag_uninit) part diag_uninit "${limit:-200}" python3 scripts/diag_uninitialized_reads.py --ints \
            --out "$R/diag_uninitialized_reads.json" ;;
        diag_gemm) part diag_gemm "${limit:-90}" python3 scripts/diag_gemm_determinism.py \
            --out "$R/gemm_determinism.json" ;;
        spec) part spec "${limit:-150}" python3 scripts/measure_speculative.py --gpu-step-cost --layers 30 \
            --out "$R/speculative_steps.json" ;;
        *) echo "unknown part $name" >&2 ;;
    esac
done

pack
cat "$R/summary.txt"

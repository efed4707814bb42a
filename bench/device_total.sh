#!/usr/bin/env bash
# Issue 34's GPU measurements on a lent GPU machine (the `device` tool of this workplace), one
# stage per call so that each call stays within its 10 minutes:
#
#   bash bench/device_total.sh parity   # TotalSegmentator parity on the GPU, torch tests
#   bash bench/device_total.sh engine   # total, engine alone: 300/824/1600 slices, the
#                                       # allocator A/B, the GPU capped (the memory ladder)
#   bash bench/device_total.sh cap      # the memory ladder alone (1600 slices, GPU capped)
#   bash bench/device_total.sh e2e      # segnode serve: --fast 300 compiled, total 824 eager
#   bash bench/device_total.sh all      # e2e, then cap (one call)
#   bash bench/device_total.sh e2e-compiled  # total 300 and 824 compiled (one engine cache)
#   bash bench/device_total.sh install  # only the wheels (the first of several calls)
#   bash bench/device_total.sh versus-total  # segnode against TotalSegmentator, same call
#   bash bench/device_total.sh versus-fast   # the same for --fast, and TS total NIfTI
#
# The machine has torch, onnx, onnxruntime and pytest; the node's other wheels travel in .whl
# (pip download, see the device tool's README), TotalSegmentator's in .whl_* folders that
# travel one call each (64 MiB a call). Each folder is installed into /tmp/site once per
# machine. Logs and JSON go to $OUT.
set -uo pipefail
OUT=${OUT:-bench/out/device}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source bench/device_wheels.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
stage=${1:-parity}

standins() {  # the ONNX stand-ins with the anatomy head (bench.totalseg_standin)
    [ -f /tmp/tsa/total.json ] || python3 -m bench.totalseg_standin --task total --anatomy --out /tmp/tsa
    [ -f /tmp/tsf/profile.json ] || python3 -m bench.totalseg_standin --anatomy --out /tmp/tsf
}

# TotalSegmentator against segnode in one call, on the same machine and series
# (bench.totalseg_compare): TotalSegmentator runs the real-shape stand-ins with the constant
# head (its cheapest non-empty output: a lower bound of its time), segnode the anatomy
# stand-ins (a realistic 117-structure SEG).
versus() {  # TASK SEGNODE_MANIFEST TS_MODES...
    local task=$1 model=$2
    shift 2
    [ -d /tmp/tsconst/nnunet/results ] ||
        python3 -m scripts.make_totalseg_standins --out /tmp/tsconst --task all --head constant |
        tail -6
    timeout 560 python3 -m bench.totalseg_compare --task "$task" --head constant \
        --home /tmp/tsconst --segnode-model "$model" --phantom anatomy --runs 3 \
        --ts-modes "$@" --out "$OUT/v$task" --timeout 500 \
        --e2e-args="--engine-cache /tmp/engines --work /tmp/e2e-v$task" 2>&1 |
        tee "$OUT/v$task.log" | grep -vE "^\[gpu-e2e\].*series [0-9]" | tail -30
    rm -f "$OUT/v$task"/*/timeline*.png "$OUT/v$task"/*/gpu_e2e.md
}

case $stage in
install) ;;
versus-total)
    standins
    versus total /tmp/tsa/total.json dicom
    ;;
versus-fast)
    standins
    versus total_fast /tmp/tsf/profile.json dicom nifti
    # TotalSegmentator's total from NIfTI to NIfTI (its DICOM row ran in versus-total)
    timeout 300 python3 -m bench.totalseg_gpu --home /tmp/tsconst --out "$OUT/tsnifti" \
        --slices 300 --tasks total --modes nifti --phantom anatomy 2>&1 | tail -3
    ;;
parity)
    standins >"$OUT/standins.log" 2>&1 &  # CPU work beside the tests, for the next stages
    timeout 420 python3 -m pytest -q -p no:cacheprovider -o addopts="" -s \
        tests/test_totalseg_oracle.py -k gpu \
        tests/test_engine_sums.py tests/test_gpu_memory_split.py 2>&1 | tee "$OUT/parity.log" |
        grep -E "gpu-parity|passed|failed|Error|error" | tail -60
    timeout 60 python3 -m bench.label_sums --slices 300 --labels 6 24 118 2>&1 | tee "$OUT/sums.log"
    wait
    ;;
engine)
    standins
    timeout 330 python3 -m bench.total_gpu --model /tmp/tsa/total.json --out "$OUT" \
        --slices 300 824 1600 --runs 2 --variants eager --gpu-limit 4 2.5 2>&1 |
        tee "$OUT/engine.log" | grep -E "^\{|Error" | tail -20
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False timeout 200 python3 -m bench.total_gpu \
        --model /tmp/tsa/total.json --out "$OUT/plain" --slices 300 824 --runs 2 \
        --variants eager 2>&1 | tee "$OUT/engine-plain.log" | grep -E "^\{|Error" | tail -10
    ;;
cap)  # the memory ladder alone: 1600 slices with the GPU capped
    standins
    timeout 500 python3 -m bench.total_gpu --model /tmp/tsa/total.json --out "$OUT" \
        --slices 1600 --runs 1 --variants eager --gpu-limit 4 2.5 1.5 2>&1 |
        tee "$OUT/cap.log" | grep -E "^\{|Error" | tail -20
    ;;
all)  # what one call of under 10 minutes can hold: e2e, the SEG profile, the ladder
    bash "$0" e2e
    timeout 170 python3 -m bench.total_gpu --model /tmp/tsa/total.json --out "$OUT" \
        --slices 1600 --runs 1 --variants eager --gpu-limit 4 2.5 2>&1 |
        tee "$OUT/cap.log" | grep -E "^\{|Error" | tail -20
    rm -f "$OUT"/*/timeline*.png  # at most 8 files come back
    ;;
fast)  # --fast end to end alone
    [ -f /tmp/tsf/profile.json ] || python3 -m bench.totalseg_standin --anatomy --out /tmp/tsf
    timeout 150 python3 -m bench.gpu_e2e --out "$OUT/fast" --models /tmp/tsf/profile.json \
        --slices 300 --runs 3 --phantom anatomy --work /tmp/e2e-fast 2>&1 | tail -22
    ;;
e2e-min)  # the two e2e figures on the least device time
    standins
    timeout 140 python3 -m bench.gpu_e2e --out "$OUT/fast" --models /tmp/tsf/profile.json \
        --slices 300 --runs 3 --phantom anatomy --work /tmp/e2e-fast 2>&1 | tail -22
    timeout 160 python3 -m bench.gpu_e2e --out "$OUT/total824" --models /tmp/tsa/total.json \
        --slices 824 --runs 1 --phantom anatomy --no-compile --work /tmp/e2e-824 2>&1 | tail -22
    ;;
e2e)
    standins
    timeout 170 python3 -m bench.gpu_e2e --out "$OUT/fast" --models /tmp/tsf/profile.json \
        --slices 300 --runs 3 --phantom anatomy --work /tmp/e2e-fast 2>&1 | tail -25
    timeout 210 python3 -m bench.gpu_e2e --out "$OUT/total824" --models /tmp/tsa/total.json \
        --slices 824 --runs 3 --phantom anatomy --no-compile --work /tmp/e2e-824 2>&1 | tail -25
    # where the SEG encode and check of 117 structures spend their time on this host's CPUs
    timeout 40 python3 - <<'PY' 2>&1 | tail -40
import cProfile, pstats, time
from pydicom.uid import DeflatedExplicitVRLittleEndian
from bench.seg_size import blob_labels, blob_manifest, blob_volume
from segnode.node.results.build import Equipment, ResultUIDs
from segnode.node.results.seg_check import check_encoded
from segnode.node.results.seg_encode import SegPlan
plan = SegPlan.prepare(blob_volume(), blob_manifest(), ResultUIDs.new(), segmentation_type="BINARY",
                       transfer_syntax=DeflatedExplicitVRLittleEndian, equipment=Equipment.for_seg("b"))
labels = blob_labels()
for _ in range(3):
    t = time.perf_counter(); e = plan.encode(labels); t1 = time.perf_counter()
    check_encoded(plan, e, labels); print(f"encode {t1 - t:.3f} s, check {time.perf_counter() - t1:.3f} s")
for call in (lambda: plan.encode(labels), lambda: check_encoded(plan, e, labels)):
    p = cProfile.Profile(); p.enable(); call(); p.disable()
    pstats.Stats(p).sort_stats("tottime").print_stats(8)
PY
    ;;
e2e-compiled)
    standins
    for n in 300 824; do
        timeout 290 python3 -m bench.gpu_e2e --out "$OUT/total$n" --models /tmp/tsa/total.json \
            --slices $n --runs 3 --phantom anatomy --engine-cache /tmp/engines --work /tmp/e2e-c$n \
            2>&1 | tail -25
    done
    ;;
esac

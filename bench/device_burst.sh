#!/usr/bin/env bash
# Issue 36's GPU measurements on a lent GPU machine (the `device` tool of this workplace):
#
#   bash bench/device_burst.sh install   # the node's wheels (.whl, .whl_dev) into /tmp/site
#   bash bench/device_burst.sh unet      # 20 x 300 slices, 4 senders: the 31 M U-Net
#   bash bench/device_burst.sh total     # the same with the TotalSegmentator `total` stand-ins
#
# Each runs bench.burst: one job at a time, then the node's lanes, same series, one call.
# The machine has no DCMTK: bench/dcmtk_bundle.sh packs this machine's storescu with its
# libraries and loader into .dcmtk/dcmtk.tar.xz (carry .dcmtk); without it the senders are
# pynetdicom associations. LANES: the lanes variants (bench.burst --lanes). Logs and JSON in $OUT.
set -uo pipefail
OUT=${OUT:-bench/out/device}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
WHEEL_DIRS=${WHEEL_DIRS:-".whl .whl_dev"}
source bench/device_wheels.sh
if [ -f .dcmtk/dcmtk.tar.xz ] && [ ! -x /tmp/dcmtkb/bin/storescu ]; then
    tar xJf .dcmtk/dcmtk.tar.xz -C /tmp
fi
[ -x /tmp/dcmtkb/bin/storescu ] && export PATH=/tmp/dcmtkb/bin:$PATH
command -v storescu >/dev/null && storescu --version | head -1
LANES=${LANES:-0,4:2}  # the default lanes (one model slot), and two slots
export PATH=$PATH:/tmp/site/bin  # py-spy, where its wheel travelled (PROFILE=1)
PROFILE_ARG=""
[ "${PROFILE:-0}" = 1 ] && PROFILE_ARG="--profile"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -m bench.sync_probe /tmp | tee "$OUT/sync-probe.json"  # the disk's time per instance
SERIES=${SERIES:-20}
SLICES=${SLICES:-300}
case ${1:-unet} in
install) ;;
unet)
    rm -rf /tmp/burst-unet
    timeout 580 python3 -m bench.burst --model unet --engine torch --series "$SERIES" \
        --slices "$SLICES" --senders 4 --lanes "$LANES" $PROFILE_ARG --work /tmp/burst-unet --out "$OUT/burst-unet" \
        2>&1 | tee "$OUT/burst-unet.log" | grep -v "^\[gpu-e2e\]" | tail -12
    tail -40 /tmp/burst-unet/node.log > "$OUT/burst-unet-node-tail.log"
    gzip -c /tmp/burst-unet/node.log > "$OUT/burst-unet-node.log.gz"
    ;;
total)
    rm -rf /tmp/burst-total
    [ -f /tmp/tsa/total.json ] ||
        python3 -m bench.totalseg_standin --task total --anatomy --out /tmp/tsa | tail -2
    timeout 560 python3 -m bench.burst --model /tmp/tsa/total.json --engine torch \
        --series "$SERIES" --slices "$SLICES" --senders 4 --lanes "$LANES" $PROFILE_ARG --work /tmp/burst-total \
        --out "$OUT/burst-total" 2>&1 | tee "$OUT/burst-total.log" | tail -12
    tail -40 /tmp/burst-total/node.log > "$OUT/burst-total-node-tail.log"
    gzip -c /tmp/burst-total/node.log > "$OUT/burst-total-node.log.gz"
    ;;
*) echo "unknown stage $1"; exit 2 ;;
esac

# One way to run things: the README's commands and CI use these targets.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: bench-burst bench-burst-gpu bench-total-gpu bench-total-cpu run test lint typecheck venv tools readers model bench bench-gpu bench-gpu-e2e bench-torch-warm clean

$(BIN)/segnode: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e .
	@touch $@

venv: $(BIN)/segnode

# Run the node on its embedded default (SQLite ledger in ./data, ONNX Runtime on CPU,
# the bundled tissue model), listening on 127.0.0.1:11112.
run: venv
	$(BIN)/segnode serve --config config.toml

# Debian tools the tests use, the same list as .ci/run: DCMTK, Orthanc, dicom3tools, PostgreSQL,
# openssl, systemd (systemd-analyze), Chromium (the browser test), FUSE 3 (the power-cut
# tests' lazy file system) and Node.js with npm (the web viewers' SEG readers, `readers`);
# installed when missing and we are root, otherwise those tests say what is missing.
# NodeSource's nodejs carries npm and conflicts with Debian's npm: each only where missing.
DEBIAN_TOOLS := dcmtk orthanc orthanc-dicomweb dicom3tools openssl systemd postgresql \
	chromium chromium-driver fuse3 rsyslog rsyslog-gnutls
tools:
	@command -v storescu >/dev/null && command -v Orthanc >/dev/null && command -v dciodvfy >/dev/null && [ -e /usr/share/orthanc/plugins/libOrthancDicomWeb.so ] && ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 \
	  && command -v openssl >/dev/null && command -v systemd-analyze >/dev/null && command -v chromium >/dev/null && command -v chromedriver >/dev/null && command -v fusermount3 >/dev/null \
	  && command -v node >/dev/null && command -v npm >/dev/null && command -v rsyslogd >/dev/null && ls /usr/lib/*/rsyslog/lmnsd_gtls.so >/dev/null 2>&1 \
	  || { if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	       apt-get install -y -qq $(DEBIAN_TOOLS) >/dev/null \
	       && { command -v node >/dev/null || apt-get install -y -qq nodejs >/dev/null; } \
	       && { command -v npm >/dev/null || apt-get install -y -qq npm >/dev/null; }; \
	     else echo "note: install $(DEBIAN_TOOLS) nodejs npm for the interop tests"; fi; }

lint: $(VENV)/.test-deps
	$(BIN)/ruff check segnode/*.py node engines storage tests bench scripts
	$(BIN)/ruff format --check segnode/*.py node engines storage tests bench scripts

typecheck: $(VENV)/.test-deps
	$(BIN)/mypy

# The test environment adds the test tools and TensorRT-RTX (engine builds run on the CPU).
$(VENV)/.test-deps: pyproject.toml $(BIN)/segnode
	$(BIN)/pip install -q -e '.[test,trt]'
	@touch $@

# The web viewers' SEG readers (dcmjs, @cornerstonejs/adapters; tests/test_seg_dcmjs.py,
# bench/seg_size.py): `npm ci` of tests/node's lock file into the tool cache
# (SEGNODE_TOOL_CACHE, default ~/.cache/segnode), once; the tests install them themselves
# when this could not (and skip without node, npm or the registry, unless SEGNODE_REQUIRE_TOOLS).
readers: venv tools
	@$(BIN)/python -m tests.node.harness >/dev/null || true

test: venv $(VENV)/.test-deps tools readers lint typecheck
	$(BIN)/pytest -q

# Results encoding (label map -> SEG and SR as checked bytes, bench/out/encode.json), then the
# ingest, completion-latency, end-to-end and memory benchmark on loopback (DCMTK storescu,
# pynetdicom storescp, Orthanc); writes bench/out/ingest.{json,md} and timeline.png.
bench: venv tools
	$(BIN)/pip install -q -e '.[bench]'
	$(BIN)/python -m bench.encode --out bench/out
	$(BIN)/python -m bench.ingest --out bench/out

# GPU benchmark (H200 or any CUDA GPU with torch, CuPy, onnx2torch): U-Net patch throughput
# and full-volume latency per backend, ratios to PyTorch eager FP32 measured in the same run;
# then an imported nnU-Net model against nnUNetPredictor (needs nnunetv2 and SimpleITK; the
# trained model from scripts.make_nnunet_trained, NNUNET_MODEL=...tar.gz, or trained first):
# the GPU oracle and the speed-up, bench/out/nnunet_gpu.{json,md}.
NNUNET_MODEL ?=
bench-gpu: venv
	$(BIN)/python -m bench.gpu_bench --out bench/out
	$(BIN)/python -m bench.nnunet_gpu --out bench/out $(if $(NNUNET_MODEL),--model $(NNUNET_MODEL))

# GPU end to end (CUDA GPU with torch and onnx2torch; no DCMTK or Orthanc needed): segnode serve
# with the torch engine (compiled and cached), a pynetdicom SCU and results SCP on loopback;
# writes bench/out/gpu_e2e.{json,md} and timeline-<model>.png.
bench-gpu-e2e: venv
	$(BIN)/pip install -q -e '.[bench,gpu]'
	$(BIN)/python -m bench.gpu_e2e --out bench/out

# A burst of series at once, one job at a time against the lanes (issue 36): on this machine's
# CPU the bundled model, 20 series of 128 slices from 4 DCMTK senders; on a GPU workstation the
# 31 M U-Net, 20 series of 300 slices; then a 117-segment SEG in the node and in an encoder
# process while Python threads hold the interpreter lock (bench/out/seg_contention.json).
bench-burst: venv tools
	$(BIN)/python -m bench.burst --model tissue --engine onnxruntime --series 20 --slices 128 \
		--lanes 0,0e --out bench/out/burst
	$(BIN)/python -m bench.seg_contention --out bench/out

bench-burst-gpu: venv
	$(BIN)/pip install -q -e '.[bench,gpu]'
	$(BIN)/python -m bench.burst --model unet --engine torch --series 20 --slices 300 \
		--lanes 0,3p,3pe --out bench/out/burst-gpu

# TotalSegmentator's total task on a CUDA GPU (issue 34; docs/performance.md): the engine alone
# on the five 1.5 mm parts of the real shape (random weights), then segnode end to end with the
# anatomy stand-ins (a label map of realistic size) and TotalSegmentator itself (installed) on
# the same series in the same run, its stand-ins' heads constant (its cheapest output: a lower
# bound of its time): one table with the ratios for `total` and for `--fast`.
TOTALSEG_HOME ?= /tmp/tsconst
bench-total-gpu: venv
	$(BIN)/pip install -q -e '.[bench,gpu]'
	$(BIN)/python -m bench.total_gpu --out bench/out --variants eager compile
	$(BIN)/python -m scripts.make_totalseg_standins --out $(TOTALSEG_HOME) --task all --head constant
	$(BIN)/python -m bench.totalseg_standin --task total --anatomy --out bench/out/total-anatomy
	$(BIN)/python -m bench.totalseg_standin --anatomy --out bench/out/fast-anatomy
	$(BIN)/python -m bench.totalseg_compare --task total --head constant --home $(TOTALSEG_HOME) \
		--segnode-model bench/out/total-anatomy/total.json --phantom anatomy --out bench/out/vtotal
	$(BIN)/python -m bench.totalseg_compare --task total_fast --head constant --home $(TOTALSEG_HOME) \
		--segnode-model bench/out/fast-anatomy/profile.json --phantom anatomy --out bench/out/vfast

# segnode against TotalSegmentator on the same weights, one table with the ratios (issue 34):
# TS_PYTHON is a Python with TotalSegmentator 2.x; on a CPU, the openvino engine (BF16).
TS_PYTHON ?= $(BIN)/python
bench-total-cpu: venv
	$(BIN)/pip install -q -e '.[openvino]'
	$(BIN)/python -m bench.totalseg_compare --task total_fast --device cpu --engine openvino \
		--ts-python $(TS_PYTHON)

# Restart-to-ready of the torch engine, cold against warm compiled-model cache, fresh processes.
bench-torch-warm: venv
	$(BIN)/python -m bench.torch_warm --out bench/out

model: venv
	$(BIN)/python -m segnode.engines.models.build_tissue

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

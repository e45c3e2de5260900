# Two commands on a fresh machine: `make demo` (the whole path on embedded data) and `make test`.
PYTHON_BASE ?= python3
VENV ?= .venv
PYTHON := $(VENV)/bin/python
OUT ?= out/demo

.PHONY: install demo reproduce test lint harness test-compat test-triton test-wheel gpu-check gpu-check-dry-run lock benchmark clean

# The default environment: exact versions from the lock file (`make lock` regenerates it on purpose), so that a green
# `make test` means the same thing on any day.
LOCK := requirements/lock.txt
# torch first, pinned: the CPU wheel where pip's sources offer one (a folder of wheels, PyTorch's CPU index); from
# plain PyPI on Linux the CUDA build, which runs on the CPU too.
TORCH := torch==2.13.0

$(VENV)/.installed: setup.cfg pyproject.toml $(LOCK)
	$(PYTHON_BASE) -m venv $(VENV)
	$(PYTHON) -m pip install --quiet $(TORCH)
	$(PYTHON) -m pip install --quiet -r $(LOCK)
	$(PYTHON) -m pip install --quiet --no-deps -e .
	$(PYTHON) -m pip check
	touch $@

install: $(VENV)/.installed

# Train a tokenizer -> pretrain LinearRoberta with LRPE on Wikipedia leads -> fine-tune on tweet sentiment.
# Writes metrics, checkpoints, model cards and loss-curve PNGs under $(OUT). About 6 minutes on 2 CPU cores.
demo: install
	$(PYTHON) run_scripts/train_tokenizer.py --train_files data/wikipedia_leads/train.txt --vocab_size 5000 \
		--output_dir $(OUT)/tokenizer
	$(PYTHON) run_scripts/run_mlm.py --tokenizer_name $(OUT)/tokenizer \
		--train_file data/wikipedia_leads/train.txt --validation_file data/wikipedia_leads/validation.txt \
		--positional_encoding lrpe_orthogonal --hidden_size 256 --num_hidden_layers 4 --num_attention_heads 4 \
		--intermediate_size 1024 --max_position_embeddings 512 --block_size 128 \
		--per_device_train_batch_size 16 --max_steps 300 --learning_rate 1e-3 --warmup_steps 30 \
		--max_eval_samples 200 --logging_steps 20 --save_strategy no --report_to none --seed 0 \
		--output_dir $(OUT)/mlm
	$(PYTHON) run_scripts/run_glue.py --model_name_or_path $(OUT)/mlm \
		--train_file data/tweet_sentiment/train.csv --validation_file data/tweet_sentiment/validation.csv \
		--max_seq_length 64 --per_device_train_batch_size 32 --num_train_epochs 1 --learning_rate 5e-4 \
		--warmup_steps 30 --logging_steps 20 --eval_strategy epoch --save_strategy no --report_to none --seed 0 \
		--output_dir $(OUT)/tweet_sentiment
	@echo "Results: $(OUT)/mlm/eval_results.json, $(OUT)/tweet_sentiment/eval_results.json; cards: README.md; plots: loss_curves.png"

# The papers' comparisons at small scale (lrpe_hf/training/compare.py, docs/comparing.md): every preset in
# one profile, 3 seeds, into $(REPRODUCE)/<preset>/ (results.md, results.csv, PNG plots). One BPE tokenizer,
# trained once, serves the text presets. Killed, it resumes where it stopped. PROFILE=quick (the default): budgeted
# for about 30 minutes on 2 CPU cores (27 when timed on 2026-11-22). PROFILE=medium: on one GPU with
# SWEEP_FLAGS="--jobs 8 --threads 2", eight runs at a time; on 2 CPU cores, "--jobs 2 --threads 1" (docs/data/README.md).
PROFILE ?= quick
SWEEP_FLAGS ?=
REPRODUCE ?= out/reproduce$(if $(filter-out quick,$(PROFILE)),-$(PROFILE))
TOKENIZER_VOCAB_quick := 2048
TOKENIZER_VOCAB_medium := 8192
TOKENIZER_VOCAB_full := 16384
TEXT_PRESETS := lrpe_table2 lrpe_table1 extrapolation
OTHER_PRESETS := image synthetic_copy synthetic_recall

reproduce: install
	test -f $(REPRODUCE)/tokenizer/tokenizer.json || $(PYTHON) run_scripts/train_tokenizer.py \
		--train_files data/wikipedia_leads/train.txt --vocab_size $(TOKENIZER_VOCAB_$(PROFILE)) \
		--output_dir $(REPRODUCE)/tokenizer
	for preset in $(TEXT_PRESETS); do \
		$(PYTHON) run_scripts/compare_encodings.py --preset $$preset --profile $(PROFILE) $(SWEEP_FLAGS) \
			--tokenizer_name $(REPRODUCE)/tokenizer --output_dir $(REPRODUCE)/$$preset || exit 1; \
	done
	for preset in $(OTHER_PRESETS); do \
		$(PYTHON) run_scripts/compare_encodings.py --preset $$preset --profile $(PROFILE) $(SWEEP_FLAGS) \
			--output_dir $(REPRODUCE)/$$preset || exit 1; \
	done
	@echo "Results: $(REPRODUCE)/<preset>/results.md (and results.csv, *.png)"

# transformers' own common model tests come from the sdist of the installed transformers (PyPI); without network
# tests/test_transformers_common.py skips and says why.
harness: install
	$(PYTHON) tests/fetch_transformers_harness.py || echo "transformers test harness unavailable: tests/test_transformers_common.py will skip"

# Lint and format check (ruff, the lock's version; the rules in pyproject.toml): CI runs it first.
lint: install
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

# Both cores: pytest-xdist's two workers share the suite, one torch thread each (two threads each would contend for
# the two cores: 18% slower on the models' and kernels' tests), then the tests whose each case starts several
# processes of one job (ranks of a distributed run) run alone, so that no two such jobs share the cores. ``worksteal``:
# a worker that runs out takes tests queued for the other, so that the long ones near the end do not leave a core idle.
MULTIPROCESS_TESTS := tests/test_distributed.py tests/test_context_parallel.py

test: install harness
	OMP_NUM_THREADS=1 $(PYTHON) -m pytest -q -n 2 --dist worksteal $(addprefix --ignore=,$(MULTIPROCESS_TESTS)) tests
	$(PYTHON) -m pytest -q $(MULTIPROCESS_TESTS)

# The two ends of the range setup.cfg declares, each in its own environment: the oldest releases of transformers and
# torch we support, and the newest that pip finds on the day (torch's newest from PyPI is its CUDA build, which runs
# on the CPU too). Each runs the tests that touch their interfaces, with transformers' common tests for its release.
# A machine may cap pip's torch with a constraints file of its own (torch<=2.14.1 where that release lies on disk):
# the newest end sets it aside, so that it tests the newest torch on PyPI, as a user's fresh install gets it.
OLDEST := transformers==5.10.1 torch==2.7.1
COMPAT_TESTS := tests/test_generation.py tests/test_models.py tests/test_pipelines.py tests/test_conventions.py \
	tests/test_extension_api.py tests/test_scripts.py tests/test_transformers_common.py

.venv-oldest/.installed: setup.cfg pyproject.toml
	$(PYTHON_BASE) -m venv .venv-oldest
	.venv-oldest/bin/python -m pip install --quiet $(OLDEST) -e ".[train,test]"
	touch $@

test-compat: .venv-oldest/.installed
	test -d .venv-newest || $(PYTHON_BASE) -m venv .venv-newest
	PIP_CONSTRAINT=/dev/null .venv-newest/bin/python -m pip install --quiet --upgrade --upgrade-strategy eager \
		torch transformers -e ".[train,test]"
	for end in oldest newest; do \
		.venv-$$end/bin/python -c 'import torch, transformers; print("'$$end':", "transformers", transformers.__version__, "torch", torch.__version__)'; \
		.venv-$$end/bin/python tests/fetch_transformers_harness.py || exit 1; \
		OMP_NUM_THREADS=1 .venv-$$end/bin/python -m pytest -q -p no:cacheprovider -n 2 $(COMPAT_TESTS) || exit 1; \
	done

# Installed as Python users install it: a wheel built from this checkout (as `pip install .` builds one) goes with its
# `train` extra into a fresh environment (the pinned torch first), where tests/installed_package_check.py runs from
# outside the checkout: tiny models of each family, the package data, `python -m lrpe_hf --help` and a script's help.
WHEEL_VENV := .venv-wheel

test-wheel: install
	rm -rf dist $(WHEEL_VENV)
	$(PYTHON) -m pip wheel --quiet --no-deps --wheel-dir dist .
	$(PYTHON_BASE) -m venv $(WHEEL_VENV)
	$(WHEEL_VENV)/bin/python -m pip install --quiet $(TORCH)
	$(WHEEL_VENV)/bin/python -m pip install --quiet "$$(ls dist/lrpe_hf-*.whl)[train]"
	cd /tmp && $(CURDIR)/$(WHEEL_VENV)/bin/python $(CURDIR)/tests/installed_package_check.py

# fla's real Triton kernels on the CPU, under Triton's interpreter: Triton and fla-core at the versions below, installed
# with pip --target beside the default environment (first on PYTHONPATH, so .venv itself stays as the lock says), run
# the Triton path's tests (tests/test_triton_adapter.py; the interpreter's shims are in tests/triton_interpreter.py).
# About 3 to 5 minutes on 2 CPU cores, the install included.
TRITON_KERNELS := triton==3.9.0 fla-core==0.6.0
TRITON_TARGET := .venv-triton

$(TRITON_TARGET)/.installed: Makefile $(VENV)/.installed
	rm -rf $(TRITON_TARGET)
	$(PYTHON) -m pip install --quiet --no-deps --target $(TRITON_TARGET) $(TRITON_KERNELS)
	touch $@

test-triton: $(TRITON_TARGET)/.installed
	TRITON_INTERPRET=1 PYTHONPATH=$(TRITON_TARGET) $(PYTHON) -m pytest -q -p no:cacheprovider tests/test_triton_adapter.py
	# the interpreter is set up once per process: the local window's run on fla's kernels takes a process of its own
	TRITON_INTERPRET=1 PYTHONPATH=$(TRITON_TARGET) $(PYTHON) -m pytest -q -p no:cacheprovider \
		tests/test_local_window.py::test_the_linear_part_runs_on_flas_kernels

# The GPU check (benchmarks/gpu_check.py): on a machine with a CUDA GPU, its own Python (GPU_PYTHON) with torch,
# transformers and accelerate, and fla-core (`pip install ".[gpu]"`, or its wheel unpacked on PYTHONPATH), from this
# working tree. Writes $(GPU_OUT)/ and packs it into $(GPU_OUT)/gpu_check.tar.gz; its parts stop at 9 minutes together.
# gpu-check-dry-run is its rehearsal on the CPU at tiny sizes (the tests run it too).
GPU_PYTHON ?= python3
GPU_OUT ?= out/gpu_check

gpu-check:
	GPU_CHECK_COMMIT=$${GPU_CHECK_COMMIT:-$$(git rev-parse HEAD 2>/dev/null)} \
	GPU_CHECK_SOURCE_HASH=$${GPU_CHECK_SOURCE_HASH:-$$($(GPU_PYTHON) -m lrpe_hf.training.provenance 2>/dev/null)} \
		PYTHONPATH=$(CURDIR):$$PYTHONPATH $(GPU_PYTHON) benchmarks/gpu_check.py --out $(GPU_OUT)

gpu-check-dry-run: install
	$(PYTHON) benchmarks/gpu_check.py --dry-run --out $(GPU_OUT)-dry-run

# Regenerate the lock file from what pip resolves today (then run `make test` and commit both).
lock:
	rm -rf .venv-lock
	$(PYTHON_BASE) -m venv .venv-lock
	.venv-lock/bin/python -m pip install --quiet $(TORCH)
	.venv-lock/bin/python -m pip install --quiet -e ".[train,test]"
	{ sed -n '/^#/p' $(LOCK); .venv-lock/bin/python -m pip freeze --exclude-editable | grep -v '^torch=='; } > $(LOCK).new
	mv $(LOCK).new $(LOCK)
	rm -rf .venv-lock

benchmark: install
	$(PYTHON) benchmarks/benchmark_attention.py
	$(PYTHON) benchmarks/benchmark_encodings.py
	$(PYTHON) benchmarks/benchmark_models.py

clean:
	rm -rf out benchmarks/results

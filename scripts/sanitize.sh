#!/usr/bin/env bash
# The C++ tests (ctest) under sanitizers, each kind in its own build directory with libtorchpar and
# the tests only (the Python extension and the examples are left out: an instrumented extension
# would need an instrumented Python):
#   asan  build-asan: AddressSanitizer + UndefinedBehaviorSanitizer + LeakSanitizer
#   tsan  build-tsan: ThreadSanitizer (the shm backend's queue thread, the parameter server's
#         channel, server and client threads, the DDP reducer's hooks, the pipeline stages)
#   scripts/sanitize.sh [asan|tsan]...   (default: both)
# Every ctest case runs under each. A report fails: the sanitizers stop the process at the first one
# (forked ranks included) and write it under build-*/reports, which must stay empty. Before the
# suite, deliberate faults in a rank (tests/cpp/test_sanitizer_selfcheck.cpp) must be reported, or
# a clean run would prove nothing. Needs what scripts/setup.sh installs (gcc's sanitizers).
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
log() { printf '\033[1m[sanitize]\033[0m %s\n' "$*"; }
kinds=("$@")
((${#kinds[@]})) || kinds=(asan tsan)

build() { # dir, sanitizers
  local dir=$1 sanitizers=$2
  mkdir -p "$dir"
  log "cmake -B $dir -DTORCHPAR_SANITIZE=$sanitizers -DTORCHPAR_BUILD_PYTHON=OFF -DTORCHPAR_BUILD_EXAMPLES=OFF; cmake --build $dir -j2"
  cmake -S . -B "$dir" -G Ninja -DPython3_EXECUTABLE="$(command -v python3)" -DTORCHPAR_SANITIZE="$sanitizers" \
    -DTORCHPAR_BUILD_PYTHON=OFF -DTORCHPAR_BUILD_EXAMPLES=OFF >"$dir/configure.log" 2>&1 ||
    { cat "$dir/configure.log"; return 1; }
  # Its log, not the output: a CI that keeps only the end of the output keeps the tests' results.
  cmake --build "$dir" -j2 >"$dir/build.log" 2>&1 || { tail -n 80 "$dir/build.log"; return 1; }
}

fresh_reports() {
  rm -rf "$1/reports"
  mkdir -p "$1/reports"
}

self_check() { # dir, Catch2 tag, what the report must say
  local dir=$1 tag=$2 expected=$3
  fresh_reports "$dir"
  # The ranks' whole outputs are kept there (UBSan writes to a rank's stderr, not to log_path).
  local rank_outputs=$dir/selfcheck-ranks
  rm -rf "$rank_outputs"
  mkdir -p "$rank_outputs"
  log "self-check: $dir/tests/cpp/torchpar_tests '$tag' must be reported ($expected)"
  if TORCHPAR_TEST_KEEP_RANK_OUTPUT=$rank_outputs "$dir/tests/cpp/torchpar_tests" "$tag" >"$dir/selfcheck.log" 2>&1; then
    log "self-check $tag passed: the sanitizer does not see into the ranks"
    return 1
  fi
  # One grep over the files, no pipe: under pipefail, `cat | grep -q` fails whenever grep stops reading
  # before cat has written everything (cat's SIGPIPE), which is how CI failed a self-check that was reported.
  grep -qsF "$expected" "$dir"/reports/* "$rank_outputs"/* && return 0
  cat "$dir/selfcheck.log"
  for output in "$rank_outputs"/*; do
    printf '=== the whole output of a rank, %s\n' "$output"
    cat "$output"
  done
  log "self-check $tag failed without a report saying '$expected'"
  return 1
}

# ctest with the extra arguments; fails on a failed test or on any report written.
run_tests() { # dir, ctest arguments...
  local dir=$1
  shift
  fresh_reports "$dir"
  log "ctest --test-dir $dir --no-tests=error -j2 $*"
  local status=0
  ctest --test-dir "$dir" --output-on-failure --no-tests=error -j2 "$@" 2>&1 | tee "$dir/ctest.log"
  ((PIPESTATUS[0] == 0)) || status=1
  local reports
  reports=$(find "$dir/reports" -type f | sort)
  if [ -n "$reports" ]; then
    log "sanitizer reports in $dir/reports:"
    for report in $reports; do
      printf '=== %s\n' "$report"
      cat "$report"
    done
    status=1
  fi
  # UBSan (gcc's) ignores log_path and reports on stderr, which ctest shows for a failed test.
  local ubsan_reports
  ubsan_reports=$(grep -c 'runtime error:' "$dir/ctest.log")
  ((ubsan_reports == 0)) || status=1
  summary+=("$(basename "$dir"): $(grep -E 'tests passed' "$dir/ctest.log" | tail -1); $(wc -w <<<"$reports") report file(s), $ubsan_reports UBSan report(s) in the output")
  return $status
}

status=0
summary=()
start=$SECONDS
for kind in "${kinds[@]}"; do
  kind_start=$SECONDS
  case $kind in
    asan)
      build build-asan address,undefined || { status=1; continue; }
      # halt_on_error (and -fno-sanitize-recover in the build): the first report ends the process.
      # Leaks are checked at exit and, in the ranks, by the harness before its _exit.
      export ASAN_OPTIONS="log_path=$root/build-asan/reports/asan:halt_on_error=1:detect_leaks=1:detect_stack_use_after_return=1:strict_init_order=1:check_initialization_order=1"
      export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
      self_check build-asan '[leak]' 'detected memory leaks' || status=1
      self_check build-asan '[undefined]' 'signed integer overflow' || status=1
      run_tests build-asan || status=1
      unset ASAN_OPTIONS UBSAN_OPTIONS
      ;;
    tsan)
      build build-tsan thread || { status=1; continue; }
      # libtorch is not instrumented: TSan sees its calls to intercepted functions (memcpy, free,
      # pthread_cond_*) but not its atomics, so the order its reference counts establish is
      # invisible and every object freed after a hand-over between threads inside libtorch (c10d's
      # Work, c10::ivalue::Future, Gloo's queue) is reported. ignore_noninstrumented_modules drops
      # the memory accesses of intercepted calls made from uninstrumented code (libtorch, libgomp)
      # and keeps their synchronisation (mutexes, condition variables), so races between
      # torchpar's own accesses are still reported; OMP_NUM_THREADS=1 keeps ATen's OpenMP
      # workers (libgomp, whose barriers TSan cannot see either) out of the picture.
      export TSAN_OPTIONS="log_path=$root/build-tsan/reports/tsan:halt_on_error=1:second_deadlock_stack=1:ignore_noninstrumented_modules=1"
      export OMP_NUM_THREADS=1
      self_check build-tsan '[race]' 'data race' || status=1
      run_tests build-tsan || status=1
      unset TSAN_OPTIONS OMP_NUM_THREADS
      ;;
    *)
      echo "usage: $0 [asan|tsan]..." >&2
      exit 2
      ;;
  esac
  summary+=("$kind: build, self-checks and tests in $((SECONDS - kind_start)) s")
done

log "summary ($((SECONDS - start)) s):"
printf '  %s\n' "${summary[@]}"
if ((status == 0)); then
  log "every test passed, no sanitizer report"
else
  log "FAILED: failed tests or sanitizer reports above"
fi
exit $status

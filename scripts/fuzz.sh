#!/usr/bin/env bash
# Fuzzes the parameter server's wire format and its checks (tests/fuzz) with libFuzzer, ASan and
# UBSan for SECONDS (default 60), then says how many inputs ran, the coverage reached and what was
# found. Builds tests/fuzz standalone with clang in build-fuzz. New interesting inputs accumulate in
# build-fuzz/corpus (the committed seeds in tests/fuzz/corpus are only read); a finding is written
# to build-fuzz/findings/: fix it, then add the input to tests/fuzz/regressions/ so that ctest
# replays it in every build.
#   scripts/fuzz.sh [SECONDS]
set -uo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
log() { printf '\033[1m[fuzz]\033[0m %s\n' "$*"; }

# clang and its runtimes (libFuzzer, ASan, UBSan) are Debian packages the normal build does not need.
fuzz_packages=(clang-14 libclang-rt-14-dev)
missing=()
for package in "${fuzz_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "ok installed" || missing+=("$package")
done
if ((${#missing[@]})); then
  log "installing Debian packages: ${missing[*]}"
  SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null ||
    exit 1
fi

start=$SECONDS
mkdir -p build-fuzz
log "building build-fuzz/ps_wire_fuzzer (clang-14, -fsanitize=fuzzer,address,undefined)"
cmake -S tests/fuzz -B build-fuzz -G Ninja -DCMAKE_CXX_COMPILER=clang++-14 \
  -DPython3_EXECUTABLE="$(command -v python3)" >build-fuzz/configure.log 2>&1 ||
  { cat build-fuzz/configure.log; exit 1; }
cmake --build build-fuzz -j2 || exit 1
log "built in $((SECONDS - start)) s"

mkdir -p build-fuzz/corpus build-fuzz/findings
log "fuzzing for $seconds s (corpus: build-fuzz/corpus + tests/fuzz/corpus)"
# malloc_limit_mb: no message of a few KB should make the server allocate half a GB.
ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
  build-fuzz/ps_wire_fuzzer build-fuzz/corpus tests/fuzz/corpus \
  -max_total_time="$seconds" -max_len=4096 -rss_limit_mb=4096 -malloc_limit_mb=512 -timeout=10 \
  -print_final_stats=1 -artifact_prefix=build-fuzz/findings/ 2>build-fuzz/fuzz.log
status=$?

# libFuzzer's last status line ("#N DONE cov: C ft: F corp: ...") and its final statistics.
grep -E '^#[0-9]+[[:space:]]' build-fuzz/fuzz.log | tail -1
grep -E '^stat::(number_of_executed_units|average_exec_per_sec|peak_rss_mb)' build-fuzz/fuzz.log
findings=$(find build-fuzz/findings -type f -newer build-fuzz/configure.log | sort)
if ((status != 0)) || [ -n "$findings" ]; then
  grep -E -A40 '^==[0-9]+==ERROR|runtime error|ps_wire_fuzzer:|deadly signal|out-of-memory|uncaught' build-fuzz/fuzz.log |
    head -80
  log "FOUND something (exit $status): ${findings:-see build-fuzz/fuzz.log}"
  log "reproduce: build-fuzz/ps_wire_fuzzer FILE"
  exit 1
fi
log "nothing found in $seconds s; log: build-fuzz/fuzz.log"

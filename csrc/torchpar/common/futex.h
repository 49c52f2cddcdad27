// Sleeping on a word of memory two processes share, until another process changes it (Linux futex,
// not the process-private kind: the word may sit in a memfd both map).
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>

namespace torchpar {

// Sleeps while `word` holds `expected`, at most `timeout`; may return early (a change, a signal).
void futex_wait(std::atomic<uint32_t>& word, uint32_t expected, std::chrono::nanoseconds timeout);
// Wakes every process sleeping on `word`.
void futex_wake_all(std::atomic<uint32_t>& word);

static_assert(std::atomic<uint32_t>::is_always_lock_free, "futex words must be lock-free atomics");

} // namespace torchpar

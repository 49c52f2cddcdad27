#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include <c10/util/SmallVector.h>

namespace torchpar::comm::shm {

// One logical run of bytes held in several contiguous pieces of memory: the tensors of a coalesced
// op, taken where they lie instead of packed into one buffer first (or a single tensor: one piece).
class Pieces {
 public:
  Pieces(char* data, uint64_t bytes) {
    add(data, bytes);
  }
  explicit Pieces(const std::vector<std::pair<char*, uint64_t>>& pieces) {
    for (const auto& [data, bytes] : pieces) {
      add(data, bytes);
    }
  }

  uint64_t bytes() const {
    return total_;
  }
  // Where logical byte `offset` lies (offset < bytes()).
  char* at(uint64_t offset) const {
    const size_t piece = piece_of(offset);
    return data_[piece] + (offset - starts_[piece]);
  }
  // How many bytes from `offset` on lie in the same piece.
  uint64_t contiguous_from(uint64_t offset) const {
    const size_t piece = piece_of(offset);
    return (piece + 1 < starts_.size() ? starts_[piece + 1] : total_) - offset;
  }
  void copy_out(uint64_t offset, uint64_t length, char* destination) const {
    for (uint64_t done = 0; done < length;) {
      const uint64_t n = std::min(length - done, contiguous_from(offset + done));
      std::memcpy(destination + done, at(offset + done), n);
      done += n;
    }
  }
  void copy_in(uint64_t offset, uint64_t length, const char* source) const {
    for (uint64_t done = 0; done < length;) {
      const uint64_t n = std::min(length - done, contiguous_from(offset + done));
      std::memcpy(at(offset + done), source + done, n);
      done += n;
    }
  }

 private:
  void add(char* data, uint64_t bytes) {
    if (bytes > 0) {
      data_.push_back(data);
      starts_.push_back(total_);
      total_ += bytes;
    }
  }
  size_t piece_of(uint64_t offset) const {
    return static_cast<size_t>(std::upper_bound(starts_.begin(), starts_.end(), offset) - starts_.begin()) - 1;
  }

  // Inline for a few pieces: an op on one tensor, the common case, allocates nothing.
  c10::SmallVector<char*, 4> data_;
  c10::SmallVector<uint64_t, 4> starts_;  // logical offset of each piece's first byte
  uint64_t total_ = 0;
};

} // namespace torchpar::comm::shm

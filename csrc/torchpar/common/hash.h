// One 64-bit mixer for every place that hashes ids: the parameter server places rows on servers and
// seeds a row's initial values with it, so checkpoints and placements depend on its exact bits.
#pragma once
#include <cstdint>

namespace torchpar {

// splitmix64's output function: consecutive or otherwise skewed ids come out spread over all 64 bits.
inline uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

} // namespace torchpar

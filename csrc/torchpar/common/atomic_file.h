// Files that are either wholly there or not at all, whatever moment a process is killed.
#pragma once
#include <cstddef>
#include <optional>
#include <string>

namespace torchpar {

// Writes `size` bytes to `path` through a temporary file in the same folder, flushed to disk, then
// renamed over `path`; the folder is flushed too, so the rename survives a power loss. A crash at any
// point leaves the previous file (or none) and at most a stray temporary file, never a torn one.
void write_file_atomically(const std::string& path, const void* bytes, size_t size);

// The file's bytes, or nothing when it does not exist; throws when it exists but cannot be read.
std::optional<std::string> read_file(const std::string& path);

} // namespace torchpar

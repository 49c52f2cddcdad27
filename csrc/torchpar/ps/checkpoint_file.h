#pragma once
// A server's checkpoint on disk: torch's pickle format (torch.load reads it too), written to a
// temporary file, flushed, then renamed over the previous one, so a crash mid-write leaves the
// last complete checkpoint in place.
#include <ATen/core/ivalue.h>

#include <optional>
#include <string>

namespace torchpar::ps {

std::string checkpoint_path(const std::string& directory, int server, int num_servers);
void write_checkpoint_file(const std::string& path, const c10::IValue& state);
// Empty when there is no file; throws when the file is there but unreadable.
std::optional<c10::IValue> read_checkpoint_file(const std::string& path);

} // namespace torchpar::ps

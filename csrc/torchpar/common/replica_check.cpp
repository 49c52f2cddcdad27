#include <torchpar/common/replica_check.h>

#include <torchpar/common/control_collectives.h>

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/irange.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>
#include <cstdint>
#include <sstream>

namespace torchpar {
namespace {

std::vector<std::string> describe_replica(const NamedTensors& parameters, const NamedTensors& buffers) {
  std::vector<std::string> lines;
  auto add = [&](const char* kind, const NamedTensors& tensors) {
    for (const auto& [name, tensor] : tensors) {
      std::ostringstream line;
      line << kind << ' ' << name << ' ' << tensor.sizes() << ' ' << tensor.scalar_type()
           << (tensor.requires_grad() ? "" : " (no grad)");
      lines.push_back(line.str());
    }
  };
  add("parameter", parameters);
  add("buffer", buffers);
  return lines;
}

std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream stream(text);
  for (std::string line; std::getline(stream, line);) {
    lines.push_back(line);
  }
  return lines;
}

// Every rank's text, gathered to every rank.
std::vector<std::string> all_gather_text(c10d::ProcessGroup& group, const std::string& text, at::Device device) {
  auto length = at::empty({1}, at::kLong);
  length.data_ptr<int64_t>()[0] = static_cast<int64_t>(text.size());
  const auto lengths = all_gather(group, length, device);
  int64_t longest = 1;
  for (const auto& each : lengths) {
    longest = std::max(longest, each.item<int64_t>());
  }
  auto padded = at::zeros({longest}, at::kByte);
  std::copy(text.begin(), text.end(), padded.data_ptr<uint8_t>());
  const auto gathered = all_gather(group, padded, device);
  std::vector<std::string> texts;
  for (const auto r : c10::irange(gathered.size())) {
    const auto* bytes = reinterpret_cast<const char*>(gathered[r].data_ptr<uint8_t>());
    texts.emplace_back(bytes, lengths[r].item<int64_t>());
  }
  return texts;
}

} // namespace

void check_same_model(c10d::ProcessGroup& group, const NamedTensors& parameters, const NamedTensors& buffers,
                      at::Device device, const std::string& who) {
  const auto local = describe_replica(parameters, buffers);
  std::ostringstream joined;
  for (const auto& line : local) {
    joined << line << '\n';
  }
  const auto texts = all_gather_text(group, joined.str(), device);
  std::vector<std::vector<std::string>> replicas;
  for (const auto& text : texts) {
    replicas.push_back(split_lines(text));
  }
  size_t first_difference = SIZE_MAX;
  const auto& reference = replicas.front();
  for (const auto& replica : replicas) {
    for (size_t k = 0; k < std::max(reference.size(), replica.size()); ++k) {
      if (k >= reference.size() || k >= replica.size() || reference[k] != replica[k]) {
        first_difference = std::min(first_difference, k);
        break;
      }
    }
  }
  if (first_difference == SIZE_MAX) {
    return;
  }
  std::ostringstream message;
  message << who << ": the model differs across ranks (checked on rank " << group.getRank()
          << "); first difference at entry " << first_difference << " of the parameter/buffer list:";
  std::vector<int> differing;
  for (const auto r : c10::irange(replicas.size())) {
    const auto& lines = replicas[r];
    const bool differs = r > 0 && (first_difference >= lines.size() || first_difference >= replicas[0].size() ||
                                   lines[first_difference] != replicas[0][first_difference]);
    if (r == 0 || differs) {
      message << "\n  rank " << r << ": "
              << (first_difference < lines.size() ? lines[first_difference]
                                                  : "nothing (it has " + std::to_string(lines.size()) + " entries)");
    }
    if (differs) {
      differing.push_back(static_cast<int>(r));
    }
  }
  message << "\nranks that differ from rank 0:";
  for (int r : differing) {
    message << ' ' << r;
  }
  message << ". Every rank must construct the same model.";
  TORCH_CHECK(false, message.str());
}

} // namespace torchpar

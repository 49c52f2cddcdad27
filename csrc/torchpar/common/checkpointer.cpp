#include <torchpar/common/checkpointer.h>

#include <algorithm>
#include <filesystem>
#include <iomanip>
#include <sstream>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <torchpar/common/atomic_file.h>
#include <torchpar/common/control_collectives.h>
#include <torchpar/common/error_message.h>

namespace torchpar {
namespace {

namespace fs = std::filesystem;

constexpr const char* kManifestHeader = "torchpar checkpoint manifest 1";
constexpr const char* kStepPrefix = "step-";

std::string step_folder(const std::string& directory, int64_t step) {
  std::ostringstream name;
  name << directory << '/' << kStepPrefix << std::setw(12) << std::setfill('0') << step;
  return name.str();
}

std::string rank_file(int rank, int world) {
  return "rank-" + std::to_string(rank) + "-of-" + std::to_string(world) + ".pt";
}

struct Manifest {
  int64_t step = -1;
  int world = 0;
  std::vector<int64_t> sizes; // every rank's file, in bytes
};

std::string manifest_text(const Manifest& manifest) {
  std::ostringstream text;
  text << kManifestHeader << "\nstep " << manifest.step << "\nworld_size " << manifest.world << '\n';
  for (int rank = 0; rank < manifest.world; ++rank) {
    text << "file " << rank_file(rank, manifest.world) << ' ' << manifest.sizes[rank] << '\n';
  }
  return text.str();
}

// Nothing when the manifest is missing or not one of ours.
std::optional<Manifest> read_manifest(const std::string& folder) {
  std::optional<std::string> text;
  try {
    text = read_file(folder + "/MANIFEST");
  } catch (const c10::Error&) {
    return std::nullopt;
  }
  if (!text) {
    return std::nullopt;
  }
  std::istringstream lines(*text);
  std::string header;
  std::getline(lines, header);
  Manifest manifest;
  std::string key;
  if (header != kManifestHeader || !(lines >> key >> manifest.step) || key != "step" ||
      !(lines >> key >> manifest.world) || key != "world_size" || manifest.world <= 0) {
    return std::nullopt;
  }
  for (int rank = 0; rank < manifest.world; ++rank) {
    std::string name;
    int64_t size = 0;
    if (!(lines >> key >> name >> size) || key != "file" || name != rank_file(rank, manifest.world)) {
      return std::nullopt;
    }
    manifest.sizes.push_back(size);
  }
  return manifest;
}

bool files_present(const std::string& folder, const Manifest& manifest) {
  for (int rank = 0; rank < manifest.world; ++rank) {
    std::error_code error;
    const auto size = fs::file_size(folder + "/" + rank_file(rank, manifest.world), error);
    if (error || static_cast<int64_t>(size) != manifest.sizes[rank]) {
      return false;
    }
  }
  return true;
}

// Steps with a folder in `directory`, newest first.
std::vector<int64_t> steps_on_disk(const std::string& directory) {
  std::vector<int64_t> steps;
  std::error_code error;
  for (const auto& entry : fs::directory_iterator(directory, error)) {
    const std::string name = entry.path().filename().string();
    if (entry.is_directory() && name.rfind(kStepPrefix, 0) == 0) {
      try {
        steps.push_back(std::stoll(name.substr(std::string(kStepPrefix).size())));
      } catch (const std::exception&) {
      }
    }
  }
  std::sort(steps.rbegin(), steps.rend());
  return steps;
}

} // namespace

Checkpointer::Checkpointer(std::string directory, c10::intrusive_ptr<c10d::ProcessGroup> group,
                           CheckpointerOptions options)
    : directory_(std::move(directory)), group_(std::move(group)), options_(options) {
  TORCH_CHECK(group_, "torchpar.Checkpointer: no process group");
  TORCH_CHECK(!directory_.empty(), "torchpar.Checkpointer: no directory");
  TORCH_CHECK(options_.keep() >= 1, "torchpar.Checkpointer: keep must be at least 1, got ", options_.keep());
  peers_ = PeerProcesses::gather(*group_, options_.control_device());
}

at::Tensor Checkpointer::agree(const at::Tensor& tensor, bool broadcast_from_0) {
  try {
    return broadcast_from_0 ? broadcast(*group_, tensor, options_.control_device(), 0)
                            : all_reduce_sum(*group_, tensor, options_.control_device());
  } catch (const std::exception& error) {
    TORCH_CHECK(false, peers_.explain(c10::str("torchpar.Checkpointer (", directory_, "): a rank did not take part: ",
                                               message_of(error))));
  }
}

void Checkpointer::save(int64_t step, const std::function<void(torch::serialize::OutputArchive&)>& write) {
  std::optional<std::string> bytes;
  std::string error;
  try {
    torch::serialize::OutputArchive archive;
    write(archive);
    std::ostringstream stream;
    archive.save_to(stream);
    bytes = stream.str();
  } catch (const std::exception& e) {
    error = "its state could not be serialised: " + message_of(e);
  }
  commit(step, bytes, error);
}

void Checkpointer::save_bytes(int64_t step, const std::string& bytes) {
  commit(step, bytes, "");
}

void Checkpointer::commit(int64_t step, const std::optional<std::string>& bytes, const std::string& local_error) {
  TORCH_CHECK(step >= 0, "torchpar.Checkpointer: the step must not be negative, got ", step);
  const int rank = group_->getRank();
  const int world = group_->getSize();
  const std::string folder = step_folder(directory_, step);
  std::string error = local_error;
  if (bytes) {
    try {
      write_file_atomically(folder + "/" + rank_file(rank, world), bytes->data(), bytes->size());
    } catch (const std::exception& e) {
      error = message_of(e);
    }
  }
  // Every rank learns every rank's file size (0: it failed), so all agree on the outcome.
  auto sizes = at::zeros({world}, at::kLong);
  sizes.data_ptr<int64_t>()[rank] = error.empty() ? static_cast<int64_t>(bytes->size()) + 1 : 0;
  sizes = agree(sizes, /*broadcast_from_0=*/false);
  Manifest manifest{step, world, {}};
  std::string failed;
  for (int r = 0; r < world; ++r) {
    const int64_t size = sizes.data_ptr<int64_t>()[r];
    manifest.sizes.push_back(size - 1);
    if (size == 0) {
      failed += (failed.empty() ? "" : ", ") + std::to_string(r);
    }
  }
  TORCH_CHECK(failed.empty(), "torchpar.Checkpointer: checkpoint step ", step, " in ", directory_, ": rank(s) ",
              failed, " could not write their state", error.empty() ? "" : " (this rank: " + error + ")",
              "; the previous checkpoints are kept");
  // Rank 0 completes the step; its success too is known to all.
  std::string manifest_error;
  if (rank == 0) {
    try {
      const std::string text = manifest_text(manifest);
      write_file_atomically(folder + "/MANIFEST", text.data(), text.size());
      remove_superseded(step);
    } catch (const std::exception& e) {
      manifest_error = message_of(e);
    }
  }
  auto completed = at::zeros({1}, at::kLong);
  completed.data_ptr<int64_t>()[0] = manifest_error.empty() ? 1 : 0;
  completed = agree(completed, /*broadcast_from_0=*/true);
  TORCH_CHECK(completed.item<int64_t>() == 1, "torchpar.Checkpointer: checkpoint step ", step, " in ", directory_,
              ": rank 0 could not complete it",
              manifest_error.empty() ? "" : " (" + manifest_error + ")", "; the previous checkpoints are kept");
}

void Checkpointer::remove_superseded(int64_t newest) const {
  int complete_kept = 0;
  for (int64_t step : steps_on_disk(directory_)) {
    const std::string folder = step_folder(directory_, step);
    const auto manifest = read_manifest(folder);
    const bool complete = manifest && files_present(folder, *manifest);
    // Newer steps than this save are another run's leftovers: left alone.
    if (step > newest) {
      continue;
    }
    if (complete && complete_kept < options_.keep()) {
      ++complete_kept;
      continue;
    }
    std::error_code ignored;
    fs::remove_all(folder, ignored);
  }
}

std::optional<int64_t> Checkpointer::latest_step() {
  int64_t newest = -1;
  if (group_->getRank() == 0) {
    for (int64_t step : steps_on_disk(directory_)) {
      const std::string folder = step_folder(directory_, step);
      const auto manifest = read_manifest(folder);
      if (manifest && manifest->step == step && files_present(folder, *manifest)) {
        newest = step;
        break;
      }
    }
  }
  auto agreed = at::zeros({1}, at::kLong);
  agreed.data_ptr<int64_t>()[0] = newest;
  newest = agree(agreed, /*broadcast_from_0=*/true).item<int64_t>();
  return newest >= 0 ? std::optional<int64_t>(newest) : std::nullopt;
}

std::string Checkpointer::load_bytes(int64_t step) const {
  const std::string folder = step_folder(directory_, step);
  const auto manifest = read_manifest(folder);
  TORCH_CHECK(manifest, "torchpar.Checkpointer: there is no complete checkpoint at step ", step, " in ", directory_,
              " (no MANIFEST in ", folder, ")");
  const int world = group_->getSize();
  TORCH_CHECK(manifest->world == world, "torchpar.Checkpointer: checkpoint step ", step, " in ", directory_,
              " was written by ", manifest->world, " ranks, this job has ", world,
              "; resume it with the same number of ranks");
  const int rank = group_->getRank();
  const std::string path = folder + "/" + rank_file(rank, world);
  const auto bytes = read_file(path);
  TORCH_CHECK(bytes, "torchpar.Checkpointer: ", path, " is missing although the manifest lists it");
  TORCH_CHECK(static_cast<int64_t>(bytes->size()) == manifest->sizes[rank], "torchpar.Checkpointer: ", path, " holds ",
              bytes->size(), " bytes, the manifest says ", manifest->sizes[rank]);
  return *bytes;
}

void Checkpointer::load(int64_t step, const std::function<void(torch::serialize::InputArchive&)>& read) const {
  const std::string bytes = load_bytes(step);
  torch::serialize::InputArchive archive;
  archive.load_from(bytes.data(), bytes.size());
  read(archive);
}

void save_rng_state(torch::serialize::OutputArchive& archive) {
  auto cpu = at::detail::getDefaultCPUGenerator();
  {
    std::lock_guard<std::mutex> lock(cpu.mutex());
    archive.write("rng.cpu", cpu.get_state());
  }
  const auto devices = at::detail::getCUDAHooks().deviceCount();
  for (c10::DeviceIndex device = 0; device < devices; ++device) {
    auto generator = at::globalContext().defaultGenerator(c10::Device(c10::kCUDA, device));
    std::lock_guard<std::mutex> lock(generator.mutex());
    archive.write("rng.cuda." + std::to_string(device), generator.get_state());
  }
}

void load_rng_state(torch::serialize::InputArchive& archive) {
  at::Tensor state;
  TORCH_CHECK(archive.try_read("rng.cpu", state),
              "torchpar.load_rng_state: the archive holds no RNG state (save it with torchpar::save_rng_state)");
  auto cpu = at::detail::getDefaultCPUGenerator();
  {
    std::lock_guard<std::mutex> lock(cpu.mutex());
    cpu.set_state(state);
  }
  const auto devices = at::detail::getCUDAHooks().deviceCount();
  for (c10::DeviceIndex device = 0; device < devices; ++device) {
    if (archive.try_read("rng.cuda." + std::to_string(device), state)) {
      auto generator = at::globalContext().defaultGenerator(c10::Device(c10::kCUDA, device));
      std::lock_guard<std::mutex> lock(generator.mutex());
      generator.set_state(state);
    }
  }
}

} // namespace torchpar

#include <torchpar/plan/calibration_store.h>

#include <torchpar/common/atomic_file.h>
#include <torchpar/common/error_message.h>

#include <ATen/Parallel.h>
#include <ATen/core/Dict.h>
#include <ATen/core/List.h>
#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/headeronly/version.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <thread>
#include <utility>

namespace torchpar::plan {
namespace {

// Samples measured with glibc trimming freed memory (version 1) ran up to 2x slower; those of version 2 hold
// networks probed by plain means, which a few stalls of the machine moved up to 10x.
constexpr int kSamplesVersion = 3;

using Fields = c10::impl::GenericDict;

Fields new_fields() { return Fields(c10::StringType::get(), c10::AnyType::get()); }

std::optional<c10::IValue> field(const Fields& fields, const char* name) {
  const auto found = fields.find(c10::IValue(std::string(name)));
  if (found == fields.end()) return std::nullopt;
  return found->value();
}

// A field every version wrote: its absence means the sample is not one of ours.
c10::IValue required(const Fields& fields, const char* name) {
  auto value = field(fields, name);
  TORCH_CHECK(value.has_value(), "no field '", name, "'");
  return *value;
}

// Fields added after samples were first kept: a sample from before keeps the member's default.
template <typename T>
void read_optional(const Fields& fields, const char* name, T& member) {
  const auto value = field(fields, name);
  if (!value) return;
  if constexpr (std::is_same_v<T, bool>) {
    member = value->toBool();
  } else if constexpr (std::is_floating_point_v<T>) {
    member = value->toDouble();
  } else {
    member = static_cast<T>(value->toInt());
  }
}

c10::IValue link_value(const LinkCost& link) {
  return c10::IValue(std::vector<double>{link.alpha_ms, link.ms_per_byte});
}

LinkCost link_from(const c10::IValue& value) {
  const auto pair = value.toDoubleVector();
  TORCH_CHECK(pair.size() == 2, "a link of ", pair.size(), " numbers, not [alpha ms, ms per byte]");
  return LinkCost{pair[0], pair[1]};
}

// The integer and real fields of a profiled layer (name and elementwise aside).
constexpr std::pair<const char*, double LayerProfile::*> kLayerTimes[] = {
    {"forward_ms", &LayerProfile::forward_ms},
    {"backward_input_ms", &LayerProfile::backward_input_ms},
    {"backward_weight_ms", &LayerProfile::backward_weight_ms},
    {"forward_overhead_ms", &LayerProfile::forward_overhead_ms},
    {"backward_input_overhead_ms", &LayerProfile::backward_input_overhead_ms},
    {"backward_weight_overhead_ms", &LayerProfile::backward_weight_overhead_ms}};
constexpr std::pair<const char*, int64_t LayerProfile::*> kLayerSizes[] = {
    {"parameter_bytes", &LayerProfile::parameter_bytes},
    {"activation_bytes", &LayerProfile::activation_bytes},
    {"output_bytes", &LayerProfile::output_bytes},
    {"input_bytes", &LayerProfile::input_bytes},
    {"sparse_parameter_bytes", &LayerProfile::sparse_parameter_bytes},
    {"sparse_bytes_per_sample", &LayerProfile::sparse_bytes_per_sample},
    {"in_features", &LayerProfile::in_features},
    {"out_features", &LayerProfile::out_features},
    {"backward_temporary_bytes", &LayerProfile::backward_temporary_bytes}};

Fields layer_fields(const LayerProfile& layer) {
  auto fields = new_fields();
  fields.insert("name", layer.name);
  for (const auto& [name, member] : kLayerTimes) fields.insert(name, layer.*member);
  for (const auto& [name, member] : kLayerSizes) fields.insert(name, layer.*member);
  fields.insert("elementwise", layer.elementwise);
  fields.insert("accumulates_weight_gradient", layer.accumulates_weight_gradient);
  return fields;
}

LayerProfile layer_from(const Fields& fields) {
  LayerProfile layer;
  layer.name = required(fields, "name").toStringRef();
  for (const auto& [name, member] : kLayerTimes) layer.*member = required(fields, name).toDouble();
  for (const auto& [name, member] : kLayerSizes) read_optional(fields, name, layer.*member);
  read_optional(fields, "elementwise", layer.elementwise);
  read_optional(fields, "accumulates_weight_gradient", layer.accumulates_weight_gradient);
  return layer;
}

constexpr std::pair<const char*, LinkCost NetworkProfile::*> kLinks[] = {
    {"all_reduce", &NetworkProfile::all_reduce},
    {"send_recv", &NetworkProfile::send_recv},
    {"copy", &NetworkProfile::copy},
    {"all_gather", &NetworkProfile::all_gather},
    {"reduce_scatter", &NetworkProfile::reduce_scatter}};
constexpr std::pair<const char*, std::optional<LinkCost> NetworkProfile::*> kOptionalLinks[] = {
    {"stage_transfer", &NetworkProfile::stage_transfer}, {"ddp_all_reduce", &NetworkProfile::ddp_all_reduce}};
constexpr std::pair<const char*, int64_t HostMemory::*> kHostSizes[] = {
    {"process_overhead_bytes", &HostMemory::process_overhead_bytes},
    {"stage_ring_bytes", &HostMemory::stage_ring_bytes},
    {"shm_chunk_bytes", &HostMemory::shm_chunk_bytes}};

Fields network_fields(const NetworkProfile& network) {
  auto fields = new_fields();
  for (const auto& [name, member] : kLinks) fields.insert(name, link_value(network.*member));
  for (const auto& [name, member] : kOptionalLinks) {
    if (network.*member) fields.insert(name, link_value(*(network.*member)));
  }
  fields.insert("ddp_in_place", network.ddp_in_place);
  fields.insert("reduce_scatter_clones_input", network.reduce_scatter_clones_input);
  fields.insert("ps_ring_bytes", network.ps_ring_bytes);
  for (const auto& [name, member] : kHostSizes) fields.insert(name, network.host_memory.*member);
  fields.insert("keeps_freed_memory", network.host_memory.keeps_freed_memory);
  return fields;
}

NetworkProfile network_from(const Fields& fields) {
  NetworkProfile network;
  for (const auto& [name, member] : kLinks) {
    if (const auto value = field(fields, name)) network.*member = link_from(*value);
  }
  for (const auto& [name, member] : kOptionalLinks) {
    if (const auto value = field(fields, name)) network.*member = link_from(*value);
  }
  read_optional(fields, "ddp_in_place", network.ddp_in_place);
  read_optional(fields, "reduce_scatter_clones_input", network.reduce_scatter_clones_input);
  read_optional(fields, "ps_ring_bytes", network.ps_ring_bytes);
  for (const auto& [name, member] : kHostSizes) read_optional(fields, name, network.host_memory.*member);
  read_optional(fields, "keeps_freed_memory", network.host_memory.keeps_freed_memory);
  return network;
}

// Strategies by name, so that a store outlives a reordering of the enum.
constexpr std::pair<const char*, Strategy> kStrategies[] = {{"ddp", Strategy::DataParallel},
                                                            {"pipeline", Strategy::Pipeline},
                                                            {"ps", Strategy::ParameterServer},
                                                            {"tensor", Strategy::TensorParallel},
                                                            {"sharded", Strategy::Sharded}};

Fields configuration_fields(const Configuration& configuration) {
  auto fields = new_fields();
  for (const auto& [name, strategy] : kStrategies) {
    if (strategy == configuration.strategy) fields.insert("strategy", std::string(name));
  }
  fields.insert("world", configuration.world);
  fields.insert("first_bucket_bytes", configuration.first_bucket_bytes);
  fields.insert("bucket_bytes", configuration.bucket_bytes);
  fields.insert("replicas", configuration.replicas);
  fields.insert("tensor", configuration.tensor);
  fields.insert("schedule", pipeline::schedule_name(configuration.schedule));
  fields.insert("microbatches", configuration.microbatches);
  fields.insert("virtual_stages", configuration.virtual_stages);
  fields.insert("balance", c10::IValue(configuration.balance));
  fields.insert("servers", configuration.servers);
  fields.insert("synchronous", configuration.synchronous);
  fields.insert("zero_stage", configuration.zero_stage);
  return fields;
}

Configuration configuration_from(const Fields& fields) {
  Configuration configuration;
  const auto strategy = required(fields, "strategy").toStringRef();
  const auto* known = std::find_if(std::begin(kStrategies), std::end(kStrategies),
                                   [&](const auto& entry) { return strategy == entry.first; });
  TORCH_CHECK(known != std::end(kStrategies), "an unknown strategy '", strategy, "'");
  configuration.strategy = known->second;
  configuration.world = static_cast<int>(required(fields, "world").toInt());
  read_optional(fields, "first_bucket_bytes", configuration.first_bucket_bytes);
  read_optional(fields, "bucket_bytes", configuration.bucket_bytes);
  read_optional(fields, "replicas", configuration.replicas);
  read_optional(fields, "tensor", configuration.tensor);
  if (const auto schedule = field(fields, "schedule")) {
    configuration.schedule = pipeline::parse_schedule(schedule->toStringRef());
  }
  read_optional(fields, "microbatches", configuration.microbatches);
  read_optional(fields, "virtual_stages", configuration.virtual_stages);
  if (const auto balance = field(fields, "balance")) configuration.balance = balance->toIntVector();
  read_optional(fields, "servers", configuration.servers);
  read_optional(fields, "synchronous", configuration.synchronous);
  read_optional(fields, "zero_stage", configuration.zero_stage);
  return configuration;
}

Fields sample_fields(const CalibrationSample& sample) {
  auto model = new_fields();
  model.insert("batch", sample.model.batch);
  model.insert("contention", sample.model.contention);
  model.insert("heap_retention_bytes", sample.model.heap_retention_bytes);
  c10::impl::GenericList layers(c10::AnyType::get());
  for (const auto& layer : sample.model.layers) layers.push_back(layer_fields(layer));
  model.insert("layers", layers);
  auto setup = new_fields();
  setup.insert("batch", sample.setup.batch);
  setup.insert("optimizer_state_factor", sample.setup.optimizer_state_factor);
  setup.insert("optimizer_ms_per_byte", sample.setup.optimizer_ms_per_byte);
  auto fields = new_fields();
  fields.insert("model", model);
  fields.insert("network", network_fields(sample.network));
  fields.insert("setup", setup);
  fields.insert("configuration", configuration_fields(sample.configuration));
  fields.insert("measured_ms", sample.measured_ms);
  return fields;
}

CalibrationSample sample_from(const Fields& fields) {
  CalibrationSample sample;
  const auto model = required(fields, "model").toGenericDict();
  sample.model.batch = required(model, "batch").toInt();
  sample.model.contention = required(model, "contention").toDouble();
  read_optional(model, "heap_retention_bytes", sample.model.heap_retention_bytes);
  for (const auto& layer : required(model, "layers").toListRef()) {
    sample.model.layers.push_back(layer_from(layer.toGenericDict()));
  }
  sample.network = network_from(required(fields, "network").toGenericDict());
  const auto setup = required(fields, "setup").toGenericDict();
  sample.setup.batch = required(setup, "batch").toInt();
  read_optional(setup, "optimizer_state_factor", sample.setup.optimizer_state_factor);
  read_optional(setup, "optimizer_ms_per_byte", sample.setup.optimizer_ms_per_byte);
  sample.configuration = configuration_from(required(fields, "configuration").toGenericDict());
  sample.measured_ms = required(fields, "measured_ms").toDouble();
  return sample;
}

Fields calibration_fields(const Calibration& calibration) {
  auto fields = new_fields();
  for (const auto& knob : calibration_knobs()) fields.insert(knob.name, calibration.*knob.field);
  return fields;
}

Calibration calibration_from(const Fields& fields) {
  Calibration calibration;
  for (const auto& knob : calibration_knobs()) read_optional(fields, knob.name, calibration.*knob.field);
  return calibration;
}

// The whole store: every key's entry. Empty when there is no file.
Fields read_store(const std::string& path) {
  const auto bytes = read_file(path);
  if (!bytes) return new_fields();
  c10::IValue saved;
  try {
    saved = torch::jit::pickle_load(std::vector<char>(bytes->begin(), bytes->end()));
  } catch (const std::exception& error) {
    TORCH_CHECK(false, "plan: the calibration store ", path, " is not one (", message_of(error),
                "); remove it, or point TORCHPAR_PLAN_CALIBRATION at another file (--verify writes a new one)");
  }
  TORCH_CHECK(saved.isGenericDict(), "plan: the calibration store ", path, " holds a ", saved.tagKind(),
              ", not a dict of entries; remove it, or point TORCHPAR_PLAN_CALIBRATION at another file");
  return saved.toGenericDict();
}

std::optional<Fields> entry_of(const Fields& store, const std::string& key) {
  const auto entry = field(store, key.c_str());
  if (!entry || !entry->isGenericDict()) return std::nullopt;
  return entry->toGenericDict();
}

std::vector<CalibrationSample> samples_of(const std::optional<Fields>& entry) {
  std::vector<CalibrationSample> samples;
  if (!entry) return samples;
  const auto kept = field(*entry, "samples");
  if (!kept || !kept->isList()) return samples;
  for (const auto& fields : kept->toListRef()) {
    try {
      samples.push_back(sample_from(fields.toGenericDict()));
    } catch (const std::exception&) {
      continue;  // written by a version whose fields no longer parse: its successors will do
    }
  }
  return samples;
}

} // namespace

std::string calibration_file() {
  if (const char* path = std::getenv("TORCHPAR_PLAN_CALIBRATION"); path != nullptr && *path != '\0') return path;
  std::filesystem::path cache;
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg != nullptr && *xdg != '\0') {
    cache = xdg;
  } else {
    const char* home = std::getenv("HOME");
    TORCH_CHECK(home != nullptr && *home != '\0',
                "plan: neither TORCHPAR_PLAN_CALIBRATION, XDG_CACHE_HOME nor HOME is set: no place for the "
                "calibration store");
    cache = std::filesystem::path(home) / ".cache";
  }
  return (cache / "torchpar" / "plan_calibration.pt").string();
}

Calibration default_calibration(int world) {
  TORCH_CHECK(world >= 1, "default_calibration: a world of ", world, " ranks");
  Calibration calibration;
  const double cores = std::max(1u, std::thread::hardware_concurrency());
  calibration.overlap = std::min(1.0, std::max(0.0, cores / world - 1));
  return calibration;
}

std::string describe(const Calibration& c) {
  char text[512];
  std::snprintf(text, sizeof(text),
                "compute x %.2f, communication x %.2f, %.0f%% of communication overlapped, %.2f ms per pipeline "
                "action, %.2f ms per transfer, %.2f ms per step, parameter server +%.2f ms/MiB, +%.2f ms per step "
                "and +%.2f ms per step of sparse rows",
                c.compute_scale, c.communication_scale, 100 * c.overlap, c.per_action_ms, c.per_transfer_ms,
                c.per_step_ms, c.ps_ms_per_byte * (1 << 20), c.ps_per_step_ms, c.ps_rows_ms);
  return text;
}

std::string calibration_key(int world, const std::string& backend) {
  return "torch " + std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) + "." +
         std::to_string(TORCH_VERSION_PATCH) + "/" + backend + "/" + std::to_string(world) + " ranks/" +
         std::to_string(at::get_num_threads()) + " threads/v" + std::to_string(kSamplesVersion);
}

CalibrationStore::CalibrationStore(std::string path) : path_(std::move(path)) {
  TORCH_CHECK(!path_.empty(), "CalibrationStore: an empty path");
}

std::optional<Calibration> CalibrationStore::calibration(int world, const std::string& backend) const {
  const auto entry = entry_of(read_store(path_), calibration_key(world, backend));
  if (!entry) return std::nullopt;
  const auto fields = field(*entry, "calibration");
  if (!fields || !fields->isGenericDict()) return std::nullopt;
  return calibration_from(fields->toGenericDict());
}

std::vector<CalibrationSample> CalibrationStore::samples(int world, const std::string& backend) const {
  return samples_of(entry_of(read_store(path_), calibration_key(world, backend)));
}

LearnedCalibration CalibrationStore::learn(const std::vector<CalibrationSample>& samples, int world,
                                           const std::string& backend, const Calibration& start) {
  auto store = read_store(path_);
  const auto key = calibration_key(world, backend);
  auto kept = samples_of(entry_of(store, key));
  kept.insert(kept.end(), samples.begin(), samples.end());
  if (kept.size() > kKeptSamples) kept.erase(kept.begin(), kept.end() - kKeptSamples);
  LearnedCalibration learned{fit_calibration(kept, start), static_cast<int>(kept.size())};
  c10::impl::GenericList sample_list(c10::AnyType::get());
  for (const auto& sample : kept) sample_list.push_back(sample_fields(sample));
  auto entry = new_fields();
  entry.insert("calibration", calibration_fields(learned.calibration));
  entry.insert("samples", sample_list);
  store.insert_or_assign(key, entry);
  const auto folder = std::filesystem::path(path_).parent_path();
  std::error_code ignored;
  if (!folder.empty()) std::filesystem::create_directories(folder, ignored);
  const auto bytes = torch::jit::pickle_save(store);
  try {
    write_file_atomically(path_, bytes.data(), bytes.size());
  } catch (const std::exception& error) {
    TORCH_CHECK(false, "plan: cannot keep the calibration in ", path_, ": ", message_of(error));
  }
  return learned;
}

} // namespace torchpar::plan

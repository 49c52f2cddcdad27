#include <torchpar/pipeline/shared_parameters.h>

#include <torchpar/pipeline/schedules.h>

#include <c10/core/TensorImpl.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <ostream>
#include <set>
#include <sstream>

namespace torchpar::pipeline {
namespace {

std::string listed_parameters(const Layer& layer) {
  if (layer.parameter_names.empty()) {
    return std::to_string(layer.parameters.size()) + " unnamed parameters (address them by position)";
  }
  std::string names;
  for (const auto& name : layer.parameter_names) {
    names += (names.empty() ? "'" : ", '") + name + "'";
  }
  return "parameters " + names;
}

} // namespace

std::string ParameterRef::describe() const {
  return "layer " + std::to_string(layer) + (by_name() ? " '" + name + "'" : " parameter " + std::to_string(index));
}

bool operator==(const ParameterRef& a, const ParameterRef& b) {
  return a.layer == b.layer && a.name == b.name && a.index == b.index;
}

bool operator<(const ParameterRef& a, const ParameterRef& b) {
  return std::tie(a.layer, a.index, a.name) < std::tie(b.layer, b.index, b.name);
}

std::ostream& operator<<(std::ostream& out, const ParameterRef& ref) { return out << ref.describe(); }

int64_t parameter_index(const ParameterRef& ref, const Layer& layer, int64_t layer_index) {
  const auto count = static_cast<int64_t>(layer.parameters.size());
  if (!ref.by_name()) {
    TORCH_CHECK(ref.index < count, "pipeline shared_parameters: ", ref.describe(), " does not exist: layer ",
                layer_index, " (", layer.name, ") has ", count, " parameters");
    return ref.index;
  }
  const auto& names = layer.parameter_names;
  const auto found = std::find(names.begin(), names.end(), ref.name);
  TORCH_CHECK(found != names.end(), "pipeline shared_parameters: ", ref.describe(), " does not exist: layer ",
              layer_index, " (", layer.name, ") has ", listed_parameters(layer));
  TORCH_CHECK(names.size() == layer.parameters.size(), "pipeline layer ", layer_index, " (", layer.name, ") names ",
              names.size(), " parameters but lists ", layer.parameters.size());
  return found - names.begin();
}

ParameterRef canonical_ref(const ParameterRef& ref, const Layer& layer) {
  const int64_t index = parameter_index(ref, layer, ref.layer);
  return layer.parameter_names.empty() ? ParameterRef(ref.layer, index) : ParameterRef(ref.layer, layer.parameter_names[index]);
}

std::vector<SharedParameterGroup> detect_shared_parameters(const std::vector<Layer>& layers) {
  // Per tensor, its first appearance in each layer listing it (a layer may list one tensor twice).
  std::map<const c10::TensorImpl*, SharedParameterGroup> holders;
  std::vector<const c10::TensorImpl*> order;
  for (size_t l = 0; l < layers.size(); ++l) {
    const auto& layer = layers[l];
    for (size_t p = 0; p < layer.parameters.size(); ++p) {
      const auto* impl = layer.parameters[p].unsafeGetTensorImpl();
      auto& group = holders[impl];
      if (group.empty()) {
        order.push_back(impl);
      }
      if (group.empty() || group.back().layer != static_cast<int64_t>(l)) {
        group.push_back(canonical_ref(ParameterRef(static_cast<int64_t>(l), static_cast<int64_t>(p)), layer));
      }
    }
  }
  std::vector<SharedParameterGroup> shared;
  for (const auto* impl : order) {
    if (holders[impl].size() > 1) {
      shared.push_back(holders[impl]);
    }
  }
  return shared;
}

std::vector<SharedParameterGroup> merge_shared_parameters(std::vector<SharedParameterGroup> groups, int64_t layers) {
  // Union-find over the distinct members: groups naming one parameter in common are one group.
  std::map<ParameterRef, size_t> id;
  std::vector<ParameterRef> members;
  for (const auto& group : groups) {
    std::set<ParameterRef> distinct(group.begin(), group.end());
    TORCH_CHECK(distinct.size() >= 2, "pipeline shared_parameters: a group of shared parameters needs at least two "
                "different parameters, got ", describe(group).empty() ? "none" : describe(group));
    for (const auto& ref : group) {
      TORCH_CHECK(ref.layer >= 0 && ref.layer < layers, "pipeline shared_parameters: ", ref.describe(),
                  " is outside the model's ", layers, " layers");
      TORCH_CHECK(ref.by_name() ? !ref.name.empty() : ref.index >= 0, "pipeline shared_parameters: layer ",
                  ref.layer, " has a parameter addressed by an empty name or a negative position");
      if (id.emplace(ref, members.size()).second) {
        members.push_back(ref);
      }
    }
  }
  std::vector<size_t> parent(members.size());
  std::iota(parent.begin(), parent.end(), 0);
  auto root = [&](size_t x) {
    while (parent[x] != x) {
      x = parent[x] = parent[parent[x]];
    }
    return x;
  };
  for (const auto& group : groups) {
    for (const auto& ref : group) {
      const auto a = root(id.at(group.front())), b = root(id.at(ref));
      parent[std::max(a, b)] = std::min(a, b);
    }
  }
  std::map<size_t, std::set<ParameterRef>> merged;
  for (size_t i = 0; i < members.size(); ++i) {
    merged[root(i)].insert(members[i]);
  }
  std::vector<SharedParameterGroup> canonical;
  for (const auto& entry : merged) {
    canonical.emplace_back(entry.second.begin(), entry.second.end());
  }
  std::sort(canonical.begin(), canonical.end(),
            [](const SharedParameterGroup& a, const SharedParameterGroup& b) { return a.front() < b.front(); });
  return canonical;
}

std::vector<SharedParameterGroup> shared_parameters_of(const std::vector<Layer>& layers,
                                                       const std::vector<SharedParameterGroup>& declared) {
  const auto count = static_cast<int64_t>(layers.size());
  auto groups = detect_shared_parameters(layers);
  for (const auto& group : declared) {
    SharedParameterGroup addressed;
    for (const auto& ref : group) {
      TORCH_CHECK(ref.layer >= 0 && ref.layer < count, "pipeline shared_parameters: ", ref.describe(),
                  " is outside the model's ", count, " layers");
      addressed.push_back(canonical_ref(ref, layers[ref.layer]));
    }
    groups.push_back(std::move(addressed));
  }
  return merge_shared_parameters(std::move(groups), count);
}

SharedParameterPlacement place_shared_parameters(const SharedParameterGroup& group,
                                                 const std::vector<int64_t>& boundaries, int ranks) {
  TORCH_INTERNAL_ASSERT(!group.empty() && ranks > 0);
  auto stage_of = [&](int64_t layer) {
    TORCH_CHECK(layer >= 0 && layer < boundaries.back(), "pipeline shared_parameters: layer ", layer,
                " is outside the model's ", boundaries.back(), " layers");
    return static_cast<int>(std::upper_bound(boundaries.begin(), boundaries.end(), layer) - boundaries.begin() - 1);
  };
  std::set<int> stages, holders;
  for (const auto& ref : group) {
    stages.insert(stage_of(ref.layer));
    holders.insert(rank_of_stage(stage_of(ref.layer), ranks));
  }
  SharedParameterPlacement placement;
  placement.stages.assign(stages.begin(), stages.end());
  placement.ranks.assign(holders.begin(), holders.end());
  const auto first = std::min_element(group.begin(), group.end(),
                                      [](const ParameterRef& a, const ParameterRef& b) { return a.layer < b.layer; });
  placement.source = rank_of_stage(stage_of(first->layer), ranks);
  return placement;
}

std::string describe(const SharedParameterGroup& group) {
  std::ostringstream text;
  for (size_t i = 0; i < group.size(); ++i) {
    text << (i ? " = " : "") << group[i].describe();
  }
  return text.str();
}

} // namespace torchpar::pipeline

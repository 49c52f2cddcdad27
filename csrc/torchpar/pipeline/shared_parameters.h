// Parameters that several layers of a pipelined model share: tied weights, such as GPT-2's input
// embedding and its LM head. Cut into stages they become copies on the ranks holding those layers;
// the pipeline keeps the copies one parameter (shared_gradients.h). This is the pure part: how a
// parameter is addressed, which ties a model has, and where the copies live.
#pragma once
#include <torchpar/pipeline/layer.h>

#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

namespace torchpar::pipeline {

// One parameter of one layer of the model: by name (Layer::parameter_names: {11, "weight"}) or by
// position in Layer::parameters ({11, 0}).
struct ParameterRef {
  ParameterRef(int64_t layer, std::string name) : layer(layer), name(std::move(name)) {}
  ParameterRef(int64_t layer, int64_t index) : layer(layer), index(index) {}

  int64_t layer = 0;
  std::string name;    // empty when addressed by position
  int64_t index = -1;  // -1 when addressed by name

  bool by_name() const { return index < 0; }
  // "layer 11 'weight'" or "layer 3 parameter 0"
  std::string describe() const;
};

bool operator==(const ParameterRef& a, const ParameterRef& b);
bool operator<(const ParameterRef& a, const ParameterRef& b);
std::ostream& operator<<(std::ostream& out, const ParameterRef& ref);  // as describe()

// Parameters that are one: each member is a copy of the same tensor.
using SharedParameterGroup = std::vector<ParameterRef>;

// The position of `ref` in `layer`'s parameters; throws naming the layer's parameters when it has none such.
int64_t parameter_index(const ParameterRef& ref, const Layer& layer, int64_t layer_index);

// `ref` as detection names it: by name when `layer` names its parameters, else by position.
ParameterRef canonical_ref(const ParameterRef& ref, const Layer& layer);

// The parameters `layers` share: a tensor (the same TensorImpl) listed by two or more layers, one
// group per tensor, one member per layer, in layer order.
std::vector<SharedParameterGroup> detect_shared_parameters(const std::vector<Layer>& layers);

// The same groups in one canonical form, the same on every rank that was given the same: groups with a
// member in common merged, members sorted and unique, groups ordered by their first member. Throws for a
// layer outside [0, layers) or a group of fewer than two distinct parameters.
std::vector<SharedParameterGroup> merge_shared_parameters(std::vector<SharedParameterGroup> groups, int64_t layers);

// With every layer at hand (the pipeline built from built layers, Python's modules): the declared
// groups, addressed as detection addresses them, with the detected ones, merged.
std::vector<SharedParameterGroup> shared_parameters_of(const std::vector<Layer>& layers,
                                                       const std::vector<SharedParameterGroup>& declared);

// Where a group's copies live, for the cut `boundaries` (stage_boundaries) over `ranks` pipeline
// ranks (stage s on rank s % ranks).
struct SharedParameterPlacement {
  std::vector<int> stages;  // ascending, each once
  std::vector<int> ranks;   // ascending, each once
  // The rank holding the group's first member (its lowest layer): its values are every copy's at the start.
  int source = 0;
};
SharedParameterPlacement place_shared_parameters(const SharedParameterGroup& group,
                                                 const std::vector<int64_t>& boundaries, int ranks);

// "layer 0 'wte.weight' = layer 5 'weight'"
std::string describe(const SharedParameterGroup& group);

} // namespace torchpar::pipeline

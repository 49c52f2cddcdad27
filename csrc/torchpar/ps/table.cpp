#include <torchpar/ps/table.h>

namespace torchpar::ps {

Table::Table(std::string name, c10::ScalarType dtype, OptimizerConfig optimizer, int num_workers)
    : pushes(num_workers, 0), name_(std::move(name)), dtype_(dtype), optimizer_(optimizer) {}

c10::IValue optimizer_to_ivalue(const OptimizerConfig& config) {
  return c10::IValue(std::vector<double>{static_cast<double>(config.kind), config.lr, config.momentum,
                                         config.weight_decay, config.beta1, config.beta2, config.eps,
                                         config.initial_accumulator});
}

OptimizerConfig optimizer_from_ivalue(const c10::IValue& value) {
  const auto fields = value.toDoubleVector();
  TORCH_CHECK(fields.size() == 8, "torchpar.ps: checkpoint holds an optimizer of ", fields.size(), " fields");
  OptimizerConfig config;
  config.kind = static_cast<OptimizerConfig::Kind>(static_cast<int>(fields[0]));
  config.lr = fields[1];
  config.momentum = fields[2];
  config.weight_decay = fields[3];
  config.beta1 = fields[4];
  config.beta2 = fields[5];
  config.eps = fields[6];
  config.initial_accumulator = fields[7];
  return config;
}

c10::impl::GenericDict Table::snapshot() const {
  c10::impl::GenericDict state(c10::StringType::get(), c10::AnyType::get());
  state.insert("name", name_);
  state.insert("sparse", is_sparse());
  state.insert("optimizer", optimizer_to_ivalue(optimizer_));
  state.insert("pushes", c10::IValue(pushes));
  state.insert("applied", applied);
  return state;
}

void Table::restore(const c10::impl::GenericDict& state) {
  const auto saved = optimizer_from_ivalue(state.at("optimizer"));
  TORCH_CHECK(saved.kind == optimizer_.kind, "torchpar.ps: table '", name_, "' was checkpointed with optimizer ",
              saved.describe(), ", it is registered with ", optimizer_.describe());
  optimizer_.lr = saved.lr;
  const auto saved_pushes = state.at("pushes").toIntVector();
  TORCH_CHECK(saved_pushes.size() == pushes.size(), "torchpar.ps: the checkpoint of table '", name_,
              "' was written with ", saved_pushes.size(), " workers, this job has ", pushes.size());
  pushes = saved_pushes;
  applied = state.at("applied").toInt();
  rounds.clear();
}

} // namespace torchpar::ps

#include <torchpar/ps/config.h>

#include <c10/util/Exception.h>

#include <sstream>

namespace torchpar::ps {

OptimizerConfig OptimizerConfig::sgd(double lr, double momentum, double weight_decay) {
  OptimizerConfig config;
  config.lr = lr;
  config.momentum = momentum;
  config.weight_decay = weight_decay;
  return config;
}

OptimizerConfig OptimizerConfig::adagrad(double lr, double eps, double initial_accumulator) {
  OptimizerConfig config;
  config.kind = Kind::Adagrad;
  config.lr = lr;
  config.eps = eps;
  config.initial_accumulator = initial_accumulator;
  return config;
}

OptimizerConfig OptimizerConfig::adam(double lr, double beta1, double beta2, double eps) {
  OptimizerConfig config;
  config.kind = Kind::Adam;
  config.lr = lr;
  config.beta1 = beta1;
  config.beta2 = beta2;
  config.eps = eps;
  return config;
}

std::string OptimizerConfig::describe() const {
  std::ostringstream text;
  switch (kind) {
    case Kind::Sgd: text << "SGD(lr=" << lr << ", momentum=" << momentum << ", weight_decay=" << weight_decay; break;
    case Kind::Adagrad: text << "Adagrad(lr=" << lr << ", eps=" << eps << ", initial_accumulator=" << initial_accumulator
                             << ", weight_decay=" << weight_decay; break;
    case Kind::Adam: text << "Adam(lr=" << lr << ", betas=(" << beta1 << ", " << beta2 << "), eps=" << eps
                          << ", weight_decay=" << weight_decay; break;
  }
  text << ")";
  return text.str();
}

RowInitializer RowInitializer::zeros() { return {}; }

RowInitializer RowInitializer::uniform(double low, double high, uint64_t seed) {
  return {Kind::Uniform, low, high, seed};
}

RowInitializer RowInitializer::normal(double mean, double std, uint64_t seed) {
  return {Kind::Normal, mean, std, seed};
}

Consistency parse_consistency(const std::string& name) {
  if (name == "bsp") return Consistency::BSP;
  if (name == "asp") return Consistency::ASP;
  if (name == "ssp") return Consistency::SSP;
  TORCH_CHECK(false, "torchpar.ps: unknown consistency model '", name, "' (bsp, asp or ssp)");
}

const char* consistency_name(Consistency consistency) {
  switch (consistency) {
    case Consistency::BSP: return "bsp";
    case Consistency::ASP: return "asp";
    case Consistency::SSP: return "ssp";
  }
  return "?";
}

} // namespace torchpar::ps

#pragma once
// What a table is created with: its server-side optimizer and, for sparse tables, how a row is
// initialised on first touch. Both travel in the registration message and into checkpoints.
#include <cstdint>
#include <string>

namespace torchpar::ps {

struct OptimizerConfig {
  enum class Kind : uint8_t { Sgd = 1, Adagrad = 2, Adam = 3 };
  Kind kind = Kind::Sgd;
  double lr = 0.01;
  double momentum = 0.0;     // SGD
  double weight_decay = 0.0; // dense tables only, as torch.optim's
  double beta1 = 0.9;        // Adam
  double beta2 = 0.999;      // Adam
  double eps = 1e-8;         // Adam (torch's default); Adagrad's default is 1e-10
  double initial_accumulator = 0.0; // Adagrad

  static OptimizerConfig sgd(double lr, double momentum = 0.0, double weight_decay = 0.0);
  static OptimizerConfig adagrad(double lr, double eps = 1e-10, double initial_accumulator = 0.0);
  static OptimizerConfig adam(double lr, double beta1 = 0.9, double beta2 = 0.999, double eps = 1e-8);
  std::string describe() const;
};

// Deterministic per row id: a row's first value depends only on (seed, id), never on which server
// holds it or when it is first touched, so a restart or another server count gives the same rows.
struct RowInitializer {
  enum class Kind : uint8_t { Zeros = 1, Uniform = 2, Normal = 3 };
  Kind kind = Kind::Zeros;
  double a = 0.0; // uniform: low; normal: mean
  double b = 0.0; // uniform: high; normal: std
  uint64_t seed = 0;

  static RowInitializer zeros();
  static RowInitializer uniform(double low, double high, uint64_t seed = 0);
  static RowInitializer normal(double mean, double std, uint64_t seed = 0);
};

enum class Consistency : uint8_t { BSP = 1, ASP = 2, SSP = 3 };
Consistency parse_consistency(const std::string& name);
const char* consistency_name(Consistency consistency);

} // namespace torchpar::ps

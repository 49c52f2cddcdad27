// Checkpoints of sharded data parallelism from C++ in which nothing is gathered: each rank writes only its pieces of
// the trained parameters (their master values, as its shard holds them) and of its optimizer's state on them, each
// piece named by its parameter and its first element, to <directory>/rank-<r>-of-<N>.pt. Any number of ranks, at
// any stage, loads them: each rank reads the pieces overlapping its own, and one process reads them all into the bare
// model. Python's form of the same is torch.distributed.checkpoint (ShardedDataParallel.sharded_state_dict).
#pragma once
#include <torchpar/common/replica_check.h>
#include <torchpar/sharded/sharded_optimizer.h>

#include <string>

namespace torch::nn {
class Module;
} // namespace torch::nn

namespace torchpar::sharded {

// Writes this rank's file; `replicated` (buffers, frozen parameters: the same on every rank) is written whole.
// Every rank of the group calls it; no collective.
void save_sharded_checkpoint(const std::string& directory, ShardedOptimizer& optimizer,
                             const NamedTensors& replicated);

// What save_sharded_checkpoint wrote, on any number of ranks: this rank's pieces of the parameters and of the
// optimizer state (made first by a step of learning rate 0 where the optimizer has none yet), the optimizer's
// options, and `replicated`. Fails naming what is missing: a rank's file, or a parameter's elements none holds.
// Collective: at stages 1-2 the loaded shards are all-gathered into the parameters.
void load_sharded_checkpoint(const std::string& directory, ShardedOptimizer& optimizer, NamedTensors& replicated);

// The same checkpoint into a bare LibTorch module and an optimizer over its parameters, in one process: each
// trained parameter and its optimizer state whole (a tied parameter by its first name), the buffers and frozen
// parameters, the optimizer's options.
void load_sharded_checkpoint(const std::string& directory, torch::nn::Module& module,
                             torch::optim::Optimizer& optimizer);

} // namespace torchpar::sharded

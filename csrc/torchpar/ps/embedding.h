#pragma once
// An embedding whose rows live on the parameter servers (a sparse table): forward pulls the rows of
// the batch's ids, backward pushes their gradients (duplicates summed), and the servers' row-wise
// optimizer updates them. Memory on the servers grows with the rows ever touched.
#include <torchpar/ps/client.h>

#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>

namespace torchpar::ps {

class EmbeddingImpl : public torch::nn::Cloneable<EmbeddingImpl> {
 public:
  EmbeddingImpl(Client& client, const std::string& name, int64_t num_rows, int64_t dim,
                const OptimizerConfig& optimizer, const RowInitializer& initializer = RowInitializer::zeros());

  // ids: int64 of any shape; returns [*ids.shape, dim].
  at::Tensor forward(const at::Tensor& ids);
  // Waits for the last backward's push (its errors surface here or at the next forward).
  void flush();
  void reset() override {}
  int table() const { return table_; }

 private:
  Client* client_;
  int table_;
  Future last_push_;
};

TORCH_MODULE(Embedding);

} // namespace torchpar::ps

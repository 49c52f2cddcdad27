#pragma once
// An embedding whose rows live on the parameter servers (a sparse table): forward pulls the rows of
// the batch's ids, backward pushes their gradients (duplicates summed), and the servers' row-wise
// optimizer updates them. Memory on the servers grows with the rows ever touched.
// torchpar.ps.Embedding (Python) is this module.
#include <torchpar/ps/client.h>

#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>

#include <memory>
#include <mutex>

namespace torchpar::ps {

class EmbeddingImpl : public torch::nn::Cloneable<EmbeddingImpl> {
 public:
  EmbeddingImpl(Client& client, const std::string& name, int64_t num_rows, int64_t dim,
                const OptimizerConfig& optimizer, const RowInitializer& initializer = RowInitializer::zeros(),
                c10::ScalarType dtype = c10::kFloat);

  // ids: int64 of any shape; returns [*ids.shape, dim]. In training mode with grad enabled, backward
  // pushes the rows' gradients. Waits for the earlier backwards' pushes first (see flush).
  at::Tensor forward(const at::Tensor& ids);
  // Waits for every push of the backwards so far; the first failed one's error is raised.
  void flush();
  void reset() override {}
  int table() const { return table_; }
  int64_t num_rows() const { return num_rows_; }
  int64_t dim() const { return dim_; }

 private:
  // Held by the gradient hooks too: a graph may outlive the module.
  struct Pushes {
    std::mutex mutex;
    std::vector<Future> futures;
  };

  Client* client_;
  int table_;
  int64_t num_rows_;
  int64_t dim_;
  std::shared_ptr<Pushes> pushes_ = std::make_shared<Pushes>();
};

TORCH_MODULE(Embedding);

} // namespace torchpar::ps

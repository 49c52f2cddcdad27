#include <torchpar/ps/embedding.h>

#include <c10/core/GradMode.h>

namespace torchpar::ps {

EmbeddingImpl::EmbeddingImpl(Client& client, const std::string& name, int64_t num_rows, int64_t dim,
                             const OptimizerConfig& optimizer, const RowInitializer& initializer)
    : client_(&client), table_(client.sparse_table(name, num_rows, dim, optimizer, initializer)) {}

void EmbeddingImpl::flush() {
  if (last_push_) {
    auto push = std::move(last_push_);
    push->waitAndThrow();
  }
}

at::Tensor EmbeddingImpl::forward(const at::Tensor& ids) {
  flush();
  auto pulled = client_->pull_rows({table_}, {ids});
  pulled->waitAndThrow();
  auto rows = pulled->value().toTensorList().get(0);
  if (is_training() && c10::GradMode::is_enabled()) {
    rows.requires_grad_(true);
    const auto batch_ids = ids.detach().cpu().clone();
    rows.register_hook([this, batch_ids](const at::Tensor& grad) {
      last_push_ = client_->push_rows({table_}, {batch_ids}, {grad});
    });
  }
  return rows;
}

} // namespace torchpar::ps

#include <torchpar/ps/embedding.h>

#include <c10/core/GradMode.h>

namespace torchpar::ps {

EmbeddingImpl::EmbeddingImpl(Client& client, const std::string& name, int64_t num_rows, int64_t dim,
                             const OptimizerConfig& optimizer, const RowInitializer& initializer,
                             c10::ScalarType dtype)
    : client_(&client),
      table_(client.sparse_table(name, num_rows, dim, optimizer, initializer, dtype)),
      num_rows_(num_rows),
      dim_(dim) {}

void EmbeddingImpl::flush() {
  std::vector<Future> futures;
  {
    std::lock_guard<std::mutex> lock(pushes_->mutex);
    futures.swap(pushes_->futures);
  }
  std::exception_ptr first_error;
  for (auto& future : futures) {
    future->wait();
    if (future->hasError() && !first_error) {
      first_error = future->exception_ptr();
    }
  }
  if (first_error) {
    std::rethrow_exception(first_error);
  }
}

at::Tensor EmbeddingImpl::forward(const at::Tensor& ids) {
  flush();
  auto pulled = client_->pull_rows({table_}, {ids});
  pulled->waitAndThrow();
  auto rows = pulled->value().toTensorList().get(0);
  if (is_training() && c10::GradMode::is_enabled()) {
    rows.requires_grad_(true);
    rows.register_hook([client = client_, table = table_, pushes = pushes_,
                        batch_ids = ids.detach().cpu().clone()](const at::Tensor& grad) {
      auto push = client->push_rows({table}, {batch_ids}, {grad});
      std::lock_guard<std::mutex> lock(pushes->mutex);
      pushes->futures.push_back(std::move(push));
    });
  }
  return rows;
}

} // namespace torchpar::ps

// Trains a small GPT (a decoder-only transformer over bytes) on Python's own docstrings with 3-D
// parallelism, data x pipeline x tensor: the C++ twin of examples/python/train_gpt.py.
//
//   ./scripts/setup.sh                  # also writes data/docstrings.txt
//   torchrun --nproc-per-node=8 --no-python build/examples/cpp/train_gpt --data-parallel 2 --pipeline 2 --tensor 2
//   (without --data-parallel it is the world / (pipeline x tensor))
//   build/examples/cpp/train_gpt        # one process: the same loss curve
//   options: [--data data/docstrings.txt] [--layers 4] [--width 64] [--heads 4] [--context 64]
//            [--batch-size 16] [--microbatches 2] [--steps 300] [--lr 3e-3] [--clip 1] [--seed 0]
//            [--backend gloo|shm] [--losses losses.json]
//
// Attention heads are split over the tensor group (query, key and value column-parallel, the output
// row-parallel), the MLP is column -> GELU -> row, the token embedding and the logits are split over
// the vocabulary and the loss is the vocabulary-parallel cross-entropy. The layers are cut evenly into
// pipeline stages (1F1B); each data replica trains on its share of every batch. Each layer is built
// from its own seed and keeps its slice of the full layer, gradients are clipped over the whole model
// and there is no dropout, so every grid trains the same model: the loss curve equals the one-process
// run's up to float rounding. Exit code 0; 1 if the loss did not fall; 2 for a wrong launch or options.
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iomanip>
#include <iostream>
#include <iterator>
#include <limits>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/full.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <ATen/ops/stack.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/normalization.h>
#include <torch/optim/adamw.h>
#include <torchpar/torchpar.h>

namespace tp = torchpar::tensor_parallel;
using Group = c10::intrusive_ptr<c10d::ProcessGroup>;

namespace {

constexpr int64_t kVocab = 128; // printable ASCII: one byte, one token

struct Arguments {
  std::string data = "data/docstrings.txt";
  int data_parallel = 0, pipeline = 1, tensor = 1; // data_parallel 0: the world / (pipeline x tensor)
  int64_t layers = 4, width = 64, heads = 4, context = 64, batch_size = 16;
  int microbatches = 2;
  int64_t steps = 300;
  double lr = 3e-3, clip = 1.0;
  uint64_t seed = 0;
  std::string backend, losses;
};

Arguments parse(int argc, char** argv) {
  Arguments a;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) throw std::invalid_argument("missing value after " + flag);
    const std::string value = argv[++i];
    if (flag == "--data") a.data = value;
    else if (flag == "--data-parallel") a.data_parallel = std::stoi(value);
    else if (flag == "--pipeline") a.pipeline = std::stoi(value);
    else if (flag == "--tensor") a.tensor = std::stoi(value);
    else if (flag == "--layers") a.layers = std::stoll(value);
    else if (flag == "--width") a.width = std::stoll(value);
    else if (flag == "--heads") a.heads = std::stoll(value);
    else if (flag == "--context") a.context = std::stoll(value);
    else if (flag == "--batch-size") a.batch_size = std::stoll(value);
    else if (flag == "--microbatches") a.microbatches = std::stoi(value);
    else if (flag == "--steps") a.steps = std::stoll(value);
    else if (flag == "--lr") a.lr = std::stod(value);
    else if (flag == "--clip") a.clip = std::stod(value);
    else if (flag == "--seed") a.seed = std::stoull(value);
    else if (flag == "--backend") a.backend = value;
    else if (flag == "--losses") a.losses = value;
    else throw std::invalid_argument("unknown option " + flag + " (see the comment at the top of train_gpt.cpp)");
  }
  return a;
}

// What is wrong with the options for this world, or ""; infers --data-parallel when it is not given.
std::string problem_with(Arguments& a, int world) {
  if (a.data_parallel == 0) {
    if (world % (a.pipeline * a.tensor) != 0) {
      return "the world's " + std::to_string(world) + " ranks do not divide into --pipeline " +
             std::to_string(a.pipeline) + " x --tensor " + std::to_string(a.tensor) +
             " (the data-parallel size is inferred from them)";
    }
    a.data_parallel = world / (a.pipeline * a.tensor);
  }
  if (a.data_parallel * a.pipeline * a.tensor != world) {
    return "--data-parallel x --pipeline x --tensor = " + std::to_string(a.data_parallel * a.pipeline * a.tensor) +
           ", but the world has " + std::to_string(world) + " ranks";
  }
  if (a.layers + 2 < a.pipeline) return "fewer layers (--layers + embedding and head) than --pipeline stages";
  if (a.heads % a.tensor || a.width % a.heads) return "--heads must divide --width and divide by --tensor";
  if (a.batch_size % (a.data_parallel * a.microbatches)) {
    return "--batch-size does not split into --data-parallel replicas x --microbatches";
  }
  return "";
}

// Token rows split over the vocabulary (tensor group), positions replicated.
struct EmbeddingImpl : torch::nn::Module {
  EmbeddingImpl(const Group& tensor, int64_t width, int64_t context)
      : tokens(register_module(
            "tokens", tp::VocabParallelEmbedding(tensor, tp::VocabParallelEmbeddingOptions(kVocab, width)
                                                             .name("embedding.tokens")))),
        positions(register_module("positions", torch::nn::Embedding(context, width))) {}
  at::Tensor forward(const at::Tensor& ids) {
    return tokens->forward(ids) + positions->forward(at::arange(ids.size(1), at::kLong));
  }
  tp::VocabParallelEmbedding tokens;
  torch::nn::Embedding positions;
};
TORCH_MODULE(Embedding);

// Pre-LayerNorm causal self-attention and MLP; this rank holds heads / T heads and 4 * width / T of the
// MLP's hidden features. Members are built one statement at a time: their order is the generator's.
struct BlockImpl : torch::nn::Module {
  BlockImpl(const Group& tensor, int64_t width, int64_t heads, const std::string& name)
      : heads_here(heads / tensor->getSize()), head_width(width / heads) {
    const auto column = [&](int64_t in, int64_t out, const char* what) {
      return tp::ColumnParallelLinear(tensor, tp::ColumnParallelLinearOptions(in, out).name(name + "." + what));
    };
    const auto row = [&](int64_t in, int64_t out, const char* what) {
      return tp::RowParallelLinear(tensor, tp::RowParallelLinearOptions(in, out).name(name + "." + what));
    };
    norm1 = register_module("norm1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})));
    norm2 = register_module("norm2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})));
    query = register_module("query", column(width, width, "query"));
    key = register_module("key", column(width, width, "key"));
    value = register_module("value", column(width, width, "value"));
    out = register_module("out", row(width, width, "out"));
    up = register_module("up", column(width, 4 * width, "up"));
    down = register_module("down", row(4 * width, width, "down"));
  }
  at::Tensor forward(const at::Tensor& input) {
    const int64_t b = input.size(0), s = input.size(1);
    const auto split = [&](const at::Tensor& t) { return t.view({b, s, heads_here, head_width}).transpose(1, 2); };
    const auto h = norm1->forward(input);
    const auto mixed = at::scaled_dot_product_attention(split(query->forward(h)), split(key->forward(h)),
                                                        split(value->forward(h)), {}, 0.0, /*is_causal=*/true);
    const auto x = input + out->forward(mixed.transpose(1, 2).reshape({b, s, heads_here * head_width}));
    return x + down->forward(at::gelu(up->forward(norm2->forward(x))));
  }
  int64_t heads_here, head_width;
  torch::nn::LayerNorm norm1{nullptr}, norm2{nullptr};
  tp::ColumnParallelLinear query{nullptr}, key{nullptr}, value{nullptr}, up{nullptr};
  tp::RowParallelLinear out{nullptr}, down{nullptr};
};
TORCH_MODULE(Block);

// The final LayerNorm and the logits, left split over the vocabulary.
struct HeadImpl : torch::nn::Module {
  HeadImpl(const Group& tensor, int64_t width)
      : norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})))),
        logits(register_module("logits", tp::ColumnParallelLinear(tensor, tp::ColumnParallelLinearOptions(width, kVocab)
                                                                             .bias(false)
                                                                             .name("head")))) {}
  at::Tensor forward(const at::Tensor& x) { return logits->forward(norm->forward(x)); }
  torch::nn::LayerNorm norm;
  tp::ColumnParallelLinear logits;
};
TORCH_MODULE(Head);

// One factory per pipeline layer, each seeding itself (a layer's weights do not depend on the grid);
// the modules this rank builds are collected in `built`, for the gradient clipping's layouts.
std::vector<torchpar::pipeline::LayerFactory> layer_factories(const Arguments& a, const Group& tensor,
                                                              std::shared_ptr<torch::nn::Module> built) {
  std::vector<std::function<torch::nn::AnyModule()>> builders;
  builders.push_back([=] { return torch::nn::AnyModule(Embedding(tensor, a.width, a.context)); });
  for (int64_t i = 0; i < a.layers; ++i) {
    builders.push_back(
        [=] { return torch::nn::AnyModule(Block(tensor, a.width, a.heads, "block" + std::to_string(i))); });
  }
  builders.push_back([=] { return torch::nn::AnyModule(Head(tensor, a.width)); });
  std::vector<torchpar::pipeline::LayerFactory> factories;
  for (size_t index = 0; index < builders.size(); ++index) {
    factories.push_back([=, build = builders[index]] {
      torch::manual_seed(a.seed * 1000 + index);
      auto module = build();
      built->register_module(std::to_string(index), module.ptr());
      return torchpar::pipeline::layer_from_module(std::to_string(index), module);
    });
  }
  return factories;
}

// Layers per stage, as even as counts allow (explicit: balancing by parameters or time would build
// every layer on every rank, and a tensor-parallel layer's constructor is collective).
std::vector<int64_t> even_balance(int64_t layers, int stages) {
  std::vector<int64_t> balance;
  for (int stage = 0; stage < stages; ++stage) balance.push_back(layers / stages + (stage < layers % stages));
  return balance;
}

// `count` random windows of context + 1 bytes: inputs and next-byte targets.
std::pair<at::Tensor, at::Tensor> windows(const at::Tensor& text, int64_t count, int64_t context,
                                          at::Generator& generator) {
  const auto starts = at::randint(0, text.size(0) - context - 1, {count}, generator, at::kLong);
  std::vector<at::Tensor> rows;
  for (int64_t i = 0; i < count; ++i) rows.push_back(text.narrow(0, starts[i].item<int64_t>(), context + 1));
  const auto batch = at::stack(rows);
  return {batch.narrow(1, 0, context), batch.narrow(1, 1, context)};
}

double learning_rate(int64_t step, int64_t steps, double peak) {
  const int64_t warmup = std::max<int64_t>(1, steps / 20);
  if (step < warmup) return peak * static_cast<double>(step + 1) / static_cast<double>(warmup);
  return peak * 0.5 *
         (1 + std::cos(M_PI * static_cast<double>(step - warmup) / static_cast<double>(std::max<int64_t>(1, steps - warmup))));
}

at::Tensor read_text(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) throw std::invalid_argument(path + " not found; write it with `python3 scripts/export_text.py`");
  std::vector<char> bytes((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  return at::from_blob(bytes.data(), {static_cast<int64_t>(bytes.size())}, at::kChar).to(at::kLong);
}

} // namespace

int main(int argc, char** argv) {
  Arguments a;
  Group world_group;
  at::Tensor text;
  try {
    a = parse(argc, argv);
    auto options = torchpar::InitOptions().backend(a.backend);
    if (std::getenv("RANK") == nullptr) { // one process on its own
      options.rank(0).world_size(1).store(c10::make_intrusive<c10d::HashStore>());
    }
    world_group = torchpar::init_process_group(options);
    const auto problem = problem_with(a, world_group->getSize());
    if (!problem.empty()) throw std::invalid_argument(problem);
    text = read_text(a.data);
  } catch (const torchpar::LaunchError& error) {
    std::cerr << "train_gpt: " << error.what() << std::endl;
    return 2;
  } catch (const std::invalid_argument& error) { // options or data
    std::cerr << "train_gpt: " << error.what() << std::endl;
    return 2;
  }
  const int rank = world_group->getRank();
  const int world = world_group->getSize();
  const int64_t held_out_from = text.size(0) * 9 / 10;
  const auto train_text = text.narrow(0, 0, held_out_from);
  const auto held_out_text = text.narrow(0, held_out_from, text.size(0) - held_out_from);

  torchpar::ParallelGrid grid(world_group, a.data_parallel, a.pipeline, a.tensor,
                              torchpar::InitOptions().backend(a.backend));
  const auto& tensor = grid.tensor_group();
  auto model = std::make_shared<torch::nn::Module>(); // this rank's layers
  auto factories = layer_factories(a, tensor, model);
  const auto layer_count = static_cast<int64_t>(factories.size());
  torchpar::pipeline::Pipeline pipe(
      std::move(factories),
      [tensor](const torchpar::pipeline::Tensors& outputs, const at::Tensor& targets) {
        return tp::vocab_parallel_cross_entropy(outputs[0], targets, tensor);
      },
      torchpar::pipeline::PipelineOptions()
          .process_group(grid.pipeline_group())
          .data_parallel_group(grid.data_group())
          .schedule("1f1b")
          .microbatches(a.microbatches)
          .balance(even_balance(layer_count, a.pipeline)));
  torch::optim::AdamW optimizer(pipe.parameters(), torch::optim::AdamWOptions(a.lr).weight_decay(0.0));
  const auto layouts = tp::parameter_layouts(*model);
  if (rank == 0) {
    std::cerr << "GPT: " << a.layers << " blocks, width " << a.width << ", " << a.heads << " heads, context "
              << a.context << ", vocabulary " << kVocab << "; " << grid.describe() << std::endl;
  }

  const int64_t share = a.batch_size / a.data_parallel;
  auto generator = at::make_generator<at::CPUGeneratorImpl>(a.seed); // the same batches on every rank
  std::vector<double> losses;
  const auto start = std::chrono::steady_clock::now();
  for (int64_t step = 0; step < a.steps; ++step) {
    const auto [inputs, targets] = windows(train_text, a.batch_size, a.context, generator);
    for (auto& group : optimizer.param_groups()) {
      static_cast<torch::optim::AdamWOptions&>(group.options()).lr(learning_rate(step, a.steps, a.lr));
    }
    optimizer.zero_grad();
    // The replicas' mean losses, averaged: the global batch's.
    std::vector<at::Tensor> loss{pipe.step(inputs.narrow(0, grid.data_index() * share, share),
                                           targets.narrow(0, grid.data_index() * share, share))
                                     .reshape({1})};
    grid.data_group()->allreduce(loss)->wait();
    tp::clip_grad_norm(layouts, a.clip, tensor, grid.pipeline_group());
    optimizer.step();
    losses.push_back(loss[0].item<double>() / a.data_parallel);
    if (rank == 0 && (step % 10 == 9 || step + 1 == a.steps)) {
      // A terminal gets one line redrawn in place; a log file, a line every 10 steps.
      std::cerr << (::isatty(2) ? "\r" : "") << "step " << std::setw(5) << step + 1 << "/" << a.steps << "  loss "
                << std::fixed << std::setprecision(3) << losses.back() << (::isatty(2) ? "" : "\n") << std::flush;
    }
  }
  if (rank == 0 && ::isatty(2)) std::cerr << std::endl;
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  // Held-out loss: every replica runs the same windows; the last stage's ranks score them.
  model->eval();
  auto held_out_generator = at::make_generator<at::CPUGeneratorImpl>(a.seed + 1);
  const auto [inputs, targets] = windows(held_out_text, 32, a.context, held_out_generator);
  const auto outputs = pipe.forward({inputs});
  std::vector<at::Tensor> held_out{at::full({1}, -std::numeric_limits<double>::infinity(), at::kDouble)};
  if (pipe.has_last_stage()) {
    held_out[0].fill_(tp::vocab_parallel_cross_entropy(outputs[0], targets, tensor).item<double>());
  }
  world_group->allreduce(held_out, {c10d::ReduceOp::MAX})->wait();
  const auto mean = [](auto begin, auto end) { return std::accumulate(begin, end, 0.0) / std::distance(begin, end); };
  const size_t edge = std::min<size_t>(10, losses.size());
  const double first = mean(losses.begin(), losses.begin() + edge), last = mean(losses.end() - edge, losses.end());
  if (rank == 0) {
    std::cout << "train_gpt: " << world << " ranks = " << a.data_parallel << " data x " << a.pipeline
              << " pipeline x " << a.tensor << " tensor, " << a.steps << " steps in " << std::fixed
              << std::setprecision(1) << seconds << " s (" << a.steps * a.batch_size / seconds
              << " sequences/s), loss " << std::setprecision(3) << first << " -> " << last
              << " (first and last 10 steps), held-out loss " << held_out[0].item<double>() << std::endl;
    if (!a.losses.empty()) {
      std::ofstream out(a.losses);
      out << std::setprecision(17) << "[";
      for (size_t i = 0; i < losses.size(); ++i) out << (i ? ", " : "") << losses[i];
      out << "]\n";
    }
  }
  return last < first ? 0 : 1;
}

// The 8x8 digits the training examples learn: data/digits.pt, a dict of tensors written by Python's
// torch.save (scripts/export_digits.py, run by scripts/setup.sh).
#pragma once
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

#include <torch/csrc/jit/serialization/pickle.h>

struct Digits {
  at::Tensor train_x, train_y, test_x, test_y;
};

inline Digits load_digits(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) {
    throw std::invalid_argument("cannot read " + path + " (scripts/setup.sh writes it; or run scripts/export_digits.py)");
  }
  std::vector<char> bytes((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  const auto dict = torch::jit::pickle_load(bytes).toGenericDict();
  return {dict.at("train_x").toTensor(), dict.at("train_y").toTensor(), dict.at("test_x").toTensor(),
          dict.at("test_y").toTensor()};
}

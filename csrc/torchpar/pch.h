// Precompiled for libtorchpar's own sources only (never installed): the c10d headers that almost
// every file of the library needs and that dominate its compile time.
#pragma once
#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

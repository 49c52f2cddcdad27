// Precompiled for the test sources (not main.cpp, which must define CATCH_CONFIG_MAIN first).
#pragma once
#include "catch_with_torch.h"
#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

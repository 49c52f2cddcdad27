// Precompiled for the pybind11 glue only: torch's pybind11 helpers and c10d's headers.
#pragma once
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/utils/pybind.h>

// Umbrella header for C++ applications: #include <torchpar/torchpar.h>
#pragma once
#include <torchpar/comm/launch_error.h>
#include <torchpar/comm/process_group.h>

// Umbrella header for C++ applications: #include <torchpar/torchpar.h>
#pragma once
#include <torchpar/common/checkpointer.h>
#include <torchpar/comm/launch_error.h>
#include <torchpar/comm/process_group.h>
#include <torchpar/ddp/comm_hooks.h>
#include <torchpar/ddp/data_parallel.h>
#include <torchpar/ddp/distributed_data_parallel.h>
#include <torchpar/ddp/powersgd_hook.h>
#include <torchpar/pipeline/partition.h>
#include <torchpar/pipeline/pipeline.h>
#include <torchpar/pipeline/simulator.h>
#include <torchpar/ps/embedding.h>
#include <torchpar/ps/remote_parameters.h>
#include <torchpar/ps/service.h>

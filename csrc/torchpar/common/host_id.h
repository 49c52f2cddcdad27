// Which machine this process runs on, for telling the ranks that share a host from the others.
#pragma once
#include <string>

namespace torchpar {

// This machine's identity: TORCHPAR_HOST_ID when set (tests simulate several hosts on one
// machine with it), else the hostname.
std::string host_id();

} // namespace torchpar

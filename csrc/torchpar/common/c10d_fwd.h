// The c10d types torchpar's headers name, declared but not defined: including c10d's own headers
// would cost every includer seconds of compile time.
#pragma once
#include <c10/util/intrusive_ptr.h>

namespace c10d {
class Backend;
class ProcessGroup;
class Store;
class Work;
} // namespace c10d

// Include this instead of <catch2/catch.hpp>. c10/util/Logging.h defines a glog-style CHECK that
// aborts the process; included after Catch2 it would silently replace Catch2's CHECK. So c10's
// logging comes first (its include guard keeps it from coming back), its CHECK goes, Catch2 follows.
#pragma once
#include <c10/util/Logging.h>
#undef CHECK
#include <catch2/catch.hpp>

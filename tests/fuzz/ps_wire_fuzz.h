#pragma once
// The parameter-server wire fuzzer's inputs, shared by the fuzz target (ps_wire_fuzzer.cpp) and the
// program that writes its seed corpus (make_corpus.cpp). An input is a stream of messages as a
// channel delivers them — each a frame (encode_frame's four fields) followed by its payload — that
// server 0 of a job with kWorkers workers receives from worker kWorker while it holds the tables of
// initial_tables() (ids 0, 1, ... in that order). Replies (ok to a registration, error) in the
// stream go through the client's decoders instead.
#include <torchpar/ps/messages.h>

#include <variant>
#include <vector>

namespace torchpar::ps::fuzz {

constexpr int kWorker = 0; // worker 0's registrations create tables (the others' wait for it)
constexpr int kWorkers = 2;
constexpr int kServer = 0;

using Registration = std::variant<DenseRegistration, SparseRegistration>;
// Dense tables of both dtypes and sharded, sparse tables with each optimizer the rows allow.
std::vector<Registration> initial_tables();

} // namespace torchpar::ps::fuzz

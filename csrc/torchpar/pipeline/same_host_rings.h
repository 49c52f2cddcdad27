// Point-to-point messages between neighbouring pipeline ranks of one host through shared memory, beside
// the process group. Measured on 2 cores (2 ranks, ZB-H1): posting a Gloo send or receive from the step's
// thread blocked it for 1.5-5.5 ms in two steps of three, because the pair's lock and Gloo's loop thread
// compete with both ranks' compute for the cores. Here a send is a copy into a ring and a receive a copy
// out of it, on the step's thread, with no other thread and no system call while data flows.
//
// Each rank owns one ring to each neighbour (the stage ranks next to it: r + 1 and r - 1, wrapping), an
// anonymous memfd the neighbour maps. A sender appends records (tag, size, data) in sending order; the
// receiver takes them in that order, into the receive posted for their tag, or aside (a copy) until that
// receive is posted. A message larger than a quarter of the ring goes as several records. A send finding
// no room waits in a queue that every later call and every wait moves on: a rank waiting for anything
// keeps its own sends and receives flowing, so two ranks never wait on each other's progress (had large
// messages gone through the group instead, a rank blocked in the group's wait would stop its ring).
//
// Not thread-safe: one thread (the pipeline's step) does every call.
#pragma once
#include <torchpar/common/c10d_fwd.h>
#include <torchpar/common/memfd_region.h>

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>

namespace torchpar::pipeline {

class SameHostRings;

// A send or receive through a ring; wait() moves every link on until it is done.
class RingWork : public c10d::Work {
 public:
  RingWork(SameHostRings* rings, at::Tensor tensor, int peer, int tag, bool sending);
  bool isCompleted() override;
  bool isSuccess() const override { return done_ && !error_; }
  std::exception_ptr exception() const override { return error_; }
  bool wait(std::chrono::milliseconds timeout) override;
  void abort() override {}

 private:
  friend class SameHostRings;
  void finish(std::exception_ptr error = nullptr);

  SameHostRings* rings_;
  at::Tensor tensor_;
  int peer_;
  int tag_;
  bool sending_;
  size_t transferred_ = 0;  // bytes written into the ring, or received
  bool done_ = false;
  std::exception_ptr error_;
};

class SameHostRings {
 public:
  // Collective over `group`. Nothing (every rank then sends through the group) when `ring_bytes` is 0
  // on some rank, or some rank could not create or map a ring to or from a neighbour on its host.
  static std::unique_ptr<SameHostRings> connect(c10d::ProcessGroup& group, int64_t ring_bytes);
  // TORCHPAR_PIPELINE_RING_BYTES, else 16 MiB; 0 turns the rings off.
  static int64_t default_ring_bytes();
  ~SameHostRings();

  // Whether messages to and from `peer` go through the rings (else through the group).
  bool connects(int peer) const;
  c10::intrusive_ptr<c10d::Work> send(const at::Tensor& tensor, int peer, int tag);
  c10::intrusive_ptr<c10d::Work> recv(const at::Tensor& buffer, int peer, int tag);
  // After a failed step: forget posted receives, messages set aside and queued sends.
  void discard_pending();

 private:
  friend class RingWork;
  struct Outgoing {
    MemfdRegion region;
    uint64_t written = 0;  // this end's copy of the ring's head
    std::deque<c10::intrusive_ptr<RingWork>> queued;  // sends that found no room, in order
  };
  struct Incoming {
    MemfdRegion region;
    int64_t pid = 0;  // the sender's process, checked while waiting for it
    std::unordered_map<int, c10::intrusive_ptr<RingWork>> posted;  // by tag
    struct SetAside {
      at::Tensor message;
      size_t received = 0;  // fragments arrive in order
    };
    std::unordered_map<int, SetAside> set_aside;  // by tag, until its receive is posted
  };

  SameHostRings(int rank, std::chrono::milliseconds timeout) : rank_(rank), timeout_(timeout) {}
  bool try_write(Outgoing& out, RingWork& send);
  // Moves every link on as far as it can go now, without waiting.
  void progress();
  void drain(int peer, Incoming& in);
  void wait_for(RingWork& work);

  int rank_;
  std::chrono::milliseconds timeout_;
  std::map<int, Outgoing> outgoing_;  // by peer
  std::map<int, Incoming> incoming_;  // by peer
};

} // namespace torchpar::pipeline

// One step of a pipeline schedule. A schedule is data: for every rank an ordered list of actions
// that the runtime executes one by one (the idea of torch.distributed.pipelining's _Action).
#pragma once
#include <cstdint>
#include <string>

namespace torchpar::pipeline {

enum class ActionType : uint8_t {
  Forward,         // F: run the stage on a micro-batch, keep what backward needs
  Backward,        // B: input and weight gradients in one pass
  BackwardInput,   // I: input gradients only (zero-bubble schedules), weight gradients deferred ...
  BackwardWeight,  // W: ... to this action, which fills a bubble
  // Communication; `stage` is always the stage whose compute action produces or consumes the data.
  SendActivation,  // stage's output to stage+1's rank
  RecvActivation,  // post the receive of stage's input from stage-1's rank (waited for by F)
  SendGradient,    // the gradient of stage's input to stage-1's rank
  RecvGradient,    // post the receive of the gradient of stage's output (waited for by B / I)
};

struct Action {
  ActionType type;
  int stage;       // global (virtual) stage index, 0 .. stages*virtual_stages-1
  int microbatch;

  bool operator==(const Action& other) const {
    return type == other.type && stage == other.stage && microbatch == other.microbatch;
  }
};

bool is_compute(ActionType type);
// "F", "B", "I", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B".
const char* action_type_name(ActionType type);
// e.g. "F3@s1" for stage 1's forward of micro-batch 3, "SEND_F3@s1".
std::string to_string(const Action& action);

} // namespace torchpar::pipeline

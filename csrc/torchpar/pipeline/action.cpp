#include <torchpar/pipeline/action.h>

namespace torchpar::pipeline {

bool is_compute(ActionType type) {
  return type == ActionType::Forward || type == ActionType::Backward || type == ActionType::BackwardInput ||
         type == ActionType::BackwardWeight;
}

const char* action_type_name(ActionType type) {
  switch (type) {
    case ActionType::Forward: return "F";
    case ActionType::Backward: return "B";
    case ActionType::BackwardInput: return "I";
    case ActionType::BackwardWeight: return "W";
    case ActionType::SendActivation: return "SEND_F";
    case ActionType::RecvActivation: return "RECV_F";
    case ActionType::SendGradient: return "SEND_B";
    case ActionType::RecvGradient: return "RECV_B";
  }
  return "?";
}

std::string to_string(const Action& action) {
  return std::string(action_type_name(action.type)) + std::to_string(action.microbatch) + "@s" +
         std::to_string(action.stage);
}

} // namespace torchpar::pipeline

#define CATCH_CONFIG_MAIN
#include "catch_with_torch.h"

#include "harness.h"

namespace {

int failed_assertion_count = 0;

// Counts failed assertions, so that a forked rank whose CHECK failed (CHECK does not throw) still
// reports failure to the harness.
class FailedAssertionCounter : public Catch::TestEventListenerBase {
 public:
  using TestEventListenerBase::TestEventListenerBase;
  bool assertionEnded(const Catch::AssertionStats& stats) override {
    if (!stats.assertionResult.isOk()) {
      ++failed_assertion_count;
    }
    return true;
  }
};

} // namespace

CATCH_REGISTER_LISTENER(FailedAssertionCounter)

int torchpar::testing::failed_assertions() {
  return failed_assertion_count;
}

// SPDX-License-Identifier: Apache-2.0
// Completion staging and overflow reporting.
#include "datapath/nic/completion_queue.h"

namespace metaroce::nic {

bool CompletionQueue::stage(const hostif::Cqe& c) {
  if (producer_.stage(c)) return true;
  if (!overflow_reported_) overflow_due_ = true;
  return false;
}

bool CompletionQueue::take_overflow_report() {
  if (!overflow_due_) return false;
  overflow_due_ = false;
  overflow_reported_ = true;
  return true;
}

}  // namespace metaroce::nic

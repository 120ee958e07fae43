// SPDX-License-Identifier: Apache-2.0
// Flow steering rules of raw packet QPs (verbs-mapping.md §18): the verbs object of a rule the
// engine holds.
#pragma once

#include <infiniband/verbs.h>

#include <cstdint>
#include <type_traits>

#include "datapath/hostif/control.h"

namespace metaroce::provider {

struct Flow {
  ibv_flow flow;  // first: the application holds &flow
  uint32_t id;    // the engine's
};
static_assert(std::is_standard_layout_v<Flow>);

ibv_flow* create_flow(ibv_qp* qp, ibv_flow_attr* attr) noexcept;
int destroy_flow(ibv_flow* flow) noexcept;

}  // namespace metaroce::provider

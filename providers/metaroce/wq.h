// SPDX-License-Identifier: Apache-2.0
// Receive work queues and their indirection tables (verbs-mapping.md §18): what an RSS raw
// packet QP spreads its frames over. A WQ is a receive queue of the engine (a QP of type kWq).
#pragma once

#include <infiniband/verbs.h>

#include <cstdint>
#include <type_traits>

#include "providers/metaroce/qp.h"

namespace metaroce::provider {

struct Wq {
  ibv_wq wq;  // first: the application holds &wq
  Qp* rq;     // its receive ring, and the engine's object
};
static_assert(std::is_standard_layout_v<Wq>);

inline Wq* to_wq(ibv_wq* w) { return reinterpret_cast<Wq*>(w); }

struct RwqIndTable {
  ibv_rwq_ind_table table;  // first: the application holds &table
  uint32_t id;              // the engine's
};
static_assert(std::is_standard_layout_v<RwqIndTable>);

ibv_wq* create_wq(ibv_context* context, ibv_wq_init_attr* attr) noexcept;
int modify_wq(ibv_wq* wq, ibv_wq_attr* attr) noexcept;
int destroy_wq(ibv_wq* wq) noexcept;
int post_wq_recv(ibv_wq* wq, ibv_recv_wr* wr, ibv_recv_wr** bad_wr) noexcept;
ibv_rwq_ind_table* create_rwq_ind_table(ibv_context* context,
                                        ibv_rwq_ind_table_init_attr* attr) noexcept;
int destroy_rwq_ind_table(ibv_rwq_ind_table* table) noexcept;

// ibv_modify_wq's state machine (the kernel's): 0 or EINVAL.
constexpr int check_wq_transition(ibv_wq_state cur, ibv_wq_state next) {
  if (cur > IBV_WQS_ERR || next > IBV_WQS_ERR) return EINVAL;
  if (next == IBV_WQS_RESET || next == IBV_WQS_ERR) return 0;
  return cur == IBV_WQS_ERR ? EINVAL : 0;  // RDY from RESET or RDY; from ERR only by RESET
}

}  // namespace metaroce::provider

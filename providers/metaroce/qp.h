// SPDX-License-Identifier: Apache-2.0
// RC and UD queue pairs: verbs checks (caps, state machine, work requests) in front of a NIC QP whose
// send and receive queues are rings that the NIC's progress thread drains.
#pragma once

#include <infiniband/verbs.h>
#include <pthread.h>

#include <cstdint>
#include <type_traits>

#include "datapath/nic/device.h"
#include "providers/metaroce/cq.h"
#include "providers/metaroce/pd.h"
#include "providers/metaroce/verbs_abi.h"

namespace metaroce::provider {

struct Qp {
  abi::VerbsQp vqp;  // first: the application holds &vqp.qp (or &vqp.qp_ex)
  nic::Qp* nic;
  Pd* pd;
  Cq* send_cq;
  Cq* recv_cq;
  struct Srq* srq;   // receives come from here when set
  ibv_qp_type type;  // IBV_QPT_RC or IBV_QPT_UD
  ibv_qp_cap cap;    // what was granted, written back to the creator and used by post_*
  bool sq_sig_all;
  pthread_mutex_t lock;  // serialises modify_qp and query_qp
  ibv_qp_attr attr;      // attributes as last set by modify_qp, for query_qp
  nic::QpRemote remote;

  // ibv_qp_ex builder: WRs between wr_start and wr_complete wait here, so that wr_abort can
  // drop them. Holds max_send_wr entries (no more could be queued anyway); never reallocated.
  uint64_t send_ops;
  nic::SendWqe* pending;
  uint32_t pending_cap;
  uint32_t pending_n;
  int wr_error;
  pthread_spinlock_t wr_lock;  // held from wr_start to wr_complete/wr_abort
};
static_assert(std::is_standard_layout_v<Qp>);

inline Qp* to_qp(ibv_qp* q) { return reinterpret_cast<Qp*>(q); }
inline Qp* to_qp(ibv_qp_ex* q) { return reinterpret_cast<Qp*>(q); }

ibv_qp* create_qp(ibv_pd* pd, ibv_qp_init_attr* attr) noexcept;
ibv_qp* create_qp_ex(ibv_context* context, ibv_qp_init_attr_ex* attr) noexcept;
int destroy_qp(ibv_qp* qp) noexcept;
int modify_qp(ibv_qp* qp, ibv_qp_attr* attr, int attr_mask) noexcept;
int query_qp(ibv_qp* qp, ibv_qp_attr* attr, int attr_mask, ibv_qp_init_attr* init_attr) noexcept;
int post_send(ibv_qp* qp, ibv_send_wr* wr, ibv_send_wr** bad_wr) noexcept;
int post_recv(ibv_qp* qp, ibv_recv_wr* wr, ibv_recv_wr** bad_wr) noexcept;

// Installs the ibv_qp_ex wr_* callbacks (qp_ex.cc).
void init_qp_ex(Qp* qp) noexcept;

}  // namespace metaroce::provider

// SPDX-License-Identifier: Apache-2.0
// RC, UC, UD, XRC and raw packet queue pairs: verbs checks (caps, state machine, work requests) in front of send and
// receive rings shared with the engine, which drains them without any call from the
// application.
#pragma once

#include <infiniband/verbs.h>
#include <pthread.h>

#include <cstdint>
#include <span>
#include <type_traits>

#include "datapath/hostif/control.h"
#include "datapath/hostif/queues.h"
#include "providers/metaroce/cq.h"
#include "providers/metaroce/pd.h"
#include "providers/metaroce/verbs_abi.h"

namespace metaroce::provider {

struct Qp {
  abi::VerbsQp vqp;  // first: the application holds &vqp.qp (or &vqp.qp_ex)
  Pd* mem_from;      // the parent domain whose allocator gave this memory; nullptr: the heap
  hostif::QpHeader* ring;
  size_t ring_bytes;
  uint32_t ring_sge;    // SGE entries per send slot (where inline bytes start)
  Pd* pd;
  Cq* send_cq;
  Cq* recv_cq;
  struct Srq* srq;      // receives come from here when set
  struct Xrcd* xrcd;    // an XRC target's domain (made or opened with it)
  ibv_qp_type type;     // IBV_QPT_RC, UC, UD, XRC_SEND (initiator), XRC_RECV (target), RAW_PACKET
  // A raw packet QP made with an indirection table (RSS): no queues; what its flows steer goes
  // to its table's WQs (verbs-mapping.md §18).
  bool rss;
  ibv_qp_cap cap;       // what was granted, written back to the creator and used by post_*
  bool sq_sig_all;
  pthread_mutex_t lock;  // serialises modify_qp and query_qp
  ibv_qp_attr attr;      // attributes as last set by modify_qp, for query_qp
  uint32_t ece_options;  // accepted by ibv_set_ece (under lock); none are offered yet
  hostif::QpRemote remote;
  // One poster per ring at a time (and none while a dead engine's queues are flushed).
  pthread_spinlock_t sq_lock, rq_lock;

  // ibv_qp_ex builder: WRs between wr_start and wr_complete are written into ring slots past the
  // head and published by wr_complete; wr_abort leaves them unpublished.
  uint64_t send_ops;
  uint32_t pending_n;
  int wr_error;

  // Direct verbs: the paths, planes and flags the engine was last given (qpn not used).
  hostif::SetQpPathsReq dv;
};
static_assert(std::is_standard_layout_v<Qp>);

inline Qp* to_qp(ibv_qp* q) { return reinterpret_cast<Qp*>(q); }
inline Qp* to_qp(ibv_qp_ex* q) { return reinterpret_cast<Qp*>(q); }

inline hostif::QpState qp_state(const Qp* qp) {
  return static_cast<hostif::QpState>(qp->ring->state.load());
}

ibv_qp* create_qp(ibv_pd* pd, ibv_qp_init_attr* attr) noexcept;
ibv_qp* create_qp_ex(ibv_context* context, ibv_qp_init_attr_ex* attr) noexcept;
// ibv_open_qp: another handle to an XRC target QP of a domain (verbs-mapping.md §17).
ibv_qp* open_qp(ibv_context* context, ibv_qp_open_attr* attr) noexcept;
int destroy_qp(ibv_qp* qp) noexcept;
// ibv_attach_mcast/ibv_detach_mcast (verbs-mapping.md §7): a UD QP and an IPv4-mapped multicast
// GID (::ffff:224.0.0.0/100); the LID is not looked at (Ethernet has none).
int attach_mcast(ibv_qp* qp, const ibv_gid* gid, uint16_t lid) noexcept;
int detach_mcast(ibv_qp* qp, const ibv_gid* gid, uint16_t lid) noexcept;
int modify_qp(ibv_qp* qp, ibv_qp_attr* attr, int attr_mask) noexcept;
int query_qp(ibv_qp* qp, ibv_qp_attr* attr, int attr_mask, ibv_qp_init_attr* init_attr) noexcept;
int bind_mw(ibv_qp* qp, ibv_mw* mw, ibv_mw_bind* bind) noexcept;
// A type 2 bind through the send queue (IBV_WR_BIND_MW, ibv_wr_bind_mw): its checks (0 or
// EINVAL), and the WQE (hostif::SendWqe documents the fields).
int check_bind(const Qp& qp, const ibv_mw* mw, uint32_t new_rkey,
               const ibv_mw_bind_info& b) noexcept;
void fill_bind(hostif::SendWqe* w, uint32_t rkey, uint32_t new_rkey,
               const ibv_mw_bind_info& b) noexcept;
// Enhanced connection establishment (ibv_query_ece(3), ibv_set_ece(3)).
int query_ece(ibv_qp* qp, ibv_ece* ece) noexcept;
int set_ece(ibv_qp* qp, ibv_ece* ece) noexcept;
int post_send(ibv_qp* qp, ibv_send_wr* wr, ibv_send_wr** bad_wr) noexcept;
// A small SEND or WRITE whose SGEs (already in the slot) lie in the context's own regions is
// copied into its WQE now, flagged kGathered (verbs-mapping.md §1, "Small messages"); anything
// else is left for the engine to gather. ibv_post_send and ibv_wr_set_sge(_list) alike.
void gather_at_post(const Qp& qp, uint8_t* slot, const ibv_sge* sg, int n) noexcept;
int post_recv(ibv_qp* qp, ibv_recv_wr* wr, ibv_recv_wr** bad_wr) noexcept;

// The receive queue behind an ibv_wq (wq.cc): a raw packet QP of the engine's type kWq, whose
// receives are posted with post_recv and complete into cq. nullptr with errno set.
Qp* create_wq_qp(ibv_context* context, ibv_pd* pd, ibv_cq* cq, uint32_t max_wr,
                 uint32_t max_sge, void* wq_handle) noexcept;
// Moves a QP to state (no attributes), as modify_qp does; 0 or the engine's errno.
int set_qp_state(Qp* qp, ibv_qp_state state) noexcept;

// Installs the ibv_qp_ex wr_* callbacks (qp_ex.cc).
void init_qp_ex(Qp* qp) noexcept;

// The send slot `i` WQEs past the ring's head (0: the next to post), or nullptr when the ring
// has no room for it. Callers hold sq_lock.
uint8_t* sq_slot_ahead(Qp* qp, uint32_t i) noexcept;
// Publishes n WQEs written at sq_slot_ahead(0..n-1) and rings the doorbell (with the engine
// gone: completes them as flushed).
void sq_publish(Qp* qp, uint32_t n) noexcept;
// Whether the send queue takes work: in RTS, and in ERR, where it completes flushed (as on
// hardware RDMA devices and rxe; an application that posts right after an error completion, or
// before it sees one, must get its flushed completion, not EINVAL).
inline bool sq_accepts(Qp* qp) noexcept {
  const hostif::QpState s = qp_state(qp);
  return s == hostif::QpState::kRts || s == hostif::QpState::kErr;
}

// With the engine gone: every WQE still in the rings completes as flushed, but for those a
// completion in `recovered` (recover_staged's) already retires.
void flush_orphan(Qp* qp, std::span<const hostif::Cqe> recovered) noexcept;

}  // namespace metaroce::provider

// SPDX-License-Identifier: Apache-2.0
// Shared receive queues and UD address handles: the verbs objects a QP refers to for where its
// receives come from (SRQ) and where its datagrams go (AH).
#pragma once

#include <infiniband/verbs.h>
#include <pthread.h>

#include <atomic>
#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

#include "datapath/hostif/queues.h"
#include "providers/metaroce/pd.h"

namespace metaroce::provider {

struct Cq;
struct Qp;
struct Xrcd;

struct Srq {
  ibv_srq srq;                  // first: the application holds &srq
  Pd* mem_from;                 // the parent domain whose allocator gave this memory, or null
  hostif::SrqHeader* ring;
  size_t ring_bytes;
  uint32_t id;                  // the engine's
  Pd* pd;
  uint32_t max_wr;
  uint32_t max_sge;
  std::atomic<uint32_t> users;  // QPs attached: destroy_srq answers EBUSY meanwhile
  pthread_spinlock_t post_lock; // one poster at a time
  ibv_srq_type type;            // IBV_SRQT_BASIC, IBV_SRQT_XRC or IBV_SRQT_TM
  Xrcd* xrcd;                   // XRC: its domain
  Cq* cq;                       // XRC, TM: the CQ its receives complete into
};
static_assert(std::is_standard_layout_v<Srq>);

inline Srq* to_srq(ibv_srq* s) { return reinterpret_cast<Srq*>(s); }

struct Ah {
  ibv_ah ah;    // first: the application holds &ah
  uint32_t ip;  // the peer's IPv4 (host order), from the IPv4-mapped dgid
};
static_assert(std::is_standard_layout_v<Ah>);

inline Ah* to_ah(ibv_ah* a) { return reinterpret_cast<Ah*>(a); }

ibv_srq* create_srq(ibv_pd* pd, ibv_srq_init_attr* attr) noexcept;
// ibv_create_srq_ex: a basic SRQ, or an XRC one (verbs-mapping.md §17); its number for XRC
// initiators from ibv_get_srq_num.
ibv_srq* create_srq_ex(ibv_context* context, ibv_srq_init_attr_ex* attr) noexcept;
int get_srq_num(ibv_srq* srq, uint32_t* srq_num) noexcept;
int modify_srq(ibv_srq* srq, ibv_srq_attr* attr, int attr_mask) noexcept;
int query_srq(ibv_srq* srq, ibv_srq_attr* attr) noexcept;
int destroy_srq(ibv_srq* srq) noexcept;
int post_srq_recv(ibv_srq* srq, ibv_recv_wr* wr, ibv_recv_wr** bad_wr) noexcept;
// ibv_post_srq_ops on a tag-matching SRQ (verbs-mapping.md §19): TAG_ADD, TAG_DEL, TAG_SYNC.
int post_srq_ops(ibv_srq* srq, ibv_ops_wr* wr, ibv_ops_wr** bad_wr) noexcept;

ibv_ah* create_ah(ibv_pd* pd, ibv_ah_attr* attr) noexcept;
int destroy_ah(ibv_ah* ah) noexcept;

// With the engine gone: every receive posted and not completed completes as flushed, in the
// receive CQ of a QP attached to it (qps: the context's QPs), but for those a completion in
// `recovered` (recover_staged's) already retires.
void flush_orphan(Srq* srq, const std::vector<Qp*>& qps,
                  std::span<const hostif::Cqe> recovered) noexcept;

}  // namespace metaroce::provider

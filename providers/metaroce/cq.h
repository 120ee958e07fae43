// SPDX-License-Identifier: Apache-2.0
// Completion queues: a verbs CQ in front of a completion ring the engine fills and poll_cq reads
// directly, in memory shared with the engine.
#pragma once

#include <infiniband/verbs.h>
#include <pthread.h>

#include <atomic>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "datapath/hostif/queues.h"
#include "providers/metaroce/verbs_abi.h"

namespace metaroce::provider {

struct Pd;

struct Cq {
  abi::VerbsCq vcq;               // first: the application holds &vcq.cq (or &vcq.cq_ex)
  Pd* mem_from;                   // the parent domain whose allocator gave this memory, or null
  Pd* parent;                     // the parent domain it was created with (holds a use), or null
  hostif::CqHeader* ring;
  size_t ring_bytes;
  // The ring before the last resize: kept mapped until the next resize or destroy, since a
  // poller may have read the old pointer just before the swap (has_completions takes no lock).
  void* retired_ring;
  size_t retired_bytes;
  uint32_t id;                    // the engine's
  std::atomic<uint32_t> users;    // QPs using it as send or receive CQ: destroy answers EBUSY
  int event_fd;                   // where completion events go (its channel's), -1 without one
  bool kernel_channel;            // kernel-backed with a channel: the kernel raises its events
  pthread_spinlock_t poll_lock;   // several threads may poll one CQ
  hostif::Cqe cur;                // ibv_cq_ex: the completion start_poll/next_poll made current
};
static_assert(std::is_standard_layout_v<Cq>);

inline Cq* to_cq(ibv_cq* c) { return reinterpret_cast<Cq*>(c); }
inline Cq* to_cq(ibv_cq_ex* c) { return reinterpret_cast<Cq*>(c); }

// Converts one completion into the verbs work completion the application reads.
void to_wc(const hostif::Cqe& cqe, ibv_wc* wc) noexcept;

// wc_flags of ibv_create_cq_ex this provider can fill in.
inline constexpr uint64_t kSupportedWcFlags =
    IBV_WC_EX_WITH_BYTE_LEN | IBV_WC_EX_WITH_IMM | IBV_WC_EX_WITH_QP_NUM |
    IBV_WC_EX_WITH_SRC_QP | IBV_WC_EX_WITH_SLID | IBV_WC_EX_WITH_SL |
    IBV_WC_EX_WITH_DLID_PATH_BITS | IBV_WC_EX_WITH_TM_INFO;

ibv_cq* create_cq(ibv_context* context, int cqe, ibv_comp_channel* channel,
                  int comp_vector) noexcept;
ibv_cq_ex* create_cq_ex(ibv_context* context, ibv_cq_init_attr_ex* attr) noexcept;
int destroy_cq(ibv_cq* cq) noexcept;
int resize_cq(ibv_cq* cq, int cqe) noexcept;
int poll_cq(ibv_cq* cq, int num_entries, ibv_wc* wc) noexcept;
int req_notify_cq(ibv_cq* cq, int solicited_only) noexcept;

// With the engine gone, the provider produces into the CQ itself (flushed work).
void push_orphan(Cq* cq, const hostif::Cqe& cqe) noexcept;
// Raises the completion event an armed CQ owes (after push_orphan).
void notify_orphan(Cq* cq) noexcept;
// Once the engine is gone, before anything is flushed: publishes what it staged and never
// published (hostif::cq_recover_staged) and appends those completions to *out.
void recover_staged(Cq* cq, std::vector<hostif::Cqe>* out) noexcept;

}  // namespace metaroce::provider

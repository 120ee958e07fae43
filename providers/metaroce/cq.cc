// SPDX-License-Identifier: Apache-2.0
// Completion queues (ibv_create_cq, ibv_poll_cq, ibv_req_notify_cq, ibv_destroy_cq).
#include "providers/metaroce/cq.h"

#include <cerrno>
#include <cstring>
#include <new>

#include "providers/metaroce/context.h"

namespace metaroce::provider {
namespace {

// poll_cq drains the ring through a small stack buffer: the hot path never allocates.
constexpr int kPollBatch = 16;

// Handles only tell CQs apart in logs and dumps; no kernel ever sees them.
std::atomic<uint32_t> next_cq_handle{1};

}  // namespace

void to_wc(const nic::Cqe& cqe, ibv_wc* wc) noexcept {
  std::memset(wc, 0, sizeof(*wc));
  wc->wr_id = cqe.wr_id;
  wc->status = cqe.status;
  wc->opcode = cqe.opcode;
  wc->vendor_err = cqe.vendor_err;
  wc->byte_len = cqe.byte_len;
  wc->imm_data = cqe.imm;
  wc->qp_num = cqe.qp_num;
  wc->src_qp = cqe.src_qp;
  wc->wc_flags = cqe.wc_flags;
  // pkey_index, slid, sl and dlid_path_bits stay 0: there is one pkey and no LIDs on Ethernet.
}

ibv_cq* create_cq(ibv_context* context, int cqe, ibv_comp_channel* /*channel*/,
                  int comp_vector) noexcept {
  if (cqe < 1 || static_cast<uint32_t>(cqe) > nic::kMaxCqe || comp_vector < 0 ||
      comp_vector >= context->num_comp_vectors) {
    errno = EINVAL;
    return nullptr;
  }
  auto* cq = new (std::nothrow) Cq{};
  if (!cq) {
    errno = ENOMEM;
    return nullptr;
  }
  int err = 0;
  cq->nic = nic_of(context).create_cq(static_cast<uint32_t>(cqe), &err);
  if (!cq->nic) {
    delete cq;
    errno = err ? err : ENOMEM;
    return nullptr;
  }
  // libibverbs (verbs_init_cq) fills context, channel, cq_context and the event fields.
  cq->vcq.cq.cqe = static_cast<int>(cq->nic->capacity());
  cq->vcq.cq.handle = next_cq_handle.fetch_add(1, std::memory_order_relaxed);
  return &cq->vcq.cq;
}

int destroy_cq(ibv_cq* ibcq) noexcept {
  Cq* cq = to_cq(ibcq);
  if (cq->users.load(std::memory_order_acquire) != 0) return EBUSY;
  int err = nic_of(ibcq->context).destroy_cq(cq->nic);
  if (err) return err;
  delete cq;
  return 0;
}

int poll_cq(ibv_cq* ibcq, int num_entries, ibv_wc* wc) noexcept {
  if (num_entries < 0) return -EINVAL;
  Cq* cq = to_cq(ibcq);
  nic::Cqe batch[kPollBatch];
  int done = 0;
  while (done < num_entries) {
    int want = num_entries - done < kPollBatch ? num_entries - done : kPollBatch;
    int got = cq->nic->poll(want, batch);
    if (got < 0) return done ? done : got;
    for (int i = 0; i < got; ++i) to_wc(batch[i], &wc[done + i]);
    done += got;
    if (got < want) break;
  }
  // A lost completion cannot be reported in a work completion: verbs says IBV_EVENT_CQ_ERR.
  if (cq->nic->overflowed() && !cq->overflow_reported.exchange(true, std::memory_order_relaxed))
    post_async_event(ibcq->context, reinterpret_cast<uintptr_t>(ibcq), IBV_EVENT_CQ_ERR);
  return done;
}

int req_notify_cq(ibv_cq* /*cq*/, int /*solicited_only*/) noexcept {
  // Completion channels cannot be created without a kernel yet (ibv_create_comp_channel fails
  // cleanly), so there is nobody to notify; arming succeeds so polling programs run unchanged.
  return 0;
}

}  // namespace metaroce::provider

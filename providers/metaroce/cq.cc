// SPDX-License-Identifier: Apache-2.0
// Completion queues (ibv_create_cq, ibv_create_cq_ex and its start/next/end_poll interface,
// ibv_poll_cq, ibv_req_notify_cq, ibv_destroy_cq).
#include "providers/metaroce/cq.h"

#include <infiniband/metaroce_dv.h>

#include <sched.h>
#include <sys/mman.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>
#include <mutex>
#include <new>

#include "providers/metaroce/comp_channel.h"
#include "providers/metaroce/context.h"
#include "providers/metaroce/pd.h"
#include "providers/metaroce/kernel.h"

namespace metaroce::provider {
namespace {

// poll_cq drains the ring through a small stack buffer: the hot path never allocates.
constexpr int kPollBatch = 16;
// A thread that keeps finding its CQ empty yields the CPU every so often (docs/design.md, "The
// engine"): on a host with fewer cores than spinning threads, the process it yields to may be
// the one whose answer it waits for (perftest's latency tests spin on both ends of one core).
// With nothing else runnable, sched_yield returns at once.
constexpr uint32_t kEmptyPollsBeforeYield = 64;
thread_local uint32_t t_empty_polls = 0;

// A UD receive's sl, as a RoCEv2 NIC reports it: the L3 type of the datagram whose header fills
// the receive's first 40 bytes (mlx5: 2 for IPv4, 1 for IPv6, 0 for a RoCE v1 GRH). UCX's UD
// transport reads it to find the destination address in the GRH and drops every datagram whose
// address is not its own, so with 0 it heard nothing (verbs-mapping.md §7). MetaRoCE's
// datagrams are IPv4 (wire.md §1).
constexpr uint8_t kSlRoceV2Ipv4 = 2;
uint8_t sl_of(const hostif::Cqe& c) { return (c.wc_flags & IBV_WC_GRH) ? kSlRoceV2Ipv4 : 0; }

void note_empty_poll() {
  if (++t_empty_polls % kEmptyPollsBeforeYield == 0) sched_yield();
}

struct SpinGuard {
  explicit SpinGuard(pthread_spinlock_t* l) : l_(l) { pthread_spin_lock(l_); }
  ~SpinGuard() { pthread_spin_unlock(l_); }
  pthread_spinlock_t* l_;
};

// The CQ's completion event: one struct ib_uverbs_comp_event_desc naming the CQ, as the
// kernel would queue it on the channel for ibv_get_cq_event.
void notify(Cq* cq) {
  if (cq->kernel_channel) {
    kernel::raise_cq_event(&cq->vcq.cq);  // the module queues it on the kernel's channel
    return;
  }
  const uint64_t handle = reinterpret_cast<uintptr_t>(&cq->vcq.cq);
  // A full socket means the application ignores its events; dropping one cannot lose a
  // wake-up, since an unread event is already waiting.
  [[maybe_unused]] ssize_t n =
      send(cq->event_fd, &handle, sizeof(handle), MSG_DONTWAIT | MSG_NOSIGNAL);
}

bool has_completions(const Cq* cq) { return cq->ring->head.load() != cq->ring->tail.peek(); }

// Shared by create_cq and create_cq_ex: the engine's ring and the channel hookup.
// pd: the parent domain the provider's memory for it comes from (ibv_create_cq_ex), or null.
Cq* new_cq(ibv_context* context, uint32_t cqe, ibv_comp_channel* channel, uint32_t comp_vector,
           ibv_pd* pd = nullptr) {
  if (cqe < 1 || cqe > hostif::kMaxCqe ||
      comp_vector >= static_cast<uint32_t>(context->num_comp_vectors)) {
    errno = EINVAL;
    return nullptr;
  }
  const bool kernel = state_of(context).kernel;
  int event_fd = -1;
  if (channel) {
    // A kernel-backed device's channels are the kernel's own (ibv_create_comp_channel).
    if (!kernel) event_fd = comp_channel_event_fd(channel);
    if ((!kernel && event_fd < 0) || channel->context != context) {
      errno = EINVAL;  // a channel of another device
      return nullptr;
    }
  }
  Pd* from = nullptr;
  auto* cq = alloc_resource<Cq>(pd, MRDV_RES_TYPE_CQ, &from);
  if (!cq) {
    errno = ENOMEM;
    return nullptr;
  }
  hostif::CreateCqReq req;
  req.cqe = cqe;
  req.has_channel = event_fd >= 0 || (kernel && channel);
  req.handle = reinterpret_cast<uintptr_t>(&cq->vcq.cq);
  if (kernel) {
    uint32_t id = 0;
    if (int e = kernel::create_cq(context, static_cast<int>(cqe), channel,
                                  static_cast<int>(comp_vector), &cq->vcq.cq, &id)) {
      free_resource(cq, from, MRDV_RES_TYPE_CQ);
      errno = e;
      return nullptr;
    }
    req.handle = id;  // the engine raises the CQ's events on the kernel's CQ of that id
  }
  hostif::CreateCqResp body;
  void* seg = nullptr;
  const int err =
      event_fd >= 0
          ? create_mapped(context, hostif::Op::kCreateCq, req, {event_fd}, hostif::Op::kDestroyCq,
                          &hostif::CreateCqResp::id, hostif::valid_cq, &body, &seg)
          : create_mapped(context, hostif::Op::kCreateCq, req, {}, hostif::Op::kDestroyCq,
                          &hostif::CreateCqResp::id, hostif::valid_cq, &body, &seg);
  if (err) {
    if (kernel) kernel::destroy_cq(&cq->vcq.cq);
    free_resource(cq, from, MRDV_RES_TYPE_CQ);
    errno = err;
    return nullptr;
  }
  cq->mem_from = from;
  if (pd) {
    cq->parent = to_pd(pd);
    cq->parent->users.fetch_add(1, std::memory_order_relaxed);
  }
  cq->ring = static_cast<hostif::CqHeader*>(seg);
  cq->ring_bytes = body.bytes;
  cq->id = body.id;
  cq->event_fd = event_fd;
  cq->kernel_channel = kernel && channel;
  pthread_spin_init(&cq->poll_lock, PTHREAD_PROCESS_PRIVATE);
  cq->vcq.cq.cqe = static_cast<int>(cq->ring->capacity);
  if (!kernel) cq->vcq.cq.handle = cq->id;
  track(context, cq);
  return cq;
}

// --- ibv_cq_ex -------------------------------------------------------------------------------

void make_current(Cq* cq) {
  ibv_cq_ex& x = cq->vcq.cq_ex;
  x.wr_id = cq->cur.wr_id;
  x.status = static_cast<ibv_wc_status>(cq->cur.status);
}

int start_poll(ibv_cq_ex* x, ibv_poll_cq_attr* attr) {
  if (attr->comp_mask) return EINVAL;
  Cq* cq = to_cq(x);
  if (!has_completions(cq)) {
    note_empty_poll();
    return ENOENT;
  }
  SpinGuard g(&cq->poll_lock);
  if (hostif::cq_poll(cq->ring, 1, &cq->cur) != 1) return ENOENT;
  make_current(cq);
  return 0;
}
int next_poll(ibv_cq_ex* x) {
  Cq* cq = to_cq(x);
  SpinGuard g(&cq->poll_lock);
  if (hostif::cq_poll(cq->ring, 1, &cq->cur) != 1) return ENOENT;
  make_current(cq);
  return 0;
}
void end_poll(ibv_cq_ex*) {}  // nothing is held between start_poll and end_poll
ibv_wc_opcode read_opcode(ibv_cq_ex* x) { return static_cast<ibv_wc_opcode>(to_cq(x)->cur.opcode); }
uint32_t read_vendor_err(ibv_cq_ex* x) { return to_cq(x)->cur.vendor_err; }
uint32_t read_byte_len(ibv_cq_ex* x) { return to_cq(x)->cur.byte_len; }
__be32 read_imm_data(ibv_cq_ex* x) { return to_cq(x)->cur.imm; }
uint32_t read_qp_num(ibv_cq_ex* x) { return to_cq(x)->cur.qp_num; }
uint32_t read_src_qp(ibv_cq_ex* x) { return to_cq(x)->cur.src_qp; }
unsigned int read_wc_flags(ibv_cq_ex* x) { return to_cq(x)->cur.wc_flags; }
uint32_t read_slid(ibv_cq_ex*) { return 0; }  // no LIDs on Ethernet
uint8_t read_sl(ibv_cq_ex* x) { return sl_of(to_cq(x)->cur); }
uint8_t read_dlid_path_bits(ibv_cq_ex*) { return 0; }
// Tag matching (verbs-mapping.md §19): the tag and the TMH's context, set with IBV_WC_TM_MATCH.
void read_tm_info(ibv_cq_ex* x, ibv_wc_tm_info* info) {
  const hostif::Cqe& c = to_cq(x)->cur;
  const bool match = c.wc_flags & IBV_WC_TM_MATCH;
  info->tag = match ? c.tag : 0;
  info->priv = match ? c.imm : 0;
}

}  // namespace

void to_wc(const hostif::Cqe& cqe, ibv_wc* wc) noexcept {
  std::memset(wc, 0, sizeof(*wc));
  wc->wr_id = cqe.wr_id;
  wc->status = static_cast<ibv_wc_status>(cqe.status);
  wc->opcode = static_cast<ibv_wc_opcode>(cqe.opcode);
  wc->vendor_err = cqe.vendor_err;
  wc->byte_len = cqe.byte_len;
  wc->imm_data = cqe.imm;
  wc->qp_num = cqe.qp_num;
  wc->src_qp = cqe.src_qp;
  wc->wc_flags = cqe.wc_flags;
  wc->sl = sl_of(cqe);
  // pkey_index, slid and dlid_path_bits stay 0: there is one pkey and no LIDs on Ethernet.
}

ibv_cq* create_cq(ibv_context* context, int cqe, ibv_comp_channel* channel,
                  int comp_vector) noexcept {
  if (cqe < 1 || comp_vector < 0) {
    errno = EINVAL;
    return nullptr;
  }
  // libibverbs (verbs_init_cq) fills context, channel, cq_context and the event fields.
  Cq* cq = new_cq(context, static_cast<uint32_t>(cqe), channel, static_cast<uint32_t>(comp_vector));
  return cq ? &cq->vcq.cq : nullptr;
}

ibv_cq_ex* create_cq_ex(ibv_context* context, ibv_cq_init_attr_ex* attr) noexcept {
  if (attr->comp_mask &
      ~static_cast<uint32_t>(IBV_CQ_INIT_ATTR_MASK_FLAGS | IBV_CQ_INIT_ATTR_MASK_PD)) {
    errno = EOPNOTSUPP;
    return nullptr;
  }
  ibv_pd* parent = (attr->comp_mask & IBV_CQ_INIT_ATTR_MASK_PD) ? attr->parent_domain : nullptr;
  if ((attr->comp_mask & IBV_CQ_INIT_ATTR_MASK_PD) &&
      (!parent || parent->context != context || !to_pd(parent)->parent_of)) {
    errno = EINVAL;  // only a parent domain of this device
    return nullptr;
  }
  const bool flags = attr->comp_mask & IBV_CQ_INIT_ATTR_MASK_FLAGS;
  if (flags && (attr->flags & ~static_cast<uint32_t>(IBV_CREATE_CQ_ATTR_SINGLE_THREADED))) {
    errno = EOPNOTSUPP;  // IGNORE_OVERRUN: a lost completion here is always reported
    return nullptr;
  }
  if (attr->cqe < 1) {
    errno = EINVAL;
    return nullptr;
  }
  if (attr->wc_flags & ~kSupportedWcFlags) {
    errno = EOPNOTSUPP;  // completion timestamps, CVLAN, flow tags
    return nullptr;
  }
  Cq* cq = new_cq(context, attr->cqe, attr->channel, attr->comp_vector, parent);
  if (!cq) return nullptr;
  ibv_cq_ex& x = cq->vcq.cq_ex;
  x.start_poll = start_poll;
  x.next_poll = next_poll;
  x.end_poll = end_poll;
  x.read_opcode = read_opcode;
  x.read_vendor_err = read_vendor_err;
  x.read_wc_flags = read_wc_flags;
  if (attr->wc_flags & IBV_WC_EX_WITH_BYTE_LEN) x.read_byte_len = read_byte_len;
  if (attr->wc_flags & IBV_WC_EX_WITH_IMM) x.read_imm_data = read_imm_data;
  if (attr->wc_flags & IBV_WC_EX_WITH_QP_NUM) x.read_qp_num = read_qp_num;
  if (attr->wc_flags & IBV_WC_EX_WITH_SRC_QP) x.read_src_qp = read_src_qp;
  if (attr->wc_flags & IBV_WC_EX_WITH_SLID) x.read_slid = read_slid;
  if (attr->wc_flags & IBV_WC_EX_WITH_SL) x.read_sl = read_sl;
  if (attr->wc_flags & IBV_WC_EX_WITH_DLID_PATH_BITS) x.read_dlid_path_bits = read_dlid_path_bits;
  if (attr->wc_flags & IBV_WC_EX_WITH_TM_INFO) x.read_tm_info = read_tm_info;
  // libibverbs (__lib_ibv_create_cq_ex, then verbs_init_cq) fills context, channel and
  // cq_context and counts the channel's user, as for create_cq: counting it here too left every
  // channel busy for ever (UCX warned at each close that ibv_destroy_comp_channel failed).
  return &x;
}

int destroy_cq(ibv_cq* ibcq) noexcept {
  Cq* cq = to_cq(ibcq);
  if (cq->users.load(std::memory_order_acquire) != 0) return EBUSY;
  hostif::Message resp;
  const int err = engine_call(ibcq->context, hostif::Op::kDestroyCq, hostif::IdReq{cq->id}, &resp);
  if (err && !engine_gone(err)) return err;
  if (state_of(ibcq->context).kernel)
    if (int e = kernel::destroy_cq(ibcq)) return e;
  untrack(ibcq->context, cq);
  munmap(cq->ring, cq->ring_bytes);
  if (cq->retired_ring) munmap(cq->retired_ring, cq->retired_bytes);
  pthread_spin_destroy(&cq->poll_lock);
  if (cq->parent) cq->parent->users.fetch_sub(1, std::memory_order_release);
  free_resource(cq, cq->mem_from, MRDV_RES_TYPE_CQ);
  return 0;
}

// The engine moves what the CQ holds into a new ring of the new size and answers with it; no
// poll runs meanwhile. EINVAL: a size out of range, or smaller than what the CQ holds.
int resize_cq(ibv_cq* ibcq, int cqe) noexcept {
  if (cqe < 1 || static_cast<uint32_t>(cqe) > hostif::kMaxCqe) return EINVAL;
  Cq* cq = to_cq(ibcq);
  SpinGuard g(&cq->poll_lock);
  hostif::ResizeCqReq req;
  req.id = cq->id;
  req.cqe = static_cast<uint32_t>(cqe);
  hostif::Message resp;
  int err = engine_call(ibcq->context, hostif::Op::kResizeCq, req, &resp);
  auto body = resp.as<hostif::CreateCqResp>();
  if (!err && (!body || resp.fds.size() != 1)) err = EPROTO;
  void* seg = nullptr;
  if (!err) {
    seg = map_segment(resp.fds[0], body->bytes);
    resp.fds.clear();
    if (!seg || !hostif::valid_cq(seg, body->bytes)) err = EPROTO;
  }
  hostif::close_fds(&resp);
  if (err) {
    if (seg) munmap(seg, body->bytes);
    return err;
  }
  if (cq->retired_ring) munmap(cq->retired_ring, cq->retired_bytes);
  cq->retired_ring = cq->ring;
  cq->retired_bytes = cq->ring_bytes;
  cq->ring = static_cast<hostif::CqHeader*>(seg);
  cq->ring_bytes = body->bytes;
  ibcq->cqe = static_cast<int>(cq->ring->capacity);
  return 0;
}

int poll_cq(ibv_cq* ibcq, int num_entries, ibv_wc* wc) noexcept {
  if (num_entries < 0) return -EINVAL;
  Cq* cq = to_cq(ibcq);
  // Pollers spin here: an empty queue costs one shared read and no lock.
  if (!has_completions(cq)) {
    note_empty_poll();
    return 0;
  }
  t_empty_polls = 0;
  hostif::Cqe batch[kPollBatch];
  int done = 0;
  SpinGuard g(&cq->poll_lock);
  while (done < num_entries) {
    const int want = num_entries - done < kPollBatch ? num_entries - done : kPollBatch;
    const int got = hostif::cq_poll(cq->ring, want, batch);
    for (int i = 0; i < got; ++i) to_wc(batch[i], &wc[done + i]);
    done += got;
    if (got < want) break;
  }
  return done;
}

int req_notify_cq(ibv_cq* ibcq, int solicited_only) noexcept {
  Cq* cq = to_cq(ibcq);
  // Without a channel there is nobody to tell; arming still succeeds, as on hardware.
  if (cq->event_fd < 0 && !cq->kernel_channel) return 0;
  cq->ring->armed.store(solicited_only ? 2 : 1);
  // Pairs with the engine's fence after publishing: either it sees the CQ armed, or we see its
  // completions here and raise the event ourselves (whoever disarms it raises it).
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (has_completions(cq) && cq->ring->armed.v.exchange(0) != 0) notify(cq);
  return 0;
}

void push_orphan(Cq* cq, const hostif::Cqe& cqe) noexcept {
  SpinGuard g(&cq->poll_lock);
  hostif::cq_push_orphan(cq->ring, cqe);
}

void recover_staged(Cq* cq, std::vector<hostif::Cqe>* out) noexcept {
  SpinGuard g(&cq->poll_lock);
  const uint32_t n = hostif::cq_recover_staged(cq->ring);
  const uint32_t head = cq->ring->head.peek();
  const hostif::Cqe* ring = hostif::cq_ring(cq->ring);
  try {
    for (uint32_t p = head - n; p != head; ++p) out->push_back(ring[p & (cq->ring->entries - 1)]);
  } catch (...) {
    // Without the list, work they retire may complete twice (once more as flushed): better
    // than a completion lost.
  }
}

void notify_orphan(Cq* cq) noexcept {
  if (cq->event_fd < 0 && !cq->kernel_channel) return;
  if (has_completions(cq) && cq->ring->armed.v.exchange(0) != 0) notify(cq);
}

}  // namespace metaroce::provider

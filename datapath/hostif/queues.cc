// SPDX-License-Identifier: Apache-2.0
// Formatting and checking shared queue segments, and the two sides' ring operations.
#include "datapath/hostif/queues.h"

#include <cerrno>
#include <new>

namespace metaroce::hostif {

void init_cq(void* seg, uint32_t cqe) {
  const CqLayout l = cq_layout(cqe);
  auto* h = new (seg) CqHeader{};
  h->magic = kCqMagic;
  h->version = kAbiVersion;
  h->entries = l.entries;
  h->capacity = l.entries - 1;
  h->ring_offset = l.ring_offset;
}

void init_qp(void* seg, uint32_t qpn, QpType type, const QpCaps& caps) {
  const QpLayout l = qp_layout(caps);
  auto* h = new (seg) QpHeader{};
  h->magic = kQpMagic;
  h->version = kAbiVersion;
  h->qpn = qpn;
  h->type = type;
  h->sq_entries = l.sq_entries;
  h->sq_stride = l.sq_stride;
  h->sq_offset = l.sq_offset;
  h->max_send_wr = caps.max_send_wr;
  h->rq_entries = l.rq_entries;
  h->rq_stride = l.rq_stride;
  h->rq_offset = l.rq_offset;
  h->max_recv_wr = caps.max_recv_wr;
  h->max_send_sge = caps.max_send_sge;
  h->max_recv_sge = caps.max_recv_sge;
  h->max_inline = caps.max_inline;
  h->state.store(static_cast<uint32_t>(QpState::kReset));
}

void init_srq(void* seg, uint32_t max_wr, uint32_t max_sge) {
  const SrqLayout l = srq_layout(max_wr, max_sge);
  auto* h = new (seg) SrqHeader{};
  h->magic = kSrqMagic;
  h->version = kAbiVersion;
  h->max_wr = max_wr;
  h->entries = l.entries;
  h->stride = l.stride;
  h->max_sge = max_sge;
  h->slots_offset = l.slots_offset;
  h->posted_offset = l.posted_offset;
  h->free_offset = l.free_offset;
  uint32_t* free_ring = srq_free_ring(h);
  for (uint32_t i = 0; i < max_wr; ++i) free_ring[i] = i;
  h->free_head.store(max_wr);
}

void init_status(void* seg, uint32_t engine_pid) {
  auto* s = new (seg) StatusPage{};
  s->magic = kStatusMagic;
  s->version = kAbiVersion;
  s->engine_pid = engine_pid;
}

namespace {

constexpr bool is_pow2(uint32_t x) { return x != 0 && (x & (x - 1)) == 0; }

bool fits(uint64_t offset, uint64_t count, uint64_t size, size_t bytes) {
  return offset <= bytes && count * size <= bytes - offset;
}

// Two arrays of a segment (offset, count * size each) that share no byte.
bool apart(uint64_t a, uint64_t a_len, uint64_t b, uint64_t b_len) {
  return a + a_len <= b || b + b_len <= a;
}

}  // namespace

bool valid_cq(const void* seg, size_t bytes) {
  if (bytes < sizeof(CqHeader)) return false;
  const auto* h = static_cast<const CqHeader*>(seg);
  return h->magic == kCqMagic && h->version == kAbiVersion && is_pow2(h->entries) &&
         h->capacity == h->entries - 1 && h->ring_offset >= sizeof(CqHeader) &&
         fits(h->ring_offset, h->entries, sizeof(Cqe), bytes);
}

bool valid_qp(const void* seg, size_t bytes) {
  if (bytes < sizeof(QpHeader)) return false;
  const auto* h = static_cast<const QpHeader*>(seg);
  return h->magic == kQpMagic && h->version == kAbiVersion && is_pow2(h->sq_entries) &&
         is_pow2(h->rq_entries) && h->max_send_wr <= h->sq_entries &&
         h->max_recv_wr <= h->rq_entries && h->max_send_sge <= kMaxSge &&
         h->max_recv_sge <= kMaxSge && h->max_inline <= kMaxInline &&
         h->sq_stride >= send_stride(h->max_send_sge, h->max_inline) &&
         h->rq_stride >= recv_stride(h->max_recv_sge) && h->sq_offset >= sizeof(QpHeader) &&
         h->rq_offset >= sizeof(QpHeader) &&
         fits(h->sq_offset, h->sq_entries, h->sq_stride, bytes) &&
         fits(h->rq_offset, h->rq_entries, h->rq_stride, bytes) &&
         apart(h->sq_offset, uint64_t{h->sq_entries} * h->sq_stride, h->rq_offset,
               uint64_t{h->rq_entries} * h->rq_stride);
}

bool valid_srq(const void* seg, size_t bytes) {
  if (bytes < sizeof(SrqHeader)) return false;
  const auto* h = static_cast<const SrqHeader*>(seg);
  return h->magic == kSrqMagic && h->version == kAbiVersion && is_pow2(h->entries) &&
         h->max_wr >= 1 && h->max_wr <= h->entries && h->max_sge <= kMaxSge &&
         h->stride >= recv_stride(h->max_sge) && h->slots_offset >= sizeof(SrqHeader) &&
         h->posted_offset >= sizeof(SrqHeader) && h->free_offset >= sizeof(SrqHeader) &&
         fits(h->slots_offset, h->max_wr, h->stride, bytes) &&
         fits(h->posted_offset, h->entries, 4, bytes) && fits(h->free_offset, h->entries, 4, bytes) &&
         apart(h->slots_offset, uint64_t{h->max_wr} * h->stride, h->posted_offset, h->entries * 4ull) &&
         apart(h->slots_offset, uint64_t{h->max_wr} * h->stride, h->free_offset, h->entries * 4ull) &&
         apart(h->posted_offset, h->entries * 4ull, h->free_offset, h->entries * 4ull);
}

// --- driver ----------------------------------------------------------------------------------

uint8_t* sq_reserve(QpHeader* h) {
  const uint32_t head = h->sq_head.peek();
  if (head - h->sq_done.load() >= h->max_send_wr) return nullptr;
  return sq_slot(h, head);
}

void sq_post(QpHeader* h) { h->sq_head.store(h->sq_head.peek() + 1); }

uint8_t* rq_reserve(QpHeader* h) {
  const uint32_t head = h->rq_head.peek();
  if (head - h->rq_done.load() >= h->max_recv_wr) return nullptr;
  return rq_slot(h, head);
}

void rq_post(QpHeader* h) { h->rq_head.store(h->rq_head.peek() + 1); }

int srq_post(SrqHeader* h, uint64_t wr_id, const Sge* sge, uint32_t num_sge) {
  const uint32_t tail = h->free_tail.peek();
  if (tail == h->free_head.load()) return ENOMEM;
  const uint32_t slot = srq_free_ring(h)[tail & (h->entries - 1)];
  if (slot >= h->max_wr) return EIO;  // the engine handed back a slot that does not exist
  h->free_tail.store(tail + 1);
  uint8_t* s = srq_slot(h, slot);
  RecvWqe* w = recv_wqe(s);
  w->wr_id = wr_id;
  w->num_sge = num_sge;
  std::memcpy(recv_sges(s), sge, sizeof(Sge) * num_sge);
  const uint32_t head = h->posted_head.peek();
  srq_posted_ring(h)[head & (h->entries - 1)] = slot;
  h->posted_head.store(head + 1);
  return 0;
}

int cq_poll(CqHeader* h, int n, Cqe* out) {
  const uint32_t tail = h->tail.peek();
  const uint32_t head = h->head.load();
  const Cqe* ring = cq_ring(h);
  int got = 0;
  for (uint32_t t = tail; got < n && t != head; ++t) out[got++] = ring[t & (h->entries - 1)];
  if (got) h->tail.store(tail + static_cast<uint32_t>(got));
  return got;
}

int cq_clean(CqHeader* h, uint32_t qpn) {
  // [tail, head) is the driver's to read and the engine never rewrites it: the kept entries
  // slide towards head, and tail moves past what was removed.
  const uint32_t tail = h->tail.peek();
  const uint32_t head = h->head.load();
  Cqe* ring = cq_ring(h);
  const uint32_t mask = h->entries - 1;
  uint32_t w = head;
  for (uint32_t r = head; r != tail;) {
    --r;
    if (ring[r & mask].qp_num == qpn) continue;
    --w;
    if (w != r) ring[w & mask] = ring[r & mask];
  }
  h->tail.store(w);
  return static_cast<int>(w - tail);
}

bool cq_push_orphan(CqHeader* h, const Cqe& c) {
  const uint32_t head = h->head.peek();
  if (head - h->tail.load() >= h->capacity) {
    h->overflow.store(1);
    return false;
  }
  Cqe& e = cq_ring(h)[head & (h->entries - 1)];
  e = c;
  e.seq = head + 1;
  h->head.store(head + 1);
  return true;
}

uint32_t cq_recover_staged(CqHeader* h) {
  const uint32_t head = h->head.load();
  const uint32_t tail = h->tail.peek();
  Cqe* ring = cq_ring(h);
  uint32_t p = head;
  // Staged entries lie in [head, tail + capacity); one left from an earlier lap names another
  // position (and a ring never written names none).
  for (; p - tail < h->capacity; ++p) {
    Cqe& c = ring[p & (h->entries - 1)];
    if (c.seq != p + 1) break;
    if (c.status != WcStatus::kSuccess) continue;  // an error announces no data: kept as it is
    c.status = WcStatus::kWrFlushErr;
    c.byte_len = 0;
    c.imm = 0;
    c.wc_flags = 0;
    c.tag = 0;
  }
  if (p != head) h->head.store(p);
  return p - head;
}

uint32_t first_unreported(uint32_t done, uint32_t head, uint32_t qpn, CqeQueue queue,
                          std::span<const Cqe> recovered) {
  uint32_t from = done;
  for (const Cqe& c : recovered) {
    if (c.qp_num != qpn || c.queue != queue) continue;
    // Within [from, head): a completion the engine staged before it moved done past the entry.
    if (c.wqe - from < head - from) from = c.wqe + 1;
  }
  return from;
}

// --- engine ----------------------------------------------------------------------------------

bool CqProducer::stage(const Cqe& c) {
  if (staged_head_ - h_->tail.load() >= capacity_) {
    h_->overflow.store(1);
    return false;
  }
  Cqe& e = ring_[staged_head_ & mask_];
  std::memcpy(&e, &c, offsetof(Cqe, seq));
  // The position last, so that a driver finding it after the engine died mid-pass finds the
  // whole completion (cq_recover_staged); a kill stops the engine between two instructions.
  std::atomic_ref<uint32_t>(e.seq).store(staged_head_ + 1, std::memory_order_release);
  ++staged_head_;
  return true;
}

bool CqProducer::move_to(CqHeader* to, uint32_t owed) {
  const uint32_t tail = h_->tail.load();
  const uint32_t n = staged_head_ - tail;
  if (uint64_t{n} + owed > to->capacity) return false;
  Cqe* dst = cq_ring(to);
  const uint32_t dst_mask = to->entries - 1;
  for (uint32_t i = 0; i < n; ++i) {
    dst[i & dst_mask] = ring_[(tail + i) & mask_];
    dst[i & dst_mask].seq = i + 1;  // where it now lies
  }
  to->tail.store(0);
  to->head.store(published_ - tail);
  to->armed.store(h_->armed.peek());
  to->overflow.store(h_->overflow.peek());
  h_ = to;
  ring_ = dst;
  mask_ = dst_mask;
  capacity_ = to->capacity;
  published_ -= tail;
  staged_head_ = n;
  return true;
}

bool CqProducer::publish() {
  if (staged_head_ == published_) return false;
  published_ = staged_head_;
  h_->head.store(staged_head_);
  // Pairs with the driver's fence after arming: either it sees these completions, or we see it
  // armed (a lost event would hang an event-driven program; a spurious one is harmless).
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (h_->armed.peek() == 0) return false;
  return h_->armed.v.exchange(0, std::memory_order_acq_rel) != 0;
}


}  // namespace metaroce::hostif

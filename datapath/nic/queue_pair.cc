// SPDX-License-Identifier: Apache-2.0
// Requester and responder logic of a queue pair (spec §5): WQEs become transport messages,
// arriving segments are placed at their final address, completions leave in order.
#include "datapath/nic/queue_pair.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cstring>
#include <new>

#include "datapath/nic/soft_device.h"

namespace metaroce::nic {

using transport::Op;
using transport::Syndrome;

namespace {

ibv_wc_opcode send_opcode(WqeOp op) {
  switch (op) {
    case WqeOp::kWrite:
    case WqeOp::kWriteImm:
      return IBV_WC_RDMA_WRITE;
    case WqeOp::kRead:
      return IBV_WC_RDMA_READ;
    case WqeOp::kCmpSwp:
      return IBV_WC_COMP_SWAP;
    case WqeOp::kFetchAdd:
      return IBV_WC_FETCH_ADD;
    case WqeOp::kSend:
    case WqeOp::kSendImm:
      break;
  }
  return IBV_WC_SEND;
}

Op transport_op(WqeOp op) {
  switch (op) {
    case WqeOp::kSend: return Op::kSend;
    case WqeOp::kSendImm: return Op::kSendImm;
    case WqeOp::kWrite: return Op::kWrite;
    case WqeOp::kWriteImm: return Op::kWriteImm;
    case WqeOp::kRead: return Op::kReadReq;
    case WqeOp::kCmpSwp:
    case WqeOp::kFetchAdd: return Op::kWrite;  // with an atomic rsn tag (queue_pair.h)
  }
  return Op::kSend;
}

ibv_wc_status remote_status(Syndrome why) {
  switch (why) {
    case Syndrome::kRemoteAccess:
    case Syndrome::kRemoteBounds:
      return IBV_WC_REM_ACCESS_ERR;
    case Syndrome::kRemoteInvalid:
      return IBV_WC_REM_INV_REQ_ERR;
    case Syndrome::kRemoteOp:
      return IBV_WC_REM_OP_ERR;
    case Syndrome::kRnr:
      return IBV_WC_RNR_RETRY_EXC_ERR;
    case Syndrome::kRetryExceeded:
    case Syndrome::kUnreachable:
      return IBV_WC_RETRY_EXC_ERR;
    case Syndrome::kOk:
      break;
  }
  return IBV_WC_GENERAL_ERR;
}

// The 40 bytes a UD receive holds in front of the payload. Like a RoCEv2 NIC receiving over
// IPv4: 20 bytes of zeros, then the IPv4 header of the datagram (ibv_init_ah_from_wc reads the
// source address there).
std::array<uint8_t, kGrhLen> make_grh(uint32_t src_ip, uint32_t dst_ip, uint32_t payload) {
  std::array<uint8_t, kGrhLen> g{};
  uint8_t* ip = g.data() + 20;
  const uint32_t total = 20 + 8 + payload;
  ip[0] = 0x45;
  ip[2] = static_cast<uint8_t>(total >> 8);
  ip[3] = static_cast<uint8_t>(total);
  ip[8] = 64;  // TTL
  ip[9] = 17;  // UDP
  for (int i = 0; i < 4; ++i) {
    ip[12 + i] = static_cast<uint8_t>(src_ip >> (24 - 8 * i));
    ip[16 + i] = static_cast<uint8_t>(dst_ip >> (24 - 8 * i));
  }
  uint32_t sum = 0;
  for (int i = 0; i < 20; i += 2) sum += (uint32_t{ip[i]} << 8) | ip[i + 1];
  while (sum >> 16) sum = (sum & 0xffff) + (sum >> 16);
  const uint16_t csum = static_cast<uint16_t>(~sum);
  ip[10] = static_cast<uint8_t>(csum >> 8);
  ip[11] = static_cast<uint8_t>(csum);
  return g;
}

// Places WRITE data. A small payload is stored strictly in ascending address order, as a
// hardware NIC's PCIe writes land: NCCL announces buffers with a 64-byte WRITE whose sequence
// number sits mid-slot and spins on it, trusting the bytes below it to be there already (x86
// keeps stores in program order; memcpy may store its pieces in any order).
void place_write(uint8_t* dst, std::span<const uint8_t> data) {
  constexpr size_t kOrdered = 256;
  if (data.size() > kOrdered) {
    std::memcpy(dst, data.data(), data.size());
    return;
  }
  size_t i = 0;
  for (; i + 8 <= data.size(); i += 8) {
    uint64_t w;
    std::memcpy(&w, data.data() + i, 8);
    std::memcpy(dst + i, &w, 8);
    asm volatile("" ::: "memory");  // keeps the compiler from merging or reordering the stores
  }
  for (; i < data.size(); ++i) dst[i] = data[i];
}

// Copies the used part of a WQE only: a full SendWqe is mostly unused SGE and inline space.
void copy_send_wqe(SendWqe& dst, const SendWqe& src) {
  dst.wr_id = src.wr_id;
  dst.op = src.op;
  dst.signaled = src.signaled;
  dst.solicited = src.solicited;
  dst.fence = src.fence;
  dst.imm = src.imm;
  dst.remote_addr = src.remote_addr;
  dst.rkey = src.rkey;
  dst.compare_add = src.compare_add;
  dst.swap = src.swap;
  dst.num_sge = src.num_sge;
  std::memcpy(dst.sge, src.sge, sizeof(Sge) * src.num_sge);
  dst.inline_len = src.inline_len;
  std::memcpy(dst.inline_data, src.inline_data, src.inline_len);
  dst.ud_ip = src.ud_ip;
  dst.ud_qpn = src.ud_qpn;
  dst.ud_qkey = src.ud_qkey;
}

}  // namespace

QueuePair::QueuePair(SoftDevice& dev, uint32_t qpn, const QpInit& init)
    : dev_(dev), qpn_(qpn), init_(init),
      sq_(std::bit_ceil(std::max(init.max_send_wr, 1u))),
      sq_slots_(sq_.size()),
      sq_mask_(static_cast<uint32_t>(sq_.size()) - 1),
      rq_(std::bit_ceil(std::max(init.max_recv_wr, 1u))),
      rq_mask_(static_cast<uint32_t>(rq_.size()) - 1),
      rx_msgs_(kRecvWindowInitial),
      srq_(static_cast<SharedReceiveQueue*>(init.srq)),
      claimed_(init.srq ? kRecvWindow : 0),
      ud_seen_(init.type == QpType::kUd ? kUdSeen : 0) {}

QueuePair::~QueuePair() {
  for (uint32_t r = srq_retired_; r != next_claim_; ++r)
    srq_->release(claimed_[r & (kRecvWindow - 1)]);
}

void QueuePair::raise(QpEvent ev) const {
  if (init_.event_fn) init_.event_fn(init_.event_arg, ev);
}

int QueuePair::post_send(const SendWqe& wqe) {
  {
    std::lock_guard lock(sq_lock_);
    uint32_t head = sq_head_.load(std::memory_order_relaxed);
    if (head - sq_retired_.load(std::memory_order_acquire) >= init_.max_send_wr) return ENOMEM;
    copy_send_wqe(sq_[head & sq_mask_], wqe);
    sq_head_.store(head + 1, std::memory_order_release);
  }
  dev_.kick();
  return 0;
}

int QueuePair::post_recv(const RecvWqe& wqe) {
  std::lock_guard lock(rq_lock_);
  uint32_t head = rq_head_.load(std::memory_order_relaxed);
  if (head - rq_retired_.load(std::memory_order_acquire) >= init_.max_recv_wr) return ENOMEM;
  RecvWqe& slot = rq_[head & rq_mask_];
  slot.wr_id = wqe.wr_id;
  slot.num_sge = wqe.num_sge;
  std::memcpy(slot.sge, wqe.sge, sizeof(Sge) * wqe.num_sge);
  rq_head_.store(head + 1, std::memory_order_release);
  return 0;
}

void QueuePair::set_state(QpState s) {
  std::lock_guard lock(dev_.lock());
  switch (s) {
    case QpState::kErr:
      if (state() != QpState::kErr) enter_error();
      return;
    case QpState::kReset:
      dev_.engine().drop_stream(qpn_);
      {
        std::lock_guard sl(sq_lock_);
        std::lock_guard rl(rq_lock_);
        sq_head_.store(0);
        sq_retired_.store(0);
        rq_head_.store(0);
        rq_retired_.store(0);
      }
      sq_next_ = 0;
      next_rsn_ = 0;
      rd_outstanding_ = 0;
      rd_blocked_ = false;
      for (auto& a : atomics_) a = AtomicResult{};
      rx_next_msn_ = 0;
      rx_msgs_.assign(kRecvWindowInitial, RecvMsg{});
      // SRQ entries this QP claimed and never completed go back to the SRQ (a reset discards
      // work without completions; from ERR they were already flushed).
      for (uint32_t r = srq_retired_; r != next_claim_; ++r)
        srq_->release(claimed_[r & (kRecvWindow - 1)]);
      next_claim_ = srq_retired_ = 0;
      comm_est_ = false;
      for (auto& u : ud_seen_) u = UdSeen{};
      for (auto& s2 : sq_slots_) s2 = SendSlot{};
      break;
    case QpState::kRtr:
      dev_.resolve(remote_.ip);
      break;
    default:
      break;
  }
  state_.store(s, std::memory_order_release);
  if (s == QpState::kRts) dev_.kick();
}

void QueuePair::set_remote(const QpRemote& r) {
  std::lock_guard lock(dev_.lock());
  remote_ = r;
}

void QueuePair::set_access(unsigned int flags) {
  std::lock_guard lock(dev_.lock());
  access_ = flags;
}

void QueuePair::push_cqe(CompletionQueue* cq, const Cqe& cqe) {
  if (cq) cq->push(cqe);
}

bool QueuePair::drain_send_queue() {
  QpState st = state();
  if (st == QpState::kErr) {
    // Work posted after the QP failed completes at once, flushed (as verbs specifies).
    if (sq_head_.load(std::memory_order_acquire) != sq_retired_.load(std::memory_order_relaxed) ||
        rq_head_.load(std::memory_order_acquire) != rq_retired_.load(std::memory_order_relaxed)) {
      flush_all();
      return true;
    }
    return false;
  }
  if (st != QpState::kRts) return false;
  uint32_t head = sq_head_.load(std::memory_order_acquire);
  if (sq_next_ == head) return false;
  const uint32_t rd_limit = std::max<uint32_t>(remote_.max_rd_atomic, 1);
  rd_blocked_ = false;
  while (sq_next_ != head) {
    const SendWqe& w = sq_[sq_next_ & sq_mask_];
    if (needs_response(w.op) && rd_outstanding_ >= rd_limit) {
      // max_rd_atomic: this READ/atomic waits (and, in order, everything behind it).
      rd_blocked_ = true;
      break;
    }
    SendSlot& s = sq_slots_[sq_next_ & sq_mask_];
    s = SendSlot{};
    s.msn = sq_next_;
    ++sq_next_;
    uint64_t length = w.inline_len;
    const unsigned int need = needs_response(w.op) ? IBV_ACCESS_LOCAL_WRITE : 0;
    for (uint32_t i = 0; i < w.num_sge; ++i) {
      length += w.sge[i].length;
      if (dev_.mrs().check(w.sge[i].lkey, init_.pd, need, w.sge[i].addr, w.sge[i].length,
                           nullptr) != MrCheck::kOk) {
        s.failed = true;
        s.status = IBV_WC_LOC_PROT_ERR;
      }
    }
    if (length > kMaxMrSize || (is_atomic(w.op) && (length != kAtomicSize || w.inline_len)) ||
        (init_.type == QpType::kUd && length > dev_.active_mtu())) {
      s.failed = true;
      s.status = IBV_WC_LOC_LEN_ERR;
    }
    if (s.failed) break;  // the QP goes to error at retirement; nothing behind it is sent
    s.length = static_cast<uint32_t>(length);
    transport::MessageDesc m;
    m.peer_ip = remote_.ip;
    m.dst_stream = remote_.qpn;
    m.src_stream = qpn_;
    m.msn = s.msn;
    m.op = transport_op(w.op);
    if (init_.type == QpType::kUd) {
      // A datagram: its own destination, the Q_Key where an RC message carries an rkey, and
      // no RSN (the receiver takes its next receive, docs/spec/verbs-mapping.md §7).
      m.peer_ip = w.ud_ip;
      m.dst_stream = w.ud_qpn;
      dev_.resolve(w.ud_ip);
    } else if (w.op == WqeOp::kSend || w.op == WqeOp::kSendImm || w.op == WqeOp::kWriteImm) {
      m.rsn = next_rsn_++;
    }
    if (init_.type == QpType::kRc) {
      // The QP's own limits: retry_cnt timeouts, over whatever paths, and the local ACK timeout
      // (4.096 us * 2^timeout, 0 = none) bound when RETRY_EXC_ERR comes (congestion.md §4.5).
      m.retry_cnt = remote_.retry_cnt;
      m.timeout = remote_.timeout ? transport::Time(int64_t{4096} << remote_.timeout)
                                  : transport::Time{0};
    }
    m.length = s.length;
    s.resp_length = w.op == WqeOp::kRead ? s.length : 0;
    if (is_atomic(w.op)) {
      m.rsn = w.op == WqeOp::kCmpSwp ? kRsnAtomicCmpSwp : kRsnAtomicFetchAdd;
      m.length = kAtomicRequestLen;
      s.resp_length = kAtomicSize;
    }
    if (needs_response(w.op)) ++rd_outstanding_;
    m.remote_addr = w.remote_addr;
    m.rkey = init_.type == QpType::kUd ? w.ud_qkey : w.rkey;
    m.imm = w.imm;
    m.cookie = SoftDevice::cookie(qpn_, s.msn);
    s.submitted = true;
    dev_.engine().submit(m);
  }
  retire_sends();
  return true;
}

bool QueuePair::send_done(const SendSlot& s, const SendWqe& w) const {
  if (s.failed) return true;
  if (!s.acked) return false;
  return !needs_response(w.op) || s.read_bytes >= s.resp_length;
}

void QueuePair::retire_sends() {
  uint32_t r = sq_retired_.load(std::memory_order_relaxed);
  while (r != sq_next_) {
    const SendWqe& w = sq_[r & sq_mask_];
    const SendSlot& s = sq_slots_[r & sq_mask_];
    if (!send_done(s, w)) break;
    const bool report = s.failed || w.signaled || init_.sq_sig_all;
    Cqe c;
    if (report) {
      c.wr_id = w.wr_id;
      c.status = s.failed ? s.status : IBV_WC_SUCCESS;
      c.opcode = send_opcode(w.op);
      c.byte_len = needs_response(w.op) ? s.resp_length : 0;
      c.qp_num = qpn_;
    }
    if (needs_response(w.op) && s.submitted && rd_outstanding_ > 0) --rd_outstanding_;
    ++r;
    // The slot is free before its completion is visible: an application that reposts as soon
    // as it polls the completion must find room in the queue.
    sq_retired_.store(r, std::memory_order_release);
    if (report) push_cqe(static_cast<CompletionQueue*>(init_.send_cq), c);
    if (s.failed) {
      const bool transport_gave_up =
          s.status == IBV_WC_RETRY_EXC_ERR || s.status == IBV_WC_RNR_RETRY_EXC_ERR;
      enter_error(transport_gave_up ? std::optional(QpEvent::kFatal) : std::nullopt);
      return;
    }
  }
}

void QueuePair::on_message_acked(uint32_t msn) {
  SendSlot& s = sq_slots_[msn & sq_mask_];
  if (s.msn != msn || !s.submitted) return;
  s.acked = true;
  retire_sends();
}

void QueuePair::on_message_failed(uint32_t msn, Syndrome why) {
  SendSlot& s = sq_slots_[msn & sq_mask_];
  if (s.msn != msn || !s.submitted || s.failed) return;
  if (init_.type == QpType::kUd) {
    // A datagram nobody took is lost, not an error of the sender (unreliable service).
    s.acked = true;
    retire_sends();
    return;
  }
  s.failed = true;
  s.status = remote_status(why);
  retire_sends();
}

void QueuePair::gather(uint32_t msn, uint32_t offset, std::span<uint8_t> out) const {
  const SendWqe& w = sq_[msn & sq_mask_];
  if (is_atomic(w.op)) {
    // The request's payload is its operands, not the local buffer (that receives the answer).
    uint8_t ops[kAtomicRequestLen];
    for (int i = 0; i < 8; ++i) {
      ops[i] = static_cast<uint8_t>(w.compare_add >> (56 - 8 * i));
      ops[8 + i] = static_cast<uint8_t>(w.swap >> (56 - 8 * i));
    }
    if (offset < kAtomicRequestLen)
      std::memcpy(out.data(), ops + offset, std::min<size_t>(out.size(), kAtomicRequestLen - offset));
    return;
  }
  if (w.inline_len > 0) {
    std::memcpy(out.data(), w.inline_data + offset, out.size());
    return;
  }
  size_t done = 0;
  for (uint32_t i = 0; i < w.num_sge && done < out.size(); ++i) {
    const Sge& g = w.sge[i];
    if (offset >= g.length) {
      offset -= g.length;
      continue;
    }
    size_t n = std::min<size_t>(g.length - offset, out.size() - done);
    std::memcpy(out.data() + done, reinterpret_cast<const uint8_t*>(g.addr) + offset, n);
    done += n;
    offset = 0;
  }
}

Syndrome QueuePair::scatter(uint32_t pd, const Sge* sge, uint32_t num_sge, uint32_t offset,
                            std::span<const uint8_t> data, ibv_wc_status* local_err) const {
  size_t done = 0;
  for (uint32_t i = 0; i < num_sge && done < data.size(); ++i) {
    const Sge& g = sge[i];
    if (offset >= g.length) {
      offset -= g.length;
      continue;
    }
    size_t n = std::min<size_t>(g.length - offset, data.size() - done);
    uint8_t* dst = nullptr;
    if (dev_.mrs().check(g.lkey, pd, IBV_ACCESS_LOCAL_WRITE, g.addr + offset, n, &dst) !=
        MrCheck::kOk) {
      *local_err = IBV_WC_LOC_PROT_ERR;
      return Syndrome::kRemoteOp;
    }
    std::memcpy(dst, data.data() + done, n);
    done += n;
    offset = 0;
  }
  if (done < data.size()) {
    *local_err = IBV_WC_LOC_LEN_ERR;
    return Syndrome::kRemoteInvalid;
  }
  return Syndrome::kOk;
}

Syndrome QueuePair::place_read_response(const transport::Segment& seg) {
  SendSlot& s = sq_slots_[seg.msn & sq_mask_];
  const SendWqe& w = sq_[seg.msn & sq_mask_];
  if (s.msn != seg.msn || !s.submitted || s.failed || !needs_response(w.op)) return Syndrome::kOk;
  if (s.read_bytes >= s.resp_length) return Syndrome::kOk;  // an answer seen again
  if (seg.src_stream != remote_.qpn || seg.total_length != s.resp_length ||
      uint64_t{seg.offset} + seg.payload.size() > s.resp_length)
    return Syndrome::kRemoteInvalid;
  ibv_wc_status err = IBV_WC_SUCCESS;
  if (scatter(init_.pd, w.sge, w.num_sge, seg.offset, seg.payload, &err) != Syndrome::kOk) {
    s.failed = true;
    s.status = err;
  } else {
    s.read_bytes += static_cast<uint32_t>(seg.payload.size());
  }
  retire_sends();
  return Syndrome::kOk;
}

// The responder's event for a request it rejected (IB spec: the responder's QP reports access
// violations and invalid requests asynchronously; the requester learns from the NAK).
static std::optional<QpEvent> responder_event(Syndrome why) {
  switch (why) {
    case Syndrome::kRemoteAccess:
    case Syndrome::kRemoteBounds:
      return QpEvent::kAccessErr;
    case Syndrome::kRemoteInvalid:
      return QpEvent::kReqErr;
    default:
      return std::nullopt;  // a local error, reported in the receive's completion
  }
}

Syndrome QueuePair::deliver(const transport::Segment& seg) {
  if (init_.type == QpType::kUd) return deliver_ud(seg);
  const QpState st = state();
  if (seg.op == Op::kReadResp) {
    if (st != QpState::kRts) return Syndrome::kRemoteInvalid;
    return place_read_response(seg);
  }
  if (st != QpState::kRtr && st != QpState::kRts) return Syndrome::kRemoteInvalid;
  if (seg.peer_ip != remote_.ip || seg.src_stream != remote_.qpn) return Syndrome::kRemoteInvalid;
  if (st == QpState::kRtr && !comm_est_) {
    comm_est_ = true;  // the connection is established: the peer reached us before our RTS
    raise(QpEvent::kCommEst);
  }
  const bool atomic = seg.op == Op::kWrite &&
                      (seg.rsn == kRsnAtomicCmpSwp || seg.rsn == kRsnAtomicFetchAdd);
  const uint32_t ahead = seg.msn - rx_next_msn_;
  if (ahead >= 0x80000000u) {
    // A message completed long ago: a duplicate. An atomic is answered again, not re-executed.
    return atomic ? execute_atomic(seg, true) : Syndrome::kOk;
  }
  // A sender too far ahead comes back later (RNR back-off), as it does when the window cannot
  // grow.
  if (ahead >= kRecvWindow || (ahead >= rx_msgs_.size() && !grow_rx_window(ahead)))
    return Syndrome::kRnr;
  RecvMsg& m = rx_msg(seg.msn);
  if (atomic) {
    const bool duplicate = m.seen && m.msn == seg.msn;
    if (!duplicate) {
      m = RecvMsg{};
      m.msn = seg.msn;
      m.total = 0;  // nothing but the request itself
    }
    Syndrome r = execute_atomic(seg, duplicate);
    m.seen = true;
    if (r != Syndrome::kOk) {
      complete_receives();
      enter_error(responder_event(r));
      return r;
    }
    complete_receives();
    return r;
  }
  if (!m.seen || m.msn != seg.msn) {
    m = RecvMsg{};
    m.msn = seg.msn;
    m.total = seg.total_length;
    m.rsn = seg.rsn;
    m.imm = seg.imm;
    m.with_imm = seg.op == Op::kWriteImm || seg.op == Op::kSendImm;
    m.is_write = seg.op == Op::kWrite || seg.op == Op::kWriteImm;
    m.consumes_recv = seg.op != Op::kWrite && seg.op != Op::kReadReq;
  }
  Syndrome result = Syndrome::kOk;
  uint32_t placed = static_cast<uint32_t>(seg.payload.size());
  switch (seg.op) {
    case Op::kWrite:
    case Op::kWriteImm: {
      if (m.consumes_recv && !recv_for(seg.rsn)) return Syndrome::kRnr;
      uint8_t* dst = nullptr;
      MrCheck c = (access_ & IBV_ACCESS_REMOTE_WRITE)
                      ? dev_.mrs().check(seg.rkey, init_.pd, IBV_ACCESS_REMOTE_WRITE,
                                         seg.remote_addr, seg.payload.size(), &dst)
                      : MrCheck::kNoAccess;
      if (c == MrCheck::kOk) {
        place_write(dst, seg.payload);
      } else {
        result = c == MrCheck::kOutOfBounds ? Syndrome::kRemoteBounds : Syndrome::kRemoteAccess;
        m.status = IBV_WC_REM_ACCESS_ERR;
      }
      break;
    }
    case Op::kSend:
    case Op::kSendImm: {
      const RecvWqe* rp = recv_for(seg.rsn);
      if (!rp) return Syndrome::kRnr;
      const RecvWqe& r = *rp;
      uint64_t room = 0;
      for (uint32_t i = 0; i < r.num_sge; ++i) room += r.sge[i].length;
      if (seg.total_length > room) {
        m.status = IBV_WC_LOC_LEN_ERR;
        result = Syndrome::kRemoteInvalid;
      } else {
        ibv_wc_status err = IBV_WC_SUCCESS;
        result = scatter(srq_ ? srq_->pd() : init_.pd, r.sge, r.num_sge, seg.offset, seg.payload,
                         &err);
        if (result != Syndrome::kOk) m.status = err;
      }
      break;
    }
    case Op::kReadReq: {
      MrCheck c = (access_ & IBV_ACCESS_REMOTE_READ)
                      ? dev_.mrs().check(seg.rkey, init_.pd, IBV_ACCESS_REMOTE_READ,
                                         seg.remote_addr, seg.total_length, nullptr)
                      : MrCheck::kNoAccess;
      if (c == MrCheck::kOk) {
        transport::MessageDesc resp;
        resp.peer_ip = seg.peer_ip;
        resp.dst_stream = seg.src_stream;
        resp.src_stream = qpn_;
        resp.msn = seg.msn;
        resp.op = Op::kReadResp;
        resp.length = seg.total_length;
        dev_.queue_read_response(resp, seg.remote_addr);
      } else {
        result = c == MrCheck::kOutOfBounds ? Syndrome::kRemoteBounds : Syndrome::kRemoteAccess;
      }
      placed = 0;
      m.total = 0;  // nothing arrives for a READ request but the request itself
      break;
    }
    case Op::kReadResp:
      break;
  }
  m.seen = true;
  if (result != Syndrome::kOk) {
    // As an RC responder does on an access or request error: the rejected message completes
    // (with its error, where it consumed a receive), then the QP enters the error state, so
    // nothing that arrives after it is placed (spec §5.6). The requester learns from the NAK.
    m.received = m.total;
    complete_receives();
    enter_error(responder_event(result));
    return result;
  }
  m.received += placed;
  complete_receives();
  return result;
}

Syndrome QueuePair::execute_atomic(const transport::Segment& seg, bool duplicate) {
  if (duplicate) {
    for (AtomicResult& r : atomics_)
      if (r.valid && r.msn == seg.msn) {
        answer_atomic(seg, r);
        return Syndrome::kOk;
      }
    return Syndrome::kOk;  // executed so long ago that its answer was surely received
  }
  if (seg.payload.size() != kAtomicRequestLen || seg.total_length != kAtomicRequestLen ||
      (seg.remote_addr & (kAtomicSize - 1)) != 0)
    return Syndrome::kRemoteInvalid;  // IBV_WC_REM_INV_REQ_ERR at the requester
  uint8_t* dst = nullptr;
  const MrCheck c = (access_ & IBV_ACCESS_REMOTE_ATOMIC)
                        ? dev_.mrs().check(seg.rkey, init_.pd, IBV_ACCESS_REMOTE_ATOMIC,
                                           seg.remote_addr, kAtomicSize, &dst)
                        : MrCheck::kNoAccess;
  if (c != MrCheck::kOk)
    return c == MrCheck::kOutOfBounds ? Syndrome::kRemoteBounds : Syndrome::kRemoteAccess;
  uint64_t compare_add = 0, swap = 0;
  for (int i = 0; i < 8; ++i) {
    compare_add = (compare_add << 8) | seg.payload[i];
    swap = (swap << 8) | seg.payload[8 + i];
  }
  // Atomic with respect to every other atomic of this NIC (IBV_ATOMIC_HCA) and, since this is
  // a CPU atomic, to the host's own atomics too.
  std::atomic_ref<uint64_t> target(*reinterpret_cast<uint64_t*>(dst));
  uint64_t original;
  if (seg.rsn == kRsnAtomicCmpSwp) {
    original = compare_add;
    target.compare_exchange_strong(original, swap);  // on a miss, original is what was found
  } else {
    original = target.fetch_add(compare_add);
  }
  AtomicResult& r = atomics_[seg.msn % kAtomicCache];
  r.msn = seg.msn;
  r.valid = true;
  r.original = original;
  answer_atomic(seg, r);
  return Syndrome::kOk;
}

void QueuePair::answer_atomic(const transport::Segment& seg, AtomicResult& r) {
  transport::MessageDesc resp;
  resp.peer_ip = seg.peer_ip;
  resp.dst_stream = seg.src_stream;
  resp.src_stream = qpn_;
  resp.msn = seg.msn;
  resp.op = Op::kReadResp;
  resp.length = kAtomicSize;
  dev_.queue_read_response(resp, reinterpret_cast<uintptr_t>(&r.original));
}

// Doubles the responder's records until message rx_next_msn_ + ahead has one, keeping every
// record in use. At most log2(kRecvWindow / kRecvWindowInitial) = 6 times in a QP's life, so
// the packet path allocates a bounded number of times; if it cannot, the sender is only slowed.
bool QueuePair::grow_rx_window(uint32_t ahead) {
  size_t size = rx_msgs_.size();
  while (size <= ahead) size *= 2;
  std::vector<RecvMsg> bigger;
  try {
    bigger.resize(size);
  } catch (const std::bad_alloc&) {
    return false;
  }
  for (uint32_t k = 0; k < rx_msgs_.size(); ++k) {
    const uint32_t msn = rx_next_msn_ + k;
    const RecvMsg& m = rx_msg(msn);
    if (m.seen && m.msn == msn) bigger[msn & (size - 1)] = m;
  }
  rx_msgs_.swap(bigger);
  return true;
}

void QueuePair::complete_receives() {
  for (;;) {
    RecvMsg& m = rx_msg(rx_next_msn_);
    if (!m.seen || m.msn != rx_next_msn_ || m.received < m.total) return;
    if (m.consumes_recv) {
      Cqe c;
      c.wr_id = retire_recv(m.rsn);  // room first (retire_sends)
      c.status = m.status;
      c.opcode = m.is_write ? IBV_WC_RECV_RDMA_WITH_IMM : IBV_WC_RECV;
      c.byte_len = m.total;
      c.imm = m.imm;
      c.qp_num = qpn_;
      c.src_qp = remote_.qpn;
      c.wc_flags = m.with_imm ? IBV_WC_WITH_IMM : 0;
      push_cqe(static_cast<CompletionQueue*>(init_.recv_cq), c);
    }
    m.seen = false;
    ++rx_next_msn_;
  }
}

void QueuePair::enter_error(std::optional<QpEvent> why) {
  state_.store(QpState::kErr, std::memory_order_release);
  dev_.engine().drop_stream(qpn_);
  flush_all();
  if (why) raise(*why);
  // Every SRQ entry this QP claimed has now completed: the application may destroy it.
  if (srq_) raise(QpEvent::kLastWqeReached);
}

void QueuePair::flush_all() {
  const uint32_t sq_head = sq_head_.load(std::memory_order_acquire);
  for (uint32_t r = sq_retired_.load(std::memory_order_relaxed); r != sq_head; ++r) {
    const SendWqe& w = sq_[r & sq_mask_];
    Cqe c;
    c.wr_id = w.wr_id;
    c.status = IBV_WC_WR_FLUSH_ERR;
    c.opcode = send_opcode(w.op);
    c.qp_num = qpn_;
    push_cqe(static_cast<CompletionQueue*>(init_.send_cq), c);
  }
  sq_next_ = sq_head;
  sq_retired_.store(sq_head, std::memory_order_release);
  rd_outstanding_ = 0;
  rd_blocked_ = false;
  const uint32_t rq_head = rq_head_.load(std::memory_order_acquire);
  for (uint32_t r = rq_retired_.load(std::memory_order_relaxed); r != rq_head; ++r) {
    Cqe c;
    c.wr_id = rq_[r & rq_mask_].wr_id;
    c.status = IBV_WC_WR_FLUSH_ERR;
    c.opcode = IBV_WC_RECV;
    c.qp_num = qpn_;
    push_cqe(static_cast<CompletionQueue*>(init_.recv_cq), c);
  }
  rq_retired_.store(rq_head, std::memory_order_release);
  // SRQ entries claimed by this QP are flushed; those never claimed stay in the SRQ for others.
  for (uint32_t r = srq_retired_; r != next_claim_; ++r) {
    Cqe c;
    c.wr_id = retire_recv(r);
    c.status = IBV_WC_WR_FLUSH_ERR;
    c.opcode = IBV_WC_RECV;
    c.qp_num = qpn_;
    push_cqe(static_cast<CompletionQueue*>(init_.recv_cq), c);
  }
}

const RecvWqe* QueuePair::recv_for(uint32_t rsn) {
  if (!srq_) {
    const uint32_t done = rq_retired_.load(std::memory_order_relaxed);
    if (rsn - done >= rq_head_.load(std::memory_order_acquire) - done) return nullptr;
    return &rq_[rsn & rq_mask_];
  }
  // RSNs are never this far ahead of the oldest open receive (the msn window bounds them);
  // refusing keeps a malformed RSN from draining the SRQ.
  if (rsn - srq_retired_ >= kRecvWindow) return nullptr;
  while (rsn - next_claim_ < 0x80000000u) {  // rsn >= next_claim_: claim up to it, in order
    uint32_t slot;
    if (!srq_->claim(&slot)) return nullptr;
    claimed_[next_claim_ & (kRecvWindow - 1)] = slot;
    ++next_claim_;
  }
  return &srq_->entry(claimed_[rsn & (kRecvWindow - 1)]);
}

uint64_t QueuePair::retire_recv(uint32_t rsn) {
  if (!srq_) {
    const uint64_t id = rq_[rsn & rq_mask_].wr_id;
    rq_retired_.store(rsn + 1, std::memory_order_release);
    return id;
  }
  const uint32_t slot = claimed_[rsn & (kRecvWindow - 1)];
  const uint64_t id = srq_->entry(slot).wr_id;
  srq_->release(slot);
  srq_retired_ = rsn + 1;
  return id;
}

bool QueuePair::ud_seen_before(const transport::Segment& seg) {
  const uint32_t h = (seg.peer_ip * 2654435761u) ^ (seg.src_stream * 40503u) ^ seg.msn;
  UdSeen& e = ud_seen_[h & (kUdSeen - 1)];
  if (e.valid && e.peer_ip == seg.peer_ip && e.src_qpn == seg.src_stream && e.msn == seg.msn)
    return true;
  e = UdSeen{seg.peer_ip, seg.src_stream, seg.msn, true};
  return false;
}

Syndrome QueuePair::deliver_ud(const transport::Segment& seg) {
  // Datagram semantics: what cannot be received is dropped and acknowledged, so the sender's
  // transport does not retry it (docs/spec/verbs-mapping.md §7).
  if (seg.op != Op::kSend && seg.op != Op::kSendImm) return Syndrome::kRemoteInvalid;
  if (seg.offset != 0 || seg.payload.size() != seg.total_length) return Syndrome::kRemoteInvalid;
  const QpState st = state();
  if (st != QpState::kRtr && st != QpState::kRts) return Syndrome::kOk;
  if (seg.rkey != remote_.qkey) return Syndrome::kOk;  // the Q_Key travels in the rkey field
  if (ud_seen_before(seg)) return Syndrome::kOk;
  const RecvWqe* r = nullptr;
  uint32_t slot = 0;
  uint32_t done = 0;
  if (srq_) {
    if (!srq_->claim(&slot)) return Syndrome::kOk;
    r = &srq_->entry(slot);
  } else {
    done = rq_retired_.load(std::memory_order_relaxed);
    if (rq_head_.load(std::memory_order_acquire) == done) return Syndrome::kOk;
    r = &rq_[done & rq_mask_];
  }
  Cqe c;
  c.wr_id = r->wr_id;
  c.opcode = IBV_WC_RECV;
  c.qp_num = qpn_;
  c.src_qp = seg.src_stream;
  c.imm = seg.imm;
  c.wc_flags = IBV_WC_GRH | (seg.op == Op::kSendImm ? IBV_WC_WITH_IMM : 0);
  c.byte_len = kGrhLen + seg.total_length;
  uint64_t room = 0;
  for (uint32_t i = 0; i < r->num_sge; ++i) room += r->sge[i].length;
  if (room < c.byte_len) {
    c.status = IBV_WC_LOC_LEN_ERR;
  } else {
    const uint32_t pd = srq_ ? srq_->pd() : init_.pd;
    const auto grh = make_grh(seg.peer_ip, dev_.config().ip, seg.total_length);
    ibv_wc_status err = IBV_WC_SUCCESS;
    if (scatter(pd, r->sge, r->num_sge, 0, grh, &err) != Syndrome::kOk ||
        scatter(pd, r->sge, r->num_sge, kGrhLen, seg.payload, &err) != Syndrome::kOk)
      c.status = err;
  }
  if (srq_) srq_->release(slot);
  else rq_retired_.store(done + 1, std::memory_order_release);
  push_cqe(static_cast<CompletionQueue*>(init_.recv_cq), c);
  return Syndrome::kOk;
}

}  // namespace metaroce::nic

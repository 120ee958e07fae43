// SPDX-License-Identifier: Apache-2.0
// Requester and responder logic of a queue pair (spec §5): WQEs become transport messages,
// arriving segments are placed at their final address, completions leave in order.
#include "datapath/nic/queue_pair.h"

#include <bit>
#include <cstring>

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
      return IBV_WC_RETRY_EXC_ERR;
    case Syndrome::kOk:
      break;
  }
  return IBV_WC_GENERAL_ERR;
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
  dst.num_sge = src.num_sge;
  std::memcpy(dst.sge, src.sge, sizeof(Sge) * src.num_sge);
  dst.inline_len = src.inline_len;
  std::memcpy(dst.inline_data, src.inline_data, src.inline_len);
}

}  // namespace

QueuePair::QueuePair(SoftDevice& dev, uint32_t qpn, const QpInit& init)
    : dev_(dev), qpn_(qpn), init_(init),
      sq_(std::bit_ceil(std::max(init.max_send_wr, 1u))),
      sq_slots_(sq_.size()),
      sq_mask_(static_cast<uint32_t>(sq_.size()) - 1),
      rq_(std::bit_ceil(std::max(init.max_recv_wr, 1u))),
      rq_mask_(static_cast<uint32_t>(rq_.size()) - 1),
      rx_msgs_(kRecvWindow) {}

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
      rx_next_msn_ = 0;
      for (auto& m : rx_msgs_) m = RecvMsg{};
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
  while (sq_next_ != head) {
    const SendWqe& w = sq_[sq_next_ & sq_mask_];
    SendSlot& s = sq_slots_[sq_next_ & sq_mask_];
    s = SendSlot{};
    s.msn = sq_next_;
    ++sq_next_;
    uint64_t length = w.inline_len;
    const unsigned int need = w.op == WqeOp::kRead ? IBV_ACCESS_LOCAL_WRITE : 0;
    for (uint32_t i = 0; i < w.num_sge; ++i) {
      length += w.sge[i].length;
      if (dev_.mrs().check(w.sge[i].lkey, init_.pd, need, w.sge[i].addr, w.sge[i].length,
                           nullptr) != MrCheck::kOk) {
        s.failed = true;
        s.status = IBV_WC_LOC_PROT_ERR;
      }
    }
    if (length > kMaxMrSize) {
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
    if (w.op == WqeOp::kSend || w.op == WqeOp::kSendImm || w.op == WqeOp::kWriteImm)
      m.rsn = next_rsn_++;
    m.length = s.length;
    m.remote_addr = w.remote_addr;
    m.rkey = w.rkey;
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
  return w.op != WqeOp::kRead || s.read_bytes >= s.length;
}

void QueuePair::retire_sends() {
  uint32_t r = sq_retired_.load(std::memory_order_relaxed);
  while (r != sq_next_) {
    const SendWqe& w = sq_[r & sq_mask_];
    const SendSlot& s = sq_slots_[r & sq_mask_];
    if (!send_done(s, w)) break;
    if (s.failed || w.signaled || init_.sq_sig_all) {
      Cqe c;
      c.wr_id = w.wr_id;
      c.status = s.failed ? s.status : IBV_WC_SUCCESS;
      c.opcode = send_opcode(w.op);
      c.byte_len = w.op == WqeOp::kRead ? s.length : 0;
      c.qp_num = qpn_;
      push_cqe(static_cast<CompletionQueue*>(init_.send_cq), c);
    }
    ++r;
    sq_retired_.store(r, std::memory_order_release);
    if (s.failed) {
      enter_error();
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
  s.failed = true;
  s.status = remote_status(why);
  retire_sends();
}

void QueuePair::gather(uint32_t msn, uint32_t offset, std::span<uint8_t> out) const {
  const SendWqe& w = sq_[msn & sq_mask_];
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

Syndrome QueuePair::scatter(const Sge* sge, uint32_t num_sge, uint32_t offset,
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
    if (dev_.mrs().check(g.lkey, init_.pd, IBV_ACCESS_LOCAL_WRITE, g.addr + offset, n, &dst) !=
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
  if (s.msn != seg.msn || !s.submitted || s.failed || w.op != WqeOp::kRead) return Syndrome::kOk;
  if (seg.src_stream != remote_.qpn || seg.total_length != s.length ||
      uint64_t{seg.offset} + seg.payload.size() > s.length)
    return Syndrome::kRemoteInvalid;
  ibv_wc_status err = IBV_WC_SUCCESS;
  if (scatter(w.sge, w.num_sge, seg.offset, seg.payload, &err) != Syndrome::kOk) {
    s.failed = true;
    s.status = err;
  } else {
    s.read_bytes += static_cast<uint32_t>(seg.payload.size());
  }
  retire_sends();
  return Syndrome::kOk;
}

Syndrome QueuePair::deliver(const transport::Segment& seg) {
  const QpState st = state();
  if (seg.op == Op::kReadResp) {
    if (st != QpState::kRts) return Syndrome::kRemoteInvalid;
    return place_read_response(seg);
  }
  if (st != QpState::kRtr && st != QpState::kRts) return Syndrome::kRemoteInvalid;
  if (seg.peer_ip != remote_.ip || seg.src_stream != remote_.qpn) return Syndrome::kRemoteInvalid;
  const uint32_t ahead = seg.msn - rx_next_msn_;
  if (ahead >= 0x80000000u) return Syndrome::kOk;  // a message completed long ago: a duplicate
  if (ahead >= kRecvWindow) return Syndrome::kRnr;  // sender too far ahead: come back later
  RecvMsg& m = rx_msgs_[seg.msn & (kRecvWindow - 1)];
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
  const uint32_t rq_done = rq_retired_.load(std::memory_order_relaxed);
  const bool recv_posted =
      seg.rsn - rq_done < rq_head_.load(std::memory_order_acquire) - rq_done;
  Syndrome result = Syndrome::kOk;
  uint32_t placed = static_cast<uint32_t>(seg.payload.size());
  switch (seg.op) {
    case Op::kWrite:
    case Op::kWriteImm: {
      if (m.consumes_recv && !recv_posted) return Syndrome::kRnr;
      uint8_t* dst = nullptr;
      MrCheck c = (access_ & IBV_ACCESS_REMOTE_WRITE)
                      ? dev_.mrs().check(seg.rkey, init_.pd, IBV_ACCESS_REMOTE_WRITE,
                                         seg.remote_addr, seg.payload.size(), &dst)
                      : MrCheck::kNoAccess;
      if (c == MrCheck::kOk) {
        if (!seg.payload.empty()) std::memcpy(dst, seg.payload.data(), seg.payload.size());
      } else {
        result = c == MrCheck::kOutOfBounds ? Syndrome::kRemoteBounds : Syndrome::kRemoteAccess;
        m.status = IBV_WC_REM_ACCESS_ERR;
      }
      break;
    }
    case Op::kSend:
    case Op::kSendImm: {
      if (!recv_posted) return Syndrome::kRnr;
      const RecvWqe& r = rq_[seg.rsn & rq_mask_];
      uint64_t room = 0;
      for (uint32_t i = 0; i < r.num_sge; ++i) room += r.sge[i].length;
      if (seg.total_length > room) {
        m.status = IBV_WC_LOC_LEN_ERR;
        result = Syndrome::kRemoteInvalid;
      } else {
        ibv_wc_status err = IBV_WC_SUCCESS;
        result = scatter(r.sge, r.num_sge, seg.offset, seg.payload, &err);
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
    enter_error();
    return result;
  }
  m.received += placed;
  complete_receives();
  return result;
}

void QueuePair::complete_receives() {
  for (;;) {
    RecvMsg& m = rx_msgs_[rx_next_msn_ & (kRecvWindow - 1)];
    if (!m.seen || m.msn != rx_next_msn_ || m.received < m.total) return;
    if (m.consumes_recv) {
      const RecvWqe& r = rq_[m.rsn & rq_mask_];
      Cqe c;
      c.wr_id = r.wr_id;
      c.status = m.status;
      c.opcode = m.is_write ? IBV_WC_RECV_RDMA_WITH_IMM : IBV_WC_RECV;
      c.byte_len = m.total;
      c.imm = m.imm;
      c.qp_num = qpn_;
      c.src_qp = remote_.qpn;
      c.wc_flags = m.with_imm ? IBV_WC_WITH_IMM : 0;
      push_cqe(static_cast<CompletionQueue*>(init_.recv_cq), c);
      rq_retired_.store(m.rsn + 1, std::memory_order_release);
    }
    m.seen = false;
    ++rx_next_msn_;
  }
}

void QueuePair::enter_error() {
  state_.store(QpState::kErr, std::memory_order_release);
  dev_.engine().drop_stream(qpn_);
  flush_all();
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
}

}  // namespace metaroce::nic

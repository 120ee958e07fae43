// SPDX-License-Identifier: Apache-2.0
// Requester and responder logic of a queue pair (spec §5): WQEs from the shared send ring become
// transport messages, arriving segments are placed at their final address in the owner's
// memory, completions leave in order.
#include "datapath/nic/queue_pair.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cstring>
#include <new>

#include "datapath/nic/nic.h"
#include "datapath/wire/mrh.h"

namespace metaroce::nic {

using hostif::Cqe;
using hostif::WqeOp;
using transport::Op;
using transport::Syndrome;

namespace {

WcOpcode send_opcode(WqeOp op) {
  switch (op) {
    case WqeOp::kWrite:
    case WqeOp::kWriteImm:
      return WcOpcode::kRdmaWrite;
    case WqeOp::kRead:
      return WcOpcode::kRdmaRead;
    case WqeOp::kCmpSwp:
      return WcOpcode::kCompSwap;
    case WqeOp::kFetchAdd:
      return WcOpcode::kFetchAdd;
    case WqeOp::kBindMw:
      return WcOpcode::kBindMw;
    case WqeOp::kLocalInv:
      return WcOpcode::kLocalInv;
    case WqeOp::kAtomicWrite:
      return WcOpcode::kAtomicWrite;
    case WqeOp::kSend:
    case WqeOp::kSendImm:
    case WqeOp::kSendInv:
      break;
  }
  return WcOpcode::kSend;
}

Op transport_op(WqeOp op) {
  switch (op) {
    case WqeOp::kSend: return Op::kSend;
    case WqeOp::kSendImm: return Op::kSendImm;
    case WqeOp::kWrite: return Op::kWrite;
    case WqeOp::kWriteImm: return Op::kWriteImm;
    case WqeOp::kRead: return Op::kReadReq;
    case WqeOp::kCmpSwp: return Op::kAtomicCmpSwp;
    case WqeOp::kFetchAdd: return Op::kAtomicFetchAdd;
    case WqeOp::kSendInv: return Op::kSendInv;
    case WqeOp::kAtomicWrite: return Op::kAtomicWrite;
    case WqeOp::kBindMw:    // local: never a message
    case WqeOp::kLocalInv: break;
  }
  return Op::kSend;
}

// What an unreliable connection carries (verbs-mapping.md §15): SENDs and RDMA WRITEs.
bool uc_op(WqeOp op) {
  return op == WqeOp::kSend || op == WqeOp::kSendImm || op == WqeOp::kWrite ||
         op == WqeOp::kWriteImm;
}

// What an XRC initiator sends (§17): RC's messages, without windows (a type 2 window is bound
// to a QP, and an XRC initiator is never the QP an access arrives at).
bool xrc_op(WqeOp op) {
  return uc_op(op) || op == WqeOp::kRead || hostif::is_atomic(op) || op == WqeOp::kAtomicWrite;
}

// Initiators that obey the QP's retry and timeout attributes: the reliable ones.
bool reliable(QpType t) { return t == QpType::kRc || t == QpType::kXrcIni; }

WcStatus remote_status(Syndrome why) {
  switch (why) {
    case Syndrome::kRemoteAccess:
    case Syndrome::kRemoteBounds:
      return WcStatus::kRemAccessErr;
    case Syndrome::kRemoteInvalid:
      return WcStatus::kRemInvReqErr;
    case Syndrome::kRemoteOp:
      return WcStatus::kRemOpErr;
    case Syndrome::kRnr:
      return WcStatus::kRnrRetryExcErr;
    case Syndrome::kRetryExceeded:
    case Syndrome::kUnreachable:
      return WcStatus::kRetryExcErr;
    case Syndrome::kOk:
      break;
  }
  return WcStatus::kGeneralErr;
}

// The 40 bytes a UD receive holds in front of the payload. Like a RoCEv2 NIC receiving over
// IPv4: 20 bytes of zeros, then the IPv4 header of the datagram (ibv_init_ah_from_wc reads the
// source address there).
void make_grh(uint8_t* g, uint32_t src_ip, uint32_t dst_ip, uint32_t payload) {
  std::memset(g, 0, kGrhLen);
  uint8_t* ip = g + 20;
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
}

// The responder's event for a request it rejected (IB spec: the responder's QP reports access
// violations and invalid requests asynchronously; the requester learns from the NAK).
std::optional<AsyncEvent> responder_event(Syndrome why) {
  switch (why) {
    case Syndrome::kRemoteAccess:
    case Syndrome::kRemoteBounds:
      return AsyncEvent::kQpAccessErr;
    case Syndrome::kRemoteInvalid:
      return AsyncEvent::kQpReqErr;
    default:
      return std::nullopt;  // a local error, reported in the receive's completion
  }
}

// The QP's own limits: retry_cnt timeouts, over whatever paths, and the local ACK timeout
// (4.096 us * 2^timeout, 0 = none) bound when RETRY_EXC_ERR comes (congestion.md §4.5); and RNR
// NAKs one packet may collect (7: for ever).
void set_limits(const QpRemote& r, transport::MessageDesc& m) {
  m.retry_cnt = r.retry_cnt;
  m.rnr_retry = r.rnr_retry;
  m.timeout = r.timeout ? transport::Time(int64_t{4096} << std::min<uint8_t>(r.timeout, 31))
                        : transport::Time{0};
}

Syndrome mr_syndrome(MrCheck c) {
  return c == MrCheck::kOutOfBounds ? Syndrome::kRemoteBounds : Syndrome::kRemoteAccess;
}

}  // namespace

QueuePair::QueuePair(Nic& nic, uint32_t qpn, const QpInit& init, hostif::QpHeader* ring)
    : nic_(nic), qpn_(qpn), init_(init), ring_(ring),
      sq_base_(hostif::sq_slot(ring, 0)), sq_mask_(ring->sq_entries - 1),
      sq_stride_(ring->sq_stride), max_send_wr_(ring->max_send_wr),
      max_send_sge_(ring->max_send_sge), max_inline_(ring->max_inline),
      rq_base_(hostif::rq_slot(ring, 0)), rq_mask_(ring->rq_entries - 1),
      rq_stride_(ring->rq_stride), max_recv_wr_(ring->max_recv_wr),
      max_recv_sge_(ring->max_recv_sge), sq_slots_(ring->sq_entries),
      rx_msgs_(init.type == QpType::kUd ? 1 : kRecvWindowInitial), srq_(init.srq),
      ud_seen_(init.type == QpType::kUd ? kUdSeen : 0) {
  if (srq_ && init.type != QpType::kUd) {
    claims_.srq = srq_;
    claims_.slots.resize(kRecvWindowInitial);
    if (srq_->tags()) tm_msgs_.resize(kRecvWindowInitial);
  }
  if (init.type == QpType::kXrcTgt) handles_.push_back({init.owner, init.handle});
  publish_state();
}

QueuePair::~QueuePair() {
  release_claims(claims_);
  for (auto& [srqn, c] : xrc_claims_) release_claims(c);
}

size_t QueuePair::state_bytes() const {
  size_t claims = claims_.slots.capacity() * sizeof(uint32_t);
  for (const auto& [srqn, c] : xrc_claims_) claims += sizeof(c) + c.slots.capacity() * sizeof(uint32_t);
  return sizeof(*this) + sq_slots_.capacity() * sizeof(SendSlot) +
         rx_msgs_.capacity() * sizeof(RecvMsg) + atomics_.capacity() * sizeof(AtomicResult) +
         atomic_writes_.capacity() * sizeof(AtomicWrite) +
         claims + ud_seen_.capacity() * sizeof(UdSeen) + handles_.capacity() * sizeof(Handle);
}

void QueuePair::raise(AsyncEvent ev) const {
  if (init_.type != QpType::kXrcTgt) {
    init_.owner->async_event(init_.handle, ev);
    return;
  }
  // A shared target tells every context that holds it, each under its own handle.
  for (const Handle& h : handles_) h.owner->async_event(h.handle, ev);
}

bool QueuePair::held_by(const Owner* o) const {
  if (init_.type != QpType::kXrcTgt) return init_.owner == o;
  return handles_of(o) > 0;
}

Owner* QueuePair::owner() const {
  if (init_.type != QpType::kXrcTgt) return init_.owner;
  return handles_.empty() ? nullptr : handles_.front().owner;
}

uint32_t QueuePair::handles_of(const Owner* o) const {
  uint32_t n = 0;
  for (const Handle& h : handles_) n += h.owner == o;
  return n;
}

bool QueuePair::drop_handle(const Owner* o, uint64_t handle) {
  for (auto it = handles_.begin(); it != handles_.end(); ++it) {
    if (it->owner == o && it->handle == handle) {
      handles_.erase(it);
      break;
    }
  }
  return handles_.empty();
}

bool QueuePair::drop_owner(const Owner* o) {
  std::erase_if(handles_, [o](const Handle& h) { return h.owner == o; });
  return handles_.empty();
}

void QueuePair::forget_srq(const SharedReceiveQueue* srq) {
  std::erase_if(xrc_claims_, [srq](const auto& e) { return e.second.srq == srq; });
}

void QueuePair::release_claims(SrqClaims& c) {
  if (!c.srq) return;
  for (uint32_t r = c.retired; r != c.next; ++r) c.srq->release(c.slots[r & (c.slots.size() - 1)]);
  c.next = c.retired = 0;
}

QueuePair::SrqClaims* QueuePair::xrc_claims(uint32_t srqn, SharedReceiveQueue* srq) {
  auto it = xrc_claims_.find(srqn);
  if (it != xrc_claims_.end()) return &it->second;
  try {
    SrqClaims c;
    c.srq = srq;
    c.slots.resize(kRecvWindowInitial);
    return &xrc_claims_.emplace(srqn, std::move(c)).first->second;
  } catch (const std::bad_alloc&) {
    return nullptr;
  }
}

QueuePair::SrqClaims* QueuePair::claims_of(const RecvMsg& m) {
  if (init_.type == QpType::kXrcTgt) {
    auto it = xrc_claims_.find(m.srqn);
    return it == xrc_claims_.end() ? nullptr : &it->second;
  }
  return srq_ ? &claims_ : nullptr;
}

CompletionQueue* QueuePair::recv_cq_of(const SrqClaims* c) const {
  if (init_.type == QpType::kXrcTgt) return c ? c->srq->cq() : nullptr;
  return init_.recv_cq;
}

void QueuePair::publish_state() { ring_->state.store(static_cast<uint32_t>(state_)); }

bool QueuePair::has_new_work() const {
  // No queues of its own (an RSS QP's are its table's WQs).
  if (init_.type == QpType::kXrcTgt || init_.type == QpType::kRss) return false;
  if (state_ == QpState::kRts) {
    for (const OwnOp& op : own_ops_)
      if (!op.submitted) return true;
    return !rd_blocked_ && sq_head() != sq_next_;
  }
  if (state_ == QpState::kErr) return sq_head() != sq_retired_ || rq_head() != rq_retired_;
  return false;
}

void QueuePair::reset() {
  nic_.forget_stream(qpn_);
  // The driver resets its heads when the reset is answered (it refuses posts meanwhile).
  ring_->sq_done.store(0);
  ring_->rq_done.store(0);
  sq_next_ = sq_retired_ = rq_retired_ = 0;
  next_rsn_ = 0;
  xrc_rsn_.clear();
  next_wire_msn_ = 0;
  rd_outstanding_ = 0;
  rd_blocked_ = false;
  atomics_.clear();
  atomics_.shrink_to_fit();
  atomic_writes_.clear();
  atomic_writes_.shrink_to_fit();
  rx_next_msn_ = 0;
  rx_msgs_.assign(init_.type == QpType::kUd ? 1 : kRecvWindowInitial, RecvMsg{});
  if (!tm_msgs_.empty()) tm_msgs_.assign(kRecvWindowInitial, TmMsg{});
  tm_next_rsn_ = tm_plain_ = 0;
  own_ops_.clear();
  own_sent_ = 0;
  // SRQ entries this QP claimed and never completed go back to the SRQ (a reset discards
  // work without completions; from ERR they were already flushed).
  release_claims(claims_);
  for (auto& [srqn, c] : xrc_claims_) release_claims(c);
  xrc_claims_.clear();
  comm_est_ = false;
  for (auto& u : ud_seen_) u = UdSeen{};
  for (auto& s : sq_slots_) s = SendSlot{};
}

void QueuePair::set_state(QpState s) {
  switch (s) {
    case QpState::kErr:
      if (state_ != QpState::kErr) enter_error();
      return;
    case QpState::kReset:
      reset();
      break;
    case QpState::kRtr:
      nic_.want_resolve(remote_.ip);
      break;
    default:
      break;
  }
  state_ = s;
  publish_state();
}

void QueuePair::set_remote(const QpRemote& r) {
  remote_ = r;
  remote_.max_rd_atomic = std::min<uint8_t>(r.max_rd_atomic, kMaxRdAtomic);
  remote_.qpn &= 0xffffff;
}

void QueuePair::push_cqe(CompletionQueue* cq, const Cqe& cqe) {
  if (!cq) return;
  cq->stage(cqe);
  nic_.note_dirty(cq);
}

bool QueuePair::drain() {
  if (init_.type == QpType::kXrcTgt || init_.type == QpType::kRss) return false;  // no send queue
  if (state_ == QpState::kErr) {
    // Work posted after the QP failed completes at once, flushed (as verbs specifies).
    if (sq_head() != sq_retired_ || rq_head() != rq_retired_) {
      flush_all();
      return true;
    }
    return false;
  }
  if (state_ != QpState::kRts) return false;
  const bool own = submit_own();
  const uint32_t head = sq_head();
  if (sq_next_ == head) return own;
  // A driver cannot post more than max_send_wr ahead of what was retired: more is garbage.
  if (head - sq_retired_ > max_send_wr_) return false;
  const uint32_t rd_limit = std::max<uint32_t>(remote_.max_rd_atomic, 1);
  rd_blocked_ = false;
  while (sq_next_ != head) {
    uint8_t* slot = sq_slot(sq_next_);
    // One snapshot of the fixed part: the application may scribble on its own ring meanwhile,
    // which can only hurt its own traffic.
    hostif::SendWqe w;
    std::memcpy(&w, slot, sizeof(w));
    const bool known_op = static_cast<uint8_t>(w.op) < hostif::kWqeOpCount;
    if (known_op && hostif::needs_response(w.op) && rd_outstanding_ >= rd_limit) {
      // max_rd_atomic: this READ/atomic waits (and, in order, everything behind it).
      rd_blocked_ = true;
      break;
    }
    SendSlot& s = sq_slots_[sq_next_ & sq_mask_];
    s = SendSlot{};
    s.msn = sq_next_;
    s.wr_id = w.wr_id;
    s.op = known_op ? w.op : WqeOp::kSend;
    s.signaled = (w.flags & hostif::kSignaled) || init_.sq_sig_all;
    s.compare_add = w.compare_add;
    s.swap = w.swap;
    ++sq_next_;
    if (!known_op || w.num_sge > max_send_sge_ || w.inline_len > max_inline_ ||
        (init_.type == QpType::kUd && w.op != WqeOp::kSend && w.op != WqeOp::kSendImm) ||
        (init_.type == QpType::kUc && !uc_op(w.op)) ||
        (init_.type == QpType::kXrcIni && !xrc_op(w.op)) ||
        (init_.type == QpType::kRaw && w.op != WqeOp::kSend) || init_.type == QpType::kWq) {
      s.failed = true;
      s.status = WcStatus::kLocQpOpErr;
      break;
    }
    if (hostif::is_local(w.op)) {
      execute_local(w, s);
      if (s.failed) break;  // the QP goes to error at retirement
      continue;
    }
    uint64_t length = w.inline_len;
    const unsigned int need = hostif::needs_response(w.op) ? unsigned{kLocalWrite} : 0u;
    const hostif::Sge* sge = hostif::send_sges(slot);
    for (uint32_t i = 0; i < w.num_sge; ++i) {
      const hostif::Sge g = sge[i];
      length += g.length;
      if (nic_.mrs().check(g.lkey, init_.pd, need, g.addr, g.length, nullptr) != MrCheck::kOk) {
        s.failed = true;
        s.status = WcStatus::kLocProtErr;
      }
    }
    // An ATOMIC_WRITE's 8 bytes are in the WQE itself when it names no buffer.
    if (w.op == WqeOp::kAtomicWrite && w.num_sge == 0 && w.inline_len == 0) length = kAtomicSize;
    if (length > kMaxMrSize || (hostif::is_atomic(w.op) && (length != kAtomicSize || w.inline_len)) ||
        (w.op == WqeOp::kAtomicWrite && length != kAtomicSize) ||
        (init_.type == QpType::kUd && length > nic_.active_mtu()) ||
        (init_.type == QpType::kRaw && (length < kEthHeaderLen || length > nic_.max_raw_frame()))) {
      s.failed = true;
      s.status = WcStatus::kLocLenErr;
    }
    if (s.failed) break;  // the QP goes to error at retirement; nothing behind it is sent
    s.length = static_cast<uint32_t>(length);
    if (init_.type == QpType::kRaw) {
      // An Ethernet frame, whole in the WQE's buffers: gathered now, put on the port by the
      // link layer once read (Nic::finish_raw_sends), no transport message.
      uint8_t* frame = nic_.raw_tx_buffer(qpn_, s.msn, s.length);
      if (!frame) {
        s.failed = true;
        s.status = WcStatus::kLocQpOpErr;
        break;
      }
      s.submitted = true;
      gather(s.msn, 0, {frame, s.length});
      continue;
    }
    if (init_.type == QpType::kUd && wire::is_multicast_ipv4(w.ud_ip)) {
      // A datagram to a group (verbs-mapping.md §7): one frame to the group's address, gathered
      // now and handed to the link layer once read, outside every connection (wire.md §8). It
      // completes once it leaves, as a datagram no member took is not the sender's error.
      const uint32_t len = wire::kDatagramHeadersLen + s.length;
      uint8_t* frame = nic_.datagram_tx_buffer(qpn_, s.msn, w.ud_ip, len);
      if (!frame) {
        s.failed = true;
        s.status = WcStatus::kLocQpOpErr;
        break;
      }
      wire::Datagram d;
      d.with_imm = w.op == WqeOp::kSendImm;
      d.src_qpn = qpn_;
      d.msn = group_msn_++;
      d.qkey = w.rkey;  // the provider put the Q_Key there (the QP's own for a high bit)
      d.imm = w.imm;
      d.timestamp = static_cast<uint32_t>(nic_.now().count());
      wire::encode_datagram({frame, wire::kDatagramHeadersLen}, d, s.length);
      s.submitted = true;
      gather(s.msn, 0, {frame + wire::kDatagramHeadersLen, s.length});
      continue;
    }
    transport::MessageDesc m;
    m.peer_ip = remote_.ip;
    m.lane = lane_;
    m.dst_stream = remote_.qpn;
    m.src_stream = qpn_;
    s.wire_msn = next_wire_msn_++;
    m.msn = s.wire_msn;
    m.op = transport_op(w.op);
    if (init_.type == QpType::kUd) {
      // A datagram: its own destination, the Q_Key where an RC message carries an rkey, and
      // no RSN (the receiver takes its next receive, docs/spec/verbs-mapping.md §7).
      m.peer_ip = w.ud_ip;
      m.dst_stream = w.ud_qpn & 0xffffff;
      nic_.want_resolve(w.ud_ip);
    } else if (init_.type == QpType::kXrcIni) {
      // Every request names the SRQ it is for; receives are numbered per SRQ, since the
      // target claims them from each SRQ in the order of their numbers (§17).
      m.xrc = true;
      m.xrc_srqn = w.xrc_srqn & wire::kXrcSrqnMask;
      if (w.op == WqeOp::kSend || w.op == WqeOp::kSendImm || w.op == WqeOp::kWriteImm) {
        try {
          m.rsn = xrc_rsn_[m.xrc_srqn]++;
        } catch (const std::bad_alloc&) {
          --next_wire_msn_;  // not sent: it fails here, and the QP with it
          s.failed = true;
          s.status = WcStatus::kLocQpOpErr;
          break;
        }
      }
    } else if (w.op == WqeOp::kSend || w.op == WqeOp::kSendImm || w.op == WqeOp::kWriteImm ||
               w.op == WqeOp::kSendInv) {
      m.rsn = next_rsn_++;
    }
    if (reliable(init_.type)) set_limits(remote_, m);
    m.length = s.length;
    s.resp_length = w.op == WqeOp::kRead ? s.length : 0;
    if (hostif::is_atomic(w.op)) {
      m.length = kAtomicRequestLen;
      s.resp_length = kAtomicSize;
    }
    if (hostif::needs_response(w.op)) {
      if (rd_outstanding_++ == 0) response_progress_ = nic_.now();
    }
    m.remote_addr = w.remote_addr;
    m.rkey = w.rkey;
    m.imm = w.imm;
    m.cookie = Nic::cookie(qpn_, s.msn);
    s.submitted = true;
    nic_.transport().submit(m);
  }
  retire_sends();
  return true;
}

bool QueuePair::send_done(const SendSlot& s) const {
  if (s.failed) return true;
  if (!s.acked) return false;
  return !hostif::needs_response(s.op) || s.read_bytes >= s.resp_length;
}

void QueuePair::retire_sends() {
  uint32_t r = sq_retired_;
  while (r != sq_next_) {
    const SendSlot& s = sq_slots_[r & sq_mask_];
    if (!send_done(s)) break;
    const bool report = s.failed || s.signaled;
    Cqe c{};
    if (report) {
      c.wr_id = s.wr_id;
      c.status = s.failed ? s.status : WcStatus::kSuccess;
      c.opcode = send_opcode(s.op);
      c.byte_len = hostif::needs_response(s.op) ? s.resp_length : 0;
      c.qp_num = qpn_;
      c.queue = hostif::CqeQueue::kSend;
      c.wqe = r;
    }
    if (hostif::needs_response(s.op) && s.submitted && rd_outstanding_ > 0) {
      --rd_outstanding_;
      response_progress_ = nic_.now();
    }
    // Staged, then the slot freed, then (at the end of the pass) visible: an application that
    // reposts as soon as it polls the completion finds room in the queue, and the driver of an
    // engine killed in between finds the completion staged (hostif::cq_recover_staged).
    if (report) push_cqe(init_.send_cq, c);
    ++r;
    sq_retired_ = r;
    ring_->sq_done.store(r);
    if (s.failed) {
      const bool transport_gave_up =
          s.status == WcStatus::kRetryExcErr || s.status == WcStatus::kRnrRetryExcErr;
      enter_error(transport_gave_up ? std::optional(AsyncEvent::kQpFatal) : std::nullopt);
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

void QueuePair::gather_failed(uint32_t msn) {
  SendSlot& s = sq_slots_[msn & sq_mask_];
  if (s.msn != msn || !s.submitted || s.failed || state_ == QpState::kErr) return;
  s.failed = true;
  s.status = WcStatus::kLocProtErr;
  retire_sends();
}

void QueuePair::check_responses(transport::Time now) {
  const bool own_reads =
      std::any_of(own_ops_.begin(), own_ops_.end(), [](const OwnOp& op) { return op.is_read; });
  if ((rd_outstanding_ == 0 && !own_reads) || state_ != QpState::kRts || remote_.timeout == 0)
    return;
  const transport::Time limit =
      transport::Time(int64_t{4096} << std::min<uint8_t>(remote_.timeout, 31)) *
      (int64_t{remote_.retry_cnt} + 1);
  if (now - response_progress_ < limit) return;
  // The oldest READ/atomic still waiting for its answer fails, and with it the QP.
  for (uint32_t r = sq_retired_; r != sq_next_; ++r) {
    SendSlot& s = sq_slots_[r & sq_mask_];
    if (s.submitted && !s.failed && hostif::needs_response(s.op) && s.read_bytes < s.resp_length) {
      s.failed = true;
      s.status = WcStatus::kRetryExcErr;
      retire_sends();
      return;
    }
  }
  retire_sends();
  // Else a rendezvous READ of the QP's own (tag matching) waits in vain: its tag fails.
  for (OwnOp& op : own_ops_) {
    if (op.is_read && op.submitted) {
      rndv_done(op, WcStatus::kRetryExcErr);
      return;
    }
  }
}

void QueuePair::gather(uint32_t msn, uint32_t offset, std::span<uint8_t> out) {
  const SendSlot& s = sq_slots_[msn & sq_mask_];
  if (s.msn != msn || !s.submitted) {
    std::memset(out.data(), 0, out.size());
    return;
  }
  if (hostif::is_atomic(s.op)) {
    // The request's payload is its operands, not the local buffer (that receives the answer).
    uint8_t ops[kAtomicRequestLen];
    for (int i = 0; i < 8; ++i) {
      ops[i] = static_cast<uint8_t>(s.compare_add >> (56 - 8 * i));
      ops[8 + i] = static_cast<uint8_t>(s.swap >> (56 - 8 * i));
    }
    std::memset(out.data(), 0, out.size());
    if (offset < kAtomicRequestLen)
      std::memcpy(out.data(), ops + offset, std::min<size_t>(out.size(), kAtomicRequestLen - offset));
    return;
  }
  uint8_t* slot = sq_slot(msn);
  const hostif::SendWqe* w = hostif::send_wqe(slot);
  if (s.op == WqeOp::kAtomicWrite && w->num_sge == 0 && w->inline_len == 0) {
    // The value as the WQE carried it at submission (hostif::SendWqe), byte for byte.
    uint8_t value[kAtomicSize];
    std::memcpy(value, &s.compare_add, kAtomicSize);
    std::memset(out.data(), 0, out.size());
    if (offset < kAtomicSize)
      std::memcpy(out.data(), value + offset, std::min<size_t>(out.size(), kAtomicSize - offset));
    return;
  }
  // Copied into the WQE by the driver at post time, the SGEs checked at submission.
  const bool gathered = (w->flags & hostif::kGathered) && w->inline_len == 0 &&
                        s.length <= max_inline_;
  const uint32_t inline_len = gathered ? s.length : std::min(w->inline_len, max_inline_);
  if (inline_len > 0) {
    const uint8_t* data = hostif::send_inline(slot, max_send_sge_);
    const size_t n = offset < inline_len ? std::min<size_t>(out.size(), inline_len - offset) : 0;
    std::memcpy(out.data(), data + offset, n);
    std::memset(out.data() + n, 0, out.size() - n);
    return;
  }
  const uint32_t num_sge = std::min<uint32_t>(w->num_sge, max_send_sge_);
  const hostif::Sge* sge = hostif::send_sges(slot);
  Memory& mem = init_.owner->memory();
  size_t done = 0;
  for (uint32_t i = 0; i < num_sge && done < out.size(); ++i) {
    const hostif::Sge g = sge[i];
    if (offset >= g.length) {
      offset -= g.length;
      continue;
    }
    const size_t n = std::min<size_t>(g.length - offset, out.size() - done);
    // Checked at submission; its region gives where the SGE's (IOVA) address lies.
    const MemoryRegion* mr = nic_.mrs().find(g.lkey);
    const uint64_t at = mr ? mr->translate(g.addr + offset) : g.addr + offset;
    nic_.queue_read(&mem, at, out.subspan(done, n), qpn_, msn);
    done += n;
    offset = 0;
  }
  // SGEs changed under the NIC's feet after posting: what is missing goes out as zeros.
  if (done < out.size()) std::memset(out.data() + done, 0, out.size() - done);
}

QueuePair::Receive QueuePair::receive_of(const uint8_t* slot, uint32_t max_sge, uint32_t pd) const {
  Receive r;
  r.wqe = reinterpret_cast<const hostif::RecvWqe*>(slot);
  r.sge = reinterpret_cast<const hostif::Sge*>(slot + sizeof(hostif::RecvWqe));
  r.num_sge = std::min(r.wqe->num_sge, max_sge);
  r.pd = pd;
  return r;
}

Syndrome QueuePair::scatter(const Receive& r, uint32_t offset, std::span<const uint8_t> data,
                            WcStatus* local_err) {
  size_t done = 0;
  for (uint32_t i = 0; i < r.num_sge && done < data.size(); ++i) {
    const hostif::Sge g = r.sge[i];
    if (offset >= g.length) {
      offset -= g.length;
      continue;
    }
    const size_t n = std::min<size_t>(g.length - offset, data.size() - done);
    const MemoryRegion* mr = nullptr;
    if (nic_.mrs().check(g.lkey, r.pd, kLocalWrite, g.addr + offset, n, &mr) != MrCheck::kOk) {
      *local_err = WcStatus::kLocProtErr;
      return Syndrome::kRemoteOp;
    }
    nic_.queue_write(mr->mem, mr->translate(g.addr + offset), data.subspan(done, n), qpn_, 0);
    done += n;
    offset = 0;
  }
  if (done < data.size()) {
    *local_err = WcStatus::kLocLenErr;
    return Syndrome::kRemoteInvalid;
  }
  return Syndrome::kOk;
}

QueuePair::SendSlot* QueuePair::slot_of_wire_msn(uint32_t wire_msn) {
  // Without binds, invalidations or messages of the QP's own the slot is the msn's; a bind or
  // invalidation before it moves it one later, an own message one earlier. An answer belongs to
  // an outstanding WQE: the search runs from the latest slot it can be down to the oldest.
  if (sq_next_ == sq_retired_) return nullptr;
  const uint32_t skew = sq_next_ + own_sent_ - next_wire_msn_;  // binds and invalidations
  uint32_t idx = wire_msn + skew;
  if (static_cast<int32_t>(idx - (sq_next_ - 1)) > 0) idx = sq_next_ - 1;
  for (; static_cast<int32_t>(idx - sq_retired_) >= 0; --idx) {
    SendSlot& s = sq_slots_[idx & sq_mask_];
    if (s.msn == idx && s.wire_msn == wire_msn && !hostif::is_local(s.op)) return &s;
    if (own_sent_ == 0 && idx == wire_msn) break;  // as low as it can be
  }
  return nullptr;
}

void QueuePair::execute_local(const hostif::SendWqe& w, SendSlot& s) {
  int err = 0;
  if (init_.type != QpType::kRc) {
    err = EINVAL;
  } else if (w.op == WqeOp::kBindMw) {
    const auto lkey = static_cast<uint32_t>(w.swap >> 32);
    const auto access = static_cast<unsigned>(w.swap & 0xffffffffu);
    err = nic_.mrs().bind_window(w.rkey, w.imm, init_.pd, qpn_, lkey, w.remote_addr,
                                 w.compare_add, access);
  } else {
    err = nic_.mrs().invalidate_window(w.rkey, init_.pd, 0);
  }
  s.submitted = s.acked = true;
  if (err) {
    s.failed = true;
    s.status = w.op == WqeOp::kBindMw ? WcStatus::kMwBindErr : WcStatus::kLocQpOpErr;
  }
}

Syndrome QueuePair::place_read_response(const transport::Segment& seg) {
  if (!own_ops_.empty() && place_own_read(seg)) return Syndrome::kOk;
  SendSlot* sp = slot_of_wire_msn(seg.msn);
  if (!sp) return Syndrome::kOk;
  SendSlot& s = *sp;
  if (!s.submitted || s.failed || !hostif::needs_response(s.op)) return Syndrome::kOk;
  if (s.read_bytes >= s.resp_length) return Syndrome::kOk;  // an answer seen again
  if (seg.src_stream != remote_.qpn || seg.total_length != s.resp_length ||
      uint64_t{seg.offset} + seg.payload.size() > s.resp_length)
    return Syndrome::kRemoteInvalid;
  // The answer lands in the READ's (or atomic's) own SGEs.
  uint8_t* slot = sq_slot(s.msn);
  Receive r;
  r.sge = hostif::send_sges(slot);
  r.num_sge = std::min<uint32_t>(hostif::send_wqe(slot)->num_sge, max_send_sge_);
  r.pd = init_.pd;
  WcStatus err = WcStatus::kSuccess;
  if (scatter(r, seg.offset, seg.payload, &err) != Syndrome::kOk) {
    s.failed = true;
    s.status = err;
  } else {
    s.read_bytes += static_cast<uint32_t>(seg.payload.size());
    response_progress_ = nic_.now();
  }
  retire_sends();
  return Syndrome::kOk;
}

Syndrome QueuePair::deliver(const transport::Segment& seg) {
  if (init_.type == QpType::kUd) return deliver_ud(seg);
  if (init_.type == QpType::kRaw || init_.type == QpType::kWq || init_.type == QpType::kRss)
    return Syndrome::kUnreachable;  // frames only, never a stream
  const QpState st = state_;
  if (seg.op == Op::kReadResp) {
    if (st != QpState::kRts) return Syndrome::kRemoteInvalid;
    return place_read_response(seg);
  }
  if (st != QpState::kRtr && st != QpState::kRts) return Syndrome::kRemoteInvalid;
  if (seg.peer_ip != remote_.ip || seg.src_stream != remote_.qpn) return Syndrome::kRemoteInvalid;
  // An XRC initiator has nothing to receive but answers.
  if (init_.type == QpType::kXrcIni) return Syndrome::kRemoteInvalid;
  if (st == QpState::kRtr && !comm_est_) {
    comm_est_ = true;  // the connection is established: the peer reached us before our RTS
    raise(AsyncEvent::kCommEst);
  }
  const bool atomic = seg.op == Op::kAtomicCmpSwp || seg.op == Op::kAtomicFetchAdd;
  const uint32_t ahead = seg.msn - rx_next_msn_;
  if (ahead >= 0x80000000u) {
    // A message completed long ago: a duplicate. An atomic is answered again, not re-executed.
    return atomic ? execute_atomic(seg, true, init_.pd) : Syndrome::kOk;
  }
  // Where its receive comes from and which PD checks its keys: the QP's own, or, at an XRC
  // target, those of the SRQ of its domain that the request names (verbs-mapping.md §17).
  uint32_t pd = init_.pd;
  SrqClaims* claims = srq_ ? &claims_ : nullptr;
  if (init_.type == QpType::kXrcTgt || seg.xrc) {
    SharedReceiveQueue* x = init_.type == QpType::kXrcTgt && seg.xrc
                                ? nic_.xrc_srq(seg.xrc_srqn, init_.xrcd)
                                : nullptr;
    if (!x) {
      // No such SRQ in the domain, no SRQ named, or one named at a QP that is not a target:
      // an invalid request, which ends the connection as any does.
      enter_error(AsyncEvent::kQpReqErr);
      return Syndrome::kRemoteInvalid;
    }
    claims = xrc_claims(seg.xrc_srqn, x);
    if (!claims) return Syndrome::kRnr;  // no memory for its claims now: the sender comes back
    pd = x->pd();
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
    Syndrome r = execute_atomic(seg, duplicate, pd);
    m.seen = true;
    complete_receives();
    if (r != Syndrome::kOk) enter_error(responder_event(r));
    return r;
  }
  // A TM SRQ's QP decides where each message goes from its headers, once (§19).
  const bool tm = !tm_msgs_.empty() && (seg.op == Op::kSend || seg.op == Op::kSendImm ||
                                        seg.op == Op::kSendInv || seg.op == Op::kWriteImm);
  uint32_t prsn = seg.rsn;
  if (tm && (!m.seen || m.msn != seg.msn)) {
    TmMsg d;
    const Syndrome s = tm_decide(seg, &d, &prsn);
    if (s != Syndrome::kOk) return s;
    tm_msg(seg.msn) = d;
  }
  if (!m.seen || m.msn != seg.msn) {
    m = RecvMsg{};
    m.msn = seg.msn;
    m.srqn = seg.xrc_srqn;
    m.total = seg.total_length;
    m.rsn = prsn;
    m.imm = seg.op == Op::kSendInv ? seg.rkey : seg.imm;
    m.with_imm = seg.op == Op::kWriteImm || seg.op == Op::kSendImm;
    m.with_inv = seg.op == Op::kSendInv;
    m.is_write = seg.op == Op::kWrite || seg.op == Op::kWriteImm;
    m.consumes_recv =
        seg.op != Op::kWrite && seg.op != Op::kReadReq && seg.op != Op::kAtomicWrite;
  } else if (m.atomic_write) {
    return Syndrome::kOk;  // a copy of one already checked and waiting for its turn
  }
  Syndrome result = Syndrome::kOk;
  uint32_t placed = static_cast<uint32_t>(seg.payload.size());
  switch (seg.op) {
    case Op::kWrite:
    case Op::kWriteImm: {
      if (m.consumes_recv && !recv_for(claims, m.rsn)) return Syndrome::kRnr;
      const MemoryRegion* mr = nullptr;
      const MrCheck c = remote_access(seg, pd, kRemoteWrite, seg.payload.size(), &mr);
      if (c == MrCheck::kOk) {
        if (!seg.payload.empty())
          nic_.queue_write(mr->mem, mr->translate(seg.remote_addr), seg.payload, qpn_, seg.msn);
      } else {
        result = mr_syndrome(c);
        m.status = WcStatus::kRemAccessErr;
      }
      break;
    }
    case Op::kSend:
    case Op::kSendImm:
    case Op::kSendInv: {
      if (tm) {
        const TmMsg& d = tm_msg(seg.msn);
        if (d.kind == TmKind::kRndv) break;  // headers only: the data comes by READ
        if (d.kind == TmKind::kEager) {
          // The payload after the TMH, into the tag's buffer.
          if (seg.total_length - kTmhLen > d.sge.length) {
            m.status = WcStatus::kLocLenErr;
            result = Syndrome::kRemoteInvalid;
            break;
          }
          const uint32_t skip = seg.offset < kTmhLen ? kTmhLen - seg.offset : 0;
          if (skip >= seg.payload.size()) break;
          Receive r;
          r.sge = &d.sge;
          r.num_sge = 1;
          r.pd = srq_->pd();
          WcStatus err = WcStatus::kSuccess;
          result = scatter(r, seg.offset + skip - kTmhLen, seg.payload.subspan(skip), &err);
          if (result != Syndrome::kOk) m.status = err;
          break;
        }
      }
      const auto rp = recv_for(claims, m.rsn);
      if (!rp) return Syndrome::kRnr;
      if (seg.op == Op::kSendInv && m.received == 0 && !m.invalidated) {
        // The window goes before the receive completes (it must be a type 2 window of our PD
        // bound to this QP): once, whichever packet of the message comes first.
        if (nic_.mrs().invalidate_window(seg.rkey, pd, qpn_) != 0) {
          m.status = WcStatus::kRemInvReqErr;
          result = Syndrome::kRemoteInvalid;
          break;
        }
        m.invalidated = true;
      }
      if (seg.total_length > room_of(*rp)) {
        m.status = WcStatus::kLocLenErr;
        result = Syndrome::kRemoteInvalid;
      } else {
        WcStatus err = WcStatus::kSuccess;
        result = scatter(*rp, seg.offset, seg.payload, &err);
        if (result != Syndrome::kOk) m.status = err;
      }
      break;
    }
    case Op::kReadReq: {
      const MemoryRegion* mr = nullptr;
      const MrCheck c = remote_access(seg, pd, kRemoteRead, seg.total_length, &mr);
      if (c == MrCheck::kOk) {
        transport::MessageDesc resp;
        resp.peer_ip = seg.peer_ip;
        resp.dst_stream = seg.src_stream;
        resp.src_stream = qpn_;
        resp.msn = seg.msn;
        resp.op = Op::kReadResp;
        resp.lane = lane_;
        resp.length = seg.total_length;
        nic_.queue_read_response(resp, mr ? mr->mem : nullptr,
                                 mr ? mr->translate(seg.remote_addr) : 0, &seg);
      } else {
        result = mr_syndrome(c);
      }
      placed = 0;
      m.total = 0;  // nothing arrives for a READ request but the request itself
      break;
    }
    case Op::kAtomicWrite: {
      // One packet of 8 bytes for an aligned target the QP and the region let us write
      // (IBV_ACCESS_REMOTE_WRITE, as for an RDMA WRITE). It is stored once every earlier
      // message of the stream is in place, so a flag written after data never shows before it.
      if (seg.payload.size() != kAtomicSize || seg.total_length != kAtomicSize ||
          (seg.remote_addr & (kAtomicSize - 1)) != 0) {
        result = Syndrome::kRemoteInvalid;
        break;
      }
      const MrCheck c = remote_access(seg, pd, kRemoteWrite, kAtomicSize, nullptr);
      if (c != MrCheck::kOk) {
        result = mr_syndrome(c);
        break;
      }
      AtomicWrite a{seg.msn, seg.rkey, pd, seg.remote_addr, 0};
      std::memcpy(&a.value, seg.payload.data(), kAtomicSize);
      try {
        atomic_writes_.push_back(a);
      } catch (const std::bad_alloc&) {
        return Syndrome::kRnr;  // no memory to hold it now: the sender comes back
      }
      m.atomic_write = true;
      break;
    }
    case Op::kReadResp:
    case Op::kAtomicCmpSwp:  // handled above
    case Op::kAtomicFetchAdd:
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

void QueuePair::placement_failed(uint32_t /*msn*/) {
  if (state_ == QpState::kErr) return;
  // The data of a message this pass completed did not reach memory: its receive completions,
  // staged but not yet visible, carry the error instead (IB: the responder's local access
  // violation), and the QP fails as on any access error.
  std::vector<CompletionQueue*> cqs{init_.recv_cq};
  if (!tm_msgs_.empty()) cqs.push_back(tm_cq());
  for (const auto& [srqn, c] : xrc_claims_) cqs.push_back(c.srq->cq());
  for (CompletionQueue* cq : cqs) {
    if (!cq) continue;
    hostif::CqProducer& p = cq->producer();
    for (uint32_t i = 0; i < p.staged(); ++i) {
      Cqe& c = p.staged_at(i);
      if (c.qp_num == qpn_ && c.status == WcStatus::kSuccess &&
          (c.opcode == WcOpcode::kRecv || c.opcode == WcOpcode::kRecvRdmaWithImm ||
           c.opcode == WcOpcode::kTmRecv || c.opcode == WcOpcode::kTmNoTag))
        c.status = WcStatus::kLocAccessErr;
    }
  }
  enter_error(AsyncEvent::kQpAccessErr);
}

// The QP's own remote access rights, then the key's (its region or window, PD and bounds) for
// `len` bytes at the request's remote address.
MrCheck QueuePair::remote_access(const transport::Segment& seg, uint32_t pd, unsigned int need,
                                 uint64_t len, const MemoryRegion** mr) const {
  if (!(access_ & need)) return MrCheck::kNoAccess;
  // A zero-length RDMA WRITE or READ names no memory, so its R_Key and address are not
  // checked (IBA C9-88, as hardware and rxe do): UCX flushes an RC endpoint with an empty
  // inline WRITE whose rkey and address are 0.
  if (len == 0 && seg.total_length == 0) {
    if (mr) *mr = nullptr;
    return MrCheck::kOk;
  }
  return nic_.mrs().check_remote(seg.rkey, pd, qpn_, need, seg.remote_addr, len, mr);
}

Syndrome QueuePair::execute_atomic(const transport::Segment& seg, bool duplicate, uint32_t pd) {
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
  const MemoryRegion* mr = nullptr;
  const MrCheck c = remote_access(seg, pd, kRemoteAtomic, kAtomicSize, &mr);
  if (c != MrCheck::kOk) return mr_syndrome(c);
  uint64_t compare_add = 0, swap = 0;
  for (int i = 0; i < 8; ++i) {
    compare_add = (compare_add << 8) | seg.payload[i];
    swap = (swap << 8) | seg.payload[8 + i];
  }
  // Atomic with respect to every other atomic of this NIC (IBV_ATOMIC_HCA): the engine is one
  // thread, and earlier writes of this pass are carried out first (RC ordering).
  nic_.flush_writes();
  uint64_t original = 0;
  const uint64_t target = mr->translate(seg.remote_addr);
  Access rd{target, reinterpret_cast<uint8_t*>(&original), kAtomicSize};
  if (mr->mem->read({&rd, 1}) != 1) return Syndrome::kRemoteAccess;
  uint64_t value = original;
  if (seg.op == Op::kAtomicCmpSwp) {
    if (original == compare_add) value = swap;
  } else {
    value = original + compare_add;
  }
  if (value != original) {
    Access wr{target, reinterpret_cast<uint8_t*>(&value), kAtomicSize};
    if (mr->mem->write({&wr, 1}) != 1) return Syndrome::kRemoteAccess;
  }
  if (atomics_.empty()) atomics_.resize(kAtomicCache);
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
  resp.lane = lane_;
  resp.length = kAtomicSize;
  // The answer is engine memory (the record outlives the response: kAtomicCache).
  nic_.queue_read_response(resp, nullptr, reinterpret_cast<uintptr_t>(&r.original), nullptr);
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
  if (!tm_msgs_.empty()) {
    std::vector<TmMsg> tm_bigger;
    try {
      tm_bigger.resize(size);
    } catch (const std::bad_alloc&) {
      return false;
    }
    for (uint32_t k = 0; k < rx_msgs_.size(); ++k) {
      const uint32_t msn = rx_next_msn_ + k;
      tm_bigger[msn & (size - 1)] = tm_msg(msn);
    }
    tm_msgs_.swap(tm_bigger);
  }
  rx_msgs_.swap(bigger);
  return true;
}

void QueuePair::complete_receives() {
  for (;;) {
    RecvMsg& m = rx_msg(rx_next_msn_);
    if (!m.seen || m.msn != rx_next_msn_ || m.received < m.total) return;
    if (!tm_msgs_.empty() && tm_msg(rx_next_msn_).kind != TmKind::kNone) {
      tm_complete(m, tm_msg(rx_next_msn_));
      m.seen = false;
      ++rx_next_msn_;
      continue;
    }
    if (m.atomic_write && !store_atomic_write(m.msn)) {
      m.seen = false;
      ++rx_next_msn_;
      enter_error(AsyncEvent::kQpAccessErr);
      return;
    }
    SrqClaims* claims = m.consumes_recv ? claims_of(m) : nullptr;
    // An XRC target's message whose SRQ went away meanwhile completes nowhere.
    if (m.consumes_recv && (claims || init_.type != QpType::kXrcTgt)) {
      Cqe c{};
      c.status = m.status;
      c.opcode = m.is_write ? WcOpcode::kRecvRdmaWithImm : WcOpcode::kRecv;
      c.byte_len = m.total;
      c.imm = m.imm;
      c.qp_num = qpn_;
      c.src_qp = remote_.qpn;
      c.wc_flags = m.with_imm ? hostif::kWcWithImm : m.with_inv ? hostif::kWcWithInv : 0;
      complete_recv(claims, m.rsn, c, recv_cq_of(claims));
    }
    m.seen = false;
    ++rx_next_msn_;
  }
}

// An ATOMIC_WRITE's turn: the earlier messages' writes of this pass land first, then its 8
// bytes in one access of 8 aligned bytes (verbs-mapping.md §3). False if its region no longer
// lets it (deregistered or invalidated since it arrived) or the memory cannot be written.
bool QueuePair::store_atomic_write(uint32_t msn) {
  auto it = std::find_if(atomic_writes_.begin(), atomic_writes_.end(),
                         [msn](const AtomicWrite& a) { return a.msn == msn; });
  if (it == atomic_writes_.end()) return false;
  AtomicWrite a = *it;
  atomic_writes_.erase(it);
  const MemoryRegion* mr = nullptr;
  if (nic_.mrs().check_remote(a.rkey, a.pd, qpn_, kRemoteWrite, a.addr, kAtomicSize, &mr) !=
      MrCheck::kOk)
    return false;
  nic_.flush_writes();
  Access wr{mr->translate(a.addr), reinterpret_cast<uint8_t*>(&a.value), kAtomicSize};
  return mr->mem->write({&wr, 1}) == 1;
}

void QueuePair::enter_error(std::optional<AsyncEvent> why) {
  state_ = QpState::kErr;
  publish_state();
  nic_.forget_stream(qpn_);
  flush_all();
  if (why) raise(*why);
  // Every SRQ entry this QP claimed has now completed: the application may destroy it.
  if (srq_) raise(AsyncEvent::kQpLastWqeReached);
}

void QueuePair::flush_all() {
  if (init_.type == QpType::kRss) return;
  if (init_.type == QpType::kXrcTgt) {
    // No queues of its own: what it claimed of each SRQ is flushed into that SRQ's CQ.
    for (auto& [srqn, c] : xrc_claims_) flush_claims(c, c.srq->cq());
    return;
  }
  const uint32_t head = sq_head();
  // Only what the driver could have posted: a garbage head flushes nothing beyond the ring.
  const uint32_t sq_end = head - sq_retired_ <= max_send_wr_ ? head : sq_retired_;
  for (uint32_t r = sq_retired_; r != sq_end; ++r) {
    Cqe c{};
    if (r - sq_retired_ < sq_next_ - sq_retired_) {
      const SendSlot& s = sq_slots_[r & sq_mask_];
      c.wr_id = s.wr_id;
      c.opcode = send_opcode(s.op);
    } else {
      const hostif::SendWqe* w = hostif::send_wqe(sq_slot(r));
      c.wr_id = w->wr_id;
      c.opcode = static_cast<uint8_t>(w->op) < hostif::kWqeOpCount ? send_opcode(w->op)
                                                                     : WcOpcode::kSend;
    }
    c.status = WcStatus::kWrFlushErr;
    c.qp_num = qpn_;
    c.queue = hostif::CqeQueue::kSend;
    c.wqe = r;
    push_cqe(init_.send_cq, c);
  }
  sq_next_ = sq_retired_ = sq_end;
  ring_->sq_done.store(sq_end);
  rd_outstanding_ = 0;
  rd_blocked_ = false;
  const uint32_t rhead = rq_head();
  const uint32_t rq_end = rhead - rq_retired_ <= max_recv_wr_ ? rhead : rq_retired_;
  for (uint32_t r = rq_retired_; r != rq_end; ++r) {
    Cqe c{};
    c.wr_id = hostif::recv_wqe(rq_slot(r))->wr_id;
    c.status = WcStatus::kWrFlushErr;
    c.opcode = WcOpcode::kRecv;
    c.qp_num = qpn_;
    c.queue = hostif::CqeQueue::kRecv;
    c.wqe = r;
    push_cqe(init_.recv_cq, c);
  }
  rq_retired_ = rq_end;
  ring_->rq_done.store(rq_end);
  // SRQ entries claimed by this QP are flushed; those never claimed stay in the SRQ for others.
  flush_claims(claims_, tm_msgs_.empty() ? init_.recv_cq : tm_cq());
  // Rendezvous READs not done: their tags complete flushed (a FIN not sent is not owed).
  for (const OwnOp& op : own_ops_) {
    if (!op.is_read) continue;
    Cqe c{};
    c.wr_id = op.wr_id;
    c.status = WcStatus::kWrFlushErr;
    c.opcode = WcOpcode::kTmRecv;
    c.qp_num = qpn_;
    push_cqe(tm_cq(), c);
  }
  own_ops_.clear();
}

void QueuePair::flush_claims(SrqClaims& c, CompletionQueue* cq) {
  if (!c.srq) return;
  for (uint32_t r = c.retired; r != c.next; ++r) {
    Cqe e{};
    e.status = WcStatus::kWrFlushErr;
    e.opcode = WcOpcode::kRecv;
    e.qp_num = qpn_;
    complete_recv(&c, r, e, cq);
  }
}

std::optional<QueuePair::Receive> QueuePair::recv_for(SrqClaims* claims, uint32_t rsn) {
  if (!claims) {
    const uint32_t head = rq_head();
    if (head - rq_retired_ > max_recv_wr_) return std::nullopt;  // garbage head
    if (rsn - rq_retired_ >= head - rq_retired_) return std::nullopt;
    return receive_of(rq_slot(rsn), max_recv_sge_, init_.pd);
  }
  SrqClaims& c = *claims;
  SharedReceiveQueue* srq = c.srq;
  // RSNs are never this far ahead of the oldest open receive (the msn window bounds them);
  // refusing keeps a malformed RSN from draining the SRQ.
  if (rsn - c.retired >= kRecvWindow) return std::nullopt;
  if (rsn - c.retired >= c.slots.size()) {
    // Grow the RSN -> slot map, keeping what is claimed (without memory: RNR, retried later).
    size_t size = c.slots.size();
    while (size <= rsn - c.retired) size *= 2;
    std::vector<uint32_t> bigger;
    try {
      bigger.resize(size);
    } catch (const std::bad_alloc&) {
      return std::nullopt;
    }
    for (uint32_t r = c.retired; r != c.next; ++r)
      bigger[r & (size - 1)] = c.slots[r & (c.slots.size() - 1)];
    c.slots.swap(bigger);
  }
  const uint32_t mask = static_cast<uint32_t>(c.slots.size()) - 1;
  while (rsn - c.next < 0x80000000u) {  // rsn >= next: claim up to it, in order
    uint32_t slot;
    bool limit_hit = false;
    if (!srq->claim(&slot, &limit_hit)) return std::nullopt;
    if (limit_hit) srq->owner()->async_event(srq->handle(), AsyncEvent::kSrqLimitReached);
    c.slots[c.next & mask] = slot;
    ++c.next;
  }
  return receive_of(srq->slot(c.slots[rsn & mask]), srq->max_sge(), srq->pd());
}

void QueuePair::complete_recv(SrqClaims* claims, uint32_t rsn, Cqe c, CompletionQueue* cq) {
  // Staged before the entry goes back (as retire_sends does).
  if (!claims) {
    c.wr_id = hostif::recv_wqe(rq_slot(rsn))->wr_id;
    c.queue = hostif::CqeQueue::kRecv;
    c.wqe = rsn;
    push_cqe(cq, c);
    rq_retired_ = rsn + 1;
    ring_->rq_done.store(rq_retired_);
    return;
  }
  SrqClaims& sc = *claims;
  const uint32_t slot = sc.slots[rsn & (sc.slots.size() - 1)];
  c.wr_id = reinterpret_cast<const hostif::RecvWqe*>(sc.srq->slot(slot))->wr_id;
  c.queue = hostif::CqeQueue::kSrq;
  c.wqe = slot;
  c.srq = sc.srq->id();
  push_cqe(cq, c);
  sc.srq->release(slot);
  sc.retired = rsn + 1;
}

bool QueuePair::ud_seen_before(const transport::Segment& seg) {
  const uint32_t h = (seg.peer_ip * 2654435761u) ^ (seg.src_stream * 40503u) ^ seg.msn;
  UdSeen& e = ud_seen_[h & (kUdSeen - 1)];
  if (e.valid && e.peer_ip == seg.peer_ip && e.src_qpn == seg.src_stream && e.msn == seg.msn)
    return true;
  e = UdSeen{seg.peer_ip, seg.src_stream, seg.msn, true};
  return false;
}

bool QueuePair::take_datagram_receive(Receive* r, uint32_t* slot) {
  if (srq_) {
    bool limit_hit = false;
    if (!srq_->claim(slot, &limit_hit)) return false;
    if (limit_hit) srq_->owner()->async_event(srq_->handle(), AsyncEvent::kSrqLimitReached);
    *r = receive_of(srq_->slot(*slot), srq_->max_sge(), srq_->pd());
    return true;
  }
  const uint32_t head = rq_head();
  if (head == rq_retired_ || head - rq_retired_ > max_recv_wr_) return false;
  *r = receive_of(rq_slot(rq_retired_), max_recv_sge_, init_.pd);
  return true;
}

void QueuePair::complete_datagram(uint32_t slot, Cqe c) {
  // Staged before the entry goes back (as retire_sends does).
  c.queue = srq_ ? hostif::CqeQueue::kSrq : hostif::CqeQueue::kRecv;
  c.wqe = srq_ ? slot : rq_retired_;
  c.srq = srq_ ? srq_->id() : 0;
  push_cqe(init_.recv_cq, c);
  if (srq_) {
    srq_->release(slot);
    return;
  }
  ++rq_retired_;
  ring_->rq_done.store(rq_retired_);
}

uint64_t QueuePair::room_of(const Receive& r) {
  uint64_t room = 0;
  for (uint32_t i = 0; i < r.num_sge; ++i) room += r.sge[i].length;
  return room;
}

bool QueuePair::raw_ready(uint32_t msn) const {
  const SendSlot& s = sq_slots_[msn & sq_mask_];
  return s.msn == msn && s.submitted && !s.failed && !s.acked && state_ == QpState::kRts;
}

bool QueuePair::raw_sent(uint32_t msn) {
  if (!raw_ready(msn)) return false;
  SendSlot& s = sq_slots_[msn & sq_mask_];
  s.acked = true;
  retire_sends();
  return true;
}

void QueuePair::deliver_raw(std::span<const uint8_t> frame) {
  if (state_ != QpState::kRtr && state_ != QpState::kRts) return;
  Receive r;
  uint32_t slot = 0;
  if (!take_datagram_receive(&r, &slot)) {
    ++nic_.mutable_counters().raw_rx_no_recv;
    return;
  }
  Cqe c{};
  c.wr_id = r.wqe->wr_id;
  c.opcode = WcOpcode::kRecv;
  c.qp_num = qpn_;
  c.byte_len = static_cast<uint32_t>(frame.size());
  if (room_of(r) < frame.size()) {
    c.status = WcStatus::kLocLenErr;
  } else {
    WcStatus err = WcStatus::kSuccess;
    if (scatter(r, 0, frame, &err) != Syndrome::kOk) c.status = err;
  }
  complete_datagram(slot, c);
}

bool QueuePair::deliver_group_datagram(const transport::Segment& seg, uint32_t group) {
  bool took = false;
  if (init_.type == QpType::kUd) deliver_ud(seg, group, &took);
  return took;
}

Syndrome QueuePair::deliver_ud(const transport::Segment& seg, uint32_t group, bool* took) {
  // Datagram semantics: what cannot be received is dropped and acknowledged, so the sender's
  // transport does not retry it (docs/spec/verbs-mapping.md §7).
  if ((seg.op != Op::kSend && seg.op != Op::kSendImm) || seg.xrc) return Syndrome::kRemoteInvalid;
  if (seg.offset != 0 || seg.payload.size() != seg.total_length) return Syndrome::kRemoteInvalid;
  const QpState st = state_;
  if (st != QpState::kRtr && st != QpState::kRts) return Syndrome::kOk;
  if (seg.rkey != remote_.qkey) return Syndrome::kOk;  // the Q_Key travels in the rkey field
  // A group's datagrams are sent once and never retransmitted: nothing to recognise again.
  if (group == 0 && ud_seen_before(seg)) return Syndrome::kOk;
  Receive r;
  uint32_t slot = 0;
  if (!take_datagram_receive(&r, &slot)) return Syndrome::kOk;
  Cqe c{};
  c.wr_id = r.wqe->wr_id;
  c.opcode = WcOpcode::kRecv;
  c.qp_num = qpn_;
  c.src_qp = seg.src_stream;
  c.imm = seg.imm;
  c.wc_flags = hostif::kWcGrh | (seg.op == Op::kSendImm ? hostif::kWcWithImm : 0);
  c.byte_len = kGrhLen + seg.total_length;
  if (room_of(r) < c.byte_len) {
    c.status = WcStatus::kLocLenErr;
  } else {
    // The GRH must outlive this call: the write is carried out at the end of the pass.
    uint8_t* grh = nic_.scratch(kGrhLen);
    make_grh(grh, seg.peer_ip, group ? group : nic_.config().ip, seg.total_length);
    WcStatus err = WcStatus::kSuccess;
    if (scatter(r, 0, {grh, kGrhLen}, &err) != Syndrome::kOk ||
        scatter(r, kGrhLen, seg.payload, &err) != Syndrome::kOk)
      c.status = err;
  }
  complete_datagram(slot, c);
  if (took) *took = true;
  return Syndrome::kOk;
}

// --- tag matching (verbs-mapping.md §19) --------------------------------------------------------

Syndrome QueuePair::tm_decide(const transport::Segment& seg, TmMsg* d, uint32_t* prsn) {
  // In message order, from the segment that holds the headers: segments are placed as they
  // come, but where a tagged message goes is known only once its TMH is read. Anything else
  // comes back after an RNR back-off.
  if (seg.rsn != tm_next_rsn_ || seg.offset != 0) return Syndrome::kRnr;
  TagMatcher& tags = *srq_->tags();
  const bool room = srq_->posted() > 0;
  const std::optional<Tmh> h =
      seg.op == Op::kWriteImm ? std::nullopt : parse_tmh(seg.payload);
  if (seg.op == Op::kWriteImm) {
    d->kind = TmKind::kPlain;
  } else if (!h) {
    d->kind = TmKind::kNoTag;  // too short for a TMH, or not one
  } else if (h->op == TmhOp::kRndv && !parse_rvh(seg.payload)) {
    if (!room) return Syndrome::kRnr;
    tags.note_unexpected();  // its RVH is beyond the first segment: software's to handle
    d->kind = TmKind::kUnexpected;
  } else {
    TagMatcher::Entry e;
    switch (tags.classify(*h, &e, room)) {
      case TagMatcher::Verdict::kMatched:
        d->kind = h->op == TmhOp::kRndv ? TmKind::kRndv : TmKind::kEager;
        d->tag = h->tag;
        d->app_ctx = h->app_ctx;
        d->wr_id = e.recv_wr_id;
        d->sge = e.sge;
        if (d->kind == TmKind::kRndv) d->rvh = *parse_rvh(seg.payload);
        break;
      case TagMatcher::Verdict::kUnexpected:
        d->kind = TmKind::kUnexpected;
        break;
      case TagMatcher::Verdict::kNoTag:
        d->kind = TmKind::kNoTag;
        break;
      case TagMatcher::Verdict::kNoRoom:
        return Syndrome::kRnr;
    }
  }
  if (d->kind != TmKind::kEager && d->kind != TmKind::kRndv) {
    // A plain receive, claimed now so that plain receives go in decision order.
    if (!room || !recv_for(&claims_, tm_plain_)) return Syndrome::kRnr;
    *prsn = tm_plain_++;
  }
  ++tm_next_rsn_;
  return Syndrome::kOk;
}

void QueuePair::tm_complete(const RecvMsg& m, TmMsg& d) {
  Cqe c{};
  c.status = m.status;
  c.qp_num = qpn_;
  c.src_qp = remote_.qpn;
  switch (d.kind) {
    case TmKind::kEager:
    case TmKind::kRndv:
      c.wr_id = d.wr_id;
      c.opcode = WcOpcode::kTmRecv;
      c.wc_flags = hostif::kWcTmMatch;
      c.tag = d.tag;
      c.imm = d.app_ctx;
      if (d.kind == TmKind::kEager) {
        c.wc_flags |= hostif::kWcTmDataValid;
        c.byte_len = m.total - kTmhLen;
      }
      push_cqe(tm_cq(), c);
      if (d.kind != TmKind::kRndv || m.status != WcStatus::kSuccess) break;
      if (d.rvh.len > d.sge.length) {
        // The sender's data does not fit the tag's buffer: no READ, no FIN; software decides.
        rndv_cqe(d.wr_id, d.rvh.len, WcStatus::kLocLenErr);
        break;
      }
      {
        OwnOp op;
        op.id = next_own_id_++;
        op.is_read = true;
        op.length = d.rvh.len;
        op.wr_id = d.wr_id;
        op.tag = d.tag;
        op.sge = d.sge;
        op.rvh = d.rvh;
        try {
          own_ops_.push_back(op);
        } catch (const std::bad_alloc&) {
          rndv_cqe(d.wr_id, d.rvh.len, WcStatus::kLocQpOpErr);
          break;
        }
        if (op.length == 0) rndv_done(own_ops_.back(), WcStatus::kSuccess);  // nothing to read
      }
      break;
    default:
      c.opcode = d.kind == TmKind::kUnexpected ? WcOpcode::kTmRecv
                 : d.kind == TmKind::kNoTag    ? WcOpcode::kTmNoTag
                 : m.is_write                  ? WcOpcode::kRecvRdmaWithImm
                                               : WcOpcode::kRecv;
      c.byte_len = m.total;
      c.imm = m.imm;
      c.wc_flags = m.with_imm ? hostif::kWcWithImm : m.with_inv ? hostif::kWcWithInv : 0;
      complete_recv(&claims_, m.rsn, c, tm_cq());
      break;
  }
  d = TmMsg{};
}

QueuePair::OwnOp* QueuePair::own_op(uint32_t id) {
  for (OwnOp& op : own_ops_)
    if (op.id == id) return &op;
  return nullptr;
}

void QueuePair::finish_own(uint32_t id) {
  std::erase_if(own_ops_, [id](const OwnOp& op) { return op.id == id; });
}

bool QueuePair::submit_own() {
  bool any = false;
  for (OwnOp& op : own_ops_) {
    if (op.submitted) continue;
    transport::MessageDesc m;
    m.peer_ip = remote_.ip;
    m.lane = lane_;
    m.dst_stream = remote_.qpn;
    m.src_stream = qpn_;
    m.msn = op.wire_msn = next_wire_msn_++;
    ++own_sent_;
    if (op.is_read) {
      // Its answer is watched like a READ WQE's (check_responses).
      if (rd_outstanding_ == 0) response_progress_ = nic_.now();
      m.op = Op::kReadReq;
      m.length = op.length;
      m.remote_addr = op.rvh.va;
      m.rkey = op.rvh.rkey;
    } else {
      m.op = Op::kSend;
      m.length = kTmhLen;
      m.rsn = next_rsn_++;  // the FIN takes one of the sender's receives
    }
    set_limits(remote_, m);
    m.cookie = Nic::own_cookie(qpn_, op.id);
    op.submitted = true;
    any = true;
    nic_.transport().submit(m);
  }
  return any;
}

bool QueuePair::place_own_read(const transport::Segment& seg) {
  OwnOp* found = nullptr;
  for (OwnOp& op : own_ops_)
    if (op.is_read && op.submitted && op.wire_msn == seg.msn) found = &op;
  if (!found) return false;
  OwnOp& op = *found;
  if (op.read_bytes >= op.length) return true;  // an answer seen again
  if (seg.src_stream != remote_.qpn || seg.total_length != op.length ||
      uint64_t{seg.offset} + seg.payload.size() > op.length)
    return true;  // not an answer to it: dropped
  Receive r;
  r.sge = &op.sge;
  r.num_sge = 1;
  r.pd = srq_->pd();
  WcStatus err = WcStatus::kSuccess;
  if (scatter(r, seg.offset, seg.payload, &err) != Syndrome::kOk) {
    rndv_done(op, err);
    return true;
  }
  op.read_bytes += static_cast<uint32_t>(seg.payload.size());
  response_progress_ = nic_.now();
  if (op.read_bytes >= op.length) rndv_done(op, WcStatus::kSuccess);
  return true;
}

void QueuePair::rndv_cqe(uint64_t wr_id, uint32_t length, WcStatus status) {
  Cqe c{};
  c.wr_id = wr_id;
  c.status = status;
  c.opcode = WcOpcode::kTmRecv;
  c.byte_len = length;
  c.wc_flags = status == WcStatus::kSuccess ? hostif::kWcTmDataValid : 0;
  c.qp_num = qpn_;
  c.src_qp = remote_.qpn;
  push_cqe(tm_cq(), c);
}

void QueuePair::rndv_done(OwnOp& op, WcStatus status) {
  rndv_cqe(op.wr_id, op.length, status);
  if (status != WcStatus::kSuccess) {
    finish_own(op.id);
    enter_error();
    return;
  }
  // The same entry becomes the FIN, sent at the next pass (after this data is written).
  op.is_read = false;
  op.submitted = false;
  op.length = kTmhLen;
}

void QueuePair::own_gather(uint32_t id, uint32_t offset, std::span<uint8_t> out) {
  uint8_t fin[kTmhLen] = {};
  if (const OwnOp* op = own_op(id); op && !op->is_read)
    write_tmh(Tmh{TmhOp::kFin, 0, op->tag}, fin);
  for (size_t i = 0; i < out.size(); ++i) out[i] = offset + i < kTmhLen ? fin[offset + i] : 0;
}

void QueuePair::own_acked(uint32_t id) {
  const OwnOp* op = own_op(id);
  if (op && !op->is_read) finish_own(id);  // a READ is done when its data is in
}

void QueuePair::own_failed(uint32_t id, Syndrome why) {
  OwnOp* op = own_op(id);
  if (!op || state_ == QpState::kErr) return;
  const bool gave_up = why == Syndrome::kRetryExceeded || why == Syndrome::kRnr;
  if (op->is_read) {
    rndv_done(*op, remote_status(why));
    return;
  }
  finish_own(id);
  enter_error(gave_up ? std::optional(AsyncEvent::kQpFatal) : std::nullopt);
}

}  // namespace metaroce::nic

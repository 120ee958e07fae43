// SPDX-License-Identifier: Apache-2.0
// The software NIC as its driver (the libibverbs provider) sees it: a device per link and per
// process, with memory regions, completion queues and queue pairs whose work queues are rings
// that a progress thread drains without any application call.
//
// Threading: every function here may be called from any application thread. post_send,
// post_recv and Cq::poll are the hot path (a per-queue spinlock, no device lock); the rest take
// the device lock. Validation of verbs arguments (opcodes, flags, attribute masks, state
// transitions) is the provider's job; the NIC trusts what it is given except memory keys, which
// it checks on every access.
#pragma once

#include <infiniband/verbs.h>

#include <cstdint>
#include <memory>
#include <string>

#include "datapath/nic/link_config.h"

namespace metaroce::nic {

inline constexpr uint32_t kMaxSge = 16;
inline constexpr uint32_t kMaxInline = 256;
inline constexpr uint32_t kMaxQpWr = 16384;
inline constexpr uint32_t kMaxCqe = 65536;
inline constexpr uint32_t kMaxMrSize = 1u << 31;  // bytes per MR (transport offsets are 32-bit)
inline constexpr uint32_t kMaxRdAtomic = 16;  // outstanding READ/atomic requests per QP, each way
inline constexpr uint32_t kAtomicSize = 8;    // FETCH_ADD and CMP_SWP operate on 8 aligned bytes
inline constexpr uint32_t kMaxSrqWr = kMaxQpWr;
inline constexpr uint32_t kGrhLen = 40;       // what a UD receive buffer holds before the payload

struct Sge {
  uint64_t addr = 0;
  uint32_t length = 0;
  uint32_t lkey = 0;
};

enum class WqeOp : uint8_t { kSend, kSendImm, kWrite, kWriteImm, kRead, kCmpSwp, kFetchAdd };

constexpr bool is_atomic(WqeOp op) { return op == WqeOp::kCmpSwp || op == WqeOp::kFetchAdd; }
// Operations whose WQE waits for a response from the peer (limited by max_rd_atomic).
constexpr bool needs_response(WqeOp op) { return op == WqeOp::kRead || is_atomic(op); }

struct SendWqe {
  uint64_t wr_id = 0;
  WqeOp op = WqeOp::kSend;
  bool signaled = false;
  bool solicited = false;
  bool fence = false;
  uint32_t imm = 0;          // network byte order, as in ibv_send_wr
  uint64_t remote_addr = 0;
  uint32_t rkey = 0;
  uint64_t compare_add = 0;  // kCmpSwp: compare value; kFetchAdd: addend (host order)
  uint64_t swap = 0;         // kCmpSwp: value stored when the compare matches
  uint32_t num_sge = 0;      // 0 with inline_len > 0 means the payload is inline
  Sge sge[kMaxSge];
  uint32_t inline_len = 0;
  uint8_t inline_data[kMaxInline];
  // UD only: the destination named by the work request (address handle, remote QPN, Q_Key).
  uint32_t ud_ip = 0;        // host byte order
  uint32_t ud_qpn = 0;
  uint32_t ud_qkey = 0;
};

struct RecvWqe {
  uint64_t wr_id = 0;
  uint32_t num_sge = 0;
  Sge sge[kMaxSge];
};

// One completion, in the terms of struct ibv_wc.
struct Cqe {
  uint64_t wr_id = 0;
  ibv_wc_status status = IBV_WC_SUCCESS;
  ibv_wc_opcode opcode = IBV_WC_SEND;
  uint32_t vendor_err = 0;
  uint32_t byte_len = 0;
  uint32_t imm = 0;          // network byte order
  uint32_t qp_num = 0;
  uint32_t src_qp = 0;
  unsigned int wc_flags = 0; // IBV_WC_WITH_IMM ...
};

class Cq {
 public:
  virtual ~Cq() = default;
  virtual uint32_t capacity() const = 0;
  // Copies up to n completions into out; returns how many (0 when empty).
  virtual int poll(int n, Cqe* out) = 0;
  // True once a completion was lost because the queue was full (IBV_EVENT_CQ_ERR territory).
  virtual bool overflowed() const = 0;
  // Completion events (ibv_req_notify_cq): the notifier is called once, from whichever thread
  // pushes the first completion after arm(), or from arm() itself when completions are already
  // waiting (a spurious event is harmless, a lost one hangs an event-driven program).
  virtual void set_notifier(void (*fn)(void* arg), void* arg) = 0;
  virtual void arm(bool solicited_only) = 0;
};

// A shared receive queue: receives any QP attached to it may consume (docs/spec/verbs-mapping.md
// §6 says which entry a message takes).
class Srq {
 public:
  virtual ~Srq() = default;
  // Hot path. ENOMEM when max_wr receives are posted and not yet consumed.
  virtual int post_recv(const RecvWqe& wqe) = 0;
  // Arms the limit event: it fires once, from the progress thread, when a QP takes an entry and
  // fewer than `limit` remain; then the limit reads 0 again (disarmed). 0 disarms.
  virtual void set_limit(uint32_t limit) = 0;
  virtual uint32_t limit() const = 0;
  virtual void set_limit_notifier(void (*fn)(void* arg), void* arg) = 0;
};

enum class QpState : uint8_t { kReset, kInit, kRtr, kRts, kErr };
enum class QpType : uint8_t { kRc, kUd };

// Asynchronous events of a QP, reported through QpInit::event_fn (ibv_event_type in brackets).
enum class QpEvent : uint8_t {
  kCommEst,        // first message arrived while in RTR (IBV_EVENT_COMM_EST)
  kFatal,          // the transport gave up: retries or RNR retries exhausted (IBV_EVENT_QP_FATAL)
  kAccessErr,      // a peer's request broke a memory key or access right (IBV_EVENT_QP_ACCESS_ERR)
  kReqErr,         // a peer's request was malformed (IBV_EVENT_QP_REQ_ERR)
  kLastWqeReached, // a QP with an SRQ entered ERR (IBV_EVENT_QP_LAST_WQE_REACHED)
};

struct QpInit {
  uint32_t pd = 0;           // provider's PD handle; MRs are usable only within their PD
  Cq* send_cq = nullptr;
  Cq* recv_cq = nullptr;
  uint32_t max_send_wr = 0;  // already rounded/validated by the provider (<= kMaxQpWr)
  uint32_t max_recv_wr = 0;
  uint32_t max_send_sge = 0; // <= kMaxSge
  uint32_t max_recv_sge = 0;
  uint32_t max_inline = 0;   // <= kMaxInline
  bool sq_sig_all = false;
  QpType type = QpType::kRc;
  Srq* srq = nullptr;        // receives come from here; the QP's own receive queue is unused
  // Called from the progress thread (device lock held) for events the NIC raises itself; it
  // must not block nor call back into the device.
  void (*event_fn)(void* arg, QpEvent ev) = nullptr;
  void* event_arg = nullptr;
};

// Peer and parameters from modify_qp to RTR/RTS.
struct QpRemote {
  uint32_t ip = 0;           // peer IPv4 (from the IPv4-mapped dgid), host byte order
  uint32_t qpn = 0;          // dest_qp_num
  uint32_t path_mtu = 4096;  // bytes, from ibv_mtu
  uint32_t rq_psn = 0, sq_psn = 0;  // recorded for query_qp; the transport has its own
  uint8_t timeout = 14;      // 4.096 us * 2^timeout, 0 = infinite
  uint8_t retry_cnt = 7;
  uint8_t rnr_retry = 7;
  uint8_t min_rnr_timer = 12;
  uint8_t max_rd_atomic = 1;       // READ/atomic requests we may have outstanding (0 acts as 1)
  uint8_t max_dest_rd_atomic = 1;  // recorded; the requester's limit is what bounds them
  uint32_t qkey = 0;               // UD: datagrams carrying another Q_Key are dropped
};

class Qp {
 public:
  virtual ~Qp() = default;
  virtual uint32_t qpn() const = 0;
  virtual QpState state() const = 0;
  // Moves the QP; the provider has checked the transition. To kErr: every outstanding WQE
  // completes with IBV_WC_WR_FLUSH_ERR. To kReset: queues emptied, no completions.
  virtual void set_state(QpState s) = 0;
  virtual void set_remote(const QpRemote& r) = 0;
  virtual void set_access(unsigned int qp_access_flags) = 0;
  // Hot path. ENOMEM when the queue is full. The provider checks state and argument limits.
  virtual int post_send(const SendWqe& wqe) = 0;
  virtual int post_recv(const RecvWqe& wqe) = 0;
};

struct DeviceCounters {
  uint64_t rx_frames = 0, tx_frames = 0, rx_drop_malformed = 0, rx_drop_not_ours = 0;
  uint64_t arp_requests = 0, arp_replies = 0;
  uint64_t naks_access = 0, rnr = 0;
};

class Device {
 public:
  virtual ~Device() = default;
  // Opens the device for this process, or returns the one already open (shared by every
  // context). Returns nullptr and sets *err (an errno) and *why (one line) on failure.
  static std::shared_ptr<Device> open(const LinkConfig& cfg, int* err, std::string* why);

  virtual const LinkConfig& config() const = 0;
  virtual bool port_active() const = 0;
  virtual uint32_t active_mtu() const = 0;  // largest verbs MTU the link carries (256..4096)

  // Memory regions. access is ibv_access_flags. Returns 0 or an errno.
  virtual int reg_mr(uint32_t pd, uint64_t addr, uint64_t length, unsigned int access,
                     uint32_t* lkey, uint32_t* rkey) = 0;
  virtual int dereg_mr(uint32_t lkey) = 0;

  // Completion queues and queue pairs; nullptr + *err on failure. destroy_* return an errno
  // (EBUSY for a CQ still used by a QP).
  virtual Cq* create_cq(uint32_t cqe, int* err) = 0;
  virtual int destroy_cq(Cq* cq) = 0;
  virtual Qp* create_qp(const QpInit& init, int* err) = 0;
  virtual int destroy_qp(Qp* qp) = 0;
  // Shared receive queues of a PD; destroy_srq answers EBUSY while a QP uses it.
  virtual Srq* create_srq(uint32_t pd, uint32_t max_wr, uint32_t max_sge, int* err) = 0;
  virtual int destroy_srq(Srq* srq) = 0;

  // Wakes the progress thread (a doorbell); post_send/post_recv ring it themselves.
  virtual void kick() = 0;
  virtual DeviceCounters counters() const = 0;
};

}  // namespace metaroce::nic

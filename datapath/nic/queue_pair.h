// SPDX-License-Identifier: Apache-2.0
// A queue pair of the software NIC: the send and receive rings the provider fills, and the
// requester and responder logic the progress thread runs on them (spec §5: streams, message
// and receive sequence numbers, in-order completion).
#pragma once

#include <atomic>
#include <cstdint>
#include <optional>
#include <vector>

#include "datapath/nic/completion_queue.h"
#include "datapath/nic/device.h"
#include "datapath/nic/shared_receive_queue.h"
#include "datapath/nic/spin_lock.h"
#include "datapath/transport/engine.h"

namespace metaroce::nic {

class SoftDevice;

class QueuePair final : public Qp {
 public:
  QueuePair(SoftDevice& dev, uint32_t qpn, const QpInit& init);
  ~QueuePair() override;  // returns SRQ entries claimed and never completed

  // Provider side (application threads).
  uint32_t qpn() const override { return qpn_; }
  // Messages a stream may run ahead of completion. The responder's record array starts small
  // and doubles only for a sender that runs further ahead, so the many QPs that never do stay
  // small.
  static constexpr uint32_t kRecvWindow = 4096;
  static constexpr uint32_t kRecvWindowInitial = 64;
  // Responder records held now (kRecvWindowInitial .. kRecvWindow), for tests and telemetry.
  size_t responder_window() const { return rx_msgs_.size(); }
  QpState state() const override { return state_.load(std::memory_order_acquire); }
  void set_state(QpState s) override;
  void set_remote(const QpRemote& r) override;
  void set_access(unsigned int flags) override;
  int post_send(const SendWqe& wqe) override;
  int post_recv(const RecvWqe& wqe) override;

  // True when WQEs were posted that the progress thread has not taken yet.
  bool has_new_work() const {
    return (!rd_blocked_ && sq_head_.load(std::memory_order_acquire) != sq_next_) ||
           (state() == QpState::kErr &&
            rq_head_.load(std::memory_order_acquire) != rq_retired_.load(std::memory_order_relaxed));
  }
  // Progress thread side; all under the device lock.
  // Hands newly posted send WQEs to the transport. Returns true if it did anything.
  bool drain_send_queue();
  void on_message_acked(uint32_t msn);
  void on_message_failed(uint32_t msn, transport::Syndrome why);
  // Copies payload of the send WQE whose message sequence number is msn.
  void gather(uint32_t msn, uint32_t offset, std::span<uint8_t> out) const;
  // Places one arriving segment addressed to this QP.
  transport::Syndrome deliver(const transport::Segment& seg);
  const QpInit& init() const { return init_; }
  const QpRemote& remote() const { return remote_; }

 private:
  // Requester state of one send WQE, by slot.
  struct SendSlot {
    uint32_t msn = 0;
    uint32_t length = 0;      // message bytes
    uint32_t resp_length = 0; // kRead, atomics: response bytes expected
    uint32_t read_bytes = 0;  // kRead, atomics: response bytes placed so far
    bool submitted = false;
    bool acked = false;
    bool failed = false;
    ibv_wc_status status = IBV_WC_SUCCESS;
  };
  // Responder state of one incoming message, by msn slot.
  struct RecvMsg {
    uint32_t msn = 0;
    bool seen = false;
    bool consumes_recv = false;
    bool with_imm = false;
    bool is_write = false;
    uint32_t rsn = 0;
    uint32_t total = 0;
    uint32_t received = 0;
    uint32_t imm = 0;
    ibv_wc_status status = IBV_WC_SUCCESS;
  };
  bool grow_rx_window(uint32_t ahead);
  RecvMsg& rx_msg(uint32_t msn) { return rx_msgs_[msn & (rx_msgs_.size() - 1)]; }
  // Responder's record of executed atomics, so that a request seen again is answered from
  // here rather than executed twice (docs/spec/verbs-mapping.md §3). Larger than the most
  // atomics a requester may have outstanding, so an entry outlives its response.
  struct AtomicResult {
    uint32_t msn = 0;
    bool valid = false;
    uint64_t original = 0;  // the target's value before the operation, as memory held it
  };
  static constexpr uint32_t kAtomicCache = 4 * kMaxRdAtomic;

  // UD: a datagram of one packet lands in the next receive, behind a 40-byte GRH.
  transport::Syndrome deliver_ud(const transport::Segment& seg);
  bool ud_seen_before(const transport::Segment& seg);
  // The receive that message rsn consumes, or nullptr when none is posted yet (RNR). With an
  // SRQ, claims entries for every RSN up to rsn not yet claimed, in increasing order.
  const RecvWqe* recv_for(uint32_t rsn);
  // Frees the receive rsn consumed (in its queue or SRQ) and returns its wr_id.
  uint64_t retire_recv(uint32_t rsn);
  void raise(QpEvent ev) const;

  transport::Syndrome execute_atomic(const transport::Segment& seg, bool duplicate);
  void answer_atomic(const transport::Segment& seg, AtomicResult& r);

  void retire_sends();
  void complete_receives();
  // why: the event to raise (none when the application asked for ERR).
  void enter_error(std::optional<QpEvent> why = std::nullopt);
  void flush_all();
  bool send_done(const SendSlot& s, const SendWqe& w) const;
  transport::Syndrome place_read_response(const transport::Segment& seg);
  transport::Syndrome scatter(uint32_t pd, const Sge* sge, uint32_t num_sge, uint32_t offset,
                              std::span<const uint8_t> data, ibv_wc_status* local_err) const;
  void push_cqe(CompletionQueue* cq, const Cqe& cqe);

  SoftDevice& dev_;
  const uint32_t qpn_;
  const QpInit init_;
  std::atomic<QpState> state_{QpState::kReset};
  QpRemote remote_;
  unsigned int access_ = 0;

  // Send ring: the provider advances sq_head_; the progress thread submits at sq_next_ and
  // frees slots by advancing sq_retired_.
  std::vector<SendWqe> sq_;
  std::vector<SendSlot> sq_slots_;
  uint32_t sq_mask_;
  SpinLock sq_lock_;
  alignas(64) std::atomic<uint32_t> sq_head_{0};
  alignas(64) std::atomic<uint32_t> sq_retired_{0};
  uint32_t sq_next_ = 0;
  uint32_t next_rsn_ = 0;  // receives consumed at the peer by our SENDs / WRITE_IMMs
  uint32_t rd_outstanding_ = 0;  // READ/atomic WQEs submitted and not yet retired
  bool rd_blocked_ = false;      // the next WQE waits for rd_outstanding_ < max_rd_atomic

  // Receive ring, indexed by receive sequence number.
  std::vector<RecvWqe> rq_;
  uint32_t rq_mask_;
  SpinLock rq_lock_;
  alignas(64) std::atomic<uint32_t> rq_head_{0};
  alignas(64) std::atomic<uint32_t> rq_retired_{0};

  // Responder: messages from the peer, completed in msn order.
  std::vector<RecvMsg> rx_msgs_;
  uint32_t rx_next_msn_ = 0;
  AtomicResult atomics_[kAtomicCache];
  bool comm_est_ = false;  // kCommEst raised since the last reset

  // With an SRQ: the slot claimed for each RSN, indexed by RSN (a message's RSN is never more
  // than kRecvWindow ahead of the oldest receive not yet completed).
  SharedReceiveQueue* const srq_;
  std::vector<uint32_t> claimed_;
  uint32_t next_claim_ = 0;   // lowest RSN without an SRQ entry
  uint32_t srq_retired_ = 0;  // lowest RSN not yet completed

  // UD: recently delivered datagrams, so that a copy the transport lets through twice does not
  // consume a second receive. Direct-mapped by (peer, source QP, msn).
  struct UdSeen {
    uint32_t peer_ip = 0, src_qpn = 0, msn = 0;
    bool valid = false;
  };
  static constexpr uint32_t kUdSeen = 1024;
  std::vector<UdSeen> ud_seen_;
};

// What the rsn field of a kWrite message means to the NIC (docs/spec/verbs-mapping.md §3): 0 for
// an RDMA WRITE; these values turn the message into an atomic request whose 16-byte payload is
// the big-endian compare/add operand followed by the big-endian swap operand.
inline constexpr uint32_t kRsnAtomicCmpSwp = 0x41435300;    // "ACS"
inline constexpr uint32_t kRsnAtomicFetchAdd = 0x41464100;  // "AFA"
inline constexpr uint32_t kAtomicRequestLen = 16;

}  // namespace metaroce::nic

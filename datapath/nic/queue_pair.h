// SPDX-License-Identifier: Apache-2.0
// A queue pair of the software NIC: the send and receive rings the provider fills, and the
// requester and responder logic the progress thread runs on them (spec §5: streams, message
// and receive sequence numbers, in-order completion).
#pragma once

#include <atomic>
#include <cstdint>
#include <vector>

#include "datapath/nic/completion_queue.h"
#include "datapath/nic/device.h"
#include "datapath/transport/engine.h"

namespace metaroce::nic {

class SoftDevice;

// A tiny test-and-set lock for the producer side of a ring: held for a few stores.
class SpinLock {
 public:
  void lock() {
    while (flag_.test_and_set(std::memory_order_acquire)) {
      while (flag_.test(std::memory_order_relaxed)) __builtin_ia32_pause();
    }
  }
  void unlock() { flag_.clear(std::memory_order_release); }

 private:
  std::atomic_flag flag_ = ATOMIC_FLAG_INIT;
};

class QueuePair final : public Qp {
 public:
  QueuePair(SoftDevice& dev, uint32_t qpn, const QpInit& init);

  // Provider side (application threads).
  uint32_t qpn() const override { return qpn_; }
  QpState state() const override { return state_.load(std::memory_order_acquire); }
  void set_state(QpState s) override;
  void set_remote(const QpRemote& r) override;
  void set_access(unsigned int flags) override;
  int post_send(const SendWqe& wqe) override;
  int post_recv(const RecvWqe& wqe) override;

  // True when WQEs were posted that the progress thread has not taken yet.
  bool has_new_work() const {
    return sq_head_.load(std::memory_order_acquire) != sq_next_ ||
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
    uint32_t read_bytes = 0;  // kRead: response bytes placed so far
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
  static constexpr uint32_t kRecvWindow = 4096;  // messages a stream may run ahead of completion

  void retire_sends();
  void complete_receives();
  void enter_error();
  void flush_all();
  bool send_done(const SendSlot& s, const SendWqe& w) const;
  transport::Syndrome place_read_response(const transport::Segment& seg);
  transport::Syndrome scatter(const Sge* sge, uint32_t num_sge, uint32_t offset,
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

  // Receive ring, indexed by receive sequence number.
  std::vector<RecvWqe> rq_;
  uint32_t rq_mask_;
  SpinLock rq_lock_;
  alignas(64) std::atomic<uint32_t> rq_head_{0};
  alignas(64) std::atomic<uint32_t> rq_retired_{0};

  // Responder: messages from the peer, completed in msn order.
  std::vector<RecvMsg> rx_msgs_;
  uint32_t rx_next_msn_ = 0;
};

}  // namespace metaroce::nic

// SPDX-License-Identifier: Apache-2.0
// A queue pair of the software NIC: the requester and responder logic run on the send and
// receive rings a driver shares with the engine (hostif), a stream of the link's transport (spec
// §5: streams, message and receive sequence numbers, in-order completion). Single-threaded, like
// the rest of the NIC core: the engine's datapath thread is the only caller.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <unordered_map>
#include <vector>

#include "datapath/hostif/control.h"
#include "datapath/hostif/queues.h"
#include "datapath/nic/completion_queue.h"
#include "datapath/nic/memory.h"
#include "datapath/nic/mr_table.h"
#include "datapath/nic/shared_receive_queue.h"
#include "datapath/nic/tag_matcher.h"
#include "datapath/transport/engine.h"
#include "datapath/wire/mrh.h"

namespace metaroce::nic {

class Nic;
class Owner;

using hostif::QpRemote;
using hostif::QpState;
using hostif::QpType;
using hostif::WcOpcode;
using hostif::WcStatus;

// What creates a QP (the engine has checked the ring and the caps against the limits).
struct QpInit {
  Owner* owner = nullptr;             // kXrcTgt: its first handle's (QueuePair::owner())
  uint32_t pd = 0;                    // kXrcTgt: 0, each message's SRQ gives one
  CompletionQueue* send_cq = nullptr;
  CompletionQueue* recv_cq = nullptr; // kXrcIni, kXrcTgt: none
  SharedReceiveQueue* srq = nullptr;  // receives come from here; the QP's own ring is unused
  QpType type = QpType::kRc;
  bool sq_sig_all = false;
  bool block_self_mcast = false;      // UD: takes no multicast datagram it sent itself
  uint64_t handle = 0;                // the driver's name for the QP in async events
  uint32_t xrcd = 0;                  // kXrcTgt: its XRC domain
  std::shared_ptr<void> keep;         // kXrcTgt: what keeps its ring mapped (it outlives the
                                      // context that made it while others hold it open)
};

// Asynchronous events a QP raises (hostif::AsyncEvent values, delivered through its owner).
using hostif::AsyncEvent;

class QueuePair {
 public:
  // ring: formatted by hostif::init_qp for this qpn; its geometry is read here, once.
  QueuePair(Nic& nic, uint32_t qpn, const QpInit& init, hostif::QpHeader* ring);
  ~QueuePair();  // returns SRQ entries claimed and never completed
  QueuePair(const QueuePair&) = delete;
  QueuePair& operator=(const QueuePair&) = delete;

  uint32_t qpn() const { return qpn_; }
  QpState state() const { return state_; }
  const QpInit& init() const { return init_; }
  const QpRemote& remote() const { return remote_; }

  // Who may name the QP: its owner, or for an XRC target every context holding a handle to it
  // (verbs-mapping.md §17). owner(): the one whose process it counts under (telemetry).
  bool held_by(const Owner* o) const;
  Owner* owner() const;
  // XRC target handles (ibv_create_qp_ex makes the first, ibv_open_qp more): each gets the QP's
  // async events under its own handle. drop_handle/drop_owner return true when none is left.
  void add_handle(Owner* o, uint64_t handle) { handles_.push_back({o, handle}); }
  bool drop_handle(const Owner* o, uint64_t handle);
  bool drop_owner(const Owner* o);
  uint32_t handles_of(const Owner* o) const;
  // An XRC SRQ is going away: what this target claimed of it is forgotten (its slots go with it).
  void forget_srq(const SharedReceiveQueue* srq);

  // Control path (hostif kModifyQp); the driver checked verbs' transition rules.
  void set_state(QpState s);
  void set_remote(const QpRemote& r);
  void set_access(unsigned int flags) { access_ = flags; }
  // Direct verbs: the QP's paths, planes and connection (kSetQpPaths), and the lane the NIC
  // derived from them; its later messages ride that lane.
  const hostif::SetQpPathsReq& paths() const { return paths_; }
  void set_paths(const hostif::SetQpPathsReq& p) { paths_ = p; }
  uint32_t lane() const { return lane_; }
  void set_lane(uint32_t lane) { lane_ = lane; }

  // Messages a stream may run ahead of completion. The responder's record array starts small
  // and doubles only for a sender that runs further ahead, so the many QPs that never do stay
  // small (docs/spec/congestion.md §7).
  static constexpr uint32_t kRecvWindow = 4096;
  static constexpr uint32_t kRecvWindowInitial = 64;
  size_t responder_window() const { return rx_msgs_.size(); }
  // Engine memory this QP holds beyond the shared rings, in bytes (telemetry, tests).
  size_t state_bytes() const;

  // True when WQEs were posted that the NIC has not taken yet.
  bool has_new_work() const;
  // Hands newly posted send WQEs to the transport; in ERR, flushes what was posted. Returns true
  // if it did anything.
  bool drain();
  // The transport's callbacks for this QP's messages.
  void on_message_acked(uint32_t msn);
  void on_message_failed(uint32_t msn, transport::Syndrome why);
  // Queues the payload bytes [offset, offset + out.size()) of message msn for reading into out.
  void gather(uint32_t msn, uint32_t offset, std::span<uint8_t> out);
  // A read queued by gather() failed: the local buffer is gone (IBV_WC_LOC_PROT_ERR).
  void gather_failed(uint32_t msn);
  // The transport's callbacks for the messages the QP sends on its own (Nic::own_cookie):
  // tag matching's rendezvous READs and FIN notifications (verbs-mapping.md §19).
  void own_gather(uint32_t id, uint32_t offset, std::span<uint8_t> out);
  void own_acked(uint32_t id);
  void own_failed(uint32_t id, transport::Syndrome why);
  // Places one arriving segment addressed to this QP.
  transport::Syndrome deliver(const transport::Segment& seg);
  // Raw packet QP (verbs-mapping.md §18): a frame steered to it takes its next receive (none
  // posted: dropped, as a NIC does); its bytes must live until the end of the pass.
  void deliver_raw(std::span<const uint8_t> frame);
  // A UD QP attached to multicast group `group` (Nic::attach_mcast): a datagram sent to it.
  // True when it took a receive.
  bool deliver_group_datagram(const transport::Segment& seg, uint32_t group);
  // The frame of send WQE msn was gathered: true unless the WQE failed meanwhile (or the QP).
  bool raw_ready(uint32_t msn) const;
  // ... and it left the port: the WQE completes (false when it failed meanwhile).
  bool raw_sent(uint32_t msn);
  // A write deliver() queued could not be done: the memory under the region is gone.
  void placement_failed(uint32_t msn);
  // READ and atomic requests whose answer never came (the responder vanished, or abandoned it):
  // after the QP's timeout x (retry_cnt + 1) without progress they fail with RETRY_EXC_ERR.
  void check_responses(transport::Time now);
  bool awaits_response() const { return rd_outstanding_ > 0; }
  // Send WQEs posted and not yet completed: completions its send CQ is owed (at most the
  // queue's depth, whatever the driver wrote into the ring's head).
  uint32_t sends_outstanding() const { return std::min(sq_head() - sq_retired_, max_send_wr_); }

 private:
  // Requester state of one send WQE, by slot.
  struct SendSlot {
    uint32_t msn = 0;          // its place in the send queue (the NIC's cookie names it)
    uint32_t wire_msn = 0;     // the message's sequence number towards the peer (local
                               // operations, binds and invalidations, send none)
    uint32_t length = 0;       // message bytes
    uint32_t resp_length = 0;  // kRead, atomics: response bytes expected
    uint32_t read_bytes = 0;   // kRead, atomics: response bytes placed so far
    hostif::WqeOp op = hostif::WqeOp::kSend;
    bool signaled = false;
    bool submitted = false;
    bool acked = false;
    bool failed = false;
    WcStatus status = WcStatus::kSuccess;
    uint64_t wr_id = 0;
    uint64_t compare_add = 0, swap = 0;  // atomics: the operands, read once at submission
  };
  // Responder state of one incoming message, by msn slot.
  struct RecvMsg {
    uint32_t msn = 0;
    uint32_t srqn = 0;      // XRC target: the SRQ it consumes from (its RSN counts there)
    bool seen = false;
    bool consumes_recv = false;
    bool with_imm = false;
    bool is_write = false;
    bool with_inv = false;  // SEND with invalidate: imm is the rkey it invalidated
    bool invalidated = false;
    uint32_t rsn = 0;
    uint32_t total = 0;
    uint32_t received = 0;
    uint32_t imm = 0;
    WcStatus status = WcStatus::kSuccess;
    bool atomic_write = false;  // an ATOMIC_WRITE: its store waits in atomic_writes_
  };
  // ATOMIC_WRITE (verbs-mapping.md §3): checked on arrival, stored when every earlier message
  // of the stream is in place (complete_receives), under the key it was checked with. Kept
  // apart from RecvMsg, which every message slot of every QP pays for.
  struct AtomicWrite {
    uint32_t msn = 0;
    uint32_t rkey = 0;
    uint32_t pd = 0;
    uint64_t addr = 0;
    uint64_t value = 0;  // the 8 bytes as they travelled
  };
  // Responder's record of executed atomics, so that a request seen again is answered from
  // here rather than executed twice (docs/spec/verbs-mapping.md §3). Larger than the most
  // atomics a requester may have outstanding, so an entry outlives its response.
  struct AtomicResult {
    uint32_t msn = 0;
    bool valid = false;
    uint64_t original = 0;  // the target's value before the operation, as memory held it
  };
  static constexpr uint32_t kAtomicCache = 64;
  // Tag matching (verbs-mapping.md §19): how a message of a TM SRQ's QP was decided, once, in
  // message order, from its first segment. Kept beside rx_msgs_ (same index) for such QPs only.
  enum class TmKind : uint8_t {
    kNone,        // not decided (or not a TM QP)
    kEager,       // matched: the payload after the TMH lands in the tag's buffer
    kRndv,        // matched rendezvous: the QP READs the sender's data into the tag's buffer
    kUnexpected,  // a plain SRQ receive takes the whole message (IBV_WC_TM_RECV, no flags)
    kNoTag,       // a plain SRQ receive takes it (IBV_WC_TM_NO_TAG)
    kPlain,       // not a SEND (WRITE with immediate): a plain receive, as without TM
  };
  struct TmMsg {
    TmKind kind = TmKind::kNone;
    uint32_t app_ctx = 0;
    uint64_t tag = 0;
    uint64_t wr_id = 0;  // the tag's recv_wr_id
    hostif::Sge sge{};   // the tag's buffer
    Rvh rvh{};
  };
  // A message the QP sends with no WQE: a rendezvous READ, then the FIN that tells the sender
  // its buffer is free.
  struct OwnOp {
    uint32_t id = 0;
    uint32_t wire_msn = 0;
    bool is_read = false;
    bool submitted = false;
    uint32_t length = 0;      // READ: bytes to read; FIN: kTmhLen
    uint32_t read_bytes = 0;  // READ: placed so far
    uint64_t wr_id = 0;       // the tag's recv_wr_id
    uint64_t tag = 0;
    hostif::Sge sge{};        // READ: the tag's buffer
    Rvh rvh{};                // READ: the sender's buffer
  };
  // A receive as the NIC uses it: a snapshot of the WQE taken when a message claims it.
  struct Receive {
    const hostif::RecvWqe* wqe = nullptr;
    const hostif::Sge* sge = nullptr;
    uint32_t num_sge = 0;
    uint32_t pd = 0;
  };

  bool grow_rx_window(uint32_t ahead);
  RecvMsg& rx_msg(uint32_t msn) { return rx_msgs_[msn & (rx_msgs_.size() - 1)]; }
  uint8_t* sq_slot(uint32_t i) const { return sq_base_ + size_t{i & sq_mask_} * sq_stride_; }
  uint8_t* rq_slot(uint32_t i) const { return rq_base_ + size_t{i & rq_mask_} * rq_stride_; }
  uint32_t sq_head() const { return ring_->sq_head.load(); }
  uint32_t rq_head() const { return ring_->rq_head.load(); }

  // group: the multicast group a datagram was sent to (its GRH names it), 0 for one sent to
  // this QP. *took (when given) is set when the datagram took a receive.
  transport::Syndrome deliver_ud(const transport::Segment& seg, uint32_t group = 0,
                                 bool* took = nullptr);
  bool ud_seen_before(const transport::Segment& seg);
  // Datagrams (UD messages, raw frames) take receives in arrival order, with no numbering: the
  // next one of the SRQ or the QP's own queue (*slot: the SRQ's entry), or false when none is
  // posted; complete_datagram stages its completion c and then frees it.
  bool take_datagram_receive(Receive* r, uint32_t* slot);
  void complete_datagram(uint32_t slot, hostif::Cqe c);
  // Bytes a receive's SGEs hold.
  static uint64_t room_of(const Receive& r);
  // Receives claimed from one SRQ, by RSN (verbs-mapping.md §6): the slot each RSN took, from
  // the oldest not completed to the newest claimed (an RSN is never more than kRecvWindow ahead
  // of the oldest open receive; the map grows like rx_msgs_). An XRC target has one per SRQ its
  // initiator names, as RSNs count per (initiator, SRQ) there (§17).
  struct SrqClaims {
    SharedReceiveQueue* srq = nullptr;
    std::vector<uint32_t> slots;
    uint32_t next = 0;     // lowest RSN without an SRQ entry
    uint32_t retired = 0;  // lowest RSN not yet completed
  };
  // The receive that message rsn consumes, or nothing when none is posted yet (RNR). claims:
  // nullptr for the QP's own receive queue; else claims entries of its SRQ for every RSN up to
  // rsn not yet claimed, in increasing order.
  std::optional<Receive> recv_for(SrqClaims* claims, uint32_t rsn);
  Receive receive_of(const uint8_t* slot, uint32_t max_sge, uint32_t pd) const;
  // Completes the receive rsn consumed (in its queue or SRQ): c, with the receive's wr_id and
  // the entry it retires, is staged on cq (none: nowhere), then the entry is freed.
  void complete_recv(SrqClaims* claims, uint32_t rsn, hostif::Cqe c, CompletionQueue* cq);
  // Gives the claimed, not completed entries back to their SRQ (reset, destruction).
  static void release_claims(SrqClaims& c);
  // Completes them flushed into cq.
  void flush_claims(SrqClaims& c, CompletionQueue* cq);
  // An XRC target's claims on SRQ srqn, made at first use; nullptr when there is no memory.
  SrqClaims* xrc_claims(uint32_t srqn, SharedReceiveQueue* srq);
  // Where message m's receive comes from, and its completion goes.
  SrqClaims* claims_of(const RecvMsg& m);
  CompletionQueue* recv_cq_of(const SrqClaims* c) const;
  void raise(AsyncEvent ev) const;

  // pd: the responder's protection domain (an XRC target: the named SRQ's).
  transport::Syndrome execute_atomic(const transport::Segment& seg, bool duplicate, uint32_t pd);
  // A bind or local invalidation, carried out in send-queue order (verbs-mapping.md §13).
  void execute_local(const hostif::SendWqe& w, SendSlot& s);
  // The send slot of the message the peer knows as wire_msn, among those outstanding.
  SendSlot* slot_of_wire_msn(uint32_t wire_msn);
  void answer_atomic(const transport::Segment& seg, AtomicResult& r);

  void retire_sends();
  void complete_receives();
  bool store_atomic_write(uint32_t msn);
  MrCheck remote_access(const transport::Segment& seg, uint32_t pd, unsigned int need,
                        uint64_t len, const MemoryRegion** mr) const;
  // Tag matching: decides the message seg is the first segment of (kRnr: not now, it comes
  // back); *prsn: the plain receive it consumes, when it does.
  transport::Syndrome tm_decide(const transport::Segment& seg, TmMsg* d, uint32_t* prsn);
  TmMsg& tm_msg(uint32_t msn) { return tm_msgs_[msn & (tm_msgs_.size() - 1)]; }
  // Completes a decided TM message (its receive-side completion, a rendezvous READ queued).
  void tm_complete(const RecvMsg& m, TmMsg& d);
  // Submits the QP's own messages queued since the last pass (RTS only).
  bool submit_own();
  OwnOp* own_op(uint32_t id);
  void finish_own(uint32_t id);
  // A rendezvous READ ended: DATA_VALID (or its error) for the tag, then the FIN.
  void rndv_done(OwnOp& op, WcStatus status);
  // The tag's second completion: DATA_VALID, or the error that kept its data out.
  void rndv_cqe(uint64_t wr_id, uint32_t length, WcStatus status);
  bool place_own_read(const transport::Segment& seg);
  CompletionQueue* tm_cq() const { return srq_->cq(); }
  // why: the event to raise (none when the application asked for ERR).
  void enter_error(std::optional<AsyncEvent> why = std::nullopt);
  void flush_all();
  bool send_done(const SendSlot& s) const;
  transport::Syndrome place_read_response(const transport::Segment& seg);
  // Queues the writes of data at `offset` into the receive's SGEs (local keys checked).
  transport::Syndrome scatter(const Receive& r, uint32_t offset, std::span<const uint8_t> data,
                              WcStatus* local_err);
  void push_cqe(CompletionQueue* cq, const hostif::Cqe& cqe);
  void publish_state();
  void reset();

  Nic& nic_;
  const uint32_t qpn_;
  const QpInit init_;
  hostif::QpHeader* const ring_;
  QpState state_ = QpState::kReset;
  QpRemote remote_;
  unsigned int access_ = 0;
  hostif::SetQpPathsReq paths_{};
  uint32_t lane_ = 0;

  // Ring geometry, copied at creation (the driver can write the shared header).
  uint8_t* sq_base_;
  uint32_t sq_mask_, sq_stride_, max_send_wr_, max_send_sge_, max_inline_;
  uint8_t* rq_base_;
  uint32_t rq_mask_, rq_stride_, max_recv_wr_, max_recv_sge_;

  // Send ring: the driver advances sq_head; the NIC submits at sq_next_ and frees slots by
  // advancing sq_done (sq_retired_ is its private copy).
  std::vector<SendSlot> sq_slots_;
  uint32_t sq_next_ = 0;
  uint32_t sq_retired_ = 0;
  uint32_t next_rsn_ = 0;        // receives consumed at the peer by our SENDs / WRITE_IMMs
  // XRC initiator: the same, per SRQ of the target's domain (§17); a map entry per SRQ named.
  std::unordered_map<uint32_t, uint32_t> xrc_rsn_;
  uint32_t next_wire_msn_ = 0;   // msn of the next message to the peer
  uint32_t group_msn_ = 0;       // datagrams sent to multicast groups (wire.md §8)
  uint32_t rd_outstanding_ = 0;  // READ/atomic WQEs submitted and not yet retired
  bool rd_blocked_ = false;      // the next WQE waits for rd_outstanding_ < max_rd_atomic
  transport::Time response_progress_{};  // last response progress while rd_outstanding_ > 0

  // Receive ring, indexed by receive sequence number.
  uint32_t rq_retired_ = 0;

  // Responder: messages from the peer, completed in msn order.
  std::vector<RecvMsg> rx_msgs_;
  uint32_t rx_next_msn_ = 0;
  std::vector<AtomicResult> atomics_;
  std::vector<AtomicWrite> atomic_writes_;  // waiting for their turn, at most kRecvWindow
  bool comm_est_ = false;  // kCommEst raised since the last reset

  // With an SRQ: what this QP claimed of it.
  SharedReceiveQueue* const srq_;
  SrqClaims claims_;
  // With a TM SRQ: decisions by msn, the next RSN to decide, plain receives consumed so far
  // (the numbers claims_ uses for it: matched messages take none), and the own messages.
  std::vector<TmMsg> tm_msgs_;
  uint32_t tm_next_rsn_ = 0;
  uint32_t tm_plain_ = 0;
  std::vector<OwnOp> own_ops_;
  uint32_t next_own_id_ = 0;
  uint32_t own_sent_ = 0;  // own messages given wire msns (they take none of the send slots)
  // XRC target: per SRQ number, what it claimed of that SRQ; and its handles.
  std::unordered_map<uint32_t, SrqClaims> xrc_claims_;
  struct Handle {
    Owner* owner;
    uint64_t handle;
  };
  std::vector<Handle> handles_;

  // UD: recently delivered datagrams, so that a copy the transport lets through twice does not
  // consume a second receive. Direct-mapped by (peer, source QP, msn).
  struct UdSeen {
    uint32_t peer_ip = 0, src_qpn = 0, msn = 0;
    bool valid = false;
  };
  static constexpr uint32_t kUdSeen = 1024;
  std::vector<UdSeen> ud_seen_;
};

// An atomic request's payload (docs/spec/wire.md §2.2, opcodes 7 and 8): the big-endian
// compare/add operand followed by the big-endian swap operand.
inline constexpr uint32_t kAtomicRequestLen = wire::kAtomicRequestLen;
// The smallest frame a raw packet QP sends: an Ethernet header.
inline constexpr uint32_t kEthHeaderLen = 14;

}  // namespace metaroce::nic

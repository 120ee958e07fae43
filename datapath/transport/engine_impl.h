// SPDX-License-Identifier: Apache-2.0
// The transport engine behind transport::Engine: connections per peer, paths with their windows,
// receive windows, message segmentation, SACK/NAK handling, congestion control, path failure,
// timers (docs/spec/wire.md §3-§6, docs/spec/congestion.md). Exposed in a header only so the unit
// tests can pin struct sizes.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "datapath/transport/engine.h"
#include "datapath/transport/path_stats.h"
#include "datapath/transport/sack_window.h"
#include "datapath/wire/mrh.h"

namespace metaroce::transport {

inline constexpr uint32_t kPathWindow = 64;   // max packets outstanding per path (spec §6.1)
inline constexpr uint32_t kNakSlots = 4;      // NAK records a receiver path remembers
inline constexpr uint32_t kMaxRecvDirs = 64;  // directions (peer conn_ids) kept per peer: its
                                              // lanes and restarts (wire.md §3.2)
inline constexpr uint8_t kMaxBackoff = 16;
inline constexpr uint16_t kEphemeralPortBase = 49152;
inline constexpr uint32_t kWinUnit = 256;     // windows are fixed point, 1/256 packet
inline constexpr uint16_t kAlphaOne = 1024;   // a path's CE fraction is fixed point, 1/1024
inline constexpr uint16_t kAlphaShift = 4;    // its gain: 1/16 per ACK
inline constexpr uint32_t kMinConnWindow = 2; // packets
inline constexpr uint32_t kActiveIntervals = 3;  // a sender counts for hints this many intervals
inline constexpr uint32_t kHintPercent = 95;  // hints share this much of rx_capacity_mbps
inline constexpr uint32_t kPaceBurst = 2;     // packets a paced connection may send back to back
inline constexpr uint8_t kTxBurst = 8;        // new packets per connection per turn in poll_tx
inline constexpr uint8_t kRnrInfinite = 7;
inline constexpr uint16_t kNoPath = UINT16_MAX;
inline constexpr uint8_t kMaxPlanes = 16;     // a device's ports (nic::kMaxPlanes)
inline constexpr size_t kTombstones = 4096;   // forgotten receive directions remembered
static_assert(kPathWindow <= SackWindow::kSpan, "in-flight packets must fit the SACK span");
static_assert(kNakSlots <= wire::kMaxNakRecords);

namespace detail {

inline constexpr uint32_t kNoSlot = UINT32_MAX;
inline constexpr uint16_t kNil = UINT16_MAX;  // no in-flight record

enum class DescState : uint8_t {
  kFree,      // on the connection's free list
  kInFlight,  // on its path's list, in sequence order
  kMoving,    // on the connection's failover queue, waiting for a path (congestion.md §4.2)
};
enum DescFlag : uint8_t {
  kRetxQueued = 1,  // a retransmission of it is queued
  kRnrWait = 2,     // refused with RNR: resent when the connection's RNR timer fires
  kCopy = 4,        // failover copy: orig_path/orig_seq name where it was first sent
  kResent = 8,      // sent more than once on its current path: an ACK of it does not tell
                    // which copy arrived, so it cannot date the path's delivery order
  kLate = 16,       // resent because it was late (§5.1): its ACK says whether it was lost
};

// One transmitted, not yet resolved packet. The payload stays with the NIC (Host::gather); its
// length follows from the message and the offset. Lives in the connection's pool.
struct TxDesc {
  uint32_t slot = kNoSlot;  // message
  uint32_t offset = 0;
  uint32_t seq = 0;         // on `path`
  uint32_t orig_seq = 0;    // kCopy
  uint32_t sent_ts = 0;     // engine clock (ns, 32 bits) of its latest transmission (§5.1)
  uint16_t tx_order = 0;    // position among all transmissions on the path (FIFO loss test)
  uint16_t next = kNil;     // path list, failover queue or free list
  uint16_t path = 0;
  uint16_t orig_path = 0;   // kCopy
  DescState state = DescState::kFree;
  uint8_t flags = 0;
  uint8_t rto_retries = 0;
  uint8_t rnr_retries = 0;
};

// Protocol state of one sending path. Telemetry lives apart (PathCounters).
struct TxPath {
  uint32_t next_seq = 0;
  uint32_t una = 0;              // ack floor: oldest unresolved seq, or oldest moved-away one
  uint16_t tx_order = 0;         // next transmission's order
  uint16_t delivered_order = 0;  // highest order known delivered
  uint32_t cwnd = 0;             // congestion window, 1/kWinUnit packets
  uint32_t srtt_ns = 0, rttvar_ns = 0;  // srtt 0: no sample yet
  uint32_t moved_floor = 0;      // oldest seq whose failover copy is unresolved (moved > 0)
  uint16_t head = kNil, tail = kNil;  // in-flight records in sequence order
  uint16_t in_flight = 0;
  uint16_t moved = 0;            // failover copies of this path's packets still unresolved
  uint16_t port = 0;             // UDP source port (entropy), re-picked when probing
  PathState state = PathState::kActive;
  uint8_t backoff = 0;           // RTO back-off; probe back-off while probing
  uint8_t plane = 0;             // from the connection's plane mask (congestion.md §4.7)
  uint16_t alpha = kAlphaOne;    // smoothed fraction of its ACKs that echoed CE (§2.2)
  Time deadline = Time::max();   // RTO while active, next probe while probing
  int64_t last_progress_ns = 0;  // last ACK progress, or first send after idle; probing: since
  int64_t last_md_ns = INT64_MIN / 2;  // last multiplicative decrease (ECN)
};

struct PathCounters {
  uint64_t tx_packets = 0, tx_bytes = 0, retransmits = 0, timeouts = 0, acks_received = 0,
           ce_echoed = 0, sack_gaps = 0, late_losses = 0;
  uint32_t failures = 0, probes = 0;
  uint32_t min_rtt_ns = 0;       // smallest RTT sample, 0 until the first
};

struct NakEntry {
  uint32_t seq = 0, src_stream = 0, msn = 0;
  uint8_t syndrome = 0;
  uint8_t rnr_timer = 0;  // wire::NakRecord::rnr_timer
};

struct RxPath {
  SackWindow win;
  uint32_t echo_ts = 0;
  uint16_t ce_since_ack = 0;
  uint16_t port = 0;             // the peer's current source port: our ACKs mirror it
  uint8_t plane = 0;             // where its data last arrived: our ACKs return there
  bool ack_pending = false;
  uint8_t nak_count = 0;
  bool echo_fresh = false;       // a packet of the path asked for the pending ACK (kFlagNoEcho)
  std::array<NakEntry, kNakSlots> naks{};
  uint64_t rx_packets = 0, rx_bytes = 0, duplicates = 0, ce_total = 0;
};

// Receive state of one data direction from a peer, keyed by its conn_id (spec §3.2).
struct RecvDir {
  uint32_t conn_id = 0;
  uint64_t token = 0;
  uint16_t path_count = 0;
  int64_t last_used_ns = 0;
  std::vector<RxPath> paths;
};

enum class PeerShares : uint8_t { kUnknown, kYes, kNo };

struct MsgSlot {
  MessageDesc m;
  uint32_t pkts_total = 0, pkts_sent = 0, pkts_acked = 0, next_offset = 0;
  uint32_t prev = kNoSlot, next = kNoSlot;
  int64_t first_tx_ns = 0;  // its first packet left: the QP's timeout counts from here
  int64_t unreachable_ns = 0;  // the peer has said its stream is gone since then (0: never, or
                               // a packet of the message was acknowledged since)
  int64_t resume_ns = 0;       // parked: resent from then on; RNR-NAKed (then it is not
                               // parked): its packets in flight are resent from then on, and
                               // no more of it is sent before
};

struct Connection {
  // Fields are grouped by size so that the struct packs (TransportSizes.CoreStructsStaySmall).
  uint64_t token = 0;
  // Sender pacing to the peer's hint: credit in byte*8000 units (= Mbit/s * ns).
  int64_t credit = 0;
  int64_t credit_ns = 0;
  Time pace_at = Time::min();               // its next packet waits for credit until then
  Time tlp_deadline = Time::max();
  // Late-packet detection (congestion.md §5.1): when the next packet sent before the newest
  // delivered one becomes overdue.
  Time rack_deadline = Time::max();
  Time rnr_deadline = Time::max();
  Time park_deadline = Time::max();
  int64_t last_progress_ns = 0;             // newest ACK progress on any path
  int64_t progress_since_ns = 0;            // start of the current run of progress (no gap
                                            // longer than 2 RTTs): silence is judged from here
  int64_t last_tx_ns = INT64_MIN / 2;       // stamp of our last data packet to it: the send
                                            // time, or 1 ns after the previous (§3.4, §5.1)
  // Scheduling (congestion.md §7.1): the earliest of the connection's deadlines as of the last
  // change, its entry in the engine's deadline heap, and whether poll_tx is to visit it.
  Time due = Time::max();
  Time heap_time = Time::max();             // of its live heap entry (in_heap)
  // Receiver side: what arrived from this peer, for fair-share hints (§3).
  uint64_t rx_bytes_interval = 0;
  std::vector<uint32_t> parked;             // messages whose stream the peer said is gone
  std::vector<TxPath> tx;
  std::vector<TxDesc> pool;                 // grown on demand, <= conn_window_max records
  std::vector<uint16_t> retx_q;             // records to resend, oldest request first
  std::vector<PathCounters> counters;
  std::vector<RecvDir> rx;

  uint32_t peer_ip = 0;
  uint32_t lane = 0;        // which connection to the peer (wire.md §3.4); 0 receives too
  uint32_t conn_id = 0;     // our data direction to the peer
  uint32_t head = kNoSlot, tail = kNoSlot;  // outstanding messages, submission order
  uint32_t cursor = kNoSlot;                // first message with packets still to send
  uint32_t in_flight = 0;                   // allocated records (on paths or moving)
  // Congestion windows per plane, 1/kWinUnit packets, and what each plane's paths hold
  // (congestion.md §2.1); the pool (conn_window_max records) bounds the connection.
  std::array<uint32_t, kMaxPlanes> plane_cwnd{};
  uint32_t plane_mask = 0;
  uint32_t rack_ts = 0;                     // send time of the newest-sent packet known
                                            // delivered, sent once (§5.1; rack_valid)
  uint32_t last_hint_mbps = 0;              // the newest hint the peer sent
  uint32_t hint_mbps = 0;                   // the hint in force (0: none, §3.3)
  uint32_t rx_heard_interval = 0;           // index of the last interval with arrivals, + 1
  uint32_t rx_rate_mbps = 0;
  uint32_t rx_demand = 0;                   // of the last division (§3.2)
  uint32_t rx_hint_told = 0;                // the share our last ACK to it carried
  uint32_t rx_dir = 0;                      // where its newest data packet came: direction
  uint32_t min_srtt_ns = 0;                 // smallest srtt of the active paths (refresh_min_srtt)

  std::array<uint16_t, kMaxPlanes> plane_in_flight{};
  uint16_t rr_next = 0;                     // spraying position
  uint16_t free_head = kNil;                // pool free list
  uint16_t move_head = kNil, move_tail = kNil;  // failover queue
  uint16_t failed_paths = 0;                // paths not kActive (of all in tx)
  // The lane's profile: new data uses paths [0, paths_used); paths past it (after a shrink) are
  // retired, failed and never probed, until the count grows again. tx.size() is what the wire
  // says (path_count), and never shrinks.
  uint16_t paths_used = 0;
  uint16_t rx_path = 0;                     // and path (share pushes, §3.3)

  uint8_t mask_planes = 0;                  // planes in plane_mask
  bool rate_hints = true;                   // false: hints are recorded (last_hint_mbps) only
  bool closing = false;                     // close_lane: forgotten once nothing is in flight
  bool in_heap = false;                     // scheduling, with due and heap_time
  bool touched = false;                     // due is to be recomputed
  bool queued = false;                      // on the engine's work list
  bool retx_listed = false;                 // on the engine's list of connections with resends
  uint8_t turn_sent = 0;                    // new packets sent in its current turn (kTxBurst)
  bool rack_valid = false;                  // rack_ts holds a time
  // Tail probes since the last progress (all fired at cfg.tail_probes; progress re-arms them),
  // and how many of them doubled the next one's wait (all but those that only moved packets off
  // suspected paths: tail_probe).
  uint8_t tlp_count = 0;
  uint8_t tlp_backoff = 0;
  bool rx_frozen = false;                   // satisfied by the last division (or not heard)
  bool rx_more = false;                     // a packet of this interval said it had more
  PeerShares peer_shares = PeerShares::kUnknown;  // whether the peer divides by shares (§3.4)
};

}  // namespace detail

class EngineImpl final : public Engine {
 public:
  EngineImpl(const EngineConfig& cfg, Host& host);

  void submit(const MessageDesc& msg) override;
  void on_packet(Time now, uint32_t peer_ip, uint16_t udp_src_port, bool ecn_ce,
                 std::span<const uint8_t> udp_payload, uint8_t plane = 0) override;
  void on_timer(Time now) override;
  uint32_t poll_tx(Time now, TxSink& sink) override;
  Time next_deadline() const override;
  bool idle() const override;
  void drop_stream(uint32_t src_stream) override;
  void reject(const RxRef& ref, Syndrome why) override;
  const EngineStats& stats() const override { return stats_; }
  Time last_answered() const override { return last_answered_; }
  void stalled(Time from, Time to) override;
  bool set_lane(Time now, uint32_t peer_ip, uint32_t lane, const LaneProfile& profile) override;
  void close_lane(uint32_t peer_ip, uint32_t lane) override;
  void set_plane_up(Time now, uint8_t plane, bool up) override;
  uint32_t planes_up() const override { return planes_up_; }
  uint16_t repath(uint32_t peer_ip, uint32_t lane, uint16_t path) override;
  size_t sweep_idle(Time now, size_t max_visits) override;

  std::vector<PathStats> path_stats(uint32_t peer_ip, uint32_t lane = 0) const;
  ConnStats conn_stats(uint32_t peer_ip, uint32_t lane = 0) const;
  std::vector<uint32_t> lanes(uint32_t peer_ip) const;
  const auto& decode_drops() const { return decode_drops_; }
  // Our data direction's id to a peer, 0 when there is none (tests, telemetry).
  uint32_t conn_id(uint32_t peer_ip) const;
  // Connections looked at by timers and by poll_tx's sending step (tests: it must not grow with
  // connections that have nothing to do).
  uint64_t conn_visits() const { return conn_visits_; }
  // What the engine's state takes, by kind, from its containers' capacities (the simulator's
  // memory per connection and per path; docs/simulation.md).
  struct Footprint {
    uint64_t connections = 0, tx_paths = 0, rx_paths = 0, records = 0, msg_slots = 0;
    uint64_t conn_bytes = 0, tx_path_bytes = 0, rx_path_bytes = 0, record_bytes = 0,
             slot_bytes = 0;
    Footprint& operator+=(const Footprint& o) {
      connections += o.connections, tx_paths += o.tx_paths, rx_paths += o.rx_paths;
      records += o.records, msg_slots += o.msg_slots;
      conn_bytes += o.conn_bytes, tx_path_bytes += o.tx_path_bytes;
      rx_path_bytes += o.rx_path_bytes, record_bytes += o.record_bytes;
      slot_bytes += o.slot_bytes;
      return *this;
    }
  };
  Footprint footprint() const;

 private:
  using Connection = detail::Connection;
  using TxDesc = detail::TxDesc;
  using TxPath = detail::TxPath;
  using RxPath = detail::RxPath;
  using RecvDir = detail::RecvDir;

  struct AckRef {
    Connection* conn;
    uint32_t conn_id;  // of the peer's direction
    uint16_t path;
  };
  struct Completion {
    uint64_t cookie;
    Syndrome why;  // kOk: acked
  };
  enum class TxKind : uint8_t { kNew, kRetx, kCopy };

  uint64_t secret_random();
  uint64_t next_random();
  uint16_t random_port();
  static uint64_t conn_key(uint32_t peer_ip, uint32_t lane) {
    return (uint64_t{lane} << 32) | peer_ip;
  }
  Connection& conn_for(uint32_t peer_ip, uint32_t lane = 0);
  void ensure_send(Connection& c);
  Connection* find_conn(uint32_t peer_ip, uint32_t lane = 0) const;
  // Paths, planes and pacing of a connection as profile says (paths already checked).
  void apply_profile(Time now, Connection& c, uint16_t paths, uint32_t mask, bool hints);
  bool plane_up(uint8_t plane) const { return (planes_up_ >> plane) & 1; }
  // A plane that is down carries nothing of a lane while another plane that one of the lane's
  // paths uses is up; with every such plane down, the lane sends as on a dead link (retries
  // decide). Planes of its mask that no path uses do not count: nothing could go there, and a
  // lane with every path out of service would hang (congestion.md §4.7).
  bool usable_plane(const Connection& c, uint8_t plane) const {
    return plane_up(plane) || !(planes_up_ & path_planes(c));
  }
  // The planes of a lane's paths in use: its mask, or with fewer paths than planes in the mask,
  // the first paths_used planes of it (path p is on the (p mod n)-th plane of the mask).
  static uint32_t path_planes(const Connection& c) {
    if (c.paths_used >= c.mask_planes) return c.plane_mask;
    uint32_t planes = 0;
    uint32_t rest = c.plane_mask;
    for (uint16_t p = 0; p < c.paths_used; ++p) {
      planes |= rest & -rest;  // lowest plane left
      rest &= rest - 1;
    }
    return planes;
  }
  void reap_closed();
  void forget(Connection& c);
  bool forgotten(uint32_t peer_ip, uint32_t conn_id) const;
  Time idle_deadline(const Connection& c) const;
  bool acks_owed(const Connection& c) const;
  // The path's RTO, backed off by the path's own count or by `backoff` if larger (a packet that
  // timed out elsewhere carries its back-off to the path it moves to).
  Time rto(const TxPath& tp, uint8_t backoff = 0) const;
  uint32_t seg_len(uint32_t slot, uint32_t offset) const;
  // Bytes in front of a packet's payload: the headers, and the XRC extension if it names an SRQ.
  static uint32_t headers_len(const MessageDesc& m) {
    return static_cast<uint32_t>(wire::kDataHeadersLen + (m.xrc ? wire::kXrcExtLen : 0));
  }
  int64_t srtt_ref(const Connection& c, const TxPath& tp) const;
  void refresh_min_srtt(Connection& c);
  // An open path to send on, kNoPath if none. avoid_plane: a plane to use only when no
  // other plane has an open path (-1: none).
  uint16_t choose_path(const Connection& c, Time now, int avoid_plane = -1,
                       uint16_t exclude = kNoPath) const;
  bool path_open(const Connection& c, const TxPath& tp) const;

  void handle_data(Time now, Connection& c, uint16_t sport, bool ecn_ce, uint8_t plane,
                   const wire::Packet& pkt);
  // handle_data's steps (engine_receive.cc alone calls them, each once: inline; the two
  // largest always, as bench/cpu_budget found that gcc calls them otherwise, at 30 Ir a packet).
  RecvDir* data_dir(Time now, Connection& c, const wire::BaseHeader& b);
  bool take_copy(Time now, Connection& c, RecvDir& d, const wire::Packet& pkt, bool ecn_ce,
                 bool* mark_orig);
  Segment segment_of(const Connection& c, uint32_t dir_id, const wire::Packet& pkt);
  void record_delivery(RecvDir& d, const wire::Packet& pkt, Syndrome why, bool mark_orig);
  void handle_ack(Time now, uint32_t peer_ip, const wire::Packet& pkt);
  // handle_ack's steps, in its order (inline, as handle_data's).
  Connection* ack_conn(uint32_t peer_ip, const wire::Packet& pkt);
  void take_hint(Time now, Connection& c, uint32_t rate_hint);
  void apply_nak(Time now, Connection& c, uint16_t path, const wire::NakRecord& r);
  uint32_t acknowledge(Connection& c, uint16_t path, const wire::AckHeader& a, uint16_t flags,
                       bool* rack_moved);
  void queue_sack_gaps(Connection& c, uint16_t path);
  void take_rtt_sample(Time now, Connection& c, uint16_t path, uint32_t echo);
  void path_progress(Time now, Connection& c, uint16_t path);
  void handle_probe(Time now, Connection& c, uint16_t sport, bool ecn_ce, uint8_t plane,
                    const wire::Packet& pkt);
  RecvDir* find_dir(Connection& c, uint32_t conn_id);
  RecvDir& create_dir(Connection& c, const wire::BaseHeader& b, Time now);
  // own: a packet of the path asks (its timestamp is echoed); else the ACK only says what the
  // path's window holds (kFlagNoEcho).
  void request_ack(Connection& c, RecvDir& d, uint16_t path, uint32_t ts, bool ecn_ce,
                   bool own = true);
  static void apply_floor(RxPath& rp, uint32_t ack_floor);
  bool add_nak(RxPath& rp, uint32_t seq, uint32_t src_stream, uint32_t msn, Syndrome why,
               uint8_t rnr_timer = 0);
  void note_unreachable(RxPath& rp, uint32_t seq, uint32_t src_stream, uint32_t msn);
  void account_rx(Time now, Connection& c, size_t bytes, bool more);
  bool heard(const Connection& c) const;
  uint32_t current_hint(const Connection& c) const;
  bool start_held(Time now, Connection& c);
  void push_shares();
  void close_rate_interval(Time now);

  void congestion_on_ack(Time now, Connection& c, uint16_t path, uint32_t newly_acked,
                         uint16_t ce);
  void rnr_nak(Time now, Connection& c, uint16_t idx, uint8_t rnr_timer);
  void hold_message(Connection& c, uint32_t slot);
  void park(Connection& c, uint32_t slot, Time now);
  void resume_parked(Connection& c, Time now);
  bool unreachable_too_long(const detail::MsgSlot& s, Time now) const;
  uint32_t retry_limit(const detail::MsgSlot& s) const;
  bool budget_spent(const detail::MsgSlot& s, Time since, Time now) const;
  uint16_t find_in_flight(const Connection& c, uint16_t path, uint32_t seq) const;
  uint32_t find_named(const Connection& c, uint16_t path, uint32_t seq) const;
  void list_append(Connection& c, uint16_t path, uint16_t idx);
  void list_remove(Connection& c, uint16_t path, uint16_t prev, uint16_t idx);
  void free_desc(Connection& c, uint16_t idx);
  void resolve(Connection& c, uint16_t idx);
  void ack_desc(Connection& c, uint16_t idx);
  void abandon(Connection& c, uint32_t slot, Time now);
  void fail_message(Connection& c, uint32_t slot, Syndrome why, Time now);
  void unlink(Connection& c, uint32_t slot);
  void update_una(Connection& c, uint16_t path);
  void queue_retx(Connection& c, uint16_t idx);
  bool must_wait(Time now, Connection& c, uint32_t len);
  uint32_t packet_len(const TxDesc& d) const;
  bool send_retx(Time now, Connection& c, TxSink& sink, uint32_t& sent);
  void expire(Time now, Connection& c, uint16_t path);
  bool heard_since(const Connection& c, uint32_t stamp, Time now) const;
  void judge_late(const TxPath& tp, const TxDesc& d, uint32_t echo);
  void resolve_moved(Connection& c, uint16_t path, const wire::AckHeader& a);
  Time fail_deadline(const Connection& c, const TxPath& tp) const;
  bool check_failure(Time now, Connection& c, uint16_t path);
  // count: a failure (telemetry); false when the path is only retired or its plane went down.
  void fail_path(Time now, Connection& c, uint16_t path, bool count = true);
  bool suspect(Time now, Connection& c, uint16_t path);
  bool silent_together(const Connection& c, uint16_t path, const TxDesc& d, Time now) const;
  bool out_of_retries(const Connection& c, const TxDesc& d, Time now) const;
  Time stalled_since(Time since) const;
  uint16_t overflow_path(const Connection& c) const;
  void path_recovered(Time now, Connection& c, uint16_t path, int64_t sample);
  void reinstate(Time now, Connection& c, uint16_t path);
  void keep_in_service(Time now, Connection& c);
  void tail_probe(Time now, Connection& c);
  // Resends the packets overdue on their path while a packet sent after them was delivered
  // (congestion.md §5.1); arms rack_deadline for the next that may become so.
  void detect_late(Time now, Connection& c);
  int64_t reorder_window(const TxPath& tp) const;
  void arm_tlp(Time now, Connection& c);
  void flush_completions();
  void refill(Connection& c, Time now);
  // Scheduling: only connections that changed are looked at again. touch(c, work): c changed,
  // its deadline is recomputed at the next settle(); work: poll_tx visits it too. settle() ends
  // every public call that can change a connection, except on_packet and submit: a burst of
  // packets or messages settles once, when the deadlines are next asked for (next_deadline,
  // on_timer) or poll_tx ends; only they read the heap.
  void touch(Connection& c, bool work = true);
  void settle() const;
  Time conn_due(const Connection& c) const;
  void timer_conn(Time now, Connection& c);
  // The heap's earliest entry made exact (stale entries dropped, early ones moved to their
  // connection's due): then its time is the engine's next deadline.
  void clean_heap_top() const;
  void drop_from_work(const Connection& c);
  uint32_t finish_poll(uint32_t sent);

  bool emit_ack(Time now, Connection& c, RecvDir& d, uint16_t path, TxSink& sink);
  bool write_data(Time now, Connection& c, const TxDesc& d, uint16_t path, uint32_t seq,
                  uint16_t flags, uint32_t orig_seq, TxSink& sink);
  bool emit_data(Time now, Connection& c, uint16_t idx, TxSink& sink, TxKind kind);
  // moving: idx is a failover copy just sent from the move queue (others may still wait).
  bool emit_redundant(Time now, Connection& c, uint16_t idx, TxSink& sink, bool moving = false);
  bool emit_probe(Time now, Connection& c, uint16_t path, TxSink& sink);
  bool send_moving(Time now, Connection& c, TxSink& sink, uint32_t& sent);
  // false: the sink is full. more: the connection's turn ended with packets it may still send.
  bool send_new(Time now, Connection& c, TxSink& sink, uint32_t& sent, bool& more);
  uint32_t alloc_slot();
  bool grow_pool(Connection& c);

  EngineConfig cfg_;
  Host& host_;
  uint64_t rng_state_;
  uint32_t seg_size_;
  EngineStats stats_;
  std::array<uint64_t, static_cast<size_t>(wire::DecodeError::kCount)> decode_drops_{};
  std::unordered_map<uint64_t, std::unique_ptr<Connection>> conns_;  // by conn_key
  std::unordered_map<uint32_t, Connection*> by_id_;                  // by our conn_id
  // find_conn's answers by a hash of the key, checked against the connection's own peer and
  // lane: every data packet names its peer, and a hash map lookup cost ~60 instructions of the
  // ~4,000 a packet takes. A connection leaves its slot as it is forgotten.
  mutable std::array<Connection*, 256> conn_cache_{};
  static size_t conn_slot(uint32_t peer_ip, uint32_t lane) {
    return (peer_ip ^ (peer_ip >> 8) ^ (lane * 0x9e3779b1u)) % 256;
  }
  uint32_t planes_up_ = UINT32_MAX;
  bool closing_ = false;  // some connection waits to be forgotten
  std::vector<Connection*> conn_list_;
  mutable std::vector<Connection*> touched_;  // since the last settle()
  std::vector<Connection*> work_;           // for poll_tx, in the order they were touched
  std::vector<Connection*> due_now_;        // on_timer scratch
  using HeapEntry = std::pair<Time, uint32_t>;  // (when, conn_id): min-heap by time
  mutable std::vector<HeapEntry> heap_;
  uint64_t conn_visits_ = 0;
  std::vector<detail::MsgSlot> slots_;
  std::vector<uint32_t> free_slots_;
  std::vector<AckRef> acks_;
  std::vector<Connection*> retx_conns_;     // connections with queued resends (retx_listed)
  std::vector<Completion> done_;
  // Receiver rate measurement (congestion.md §3).
  Time interval_start_ = Time::min();
  uint32_t interval_idx_ = 0;
  // The last division (§3.2), and the senders admitted since: what the unsatisfied share.
  uint64_t share_remaining_ = 0, share_level_ = 0, share_spare_ = 0;
  uint32_t share_unsat_ = 0;
  bool shares_fell_ = false;                // a sender was admitted: push_shares() is due
  Time last_answered_ = Time::min();
  // Receive directions of forgotten connections, (peer_ip << 32 | conn_id), the last
  // kTombstones of them (§4.6).
  std::unordered_set<uint64_t> tombstones_;
  std::vector<uint64_t> tombstone_ring_;
  size_t tombstone_next_ = 0;
  size_t sweep_next_ = 0;                   // sweep_idle's place in conn_list_
  // The owner's stalls (stalled()), oldest first, the last kStallLog of them: a silence that
  // began before the oldest counts the stalls kept, so forgetting errs on the side of failing.
  struct Stall {
    int64_t from_ns, to_ns;
  };
  static constexpr size_t kStallLog = 256;
  std::vector<Stall> stall_log_;  // a ring once full
  size_t stall_next_ = 0;
};

}  // namespace metaroce::transport

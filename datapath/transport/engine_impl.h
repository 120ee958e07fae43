// SPDX-License-Identifier: Apache-2.0
// The transport engine behind transport::Engine: connections per peer, paths with their send
// rings and receive windows, message segmentation, SACK/NAK handling and retransmission timers
// (docs/spec/wire.md §3-§6). Exposed in a header only so the unit tests can pin struct sizes.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

#include "datapath/transport/engine.h"
#include "datapath/transport/path_stats.h"
#include "datapath/transport/sack_window.h"
#include "datapath/wire/mrh.h"

namespace metaroce::transport {

inline constexpr uint32_t kPathWindow = 64;   // packets in flight per path (spec §6.1)
inline constexpr uint32_t kNakSlots = 4;      // NAK records a receiver path remembers
inline constexpr uint32_t kMaxRecvDirs = 4;   // directions (peer conn_ids) kept per peer
inline constexpr uint8_t kMaxBackoff = 16;
inline constexpr uint16_t kEphemeralPortBase = 49152;
static_assert(kPathWindow <= SackWindow::kSpan, "in-flight packets must fit the SACK span");
static_assert(kNakSlots <= wire::kMaxNakRecords);

namespace detail {

inline constexpr uint32_t kNoSlot = UINT32_MAX;

enum class DescState : uint8_t { kFree, kInFlight, kDone };

// One transmitted, not yet resolved packet. The payload stays with the NIC (Host::gather).
struct TxDesc {
  int64_t sent_ns = 0;      // last transmission
  uint32_t slot = kNoSlot;  // message
  uint32_t offset = 0;
  uint32_t len = 0;
  uint32_t tx_order = 0;    // position among all transmissions on the path (FIFO loss test)
  DescState state = DescState::kFree;
  uint8_t rto_retries = 0;
  bool retx_queued = false;
};

struct TxPath {
  uint32_t next_seq = 0;
  uint32_t una = 0;              // oldest unresolved seq = the ack floor sent in packets
  uint32_t tx_order = 0;         // next transmission's order
  uint32_t delivered_order = 0;  // highest order known delivered
  uint32_t in_flight = 0;
  uint8_t backoff = 0;
  int64_t srtt_ns = 0, rttvar_ns = 0;  // srtt 0: no sample yet
  Time rto_deadline = Time::max();
  uint64_t tx_packets = 0, tx_bytes = 0, retransmits = 0, timeouts = 0, acks_received = 0,
           ce_echoed = 0;
};

struct NakEntry {
  uint32_t seq = 0, src_stream = 0, msn = 0;
  uint8_t syndrome = 0;
};

struct RxPath {
  SackWindow win;
  uint32_t echo_ts = 0;
  uint16_t ce_since_ack = 0;
  bool ack_pending = false;
  uint8_t nak_count = 0;
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

struct MsgSlot {
  MessageDesc m;
  uint32_t pkts_total = 0, pkts_sent = 0, pkts_acked = 0, next_offset = 0;
  uint32_t prev = kNoSlot, next = kNoSlot;
};

struct Connection {
  uint32_t peer_ip = 0;
  uint16_t port_base = 0;   // path p leaves from UDP port port_base + p
  uint16_t rr_next = 0;     // spraying position
  uint32_t conn_id = 0;     // our data direction to the peer
  uint64_t token = 0;
  uint32_t head = kNoSlot, tail = kNoSlot;  // outstanding messages, submission order
  uint32_t cursor = kNoSlot;                // first message with packets still to send
  uint32_t in_flight = 0;
  std::vector<TxPath> tx;
  std::vector<TxDesc> descs;  // tx.size() * kPathWindow, indexed by path and seq % window
  std::vector<RecvDir> rx;
};

}  // namespace detail

class EngineImpl final : public Engine {
 public:
  EngineImpl(const EngineConfig& cfg, Host& host);

  void submit(const MessageDesc& msg) override;
  void on_packet(Time now, uint32_t peer_ip, uint16_t udp_src_port, bool ecn_ce,
                 std::span<const uint8_t> udp_payload) override;
  void on_timer(Time now) override;
  uint32_t poll_tx(Time now, TxSink& sink) override;
  Time next_deadline() const override;
  bool idle() const override;
  void drop_stream(uint32_t src_stream) override;
  const EngineStats& stats() const override { return stats_; }

  std::vector<PathStats> path_stats(uint32_t peer_ip) const;
  const auto& decode_drops() const { return decode_drops_; }
  // Our data direction's id to a peer, 0 when there is no connection (tests, telemetry).
  uint32_t conn_id(uint32_t peer_ip) const;

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
  struct RetxRef {
    Connection* conn;
    uint16_t path;
    uint32_t seq;
  };
  struct Completion {
    uint64_t cookie;
    Syndrome why;  // kOk: acked
  };

  uint64_t next_random();
  Connection& conn_for(uint32_t peer_ip);
  TxDesc& desc(Connection& c, uint16_t path, uint32_t seq) {
    return c.descs[size_t{path} * kPathWindow + seq % kPathWindow];
  }
  Time rto(const TxPath& tp) const;
  uint16_t port_of(const Connection& c, uint16_t path) const;
  uint8_t plane_of(uint16_t path) const;

  void handle_data(Time now, Connection& c, bool ecn_ce, const wire::Packet& pkt);
  void handle_ack(Time now, uint32_t peer_ip, const wire::Packet& pkt);
  void handle_probe(Time now, Connection& c, bool ecn_ce, const wire::Packet& pkt);
  RecvDir* find_dir(Connection& c, uint32_t conn_id);
  RecvDir& create_dir(Connection& c, const wire::BaseHeader& b, Time now);
  void request_ack(Connection& c, RecvDir& d, uint16_t path, uint32_t ts, bool ecn_ce);

  void ack_desc(Connection& c, TxPath& tp, TxDesc& d);
  void abandon(Connection& c, uint32_t slot, Time now);
  void fail_message(Connection& c, uint32_t slot, Syndrome why, Time now);
  void unlink(Connection& c, uint32_t slot);
  void advance_una(Connection& c, uint16_t path);
  void queue_retx(Connection& c, uint16_t path, uint32_t seq);
  void expire(Time now, Connection& c, uint16_t path);
  void flush_completions();

  bool emit_ack(Time now, Connection& c, RecvDir& d, uint16_t path, TxSink& sink);
  bool emit_data(Time now, Connection& c, uint16_t path, uint32_t seq, TxSink& sink, bool retx);
  uint32_t alloc_slot();

  EngineConfig cfg_;
  Host& host_;
  uint64_t rng_state_;
  uint32_t seg_size_;
  EngineStats stats_;
  std::array<uint64_t, static_cast<size_t>(wire::DecodeError::kCount)> decode_drops_{};
  std::unordered_map<uint32_t, std::unique_ptr<Connection>> conns_;
  std::vector<Connection*> conn_list_;
  std::vector<detail::MsgSlot> slots_;
  std::vector<uint32_t> free_slots_;
  std::vector<AckRef> acks_;
  std::vector<RetxRef> retx_;
  size_t retx_head_ = 0;
  std::vector<Completion> done_;
};

}  // namespace metaroce::transport

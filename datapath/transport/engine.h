// SPDX-License-Identifier: Apache-2.0
// The transport engine's public face: a deterministic state machine that the software NIC drives
// with packets, a clock and a transmit sink, and that calls back into the NIC to place data and to
// report message completions. No DPDK, no verbs, no real clock in here (docs/spec/ §4-§7).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>

namespace metaroce::transport {

// Time is nanoseconds since an arbitrary epoch chosen by whoever drives the engine.
using Time = std::chrono::nanoseconds;

// Outcome of handing one data segment to the NIC; anything but kOk is reported to the sender
// as a NAK for the message (spec §6.4).
enum class Syndrome : uint8_t {
  kOk = 0,
  kRnr = 1,            // no receive posted yet: sender retries after a back-off
  kRemoteAccess = 2,   // bad rkey, missing access right
  kRemoteBounds = 3,   // address/length outside the memory region
  kRemoteInvalid = 4,  // unknown stream (QP), QP not ready, malformed request
  kRemoteOp = 5,       // responder failed to carry out the operation
  kRetryExceeded = 6,  // local only: the peer never acknowledged
  kUnreachable = 7,    // the receiver has no such stream (QP destroyed or never made). Not
                       // received, and said so in a NAK record: the sender does not fail the
                       // message at once (a peer that merely finished and tore down must not
                       // fail a straggler), it resends with back-off and fails it with
                       // kRetryExceeded once the stream has been unreachable for the QP's
                       // timeout * (retry_cnt + 1), whatever the connection's other streams do.
};

// Message kinds the transport carries. The NIC gives them meaning; the transport only needs to
// know which carry payload from the sender (all but kReadReq) and their lengths.
enum class Op : uint8_t {
  kWrite = 1,
  kWriteImm = 2,
  kSend = 3,
  kSendImm = 4,
  kReadReq = 5,   // carries no payload; length = bytes requested
  kReadResp = 6,  // payload flows responder -> requester
  kAtomicCmpSwp = 7,    // payload: 16 bytes of operands; answered by a kReadResp
  kAtomicFetchAdd = 8,
  kSendInv = 9,         // a SEND whose rkey the receiver invalidates (a memory window)
  kAtomicWrite = 12,    // payload: the 8 bytes to store whole; acknowledged as a WRITE
};

// A message the NIC asks the transport to deliver reliably to one peer.
struct MessageDesc {
  uint32_t peer_ip = 0;      // IPv4, host byte order
  uint32_t dst_stream = 0;   // stream at the receiver (its QP number)
  uint32_t src_stream = 0;   // stream at the sender (our QP number)
  uint32_t msn = 0;          // message sequence number within src_stream -> dst_stream
  uint32_t rsn = 0;          // receive sequence number: index of the posted receive consumed
                             // (kSend, kSendImm, kWriteImm); 0 otherwise
  Op op = Op::kWrite;
  // XRC (wire.md §2.2.1): every packet of the message names the receiver's XRC SRQ (24 bits).
  // Requests only; the receiver's NIC gives it meaning. (Placed to fill padding.)
  bool xrc = false;
  uint32_t length = 0;       // payload bytes (kReadReq: bytes requested)
  uint32_t xrc_srqn = 0;
  uint64_t remote_addr = 0;  // kWrite*, kReadReq: remote virtual address of byte 0
  uint32_t rkey = 0;         // kWrite*, kReadReq
  uint32_t imm = 0;          // kWriteImm, kSendImm: immediate data, network byte order as verbs
  uint64_t cookie = 0;       // the NIC's handle, returned in Host callbacks
  // The QP's retry limits (verbs retry_cnt and timeout, congestion.md §4.5). The message fails
  // with kRetryExceeded once one of its packets has timed out retry_cnt times, on whatever paths,
  // and the peer has said nothing on any path for `timeout`; at the latest after timeout *
  // (retry_cnt + 1) of such silence, once the packet was resent (retry_cnt > 0).
  // kEngineRetries: EngineConfig::max_retries. timeout 0: the count alone decides.
  static constexpr uint8_t kEngineRetries = 0xff;
  uint8_t retry_cnt = kEngineRetries;
  Time timeout{0};
  // The QP's rnr_retry (congestion.md §6): RNR NAKs one packet may collect before the message
  // fails with kRnr, 7 = for ever; kEngineRetries: EngineConfig::rnr_retry.
  uint8_t rnr_retry = kEngineRetries;
  // Which connection to the peer carries it (docs/spec/wire.md §3.4): 0, the connection every
  // stream with the engine's default paths and planes shares; any other value names a
  // connection of its own whose settings set_lane gave (a lane not set has the defaults).
  uint32_t lane = 0;
};

// The settings of one connection (a lane): how many paths it sprays over, on which planes, and
// whether it paces to the receiver's rate hints.
struct LaneProfile {
  uint16_t num_paths = 0;   // 1..256; 0: EngineConfig::num_paths
  uint32_t plane_mask = 0;  // planes its paths use (path p: the (p mod n)-th of the n set
                            // bits); 0: every plane
  bool rate_hints = true;   // false: ECN AIMD alone; hints are recorded, not obeyed
};

// Names one received data packet, so that the NIC can still reject a packet that deliver()
// accepted when its placement fails later in the same pass (the memory under a region was
// gone), before the acknowledgement leaves: reject() turns it into a NAK (spec §5.3).
struct RxRef {
  uint32_t peer_ip = 0;
  uint32_t dir = 0;         // the peer's direction (its conn_id)
  uint32_t seq = 0;         // on `path`
  uint32_t src_stream = 0;
  uint32_t msn = 0;
  uint16_t path = 0;
};

// One arriving data packet, after duplicate filtering, handed to the NIC for placement.
struct Segment {
  uint32_t peer_ip = 0;
  Op op = Op::kWrite;
  uint32_t dst_stream = 0;
  uint32_t src_stream = 0;
  uint32_t msn = 0;
  uint32_t rsn = 0;
  uint32_t offset = 0;        // of this packet's payload within the message
  uint32_t total_length = 0;  // of the whole message
  uint64_t remote_addr = 0;   // kWrite*: address of this packet's first byte; kReadReq: base
  uint32_t rkey = 0;
  uint32_t imm = 0;
  bool xrc = false;           // the packet named an XRC SRQ: xrc_srqn
  uint32_t xrc_srqn = 0;
  std::span<const uint8_t> payload;
  RxRef ref;
};

// Implemented by the software NIC.
class Host {
 public:
  virtual ~Host() = default;
  // Copy bytes [offset, offset + out.size()) of the message named by cookie into out.
  virtual void gather(uint64_t cookie, uint32_t offset, std::span<uint8_t> out) = 0;
  // Place an arriving segment. Must be idempotent for a segment seen twice.
  virtual Syndrome deliver(const Segment& seg) = 0;
  // After deliver() answered kRnr: the receiving stream's minimum RNR timer (verbs'
  // min_rnr_timer code, 0..31) that the RNR NAK tells the sender to wait, or -1 for none (the
  // sender's own EngineConfig::rnr_delay).
  virtual int rnr_timer(uint32_t /*dst_stream*/) { return -1; }
  // Every packet of the message was acknowledged by the peer.
  virtual void message_acked(uint64_t cookie) = 0;
  // The peer NAKed the message, or retries ran out (kRetryExceeded). Called at most once per
  // message, and then message_acked is never called for it.
  virtual void message_failed(uint64_t cookie, Syndrome why) = 0;
};

// Where the engine writes outgoing packets. begin() returns room for the UDP payload (the NIC
// puts Ethernet/IP/UDP in front) of a packet for `plane`; commit() sends it (the same plane).
// begin() may return an empty span when the link has no buffers: the engine then stops for this
// poll and tries again later.
class TxSink {
 public:
  virtual ~TxSink() = default;
  virtual std::span<uint8_t> begin(uint32_t max_len, uint8_t plane) = 0;
  virtual void commit(uint32_t peer_ip, uint16_t udp_src_port, uint8_t plane, uint32_t len) = 0;
};

// How long verbs' RNR timer code (min_rnr_timer, 0..31) says to wait: 0.01 ms .. 491.52 ms,
// 0 meaning 655.36 ms (InfiniBand's table).
constexpr Time rnr_timer_delay(uint8_t code) {
  constexpr uint32_t k10us[32] = {65536, 1,    2,    3,    4,     6,     8,     12,
                                  16,    24,   32,   48,   64,    96,    128,   192,
                                  256,   384,  512,  768,  1024,  1536,  2048,  3072,
                                  4096,  6144, 8192, 12288, 16384, 24576, 32768, 49152};
  return std::chrono::microseconds(int64_t{k10us[code & 31]} * 10);
}

struct EngineConfig {
  uint32_t local_ip = 0;            // host byte order
  uint16_t num_paths = 8;           // paths per connection, 1..256
  uint8_t num_planes = 1;           // device ports; path p uses plane p % num_planes
  uint32_t mtu_payload = 4096;      // max payload bytes per data packet
  uint32_t max_packet = 4096 + 128; // max UDP payload the sink accepts
  Time rto_initial = std::chrono::microseconds(1000);
  Time rto_min = std::chrono::microseconds(200);
  Time rto_max = std::chrono::milliseconds(100);
  uint32_t max_retries = 7;         // RTO expiries of one packet before kRetryExceeded
  uint64_t seed = 1;                // randomness: connection ids, tokens, entropy
  // Connection ids and tokens from the kernel's random generator (getrandom), not the seeded
  // one: what an off-path sender must guess to inject (wire.md §3.2). The seeded generator is
  // predictable from one of its outputs, which every peer sees; off for reproducible runs (unit
  // tests, the simulator, the fuzzer), on in the NIC.
  bool secret_ids = false;
  // Congestion control (docs/spec/congestion.md §2-§3). Windows count packets.
  uint32_t path_window_init = 16;   // per path, 1..64
  // Per plane of a connection: each plane is its own network, so each starts at this (about
  // one BDP) and grows to at most conn_window_max, 2..conn_window_max.
  uint32_t conn_window_init = 64;
  // Packets a connection may have in flight, all planes together: its in-flight records, which
  // are allocated as they are first used (32 B each). 256 capped a connection at 1 MiB per RTT.
  uint32_t conn_window_max = 4096;
  uint32_t rx_capacity_mbps = 0;    // our inbound capacity shared by fair-share hints; 0 = none
  // Where shares are in use (rx_capacity_mbps > 0), packets a connection sends to a peer before
  // that peer's first share, and after a pause long enough for it to forget (§3.4); 0: no limit.
  uint32_t start_window = 4;
  Time hint_interval = std::chrono::microseconds(20);  // receiver's rate measurement period
  // Path failure (congestion.md §4): silent smoothed RTTs, while another path of the connection
  // advances, before a path is declared failed.
  uint32_t fail_rtts = 3;
  // A path whose packet timed out (RTO) or stayed silent through a tail-loss probe is suspected:
  // its packets are resent on other paths and it is probed under a new entropy value until it
  // answers (congestion.md §4.1). false: resend on the same path (tests prove the difference).
  bool suspect_silent_paths = true;
  bool tail_loss_probe = true;      // congestion.md §5
  // A packet out for its path's RTT plus a reordering window while one sent after it, on any
  // path, was delivered is lost (congestion.md §5.1). false: only SACK, tail probes and RTOs.
  bool late_detection = true;
  // Once a connection has sent all its data, each packet it resends also goes out once more on
  // another path (congestion.md §5.2). false: resends go on their own path only.
  bool tail_redundancy = true;
  // Tail probes (each after twice the previous wait) before only the RTO is left, until the
  // connection makes progress again. One probe let the slowest flows of a 64-host permutation at
  // 5 % loss wait out RTOs (0.47 of the clean goodput; three: 0.86), and the all-reduce at 10 %
  // loss lose 0.62 of its bus bandwidth to them (three: 0.82) (docs/simulation.md). A
  // failover.sh failure first blamed on three probes occurred with one as well.
  uint8_t tail_probes = 3;
  // RNR (congestion.md §6): back-off before a refused packet is resent, and how many RNR NAKs
  // one packet may collect before its message fails with kRnr (7 = retry forever, as verbs).
  Time rnr_delay = std::chrono::microseconds(1000);
  uint8_t rnr_retry = 7;
  // A lane-0 connection idle both ways this long (nothing queued, in flight or owed) is forgotten
  // by sweep_idle (congestion.md §4.6); longer than any peer keeps resending (a QP's timeout x (retry_cnt + 1):
  // 34 s for NCCL's default timeout 20). 0: never.
  Time conn_idle = std::chrono::seconds(60);
};

// Counters for `metaroce stat` and tests (per engine; per-path detail via path_stats()).
struct EngineStats {
  uint64_t tx_packets = 0, tx_bytes = 0, rx_packets = 0, rx_bytes = 0;
  uint64_t retransmits = 0, timeouts = 0, acks_sent = 0, acks_received = 0;
  uint64_t duplicates = 0, naks_sent = 0, naks_received = 0;
  uint64_t drop_malformed = 0, drop_version = 0, drop_unknown_conn = 0, drop_token = 0,
           drop_out_of_window = 0, drop_rnr = 0, drop_unreachable = 0;
  uint64_t drop_forgotten = 0;     // data of a receive direction forgotten as idle (§4.6)
  // Congestion control, failure handling, tail probes, RNR (congestion.md).
  uint64_t ecn_decreases = 0;      // multiplicative decreases of a path window
  uint64_t sack_gaps = 0;          // packets found missing by SACK and resent
  uint64_t tail_probes = 0;        // packets resent by the tail-loss probe
  uint64_t late_losses = 0;        // packets found lost by time, a later one delivered (§5.1)
  uint64_t late_spurious = 0;      // of those, resent for nothing: the original arrived
  uint64_t redundant_copies = 0;   // second copies of resends in a connection's tail (§5.2)
  uint64_t paths_failed = 0, paths_recovered = 0, probes_sent = 0;
  uint64_t failover_resends = 0;   // packets moved from a failed path to another
  uint64_t paths_suspected = 0;    // of paths_failed: by a timeout or a silent tail probe
  uint64_t paths_reinstated = 0;   // back in service unproven: the lane had none (§4.7)
  uint64_t failover_duplicates = 0;  // receiver: copies whose original had arrived
  uint64_t rnr_naks_sent = 0, rnr_naks_received = 0;
  uint64_t pacing_waits = 0;       // times a packet waited for the rate hint's tokens
  uint64_t share_pushes = 0;       // ACKs sent only to tell a sender its share fell (§3.3)
};

class Engine {
 public:
  virtual ~Engine() = default;
  static std::unique_ptr<Engine> create(const EngineConfig& cfg, Host& host);

  // Queue a message; packets go out from poll_tx as windows allow. Messages to one peer leave
  // in submission order (their packets may arrive in any order).
  virtual void submit(const MessageDesc& msg) = 0;
  // One received UDP payload from peer_ip (IPv4 host order); ecn_ce: the IP header was CE-marked.
  // plane: where it arrived; the answers to it (ACKs) leave on the same plane.
  virtual void on_packet(Time now, uint32_t peer_ip, uint16_t udp_src_port, bool ecn_ce,
                         std::span<const uint8_t> udp_payload, uint8_t plane = 0) = 0;
  // Fire due timers (retransmission, tail probes, ACK delay).
  virtual void on_timer(Time now) = 0;
  // Emit ACKs, retransmissions and new packets. Returns the number of packets emitted.
  virtual uint32_t poll_tx(Time now, TxSink& sink) = 0;
  // The earliest time on_timer has work to do; Time::max() when none.
  virtual Time next_deadline() const = 0;
  // True when nothing is waiting to go out or be acknowledged.
  virtual bool idle() const = 0;
  // Forget everything queued for or from one stream (QP destroyed or reset). Queued messages of
  // the stream are dropped without callbacks.
  virtual void drop_stream(uint32_t src_stream) = 0;
  // Rejects a packet deliver() accepted in this pass (RxRef): its ACK carries a NAK with `why`,
  // so the sender fails the message instead of completing it. No effect once the connection or
  // direction is gone.
  virtual void reject(const RxRef& ref, Syndrome why) = 0;
  virtual const EngineStats& stats() const = 0;
  // When a data packet last arrived that we accepted or had accepted (Time::min() if never): a
  // closing NIC keeps answering until its peers have had time to resend what they still miss
  // (congestion.md §4.6). Probes and packets for streams we do not have do not count.
  virtual Time last_answered() const = 0;

  // Lanes and planes (wire.md §3.4, congestion.md §4.7). Creates the connection of (peer_ip,
  // lane) if it does not exist, and applies profile to it: later packets use the new paths and
  // planes; packets in flight on a path no longer used move to the others. Lane 0's profile is
  // fixed (the engine's). Returns false for lane 0 or a profile out of range.
  virtual bool set_lane(Time now, uint32_t peer_ip, uint32_t lane, const LaneProfile& profile) = 0;
  // The lane's streams are gone: its connection is forgotten once nothing of it is in flight.
  virtual void close_lane(uint32_t peer_ip, uint32_t lane) = 0;
  // A plane's port went down (or was set down) or came back: while down nothing is sent on it;
  // what was in flight there moves to the paths of other planes. Planes start up.
  virtual void set_plane_up(Time now, uint8_t plane, bool up) = 0;
  virtual uint32_t planes_up() const = 0;
  // A new UDP source port (entropy) for one path of a connection; 0 when there is no such
  // connection or path.
  virtual uint16_t repath(uint32_t peer_ip, uint32_t lane, uint16_t path) = 0;
  // Looks at up to max_visits connections (round robin over calls) and forgets those of lane 0
  // idle both ways for EngineConfig::conn_idle, with nothing queued, in flight or owed; a later
  // packet of a forgotten peer direction is dropped (drop_forgotten), never taken for a new one.
  // Returns how many were forgotten. Called periodically by the NIC's owner.
  virtual size_t sweep_idle(Time now, size_t max_visits) = 0;
  // The engine's owner did not run between from and to (its thread off the CPU, the host or VM
  // paused): the peers' silence is measured without that time (congestion.md §4.5), since
  // nothing they sent was read and nobody asked them again meanwhile. Calls come in time order.
  virtual void stalled(Time from, Time to) = 0;
};

}  // namespace metaroce::transport

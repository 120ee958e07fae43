// SPDX-License-Identifier: Apache-2.0
// The fabric emulator's core: E endpoints joined by P leaf-spine planes of K core links each,
// driven only by frames and a clock the caller passes in (no DPDK, no real time), so tests run it
// on a virtual clock and the DPDK runner (fabric_runner.h) is a thin adapter around it.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "datapath/wire/frame.h"

namespace metaroce::fabric {

using Nanos = std::chrono::nanoseconds;

inline constexpr uint32_t kMaxEndpoints = 64;
inline constexpr uint32_t kMaxPlanes = 16;
inline constexpr uint32_t kMaxLinksPerPlane = 1024;

// What one link does to the frames that cross it. Rates are bits/s of frame bytes (no preamble,
// no inter-frame gap); 0 means unlimited.
struct LinkParams {
  uint64_t rate_bps = 100'000'000'000;
  uint64_t queue_bytes = 1 << 20;        // tail drop beyond this many queued bytes
  uint64_t ecn_threshold_bytes = 1 << 17;  // CE-mark ECT frames arriving above this occupancy
  double loss = 0;                       // probability a frame is dropped on arrival
  Nanos delay{0};                        // propagation delay after serialisation
  double reorder = 0;                    // probability a frame is held back by reorder_delay
  Nanos reorder_delay{20'000};
  double duplicate = 0;                  // probability a frame is sent on twice (a second copy
                                         // queued behind it, as a flapping bridge or a retrying
                                         // link layer does)
  bool up = true;                        // down: every frame arriving or in flight is lost
};

struct FabricConfig {
  uint32_t endpoints = 2;
  uint32_t planes = 1;
  uint32_t links_per_plane = 4;  // K: core links of a plane, chosen by the ECMP hash
  LinkParams core;               // the spine links (--rate, --loss, --delay, --reorder,
                                 // --duplicate)
  LinkParams edge;               // each endpoint's down-link of a plane (--edge-rate)
  uint16_t udp_port = 4793;      // MetaRoCE's port, for parse_frame; any UDP is hashed alike
  uint64_t seed = 1;             // loss, reordering and duplication draws; the ECMP hash seed
  uint32_t max_in_flight = 1 << 16;  // frame records preallocated (queued or propagating)

  // Empty when the configuration is usable, else the reason.
  std::string validate() const;
};

enum class LinkKind : uint8_t { kCore, kEdge };

struct LinkId {
  uint32_t plane = 0;
  LinkKind kind = LinkKind::kCore;
  uint32_t index = 0;  // core link 0..K-1, or the endpoint an edge link leads to
  bool operator==(const LinkId&) const = default;
};

struct LinkStats {
  uint64_t frames_in = 0, bytes_in = 0;    // offered to the link
  uint64_t frames_out = 0, bytes_out = 0;  // handed to the next hop
  uint64_t drop_queue = 0;                 // tail drops (queue full)
  uint64_t drop_loss = 0;                  // random loss
  uint64_t drop_down = 0;                  // arrived at, or were on, a down link
  uint64_t ce_marked = 0;
  uint64_t reordered = 0;                  // held back by reorder_delay
  uint64_t duplicated = 0;                 // second copies queued (counted in frames_out, not in)
  uint64_t queue_bytes = 0;                // now
  uint64_t max_queue_bytes = 0;            // highest seen
};

// Counters that belong to no link.
struct FabricStats {
  uint64_t frames_in = 0;         // received from endpoints
  uint64_t delivered = 0;         // handed to endpoints
  uint64_t flooded = 0;           // broadcast or unknown destination: copied to every other endpoint
  uint64_t dropped_no_route = 0;  // unicast back to its sender, or a bad endpoint/plane
  uint64_t dropped_no_record = 0; // max_in_flight frame records in use
  uint64_t dropped_no_buffer = 0; // a flood copy the sink could not make
  // Frame bytes handed to any endpoint, by the endpoint that sent them: who gets what share of a
  // shared edge link (incast fairness) without parsing the transport's headers.
  std::array<uint64_t, kMaxEndpoints> delivered_bytes_from{};
};

// A frame the fabric holds: bytes it may rewrite (ECN) and the owner's buffer handle.
struct FrameRef {
  uint8_t* data = nullptr;
  uint32_t len = 0;
  void* handle = nullptr;
};

// Where frames go: the runner maps these to DPDK mbufs, tests to plain vectors.
class FrameSink {
 public:
  virtual ~FrameSink() = default;
  // The fabric hands the frame over to endpoint `endpoint` on `plane`; ownership passes.
  virtual void deliver(uint32_t endpoint, uint32_t plane, FrameRef frame) = 0;
  // The fabric dropped the frame; ownership passes.
  virtual void discard(FrameRef frame) = 0;
  // A copy for flooding; false when no buffer is free.
  virtual bool clone(const FrameRef& frame, FrameRef* copy) = 0;
};

// Which core link (0..links-1) a frame of this 5-tuple crosses: a seeded 64-bit mix, so that the
// UDP source port alone spreads one connection's paths over the links, as ECMP does.
uint32_t ecmp_link(uint32_t src_ip, uint32_t dst_ip, uint8_t proto, uint16_t src_port,
                   uint16_t dst_port, uint64_t seed, uint32_t links);

// Rewrites the ECN bits of an IPv4 frame to CE and fixes the header checksum. Returns false
// (frame untouched) when it is not IPv4 or not ECN-capable.
bool mark_ce(uint8_t* frame, uint32_t len);

// A small seeded PRNG (splitmix64): the same seed gives the same loss and reordering everywhere.
class Random {
 public:
  explicit Random(uint64_t seed) : state_(seed) {}
  uint64_t next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, 1).
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
  bool chance(double p) { return p > 0 && uniform() < p; }

 private:
  uint64_t state_;
};

class Fabric {
 public:
  // config must validate(); sink outlives the fabric.
  Fabric(const FabricConfig& config, FrameSink* sink);
  Fabric(const Fabric&) = delete;
  Fabric& operator=(const Fabric&) = delete;
  // Frames still held are discarded through the sink.
  ~Fabric();

  // A frame sent by `endpoint` on `plane` at time `now`; the fabric owns it afterwards.
  void ingress(uint32_t endpoint, uint32_t plane, FrameRef frame, Nanos now);
  // Moves every frame due by `now` one hop on, delivering those that reach an endpoint. Returns
  // the number delivered.
  uint32_t advance(Nanos now);
  // When the next frame is due, or nullopt when none is held.
  std::optional<Nanos> next_event() const;
  // Frames queued or propagating.
  uint32_t in_flight() const { return static_cast<uint32_t>(heap_.size()); }

  const FabricConfig& config() const { return config_; }
  uint32_t link_count() const { return static_cast<uint32_t>(links_.size()); }
  // Valid when plane, kind and index are in range.
  std::optional<uint32_t> link_index(const LinkId& id) const;
  LinkId link_id(uint32_t index) const;
  std::string link_name(uint32_t index) const;  // "p0.core3", "p1.edge0"
  const LinkParams& params(uint32_t index) const { return links_[index].params; }
  // Takes effect for frames arriving from now on; taking a link down loses what it holds.
  void set_params(uint32_t index, const LinkParams& params, Nanos now);
  // Counters of a link with its queue occupancy brought up to `now`.
  LinkStats link_stats(uint32_t index, Nanos now);
  const FabricStats& stats() const { return stats_; }
  // The endpoint a plane has learnt for a MAC, or nullopt.
  std::optional<uint32_t> endpoint_of(uint32_t plane, const wire::MacAddr& mac) const;

 private:
  static constexpr uint32_t kFlood = UINT32_MAX;

  static constexpr uint32_t kNone = UINT32_MAX;

  // A frame on its way: over link `link` (one at a time), then to `dst` or to all. While it is
  // being queued or serialised it is also on that link's FIFO (`next`), which is how queue
  // occupancy is known without a per-link buffer sized for the worst case.
  struct Record {
    FrameRef frame;
    int64_t depart_ns = 0;  // end of its serialisation on `link`
    uint32_t next = kNone;  // next record on the same link's FIFO
    uint32_t link = 0;
    uint32_t epoch = 0;     // the link's epoch when the frame entered it
    uint32_t src = 0;       // sending endpoint (excluded from floods)
    uint32_t dst = 0;       // endpoint, or kFlood
  };
  struct Event {
    int64_t at_ns;
    uint64_t seq;  // FIFO among equal times keeps runs deterministic
    uint32_t record;
  };
  struct Link {
    LinkParams params;
    LinkStats stats;
    uint32_t head = kNone, tail = kNone;  // FIFO of records not yet serialised
    int64_t busy_until_ns = 0;
    uint32_t epoch = 0;
  };
  struct Learnt {
    wire::MacAddr mac{};
    uint32_t ip = 0;
    bool known = false;
  };

  // `copy`: a duplicate this link made of the frame before it, which is neither offered nor
  // lost nor duplicated again, but queues and may be reordered like any frame.
  void enqueue(uint32_t link, uint32_t record, int64_t now_ns, bool copy = false);
  void drain(Link& l, int64_t now_ns);
  void drop(uint32_t record);
  std::optional<uint32_t> take_record();
  uint32_t edge_link(uint32_t plane, uint32_t endpoint) const;
  static bool event_after(const Event& a, const Event& b);

  FabricConfig config_;
  FrameSink* sink_;
  Random rng_;
  std::vector<Link> links_;  // plane-major: K core links, then E edge links
  std::vector<Learnt> learnt_;  // [plane * E + endpoint]
  std::vector<Record> records_;
  std::vector<uint32_t> free_records_;
  std::vector<Event> heap_;  // min-heap on (at_ns, seq), capacity reserved up front
  uint64_t next_seq_ = 0;
  FabricStats stats_;
};

}  // namespace metaroce::fabric

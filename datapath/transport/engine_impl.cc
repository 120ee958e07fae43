// SPDX-License-Identifier: Apache-2.0
// The transport state machine (this file: connections, lanes and planes, scheduling and
// telemetry; engine_send.cc, engine_receive.cc and engine_recovery.cc the rest): spraying, per-path SACK, selective retransmission, NAKs, ECN
// AIMD, fair-share pacing, path failure and re-probing, tail-loss probes, RNR back-off and the
// timers, driven only by the calls of transport::Engine (docs/spec/wire.md §3-§6,
// docs/spec/congestion.md).
#include "datapath/transport/engine_impl.h"

#include <sys/random.h>

#include <algorithm>
#include <bit>

#include "datapath/transport/engine_util.h"
#include "datapath/transport/path_seq.h"

namespace metaroce::transport {

using detail::DescState;
using detail::kNil;
using detail::kNoSlot;

namespace {

EngineConfig sanitize(EngineConfig c) {
  c.num_paths = std::clamp<uint16_t>(c.num_paths, 1, wire::kMaxPathCount);
  c.num_planes = std::clamp<uint8_t>(c.num_planes, 1, kMaxPlanes);
  // An ACK must carry every NAK record a path keeps, or a rejection could go unreported.
  c.max_packet = std::max<uint32_t>(
      c.max_packet, static_cast<uint32_t>(wire::kAckHeadersLen + kNakSlots * wire::kNakRecordLen));
  c.mtu_payload = std::max<uint32_t>(c.mtu_payload, 1);
  if (c.rto_min > c.rto_max) c.rto_min = c.rto_max;
  c.path_window_init = std::clamp<uint32_t>(c.path_window_init, 1, kPathWindow);
  // Record indices are 16 bits with one value reserved.
  c.conn_window_max = std::clamp<uint32_t>(c.conn_window_max, kMinConnWindow, kNil);
  c.conn_window_init = std::clamp<uint32_t>(c.conn_window_init, kMinConnWindow, c.conn_window_max);
  if (c.hint_interval <= Time{0}) c.hint_interval = std::chrono::microseconds(20);
  c.rnr_retry = std::min(c.rnr_retry, kRnrInfinite);
  if (c.rnr_delay < Time{0}) c.rnr_delay = Time{0};
  return c;
}

}  // namespace

const char* to_string(PathState s) {
  switch (s) {
    case PathState::kActive: return "active";
    case PathState::kFailed: return "failed";
    case PathState::kProbing: return "probing";
  }
  return "?";
}

std::unique_ptr<Engine> Engine::create(const EngineConfig& cfg, Host& host) {
  return std::make_unique<EngineImpl>(cfg, host);
}

EngineImpl::EngineImpl(const EngineConfig& cfg, Host& host)
    : cfg_(sanitize(cfg)), host_(host), rng_state_(cfg.seed) {
  // Room for the XRC extension whatever the message, so that every message cuts alike.
  seg_size_ = std::min<uint32_t>(
      cfg_.mtu_payload,
      cfg_.max_packet - static_cast<uint32_t>(wire::kDataHeadersLen + wire::kXrcExtLen));
  acks_.reserve(256);
  retx_conns_.reserve(64);
  done_.reserve(64);
}

// splitmix64: tiny, seedable, good enough for ids, tokens and ports.
uint64_t EngineImpl::next_random() {
  uint64_t z = (rng_state_ += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// What names a direction to its receiver (EngineConfig::secret_ids).
uint64_t EngineImpl::secret_random() {
  uint64_t v = 0;
  if (cfg_.secret_ids && getrandom(&v, sizeof(v), 0) == static_cast<ssize_t>(sizeof(v))) return v;
  return next_random();
}

uint16_t EngineImpl::random_port() {
  return static_cast<uint16_t>(kEphemeralPortBase + next_random() % (65536u - kEphemeralPortBase));
}

EngineImpl::Connection* EngineImpl::find_conn(uint32_t peer_ip, uint32_t lane) const {
  Connection*& slot = conn_cache_[conn_slot(peer_ip, lane)];
  if (slot && slot->peer_ip == peer_ip && slot->lane == lane) return slot;
  auto it = conns_.find(conn_key(peer_ip, lane));
  if (it == conns_.end()) return nullptr;
  slot = it->second.get();
  return slot;
}

EngineImpl::Connection& EngineImpl::conn_for(uint32_t peer_ip, uint32_t lane) {
  if (Connection* known = find_conn(peer_ip, lane)) {
    known->closing = false;  // a stream came back to it
    touch(*known);
    return *known;
  }
  auto c = std::make_unique<Connection>();
  c->peer_ip = peer_ip;
  c->lane = lane;
  do {
    c->conn_id = static_cast<uint32_t>(secret_random());
  } while (c->conn_id == 0 || by_id_.count(c->conn_id));
  c->token = secret_random();
  c->plane_mask = all_planes(cfg_.num_planes);
  c->mask_planes = cfg_.num_planes;
  // One window per plane (congestion.md §2.1), each starting at one BDP of its own network.
  c->plane_cwnd.fill(cfg_.conn_window_init * kWinUnit);
  Connection& ref = *c;
  conn_list_.push_back(c.get());
  by_id_.emplace(c->conn_id, c.get());
  conns_.emplace(conn_key(peer_ip, lane), std::move(c));
  touch(ref);
  return ref;
}

// The send side of a connection, made when it first has something to send: a connection that
// only receives (the peer's lane 0 to us) holds no send paths (congestion.md §7: at 64 paths,
// half of a host's transport state in the 8,192-host run was receiving connections' unused send
// paths). The in-flight records are a pool that grows as the windows use it (§7).
void EngineImpl::ensure_send(Connection& c) {
  if (!c.tx.empty()) return;
  const uint32_t span = 65536u - kEphemeralPortBase - cfg_.num_paths + 1;
  const auto port_base = static_cast<uint16_t>(kEphemeralPortBase + next_random() % span);
  c.tx.resize(cfg_.num_paths);
  c.counters.resize(cfg_.num_paths);
  c.paths_used = cfg_.num_paths;
  for (uint16_t p = 0; p < cfg_.num_paths; ++p) {
    c.tx[p].port = static_cast<uint16_t>(port_base + p);
    c.tx[p].cwnd = cfg_.path_window_init * kWinUnit;
    c.tx[p].plane = plane_for(c.plane_mask, c.mask_planes, p);
  }
  c.rr_next = static_cast<uint16_t>(next_random() % cfg_.num_paths);
  // A path on a plane that is down starts out of service (probed once the plane is back).
  for (uint16_t p = 0; p < c.tx.size(); ++p) {
    if (!usable_plane(c, c.tx[p].plane)) fail_path(Time{0}, c, p, false);
  }
}

uint32_t EngineImpl::conn_id(uint32_t peer_ip) const {
  const Connection* c = find_conn(peer_ip);
  return c ? c->conn_id : 0;
}

// ---------------------------------------------------------------------------------------------
// Lanes and planes (wire.md §3.4, congestion.md §4.7)

bool EngineImpl::set_lane(Time now, uint32_t peer_ip, uint32_t lane, const LaneProfile& profile) {
  const uint32_t every = all_planes(cfg_.num_planes);
  const uint32_t mask = profile.plane_mask ? profile.plane_mask : every;
  const uint16_t paths = profile.num_paths ? profile.num_paths : cfg_.num_paths;
  if (lane == 0 || (mask & ~every) || paths > wire::kMaxPathCount) return false;
  Connection& c = conn_for(peer_ip, lane);
  ensure_send(c);
  apply_profile(now, c, paths, mask, profile.rate_hints);
  settle();
  return true;
}

void EngineImpl::apply_profile(Time now, Connection& c, uint16_t paths, uint32_t mask,
                               bool hints) {
  const auto old = static_cast<uint16_t>(c.tx.size());
  if (paths > old) {
    c.tx.resize(paths);
    c.counters.resize(paths);
    for (uint16_t p = old; p < paths; ++p) {
      c.tx[p].port = random_port();
      c.tx[p].cwnd = cfg_.path_window_init * kWinUnit;
    }
  }
  c.paths_used = paths;
  c.plane_mask = mask;
  c.mask_planes = static_cast<uint8_t>(std::popcount(mask));
  for (uint16_t p = 0; p < c.tx.size(); ++p) {
    TxPath& tp = c.tx[p];
    const uint8_t plane = plane_for(mask, c.mask_planes, p);
    if (plane != tp.plane) {  // what it has in flight counts on its new plane from now on
      c.plane_in_flight[tp.plane] = static_cast<uint16_t>(c.plane_in_flight[tp.plane] - tp.in_flight);
      c.plane_in_flight[plane] = static_cast<uint16_t>(c.plane_in_flight[plane] + tp.in_flight);
    }
    tp.plane = plane;
    // Retired, or now on a plane that is down: its packets move to the paths in service.
    // Failed paths in use come back through their probes (on their new plane).
    if (tp.state == PathState::kActive && (p >= paths || !usable_plane(c, tp.plane))) {
      fail_path(now, c, p, false);
    }
  }
  c.rr_next = static_cast<uint16_t>(c.rr_next % paths);
  c.rate_hints = hints;
  if (!hints) c.hint_mbps = 0;
}

void EngineImpl::close_lane(uint32_t peer_ip, uint32_t lane) {
  Connection* c = lane ? find_conn(peer_ip, lane) : nullptr;
  if (!c) return;
  c->closing = true;
  closing_ = true;
}

// Forgets closed lanes that have nothing left in flight. Only where no ACK or retransmission
// request names them: lanes other than 0 never receive (their peer's data arrives on its
// lane 0), and retransmission requests are spent before this runs.
void EngineImpl::reap_closed() {
  if (!closing_) return;
  closing_ = false;
  for (size_t i = 0; i < conn_list_.size();) {
    Connection* c = conn_list_[i];
    if (!c->closing) {
      ++i;
      continue;
    }
    if (c->head != kNoSlot || c->in_flight || !c->parked.empty() || c->move_head != kNil ||
        c->retx_listed) {
      closing_ = true;
      ++i;
      continue;
    }
    forget(*c);  // conn_list_[i] is now another connection
  }
}

// Removes a connection that has nothing left to do: from every list, the id map and the map of
// connections (its heap entry is dropped when it surfaces). Its receive directions are
// remembered as gone (tombstoned), so a packet of one arriving later is dropped, not taken for a
// new direction and delivered a second time (congestion.md §4.6).
void EngineImpl::forget(Connection& c) {
  for (const RecvDir& d : c.rx) {
    const uint64_t key = (uint64_t{c.peer_ip} << 32) | d.conn_id;
    if (!tombstones_.insert(key).second) continue;
    if (tombstone_ring_.size() < kTombstones) {
      tombstone_ring_.push_back(key);
    } else {
      tombstones_.erase(tombstone_ring_[tombstone_next_]);
      tombstone_ring_[tombstone_next_] = key;
      tombstone_next_ = (tombstone_next_ + 1) % kTombstones;
    }
  }
  drop_from_work(c);
  by_id_.erase(c.conn_id);
  const auto it = std::find(conn_list_.begin(), conn_list_.end(), &c);
  *it = conn_list_.back();
  conn_list_.pop_back();
  if (Connection*& slot = conn_cache_[conn_slot(c.peer_ip, c.lane)]; slot == &c) slot = nullptr;
  conns_.erase(conn_key(c.peer_ip, c.lane));
}

bool EngineImpl::forgotten(uint32_t peer_ip, uint32_t conn_id) const {
  return !tombstones_.empty() && tombstones_.count((uint64_t{peer_ip} << 32) | conn_id);
}

// When a lane-0 connection with nothing queued, in flight, parked or owed, silent both ways,
// may be forgotten by sweep_idle() (congestion.md §4.6): a host that talked to every peer once
// keeps no state for them for ever. Other lanes live as long as their QPs (close_lane).
// Time::max(): not now (busy, another lane, or never used).
Time EngineImpl::idle_deadline(const Connection& c) const {
  if (c.lane != 0 || cfg_.conn_idle <= Time{0} || c.head != kNoSlot || c.in_flight ||
      !c.parked.empty() || c.move_head != kNil || c.retx_listed) {
    return Time::max();
  }
  int64_t last = c.last_tx_ns;
  for (const RecvDir& d : c.rx) last = std::max(last, d.last_used_ns);
  if (last <= INT64_MIN / 2) return Time::max();
  return Time(last) + cfg_.conn_idle;
}

void EngineImpl::set_plane_up(Time now, uint8_t plane, bool up) {
  if (plane >= 32 || plane_up(plane) == up) return;
  planes_up_ ^= 1u << plane;
  for (Connection* c : conn_list_) {
    touch(*c);  // up: its failed paths there are probed again from the next poll_tx
    // Down: its paths there, unless that was the lane's last plane (then as a dead link, §4.7).
    // Up after every plane was down: the paths that stayed in service on the others.
    for (uint16_t p = 0; p < c->tx.size(); ++p) {
      if (c->tx[p].state == PathState::kActive && !usable_plane(*c, c->tx[p].plane)) {
        fail_path(now, *c, p, false);
      }
    }
    keep_in_service(now, *c);
  }
  settle();
}

// A lane keeps a path in service on a usable plane (congestion.md §4.7). Planes going down can
// leave every path of a lane failed or probing, and probing alone may never end: a receiver
// drops the probes of a direction it has not seen (wire.md §2.5), and only data makes one. So
// the usable path out of service longest goes back in service unproven, as the last path of a
// dead link stays: its packets leave with timers running, and the QP's retries decide.
void EngineImpl::keep_in_service(Time now, Connection& c) {
  uint16_t pick = kNoPath;
  for (uint16_t p = 0; p < c.paths_used; ++p) {
    const TxPath& tp = c.tx[p];
    if (!usable_plane(c, tp.plane)) continue;
    if (tp.state == PathState::kActive) return;
    if (pick == kNoPath || tp.last_progress_ns < c.tx[pick].last_progress_ns) pick = p;
  }
  if (pick == kNoPath) return;
  reinstate(now, c, pick);
  c.tx[pick].srtt_ns = 0;  // a route nothing has measured: the initial RTO until a sample
  c.tx[pick].rttvar_ns = 0;
  refresh_min_srtt(c);
  ++stats_.paths_reinstated;
}

// Makes the connection if its first message has not yet: a QP with a peer may ask first.
uint16_t EngineImpl::repath(uint32_t peer_ip, uint32_t lane, uint16_t path) {
  Connection* c = &conn_for(peer_ip, lane);
  ensure_send(*c);
  if (path >= c->paths_used) return 0;
  TxPath& tp = c->tx[path];
  uint16_t port = tp.port;
  while (port == tp.port) port = random_port();
  tp.port = port;
  settle();
  return port;
}

// ---------------------------------------------------------------------------------------------
// Scheduling (congestion.md §7.1)

void EngineImpl::touch(Connection& c, bool work) {
  if (!c.touched) {
    c.touched = true;
    touched_.push_back(&c);
  }
  if (work && !c.queued) {
    c.queued = true;
    work_.push_back(&c);
  }
}

void EngineImpl::settle() const {
  for (size_t i = 0; i < touched_.size(); ++i) {  // no call below touches, but be safe
    Connection& c = *touched_[i];
    c.touched = false;
    c.due = conn_due(c);
    // The heap holds at most one live entry per connection, never later than its due: a due
    // that moves later leaves the entry where it is, to be moved when it comes up.
    if (c.due == Time::max() || (c.in_heap && c.heap_time <= c.due)) continue;
    c.in_heap = true;
    c.heap_time = c.due;
    heap_.emplace_back(c.due, c.conn_id);
    std::push_heap(heap_.begin(), heap_.end(), std::greater<>{});
  }
  touched_.clear();
}

void EngineImpl::clean_heap_top() const {
  while (!heap_.empty()) {
    const auto [t, id] = heap_.front();
    auto it = by_id_.find(id);
    Connection* c = it == by_id_.end() ? nullptr : it->second;
    if (c && c->in_heap && c->heap_time == t && c->due == t) return;
    std::pop_heap(heap_.begin(), heap_.end(), std::greater<>{});
    heap_.pop_back();
    if (!c || !c->in_heap || c->heap_time != t) continue;  // superseded, or its conn is gone
    // The live entry of a connection whose due moved: moved with it.
    c->in_heap = false;
    if (c->due == Time::max()) continue;
    c->in_heap = true;
    c->heap_time = c->due;
    heap_.emplace_back(c->due, id);
    std::push_heap(heap_.begin(), heap_.end(), std::greater<>{});
  }
}

void EngineImpl::drop_from_work(const Connection& c) {
  if (c.queued) work_.erase(std::find(work_.begin(), work_.end(), &c));
  if (c.retx_listed) retx_conns_.erase(std::find(retx_conns_.begin(), retx_conns_.end(), &c));
  if (c.touched) touched_.erase(std::find(touched_.begin(), touched_.end(), &c));
}

Time EngineImpl::conn_due(const Connection& c) const {
  Time t = Time::max();
  // Only a path with packets on it (so the connection has records) or one out of service (a
  // probe's timer) has a deadline: an idle connection with every path active skips the scan.
  const std::span<const TxPath> paths =
      c.in_flight || c.failed_paths ? std::span<const TxPath>(c.tx) : std::span<const TxPath>();
  for (const TxPath& tp : paths) {
    if (tp.state == PathState::kProbing) {
      t = std::min(t, tp.deadline);
      continue;
    }
    if (tp.state != PathState::kActive || tp.in_flight == 0) continue;
    t = std::min({t, tp.deadline, fail_deadline(c, tp)});
  }
  if (c.in_flight) t = std::min({t, c.tlp_deadline, c.rack_deadline});
  t = std::min(t, c.rnr_deadline);  // also for a held message with nothing in flight
  t = std::min(t, c.park_deadline);
  if (c.pace_at != Time::min()) t = std::min(t, c.pace_at);  // a stale one wakes it once
  return t;
}

Time EngineImpl::next_deadline() const {
  settle();
  clean_heap_top();
  return heap_.empty() ? Time::max() : heap_.front().first;
}

bool EngineImpl::idle() const {
  if (!acks_.empty() || !retx_conns_.empty()) return false;
  for (const Connection* c : conn_list_) {
    if (c->cursor != kNoSlot || c->in_flight != 0 || !c->parked.empty()) return false;
    // A probe is due, except on retired paths and planes that are down (never probed).
    for (uint16_t p = 0; p < c->paths_used; ++p) {
      if (c->tx[p].state == PathState::kFailed && usable_plane(*c, c->tx[p].plane)) return false;
    }
  }
  return true;
}

// ---------------------------------------------------------------------------------------------
// Telemetry

std::vector<PathStats> EngineImpl::path_stats(uint32_t peer_ip, uint32_t lane) const {
  std::vector<PathStats> out;
  const Connection* cp = find_conn(peer_ip, lane);
  if (!cp) return out;
  const Connection& c = *cp;
  const RecvDir* newest = nullptr;
  for (const RecvDir& d : c.rx) {
    if (!newest || d.last_used_ns > newest->last_used_ns) newest = &d;
  }
  // The send side's paths, or, where the connection only receives (its send side is made at the
  // first send), the newest direction's.
  const size_t n = c.tx.empty() ? (newest ? newest->paths.size() : 0) : c.paths_used;
  for (uint16_t p = 0; p < n; ++p) {
    PathStats s;
    s.path_id = p;
    if (newest && p < newest->paths.size()) {
      const RxPath& rp = newest->paths[p];
      s.rx_packets = rp.rx_packets;
      s.rx_bytes = rp.rx_bytes;
      s.duplicates = rp.duplicates;
      s.ecn_ce_received = rp.ce_total;
      s.rx_cum = rp.win.cum();
      s.udp_src_port = rp.port;
      s.plane = rp.plane;
    }
    if (c.tx.empty()) {
      out.push_back(s);
      continue;
    }
    const TxPath& tp = c.tx[p];
    const detail::PathCounters& pc = c.counters[p];
    s.udp_src_port = tp.port;
    s.plane = tp.plane;
    s.plane_down = !plane_up(tp.plane);
    s.min_rtt_ns = pc.min_rtt_ns;
    for (uint16_t k = tp.head; k != kNil; k = c.pool[k].next) {
      s.in_flight_bytes += seg_len(c.pool[k].slot, c.pool[k].offset);
    }
    s.state = tp.state;
    s.tx_packets = pc.tx_packets;
    s.tx_bytes = pc.tx_bytes;
    s.retransmits = pc.retransmits;
    s.timeouts = pc.timeouts;
    s.acks_received = pc.acks_received;
    s.ecn_ce_echoed = pc.ce_echoed;
    s.sack_gaps = pc.sack_gaps;
    s.late_losses = pc.late_losses;
    s.failures = pc.failures;
    s.probes = pc.probes;
    s.next_seq = tp.next_seq;
    s.ack_floor = tp.una;
    s.in_flight = tp.in_flight;
    s.window = tp.cwnd / kWinUnit;
    s.srtt_ns = tp.srtt_ns;
    s.rto_ns = rto(tp).count();
    out.push_back(s);
  }
  return out;
}

ConnStats EngineImpl::conn_stats(uint32_t peer_ip, uint32_t lane) const {
  ConnStats s;
  const Connection* cp = find_conn(peer_ip, lane);
  if (!cp) return s;
  const Connection& c = *cp;
  s.exists = true;
  for (uint8_t pl = 0; pl < c.plane_cwnd.size(); ++pl)
    if ((c.plane_mask >> pl) & 1) s.window += c.plane_cwnd[pl] / kWinUnit;
  s.in_flight = c.in_flight;
  s.records = static_cast<uint32_t>(c.pool.size());
  s.rate_hint_mbps = c.rate_hints ? c.hint_mbps : c.last_hint_mbps;
  for (uint16_t p = 0; p < c.paths_used; ++p) {
    if (c.tx[p].state == PathState::kActive && usable_plane(c, c.tx[p].plane)) ++s.paths_active;
  }
  s.conn_id = c.conn_id;
  // Before its first send the lane's paths exist only as its profile (ensure_send).
  s.num_paths = c.tx.empty() ? cfg_.num_paths : c.paths_used;
  s.plane_mask = c.plane_mask;
  s.rate_hints = c.rate_hints;
  s.rx_rate_mbps = c.rx_rate_mbps;
  s.rx_hint_mbps = current_hint(c);
  return s;
}

EngineImpl::Footprint EngineImpl::footprint() const {
  Footprint f;
  for (const Connection* c : conn_list_) {
    ++f.connections;
    f.conn_bytes += sizeof(Connection) + c->parked.capacity() * sizeof(uint32_t) +
                    c->rx.capacity() * sizeof(RecvDir);
    f.tx_paths += c->tx.size();
    f.tx_path_bytes += c->tx.capacity() * sizeof(TxPath) +
                       c->counters.capacity() * sizeof(detail::PathCounters);
    for (const RecvDir& d : c->rx) {
      f.rx_paths += d.paths.size();
      f.rx_path_bytes += d.paths.capacity() * sizeof(RxPath);
    }
    f.records += c->pool.size();
    f.record_bytes += c->pool.capacity() * sizeof(TxDesc);
  }
  f.msg_slots = slots_.size();
  f.slot_bytes = slots_.capacity() * sizeof(detail::MsgSlot);
  return f;
}

std::vector<uint32_t> EngineImpl::lanes(uint32_t peer_ip) const {
  std::vector<uint32_t> out;
  for (const Connection* c : conn_list_) {
    if (c->peer_ip == peer_ip) out.push_back(c->lane);
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<PathStats> path_stats(const Engine& engine, uint32_t peer_ip, uint32_t lane) {
  const auto* e = dynamic_cast<const EngineImpl*>(&engine);
  return e ? e->path_stats(peer_ip, lane) : std::vector<PathStats>{};
}

ConnStats conn_stats(const Engine& engine, uint32_t peer_ip, uint32_t lane) {
  const auto* e = dynamic_cast<const EngineImpl*>(&engine);
  return e ? e->conn_stats(peer_ip, lane) : ConnStats{};
}

std::vector<uint32_t> lanes(const Engine& engine, uint32_t peer_ip) {
  const auto* e = dynamic_cast<const EngineImpl*>(&engine);
  return e ? e->lanes(peer_ip) : std::vector<uint32_t>{};
}

std::array<uint64_t, static_cast<size_t>(wire::DecodeError::kCount)> decode_drops(
    const Engine& engine) {
  const auto* e = dynamic_cast<const EngineImpl*>(&engine);
  if (!e) return {};
  return e->decode_drops();
}

}  // namespace metaroce::transport

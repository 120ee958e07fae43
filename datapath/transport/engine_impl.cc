// SPDX-License-Identifier: Apache-2.0
// The transport state machine: spraying, per-path SACK, selective retransmission, NAKs, ECN
// AIMD, fair-share pacing, path failure and re-probing, tail-loss probes, RNR back-off and the
// timers, driven only by the calls of transport::Engine (docs/spec/wire.md §3-§6,
// docs/spec/congestion.md).
#include "datapath/transport/engine_impl.h"

#include <sys/random.h>

#include <algorithm>
#include <bit>

#include "datapath/transport/path_seq.h"

namespace metaroce::transport {

using detail::DescState;
using detail::kNil;
using detail::kNoSlot;

namespace {

uint32_t ts32(Time t) { return static_cast<uint32_t>(t.count()); }

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

bool sack_bit(const std::array<uint64_t, 4>& sack, uint32_t i) {
  return i < wire::kSackBits && ((sack[i / 64] >> (i % 64)) & 1);
}

uint32_t window_packets(uint32_t w) { return std::max<uint32_t>(1, w / kWinUnit); }

uint32_t all_planes(uint8_t n) { return n >= 32 ? UINT32_MAX : (1u << n) - 1; }

// Path p of a connection uses the (p mod n)-th of the n planes in its mask (congestion.md §4.7).
uint8_t plane_for(uint32_t mask, uint8_t n, uint16_t p) {
  uint32_t k = p % n;
  for (uint8_t b = 0; b < 32; ++b) {
    if (!((mask >> b) & 1)) continue;
    if (k-- == 0) return b;
  }
  return 0;
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

// RFC 6298 from the path's own samples, clamped, then exponential back-off (spec §6.3).
Time EngineImpl::rto(const TxPath& tp, uint8_t backoff) const {
  Time base = cfg_.rto_initial;
  if (tp.srtt_ns != 0) base = Time(int64_t{tp.srtt_ns} + std::max<int64_t>(4 * int64_t{tp.rttvar_ns}, 1000));
  base = std::clamp(base, cfg_.rto_min, cfg_.rto_max);
  backoff = std::max(backoff, tp.backoff);
  for (uint8_t i = 0; i < backoff && base < cfg_.rto_max; ++i) base *= 2;
  return std::min(base, cfg_.rto_max);
}

uint32_t EngineImpl::seg_len(uint32_t slot, uint32_t offset) const {
  const MessageDesc& m = slots_[slot].m;
  if (m.op == Op::kReadReq) return 0;
  return std::min(seg_size_, m.length - offset);
}

// The path's own smoothed RTT, or before its first sample the smallest of its siblings'; 0 when
// the connection has none.
int64_t EngineImpl::srtt_ref(const Connection& c, const TxPath& tp) const {
  return tp.srtt_ns ? tp.srtt_ns : c.min_srtt_ns;
}

// The smallest smoothed RTT of the connection's active paths, kept in c.min_srtt_ns: called
// wherever a path's RTT or state changes, since the sprayer needs it for every packet.
void EngineImpl::refresh_min_srtt(Connection& c) {
  uint32_t best = 0;
  for (const TxPath& o : c.tx) {
    if (o.srtt_ns && o.state == PathState::kActive && (!best || o.srtt_ns < best)) best = o.srtt_ns;
  }
  c.min_srtt_ns = best;
}

bool EngineImpl::path_open(const Connection& c, const TxPath& tp) const {
  return tp.state == PathState::kActive && usable_plane(c, tp.plane) &&
         c.plane_in_flight[tp.plane] < window_packets(c.plane_cwnd[tp.plane]) &&
         tp.next_seq - tp.una < kPathWindow &&
         tp.in_flight < window_packets(tp.cwnd);
}

// Spraying (congestion.md §2.4): round-robin over open paths, preferring those without a recent
// CE mark, then those whose smoothed RTT is within 1.5x of the connection's best; a packet
// leaving a suspected path avoids that path's plane while another plane has room (§4.2).
uint16_t EngineImpl::choose_path(const Connection& c, Time now, int avoid_plane,
                                 uint16_t exclude) const {
  const uint16_t np = c.paths_used;
  const uint32_t min_srtt = c.min_srtt_ns;
  if (c.mask_planes < 2) avoid_plane = -1;
  uint16_t best = kNoPath;
  int best_class = 8;
  for (uint16_t k = 0; k < np; ++k) {
    const auto p = static_cast<uint16_t>((c.rr_next + k) % np);
    const TxPath& tp = c.tx[p];
    if (p == exclude || !path_open(c, tp)) continue;
    int cls = 0;
    const int64_t rtt = std::max<int64_t>(tp.srtt_ns, 1000);
    if (now.count() - tp.last_md_ns < 2 * rtt) cls += 2;
    // A slow path's sample goes stale when it carries nothing: after 8 of the best RTTs without
    // progress it is tried again, or a path slow once (an early timeout, a repath) would never
    // get the packet that shows it is fast now.
    if (min_srtt && uint64_t{tp.srtt_ns} * 2 > uint64_t{min_srtt} * 3 &&
        now.count() - tp.last_progress_ns < 8 * int64_t{min_srtt})
      cls += 1;
    if (tp.plane == avoid_plane) cls += 4;
    if (cls < best_class) {
      best = p;
      best_class = cls;
      if (cls == 0) break;
    }
  }
  return best;
}

uint32_t EngineImpl::alloc_slot() {
  if (!free_slots_.empty()) {
    const uint32_t s = free_slots_.back();
    free_slots_.pop_back();
    return s;
  }
  slots_.emplace_back();
  return static_cast<uint32_t>(slots_.size() - 1);
}

// ---------------------------------------------------------------------------------------------
// In-flight records

void EngineImpl::list_append(Connection& c, uint16_t path, uint16_t idx) {
  TxPath& tp = c.tx[path];
  TxDesc& d = c.pool[idx];
  d.next = kNil;
  d.path = path;
  d.state = DescState::kInFlight;
  if (tp.tail != kNil) c.pool[tp.tail].next = idx;
  else tp.head = idx;
  tp.tail = idx;
  ++tp.in_flight;
  ++c.plane_in_flight[tp.plane];
}

void EngineImpl::list_remove(Connection& c, uint16_t path, uint16_t prev, uint16_t idx) {
  TxPath& tp = c.tx[path];
  TxDesc& d = c.pool[idx];
  if (prev == kNil) tp.head = d.next;
  else c.pool[prev].next = d.next;
  if (tp.tail == idx) tp.tail = prev;
  d.next = kNil;
  --tp.in_flight;
  --c.plane_in_flight[tp.plane];
}

uint16_t EngineImpl::find_in_flight(const Connection& c, uint16_t path, uint32_t seq) const {
  for (uint16_t i = c.tx[path].head; i != kNil; i = c.pool[i].next) {
    if (c.pool[i].seq == seq) return i;
  }
  return kNil;
}

// The message of the packet sent as `seq` on `path`, wherever it is now: still on that path, or
// moved off it (a failover copy in flight elsewhere, or waiting to go); kNoSlot if resolved.
uint32_t EngineImpl::find_named(const Connection& c, uint16_t path, uint32_t seq) const {
  const uint16_t idx = find_in_flight(c, path, seq);
  if (idx != kNil) return c.pool[idx].slot;
  if (!c.tx[path].moved) return kNoSlot;
  auto names = [&](const TxDesc& d) {
    return (d.flags & detail::kCopy) && d.orig_path == path && d.orig_seq == seq;
  };
  for (uint16_t p = 0; p < c.tx.size(); ++p) {
    if (p == path) continue;
    for (uint16_t i = c.tx[p].head; i != kNil; i = c.pool[i].next) {
      if (names(c.pool[i])) return c.pool[i].slot;
    }
  }
  for (uint16_t i = c.move_head; i != kNil; i = c.pool[i].next) {
    if (names(c.pool[i])) return c.pool[i].slot;
  }
  return kNoSlot;
}

void EngineImpl::free_desc(Connection& c, uint16_t idx) {
  TxDesc& d = c.pool[idx];
  d = TxDesc{};
  d.next = c.free_head;
  c.free_head = idx;
  --c.in_flight;
}

// The record left every list: release the pin its failover copy held on the original path.
void EngineImpl::resolve(Connection& c, uint16_t idx) {
  const TxDesc& d = c.pool[idx];
  if (d.flags & detail::kCopy) {
    TxPath& op = c.tx[d.orig_path];
    if (op.moved && --op.moved == 0) update_una(c, d.orig_path);
  }
  free_desc(c, idx);
}

void EngineImpl::update_una(Connection& c, uint16_t path) {
  TxPath& tp = c.tx[path];
  uint32_t u = tp.head != kNil ? c.pool[tp.head].seq : tp.next_seq;
  // A moved packet is unresolved until its copy is: the receiver must still be able to tell
  // whether the original arrived (congestion.md §4.3).
  if (tp.moved && seq_lt(tp.moved_floor, u)) u = tp.moved_floor;
  tp.una = u;
}

// A resend request: the connection's own queue (paced with its other packets, §3.3), and the
// connection on the engine's list of those with resends to send, in the order they first asked.
// An entry whose record moved or was freed since has lost kRetxQueued and is skipped.
void EngineImpl::queue_retx(Connection& c, uint16_t idx) {
  c.pool[idx].flags |= detail::kRetxQueued;
  c.retx_q.push_back(idx);
  if (!c.retx_listed) {
    c.retx_listed = true;
    retx_conns_.push_back(&c);
  }
}

// A connection that has no share from its peer yet, where shares are in use, sends at most
// start_window packets: the share comes with the first ACK (congestion.md §3.4). A share is
// forgotten by the peer once we have sent it nothing for kActiveIntervals of its intervals, so
// after such a pause ours is dropped too and the next burst waits for a fresh one.
bool EngineImpl::start_held(Time now, Connection& c) {
  if (!cfg_.rx_capacity_mbps || !cfg_.start_window || !c.rate_hints ||
      c.peer_shares == detail::PeerShares::kNo) {
    return false;
  }
  if (c.hint_mbps && now.count() - c.last_tx_ns > kActiveIntervals * cfg_.hint_interval.count()) {
    c.hint_mbps = 0;
  }
  return !c.hint_mbps && c.in_flight >= cfg_.start_window;
}

// With a rate hint, whether a packet of len bytes (UDP payload) must wait for credit; if so, the
// connection's pace_at says until when (congestion.md §3.3).
bool EngineImpl::must_wait(Time now, Connection& c, uint32_t len) {
  if (!c.hint_mbps) return false;
  refill(c, now);
  const int64_t cost = int64_t{len} * 8000;
  if (c.credit >= cost) return false;
  c.pace_at = now + Time((cost - c.credit + c.hint_mbps - 1) / c.hint_mbps);
  ++stats_.pacing_waits;
  return true;
}

uint32_t EngineImpl::packet_len(const TxDesc& d) const {
  return headers_len(slots_[d.slot].m) + seg_len(d.slot, d.offset);
}

// The connection's queued resends, oldest request first, as its credit allows. False when the
// sink is full.
bool EngineImpl::send_retx(Time now, Connection& c, TxSink& sink, uint32_t& sent) {
  size_t i = 0;
  bool ok = true;
  for (; i < c.retx_q.size(); ++i) {
    const uint16_t idx = c.retx_q[i];
    const TxDesc& d = c.pool[idx];
    if (d.state != DescState::kInFlight || !(d.flags & detail::kRetxQueued)) continue;
    if (must_wait(now, c, packet_len(d))) break;
    if (!emit_data(now, c, idx, sink, TxKind::kRetx)) {
      ok = false;
      break;
    }
    ++sent;
    const uint64_t copies = stats_.redundant_copies;
    ok = emit_redundant(now, c, idx, sink);
    sent += static_cast<uint32_t>(stats_.redundant_copies - copies);
    if (!ok) {
      ++i;
      break;
    }
  }
  c.retx_q.erase(c.retx_q.begin(), c.retx_q.begin() + static_cast<std::ptrdiff_t>(i));
  return ok;
}

// ---------------------------------------------------------------------------------------------
// Submission and sending

void EngineImpl::submit(const MessageDesc& msg) {
  Connection& c = conn_for(msg.peer_ip, msg.lane);
  ensure_send(c);
  const uint32_t idx = alloc_slot();
  detail::MsgSlot& s = slots_[idx];
  s = detail::MsgSlot{};
  s.m = msg;
  // kReadReq and a zero-length message are one packet without payload (spec §4.1).
  s.pkts_total = (msg.op == Op::kReadReq || msg.length == 0)
                     ? 1
                     : static_cast<uint32_t>((uint64_t{msg.length} + seg_size_ - 1) / seg_size_);
  s.prev = c.tail;
  if (c.tail != kNoSlot) slots_[c.tail].next = idx;
  else c.head = idx;
  c.tail = idx;
  if (c.cursor == kNoSlot) c.cursor = idx;
}

// Token bucket on the engine's clock: credit in Mbit/s * ns, a byte costs 8000 (congestion.md §3.3).
void EngineImpl::refill(Connection& c, Time now) {
  if (!c.hint_mbps) return;
  int64_t el = now.count() - c.credit_ns;
  c.credit_ns = now.count();
  if (el <= 0) return;
  el = std::min<int64_t>(el, 1'000'000'000);
  const int64_t cap = int64_t{kPaceBurst} * cfg_.max_packet * 8000;
  c.credit = std::min(cap, c.credit + el * c.hint_mbps);
}

// Writes one data packet of record d's segment on `path` with sequence `seq`: the record's own
// transmission, or a redundant copy of it (§5.2). False when the sink has no room.
bool EngineImpl::write_data(Time now, Connection& c, const TxDesc& d, uint16_t path, uint32_t seq,
                            uint16_t flags, uint32_t orig_seq, TxSink& sink) {
  const MessageDesc& m = slots_[d.slot].m;
  const uint32_t plen = seg_len(d.slot, d.offset);
  const uint32_t hlen = headers_len(m);
  const uint32_t len = hlen + plen;
  TxPath& tp = c.tx[path];
  std::span<uint8_t> buf = sink.begin(len, tp.plane);
  if (buf.size() < len) return false;

  wire::BaseHeader b;
  b.opcode = static_cast<wire::Opcode>(m.op);
  // It has more waiting to go than this packet: its receiver's share holds it back (§3.2).
  const bool more = c.cursor != kNoSlot || c.move_head != kNil || c.retx_q.size() > 1;
  b.flags = static_cast<uint16_t>(flags | (more ? wire::kFlagMore : 0) |
                                  (m.xrc ? wire::kFlagXrc : 0));
  b.conn_id = c.conn_id;
  b.token = c.token;
  b.path_id = path;
  b.path_count = static_cast<uint16_t>(c.tx.size());
  b.path_seq = seq;
  b.timestamp = ts32(now);
  b.ack_floor = tp.una;  // never above seq: una <= every listed seq <= next_seq
  wire::DataHeader h;
  h.dst_stream = m.dst_stream;
  h.src_stream = m.src_stream;
  h.msn = m.msn;
  h.rsn = m.rsn;
  h.offset = d.offset;
  h.total_length = m.length;
  h.remote_addr = m.remote_addr;
  h.rkey = m.rkey;
  h.imm = m.imm;
  h.payload_len = plen;
  h.orig_seq = orig_seq;
  h.xrc_srqn = m.xrc_srqn & wire::kXrcSrqnMask;
  wire::encode_data(buf, b, h);
  if (plen) host_.gather(m.cookie, d.offset, buf.subspan(hlen, plen));
  sink.commit(c.peer_ip, tp.port, tp.plane, len);
  // Strictly increasing per connection, so that packets a poll sends at one instant still have
  // an order for late-packet detection (§5.1): a nanosecond apart.
  c.last_tx_ns = std::max<int64_t>(now.count(), c.last_tx_ns + 1);
  detail::PathCounters& pc = c.counters[path];
  ++pc.tx_packets;
  pc.tx_bytes += len;
  ++stats_.tx_packets;
  stats_.tx_bytes += len;
  if (c.hint_mbps) {
    refill(c, now);
    const int64_t cap = int64_t{kPaceBurst} * cfg_.max_packet * 8000;
    c.credit = std::max(c.credit - int64_t{len} * 8000, -4 * cap);
  }
  return true;
}

bool EngineImpl::emit_data(Time now, Connection& c, uint16_t idx, TxSink& sink, TxKind kind) {
  TxDesc& d = c.pool[idx];
  TxPath& tp = c.tx[d.path];
  const bool copy = d.flags & detail::kCopy;
  // Its timeouts back its timer off only while the peer has said nothing since it last left
  // (expire()): the back-off it carries to a new path is 0 when the connection made progress.
  const uint8_t backoff =
      d.rto_retries && !heard_since(c, d.sent_ts, now) ? d.rto_retries : 0;
  if (!write_data(now, c, d, d.path, d.seq, copy ? wire::failover_flags(d.orig_path) : 0,
                  copy ? d.orig_seq : 0, sink)) {
    return false;
  }

  d.tx_order = tp.tx_order++;
  d.sent_ts = ts32(Time(c.last_tx_ns));
  d.flags &= static_cast<uint8_t>(~detail::kRetxQueued);
  if (kind == TxKind::kRetx) d.flags |= detail::kResent;
  if (kind == TxKind::kRetx) {
    ++c.counters[d.path].retransmits;
    ++stats_.retransmits;
  } else if (kind == TxKind::kCopy) {
    ++stats_.failover_resends;
  }
  if (tp.deadline == Time::max()) tp.deadline = now + rto(tp, backoff);
  return true;
}

// Redundancy in the tail (congestion.md §5.2): once a connection has sent all its data, a packet
// it resends goes out twice, on its own path and, unrecorded, on another open path (another
// plane if it can), flagged as a redundant copy of the original. In the tail nothing new waits,
// so the copy costs no goodput; a resend is what the message's completion waits for, and under
// heavy loss one path loses it as often as the first time (a round trip each). Only a record on
// its first path is copied: a failover copy's original is elsewhere, and its receive window
// could not tell the receiver about this one. The copy consumes a sequence on its path that no
// record holds; that path's ack floor passes it at once.
bool EngineImpl::emit_redundant(Time now, Connection& c, uint16_t idx, TxSink& sink, bool moving) {
  const TxDesc& d = c.pool[idx];
  // Nor one the receiver refused for want of a receive (RNR): it is not lost, and a copy
  // would only be refused too.
  if (!cfg_.tail_redundancy || d.rnr_retries || c.cursor != kNoSlot ||
      (c.move_head != kNil && !moving)) {
    return true;
  }
  // A failover copy's copy names the first transmission too (§4.3): the receiver acknowledges
  // that path, and the sender resolves the moved record from it (resolve_moved).
  const bool moved = d.flags & detail::kCopy;
  const uint16_t orig_path = moved ? d.orig_path : d.path;
  const uint32_t orig_seq = moved ? d.orig_seq : d.seq;
  const uint16_t q = choose_path(c, now, c.tx[d.path].plane, d.path);
  if (q == kNoPath) return true;
  // Paced, it goes only on credit to spare: it must not delay the resends the peer's share is for.
  if (c.hint_mbps) {
    refill(c, now);
    if (c.credit < int64_t{packet_len(d)} * 8000) return true;
  }
  TxPath& tq = c.tx[q];
  if (q == orig_path) return true;
  const auto flags = static_cast<uint16_t>(wire::failover_flags(orig_path) | wire::kFlagRedundant);
  if (!write_data(now, c, d, q, tq.next_seq, flags, orig_seq, sink)) return false;
  ++tq.tx_order;
  ++tq.next_seq;
  update_una(c, q);
  ++stats_.redundant_copies;
  return true;
}

bool EngineImpl::emit_probe(Time now, Connection& c, uint16_t path, TxSink& sink) {
  TxPath& tp = c.tx[path];
  std::span<uint8_t> buf = sink.begin(wire::kBaseHeaderLen, tp.plane);
  if (buf.size() < wire::kBaseHeaderLen) return false;
  // Entropy re-pick: every probe tries another route through the fabric (congestion.md §4.4).
  tp.port = random_port();
  wire::BaseHeader b;
  b.opcode = wire::Opcode::kProbe;
  b.conn_id = c.conn_id;
  b.token = c.token;
  b.path_id = path;
  b.path_count = static_cast<uint16_t>(c.tx.size());
  b.path_seq = tp.next_seq;
  b.timestamp = ts32(now);
  b.ack_floor = tp.una;
  wire::encode_base(buf, b);
  sink.commit(c.peer_ip, tp.port, tp.plane, wire::kBaseHeaderLen);
  tp.state = PathState::kProbing;
  Time interval = std::max(Time(2 * srtt_ref(c, tp)), cfg_.rto_min);
  for (uint8_t i = 0; i < tp.backoff && interval < cfg_.rto_max; ++i) interval *= 2;
  if (tp.backoff < kMaxBackoff) ++tp.backoff;
  tp.deadline = now + std::min(interval, cfg_.rto_max);
  ++c.counters[path].probes;
  ++stats_.probes_sent;
  ++stats_.tx_packets;
  stats_.tx_bytes += wire::kBaseHeaderLen;
  return true;
}

bool EngineImpl::emit_ack(Time now, Connection& c, RecvDir& d, uint16_t path, TxSink& sink) {
  RxPath& rp = d.paths[path];
  // NAK records stay until cum has passed them by the SACK span (spec §5.3).
  uint8_t kept = 0;
  for (uint8_t i = 0; i < rp.nak_count; ++i) {
    if (seq_diff(rp.naks[i].seq, rp.win.cum()) <= static_cast<int32_t>(wire::kSackBits)) {
      rp.naks[kept++] = rp.naks[i];
    }
  }
  rp.nak_count = kept;
  std::array<wire::NakRecord, kNakSlots> naks;
  const uint32_t n = kept;
  for (uint32_t i = 0; i < n; ++i) {
    naks[i] = {rp.naks[i].seq, rp.naks[i].src_stream, rp.naks[i].msn, rp.naks[i].syndrome,
               rp.naks[i].rnr_timer};
  }
  const uint32_t len = wire::kAckHeadersLen + n * wire::kNakRecordLen;
  // Back where the data arrived; while that plane is down, on the first plane that is up (the
  // sender takes an ACK on any plane).
  uint8_t plane = rp.plane;
  if (!plane_up(plane) && planes_up_ & all_planes(cfg_.num_planes)) {
    plane = static_cast<uint8_t>(std::countr_zero(planes_up_ & all_planes(cfg_.num_planes)));
  }
  std::span<uint8_t> buf = sink.begin(len, plane);
  if (buf.size() < len) return false;

  wire::BaseHeader b;
  b.opcode = wire::Opcode::kAck;
  b.flags = rp.echo_fresh ? 0 : wire::kFlagNoEcho;
  b.conn_id = d.conn_id;
  b.token = d.token;
  b.path_id = path;
  b.path_count = d.path_count;
  b.timestamp = ts32(now);
  wire::AckHeader a;
  a.cum_seq = rp.win.cum();
  a.sack = rp.win.sack();
  a.echo_timestamp = rp.echo_ts;
  a.ecn_ce_count = rp.ce_since_ack;
  a.rate_hint = current_hint(c);
  c.rx_hint_told = a.rate_hint;
  wire::encode_ack(buf, b, a, std::span(naks.data(), n));
  // The ACK mirrors the data's source port, so a sender's entropy re-pick moves both
  // directions of the path (spec §3.3).
  const uint16_t port = rp.port || c.tx.empty() ? rp.port : c.tx[path % c.tx.size()].port;
  sink.commit(c.peer_ip, port, plane, len);

  // An RNR record is said once: the packet is still missing, so if this ACK is lost the
  // sender's loss recovery resends it and a new refusal makes a new record (congestion.md §6).
  kept = 0;
  for (uint8_t i = 0; i < rp.nak_count; ++i) {
    if (rp.naks[i].syndrome != static_cast<uint8_t>(Syndrome::kRnr)) rp.naks[kept++] = rp.naks[i];
  }
  rp.nak_count = kept;
  rp.ack_pending = false;
  rp.echo_fresh = false;
  rp.ce_since_ack = 0;
  ++stats_.acks_sent;
  ++stats_.tx_packets;
  stats_.tx_bytes += len;
  return true;
}

// Failover copies go first among data, on whichever open path the sprayer picks.
bool EngineImpl::send_moving(Time now, Connection& c, TxSink& sink, uint32_t& sent) {
  while (c.move_head != kNil) {
    const uint16_t idx = c.move_head;
    TxDesc& d = c.pool[idx];
    // d.path still names the path it left.
    uint16_t p = choose_path(c, now, c.tx[d.path].plane);
    if (p == kNoPath) p = overflow_path(c);
    if (p == kNoPath || must_wait(now, c, packet_len(d))) return true;
    TxPath& tp = c.tx[p];
    d.path = p;
    d.seq = tp.next_seq;
    if (!emit_data(now, c, idx, sink, TxKind::kCopy)) return false;
    c.move_head = d.next;
    if (c.move_head == kNil) c.move_tail = kNil;
    if (tp.in_flight == 0) tp.last_progress_ns = now.count();
    list_append(c, p, idx);
    ++tp.next_seq;
    update_una(c, p);
    c.rr_next = static_cast<uint16_t>((p + 1) % c.paths_used);
    ++sent;
    // In the tail a moved packet is a resend like any other: it goes twice (§5.2). One sent once
    // left the all-to-all at 10 % loss with a packet through five backed-off RTOs (6.7 ms).
    const uint64_t copies = stats_.redundant_copies;
    if (!emit_redundant(now, c, idx, sink, true)) return false;
    sent += static_cast<uint32_t>(stats_.redundant_copies - copies);
  }
  return true;
}

// No path is open, yet failover copies wait: they go on the active path with the most room left
// in its SACK span, past its window. A copy held back could be what that window waits for (its
// original pins the ack floor of the path it left, §4.3), and while it waits no timer runs for
// it, so nothing would ever fail its message if the peer were gone.
uint16_t EngineImpl::overflow_path(const Connection& c) const {
  uint16_t best = kNoPath;
  uint32_t best_used = SackWindow::kSpan - 1;
  for (uint16_t p = 0; p < c.paths_used; ++p) {
    const TxPath& tp = c.tx[p];
    const uint32_t used = tp.next_seq - tp.una;
    if (tp.state == PathState::kActive && usable_plane(c, tp.plane) && used < best_used) {
      best = p;
      best_used = used;
    }
  }
  return best;
}

// One more in-flight record, false at conn_window_max. The pool grows only here, where no
// reference into it is held; a connection has as many records as it ever had in flight.
bool EngineImpl::grow_pool(Connection& c) {
  if (c.pool.size() >= cfg_.conn_window_max) return false;
  c.pool.emplace_back();
  c.free_head = static_cast<uint16_t>(c.pool.size() - 1);
  return true;
}

bool EngineImpl::send_new(Time now, Connection& c, TxSink& sink, uint32_t& sent, bool& more) {
  more = false;
  // c.turn_sent: what it sent of its turn, kept when the sink stopped it mid-turn.
  for (; c.cursor != kNoSlot; ++c.turn_sent) {
    if (c.turn_sent >= kTxBurst) {  // its turn is over; the work list comes back to it
      c.turn_sent = 0;
      more = true;
      return true;
    }
    const uint16_t p = choose_path(c, now);
    if (p == kNoPath) return true;
    if (c.free_head == kNil && !grow_pool(c)) return true;  // conn_window_max records in all
    if (start_held(now, c)) return true;
    detail::MsgSlot& s = slots_[c.cursor];
    if (s.resume_ns > now.count()) return true;  // refused (RNR): waits out its back-off
    const uint32_t len = seg_len(c.cursor, s.next_offset);
    if (must_wait(now, c, headers_len(s.m) + len)) return true;
    TxPath& tp = c.tx[p];
    if (s.pkts_sent == 0) s.first_tx_ns = now.count();
    const uint16_t idx = c.free_head;
    TxDesc& d = c.pool[idx];
    c.free_head = d.next;
    ++c.in_flight;
    d = TxDesc{};
    d.slot = c.cursor;
    d.offset = s.next_offset;
    d.path = p;
    d.seq = tp.next_seq;
    d.state = DescState::kInFlight;
    if (!emit_data(now, c, idx, sink, TxKind::kNew)) {
      free_desc(c, idx);
      return false;
    }
    if (tp.in_flight == 0) tp.last_progress_ns = now.count();
    list_append(c, p, idx);
    ++tp.next_seq;
    update_una(c, p);
    ++sent;
    c.rr_next = static_cast<uint16_t>((p + 1) % c.paths_used);
    s.next_offset += len;
    if (++s.pkts_sent == s.pkts_total) c.cursor = s.next;
  }
  return true;
}

uint32_t EngineImpl::poll_tx(Time now, TxSink& sink) {
  uint32_t sent = 0;
  if (shares_fell_) push_shares();
  // 1. ACKs first: they unblock the peer's windows (spec §5.2).
  size_t i = 0;
  for (; i < acks_.size(); ++i) {
    const AckRef r = acks_[i];
    RecvDir* d = find_dir(*r.conn, r.conn_id);
    if (!d || r.path >= d->paths.size() || !d->paths[r.path].ack_pending) continue;
    if (!emit_ack(now, *r.conn, *d, r.path, sink)) break;
    ++sent;
  }
  acks_.erase(acks_.begin(), acks_.begin() + static_cast<std::ptrdiff_t>(i));
  if (!acks_.empty()) return sent;  // the sink is full

  // 2. Probes of failed paths. Only connections that changed since they were last visited can
  // have something to send (congestion.md §7.1): a path fails, a window opens, a message or a
  // timer comes only through a call that touches its connection.
  for (Connection* c : work_) {
    if (!c->failed_paths) continue;
    touch(*c, false);  // a probe arms the path's probe deadline
    // Retired paths and those on a plane that is down are not probed.
    for (uint16_t p = 0; p < c->paths_used; ++p) {
      if (c->tx[p].state != PathState::kFailed || !usable_plane(*c, c->tx[p].plane)) continue;
      if (!emit_probe(now, *c, p, sink)) return finish_poll(sent);
      ++sent;
    }
  }

  // 3. Retransmissions of every connection before anyone's new data, connections in the order
  // they first asked; a connection whose credit runs out keeps the rest for later (§3.3).
  bool full = false;
  for (Connection*& c : retx_conns_) {
    touch(*c, false);
    if (!send_retx(now, *c, sink, sent)) {
      full = true;
      break;
    }
    if (!c->retx_q.empty()) continue;  // waits for credit
    c->retx_listed = false;
    c = nullptr;
  }
  std::erase(retx_conns_, nullptr);
  if (full) return finish_poll(sent);

  // 4. Failover copies, then new packets, sprayed one by one over open paths (spec §6.1).
  // Connections take turns of kTxBurst new packets, as a NIC arbitrates among its queue pairs:
  // sending each connection its whole window in turn made a host's peers receive from all
  // hosts in the same order, a rolling incast (congestion.md §7.1). A connection leaves the
  // work list once it has nothing more it may send; one that the sink stopped stays, first.
  size_t visited = 0;
  for (; visited < work_.size(); ++visited) {
    Connection* c = work_[visited];
    ++conn_visits_;
    touch(*c, false);
    bool more = false;
    if (!send_moving(now, *c, sink, sent) || !send_new(now, *c, sink, sent, more)) break;
    if (c->tlp_deadline == Time::max()) arm_tlp(now, *c);
    if (more) {
      work_.push_back(c);  // another turn, after the others
    } else {
      c->queued = false;
      c->turn_sent = 0;
    }
  }
  work_.erase(work_.begin(), work_.begin() + static_cast<std::ptrdiff_t>(visited));
  return finish_poll(sent);
}

uint32_t EngineImpl::finish_poll(uint32_t sent) {
  settle();
  return sent;
}

// ---------------------------------------------------------------------------------------------
// Receiving

void EngineImpl::on_packet(Time now, uint32_t peer_ip, uint16_t udp_src_port, bool ecn_ce,
                           std::span<const uint8_t> udp_payload, uint8_t plane) {
  ++stats_.rx_packets;
  stats_.rx_bytes += udp_payload.size();
  wire::Packet pkt;
  const wire::DecodeError err = wire::decode(udp_payload, pkt);
  if (err != wire::DecodeError::kNone) {
    ++decode_drops_[static_cast<size_t>(err)];
    if (err == wire::DecodeError::kBadVersion) ++stats_.drop_version;
    else ++stats_.drop_malformed;
    return;
  }
  if (wire::is_data_opcode(pkt.base.opcode)) {
    if (forgotten(peer_ip, pkt.base.conn_id)) {
      // A direction we forgot: never a new one (§4.6). (A conn_id the peer drew again since
      // would be a new direction: 1 in 2^32 per direction of the 4,096 remembered.)
      Connection* known = find_conn(peer_ip);
      if (!known || !find_dir(*known, pkt.base.conn_id)) {
        ++stats_.drop_forgotten;
        return;
      }
    }
    handle_data(now, conn_for(peer_ip), udp_src_port, ecn_ce, plane, pkt);
  } else if (pkt.base.opcode == wire::Opcode::kAck) {
    handle_ack(now, peer_ip, pkt);
  } else {
    Connection* c = find_conn(peer_ip);
    if (!c) ++stats_.drop_unknown_conn;
    else handle_probe(now, *c, udp_src_port, ecn_ce, plane, pkt);
    if (c) touch(*c);
  }
  flush_completions();
}

EngineImpl::RecvDir* EngineImpl::find_dir(Connection& c, uint32_t conn_id) {
  for (RecvDir& d : c.rx) {
    if (d.conn_id == conn_id) return &d;
  }
  return nullptr;
}

// 0-RTT: the first valid data packet of an unknown direction creates its state (spec §3.2).
EngineImpl::RecvDir& EngineImpl::create_dir(Connection& c, const wire::BaseHeader& b, Time now) {
  RecvDir* d = nullptr;
  if (c.rx.size() < kMaxRecvDirs) {
    d = &c.rx.emplace_back();
  } else {
    // A peer that restarted abandons its old direction; the least recently used one goes.
    d = &*std::min_element(c.rx.begin(), c.rx.end(), [](const RecvDir& x, const RecvDir& y) {
      return x.last_used_ns < y.last_used_ns;
    });
  }
  d->conn_id = b.conn_id;
  d->token = b.token;
  d->path_count = b.path_count;
  d->last_used_ns = now.count();
  d->paths.assign(b.path_count, RxPath{});
  return *d;
}

void EngineImpl::request_ack(Connection& c, RecvDir& d, uint16_t path, uint32_t ts, bool ecn_ce,
                             bool own) {
  RxPath& rp = d.paths[path];
  if (own) {
    rp.echo_ts = ts;
    rp.echo_fresh = true;
  }
  if (ecn_ce) {
    if (rp.ce_since_ack != UINT16_MAX) ++rp.ce_since_ack;
    ++rp.ce_total;
  }
  if (!rp.ack_pending) {
    rp.ack_pending = true;
    acks_.push_back({&c, d.conn_id, path});
  }
}

void EngineImpl::note_unreachable(RxPath& rp, uint32_t seq, uint32_t src_stream, uint32_t msn) {
  const auto unreachable = static_cast<uint8_t>(Syndrome::kUnreachable);
  for (uint8_t i = 0; i < rp.nak_count; ++i) {
    detail::NakEntry& n = rp.naks[i];
    if (n.syndrome == unreachable && n.src_stream == src_stream) {
      if (seq_lt(n.seq, seq)) n = {seq, src_stream, msn, unreachable};
      return;
    }
  }
  if (rp.nak_count < kNakSlots) rp.naks[rp.nak_count++] = {seq, src_stream, msn, unreachable};
}

// The sender has resolved every sequence below its ack floor: the window skips them, and NAK
// records for them are no longer needed by anyone (spec §5.3).
void EngineImpl::apply_floor(RxPath& rp, uint32_t ack_floor) {
  rp.win.advance_to(ack_floor);
  uint8_t kept = 0;
  for (uint8_t i = 0; i < rp.nak_count; ++i) {
    if (!seq_lt(rp.naks[i].seq, ack_floor)) rp.naks[kept++] = rp.naks[i];
  }
  rp.nak_count = kept;
}

// False when the path's records are full (the record is not kept).
bool EngineImpl::add_nak(RxPath& rp, uint32_t seq, uint32_t src_stream, uint32_t msn,
                         Syndrome why, uint8_t rnr_timer) {
  const detail::NakEntry e{seq, src_stream, msn, static_cast<uint8_t>(why), rnr_timer};
  for (uint8_t i = 0; i < rp.nak_count; ++i) {
    if (rp.naks[i].seq == seq) {
      rp.naks[i] = e;
      return true;
    }
  }
  if (rp.nak_count == kNakSlots) return false;
  rp.naks[rp.nak_count++] = e;
  return true;
}

// Arrival accounting for fair-share hints (congestion.md §3.1). A sender not heard from in the
// last kActiveIntervals is admitted at once with an unlimited demand: its first ACK carries a
// share, and the other unsatisfied senders' shares shrink with the same ACKs (§3.2).
void EngineImpl::account_rx(Time now, Connection& c, size_t bytes, bool more) {
  if (!cfg_.rx_capacity_mbps) return;
  if (interval_start_ == Time::min()) {
    interval_start_ = now;
    share_remaining_ = uint64_t{cfg_.rx_capacity_mbps} * kHintPercent / 100;
  } else if (now - interval_start_ >= cfg_.hint_interval) {
    close_rate_interval(now);
  }
  if (!heard(c)) {
    c.rx_rate_mbps = 0;
    c.rx_demand = UINT32_MAX;
    c.rx_frozen = false;
    ++share_unsat_;
    share_spare_ = 0;
    share_level_ = share_remaining_ / share_unsat_;
    shares_fell_ = true;
  }
  c.rx_bytes_interval += bytes;
  c.rx_heard_interval = interval_idx_ + 1;
  if (more) c.rx_more = true;
}

// Senders whose share fell to half or less of what we last told them hear it now, in an ACK on
// the path their data last came by, instead of with the ACK of their next packet: that packet may
// wait behind the queue the newcomers build, while the way back is clear (congestion.md §3.3).
void EngineImpl::push_shares() {
  shares_fell_ = false;
  for (Connection* c : conn_list_) {
    if (!heard(*c) || uint64_t{current_hint(*c)} * 2 > c->rx_hint_told) continue;
    RecvDir* d = find_dir(*c, c->rx_dir);
    if (!d || c->rx_path >= d->paths.size()) continue;
    request_ack(*c, *d, c->rx_path, d->paths[c->rx_path].echo_ts, false, false);
    ++stats_.share_pushes;
  }
}

bool EngineImpl::heard(const Connection& c) const {
  return c.rx_heard_interval != 0 && interval_idx_ + 1 - c.rx_heard_interval < kActiveIntervals;
}

// The share an ACK to this sender carries now (congestion.md §3.3): its demand and the spare if
// the last division satisfied it, else the level every unsatisfied sender gets.
uint32_t EngineImpl::current_hint(const Connection& c) const {
  if (!cfg_.rx_capacity_mbps || !heard(c)) return 0;
  const uint64_t cap = uint64_t{cfg_.rx_capacity_mbps} * kHintPercent / 100;
  if (c.rx_frozen) return static_cast<uint32_t>(std::min<uint64_t>(c.rx_demand + share_spare_, cap));
  return static_cast<uint32_t>(std::clamp<uint64_t>(share_level_, 1, cap));
}

// Max-min fair division of our inbound capacity among the senders heard in the last few
// intervals, by water-filling over their demands; capacity a sender does not demand is shared
// by the others (congestion.md §3.2). A sender that said it had more to send (kFlagMore) is
// held back by its share or by the network, not by its application: its demand does not fall
// below 0.9 of its share, so a stall while it recovers a loss costs it a tenth per interval, not
// its share. One that had nothing more wants its measured rate plus a quarter. Once per interval.
void EngineImpl::close_rate_interval(Time now) {
  const int64_t elapsed = std::max<int64_t>((now - interval_start_).count(), 1);
  const uint64_t cap = uint64_t{cfg_.rx_capacity_mbps} * kHintPercent / 100;
  uint32_t n = 0;
  for (Connection* c : conn_list_) {
    if (heard(*c)) {
      const auto sample = static_cast<uint32_t>(
          std::min<uint64_t>(c->rx_bytes_interval * 8000 / static_cast<uint64_t>(elapsed), UINT32_MAX / 2));
      // Smoothed over intervals (gain 1/4): an interval holds only a few packets of a slow
      // sender. A sender that was silent before starts from its sample.
      const bool fresh = c->rx_rate_mbps == 0;
      c->rx_rate_mbps = fresh ? sample
                              : static_cast<uint32_t>((3 * uint64_t{c->rx_rate_mbps} + sample) / 4);
      uint64_t d = uint64_t{c->rx_rate_mbps} * 5 / 4 + 1;
      if (c->rx_more) {
        const uint32_t share = current_hint(*c);
        d = share ? std::max<uint64_t>(d, uint64_t{share} * 9 / 10) : cap;
      }
      c->rx_demand = static_cast<uint32_t>(std::min<uint64_t>(d, UINT32_MAX));
      c->rx_frozen = false;
      ++n;
    } else {
      c->rx_rate_mbps = 0;
      c->rx_demand = 0;
      c->rx_frozen = true;
    }
    c->rx_bytes_interval = 0;
    c->rx_more = false;
  }
  const uint32_t active = n;
  uint64_t remaining = cap;
  for (bool changed = true; changed && n;) {
    changed = false;
    const uint64_t level = remaining / n;
    for (Connection* c : conn_list_) {
      if (c->rx_frozen || c->rx_demand > level) continue;
      c->rx_frozen = true;
      remaining -= c->rx_demand;
      --n;
      changed = true;
    }
  }
  // Unsatisfied senders share the rest equally; when everyone is satisfied, the rest is spread
  // over all of them so the hints add up to the capacity. Senders admitted before the next
  // division take from what is left (account_rx).
  share_remaining_ = remaining;
  share_unsat_ = n;
  share_level_ = n ? remaining / n : 0;
  share_spare_ = (!n && active) ? remaining / active : 0;
  ++interval_idx_;
  interval_start_ = now;
}

void EngineImpl::handle_data(Time now, Connection& c, uint16_t sport, bool ecn_ce, uint8_t plane,
                             const wire::Packet& pkt) {
  const wire::BaseHeader& b = pkt.base;
  RecvDir* d = find_dir(c, b.conn_id);
  if (!d) {
    d = &create_dir(c, b, now);
  } else if (d->token != b.token) {
    ++stats_.drop_token;
    return;
  } else if (d->path_count < b.path_count) {
    // The sender's lane grew (wire.md §3.4): a direction's paths never shrink; packets sent
    // before the change still name the smaller count.
    d->path_count = b.path_count;
    d->paths.resize(b.path_count);
  }
  d->last_used_ns = now.count();
  account_rx(now, c, wire::data_headers_len(b.flags) + pkt.payload.size(), b.flags & wire::kFlagMore);
  RxPath& rp = d->paths[b.path_id];
  rp.port = sport;
  rp.plane = plane;
  apply_floor(rp, b.ack_floor);
  c.rx_dir = d->conn_id;
  c.rx_path = b.path_id;

  switch (rp.win.check(b.path_seq)) {
    case SackWindow::Check::kOutOfWindow:
      ++stats_.drop_out_of_window;
      return;
    case SackWindow::Check::kDuplicate:
      // The ACK that covered it was lost or is late: say it again, deliver nothing.
      ++stats_.duplicates;
      ++rp.duplicates;
      last_answered_ = now;  // a packet we accepted: its sender needs this answer (§4.6)
      request_ack(c, *d, b.path_id, b.timestamp, ecn_ce);
      return;
    case SackWindow::Check::kNew:
      break;
  }

  const wire::DataHeader& h = pkt.data;
  // A failover copy is delivered only if its original has not arrived; the original's receive
  // window on its own path is the record of that (congestion.md §4.3).
  const bool copy = wire::is_failover_copy(b.flags);
  const uint16_t opath = wire::orig_path_of(b.flags);
  bool mark_orig = false;
  if (copy && opath < d->paths.size()) {
    RxPath& o = d->paths[opath];
    SackWindow::Check oc = o.win.check(h.orig_seq);
    if (oc == SackWindow::Check::kOutOfWindow) {
      // The original's path went on at its sender while nothing of it reached us: everything
      // 256 before the original is resolved there (no more than 64 are ever in flight on a
      // path, §3.1), so its window moves up to it and the original is recorded when this copy
      // delivers it (a second copy, or the original arriving late, is then a duplicate).
      apply_floor(o, h.orig_seq - wire::kSackBits);
      oc = o.win.check(h.orig_seq);
    }
    // A redundant copy's original stays in flight at the sender: its path is acknowledged too,
    // whichever of the two got here first (congestion.md §5.2).
    // Flagged kFlagNoEcho: an echo of the copy could make a path the sender is probing look
    // answered (congestion.md §4.4) when only the copy's route is, and an echo of the path's own
    // newest packet, maybe long ago, would be an RTT sample of everything since.
    if (wire::is_redundant_copy(b.flags) && oc != SackWindow::Check::kOutOfWindow) {
      request_ack(c, *d, opath, o.echo_ts, false, false);
    }
    if (oc == SackWindow::Check::kDuplicate) {
      ++stats_.failover_duplicates;
      ++rp.rx_packets;
      rp.rx_bytes += pkt.payload.size();
      // A rejection the original earned must reach the sender through the copy too; with no
      // room for its record, the copy is left unmarked, like an RNR (§5.3): it comes again.
      bool recorded = true;
      for (uint8_t i = 0; i < o.nak_count; ++i) {
        if (o.naks[i].seq == h.orig_seq && o.naks[i].syndrome != static_cast<uint8_t>(Syndrome::kRnr)) {
          recorded &= add_nak(rp, b.path_seq, o.naks[i].src_stream, o.naks[i].msn,
                              static_cast<Syndrome>(o.naks[i].syndrome));
        }
      }
      if (!recorded) {
        ++stats_.drop_rnr;
        request_ack(c, *d, b.path_id, b.timestamp, ecn_ce);
        return;
      }
      rp.win.mark(b.path_seq);
      last_answered_ = now;
      request_ack(c, *d, b.path_id, b.timestamp, ecn_ce);
      return;
    }
    mark_orig = oc == SackWindow::Check::kNew;
  }

  Segment seg;
  seg.peer_ip = c.peer_ip;
  seg.op = static_cast<Op>(b.opcode);
  seg.dst_stream = h.dst_stream;
  seg.src_stream = h.src_stream;
  seg.msn = h.msn;
  seg.rsn = h.rsn;
  seg.offset = h.offset;
  seg.total_length = h.total_length;
  const bool addressed = seg.op == Op::kWrite || seg.op == Op::kWriteImm || seg.op == Op::kReadResp;
  seg.remote_addr = addressed ? h.remote_addr + h.offset : h.remote_addr;
  seg.rkey = h.rkey;
  seg.imm = h.imm;
  seg.xrc = b.flags & wire::kFlagXrc;
  seg.xrc_srqn = h.xrc_srqn;
  seg.payload = pkt.payload;
  const uint32_t dir_id = d->conn_id;
  const uint16_t path = b.path_id;
  seg.ref = RxRef{c.peer_ip, dir_id, b.path_seq, h.src_stream, h.msn, path};

  const Syndrome why = host_.deliver(seg);
  // deliver() may submit (a READ response); our receive state is untouched by that, but look
  // the direction up again rather than trust a pointer across a callback.
  d = find_dir(c, dir_id);
  if (!d) return;
  RxPath& r = d->paths[path];
  ++r.rx_packets;
  r.rx_bytes += pkt.payload.size();
  if (why == Syndrome::kOk) {
    r.win.mark(b.path_seq);
    if (mark_orig) d->paths[opath].win.mark(h.orig_seq);
  } else if (why == Syndrome::kUnreachable) {
    // No such stream here: not marked (nothing was delivered), and said in one NAK record per
    // stream and path, moved to the newest such packet, so that the sender parks the stream and
    // its QP's timeout decides, not the connection's silence (the peer's other streams answer).
    ++stats_.drop_unreachable;
    note_unreachable(r, b.path_seq, h.src_stream, h.msn);
  } else if (why == Syndrome::kRnr || r.nak_count == kNakSlots ||
             (mark_orig && d->paths[opath].nak_count == kNakSlots)) {
    // Not marked: the sender resends it. An RNR is reported (once) so that the sender backs
    // off instead of treating it as loss; a full NAK list is treated the same way, so that no
    // rejection goes unreported (spec §5.3).
    ++stats_.drop_rnr;
    if (why == Syndrome::kRnr && r.nak_count < kNakSlots) {
      // The refusing QP's min_rnr_timer travels with the refusal (spec §2.4).
      const int t = host_.rnr_timer(h.dst_stream);
      const uint8_t timer =
          t < 0 ? 0 : static_cast<uint8_t>(wire::kRnrTimerValid | (t & wire::kRnrTimerCodeMask));
      add_nak(r, b.path_seq, h.src_stream, h.msn, Syndrome::kRnr, timer);
      ++stats_.rnr_naks_sent;
    }
  } else {
    add_nak(r, b.path_seq, h.src_stream, h.msn, why);
    r.win.mark(b.path_seq);
    if (mark_orig) {
      // The original's path is acknowledged too (and a redundant copy asked for its ACK): the
      // rejection goes with it, or the sender would take that ACK for a delivery (spec §5.3).
      d->paths[opath].win.mark(h.orig_seq);
      add_nak(d->paths[opath], h.orig_seq, h.src_stream, h.msn, why);
    }
    ++stats_.naks_sent;
  }
  if (why != Syndrome::kUnreachable) last_answered_ = now;  // nothing is owed for those
  request_ack(c, *d, path, b.timestamp, ecn_ce);
}

void EngineImpl::handle_probe(Time now, Connection& c, uint16_t sport, bool ecn_ce,
                              uint8_t plane, const wire::Packet& pkt) {
  const wire::BaseHeader& b = pkt.base;
  RecvDir* d = find_dir(c, b.conn_id);
  if (!d) {
    ++stats_.drop_unknown_conn;
    return;
  }
  if (d->token != b.token) {
    ++stats_.drop_token;
    return;
  }
  if (d->path_count < b.path_count) {
    d->path_count = b.path_count;
    d->paths.resize(b.path_count);
  }
  d->last_used_ns = now.count();
  RxPath& rp = d->paths[b.path_id];
  rp.port = sport;
  rp.plane = plane;
  apply_floor(rp, b.ack_floor);
  request_ack(c, *d, b.path_id, b.timestamp, ecn_ce);
}

void EngineImpl::handle_ack(Time now, uint32_t peer_ip, const wire::Packet& pkt) {
  const wire::BaseHeader& b = pkt.base;
  auto it = by_id_.find(b.conn_id);
  if (it == by_id_.end() || it->second->peer_ip != peer_ip) {
    ++stats_.drop_unknown_conn;
    return;
  }
  Connection& c = *it->second;
  touch(c);
  if (c.token != b.token) {
    ++stats_.drop_token;
    return;
  }
  // An ACK of a packet sent before the lane grew names the smaller count.
  if (b.path_count > c.tx.size()) {
    ++stats_.drop_malformed;
    return;
  }
  const uint16_t path = b.path_id;
  TxPath& tp = c.tx[path];
  const wire::AckHeader& a = pkt.ack;
  // An ACK for a sequence never sent is forged or corrupt.
  if (seq_lt(tp.next_seq, a.cum_seq)) {
    ++stats_.drop_malformed;
    return;
  }
  ++stats_.acks_received;
  detail::PathCounters& pc = c.counters[path];
  ++pc.acks_received;
  pc.ce_echoed += a.ecn_ce_count;

  // The receiver's fair share for us; pacing starts with a small burst of credit. A lane that
  // does not take part in hints only records it.
  c.last_hint_mbps = a.rate_hint;
  // A peer that answers without a share does not divide its capacity: no start window for it.
  // (One that does gives every sender it hears a share; a zero from it only means it had not
  // heard us lately.)
  if (a.rate_hint) c.peer_shares = detail::PeerShares::kYes;
  else if (c.peer_shares == detail::PeerShares::kUnknown) c.peer_shares = detail::PeerShares::kNo;
  if (c.rate_hints && a.rate_hint != c.hint_mbps) {
    if (!c.hint_mbps) {
      c.credit = int64_t{kPaceBurst} * cfg_.max_packet * 8000;
      c.credit_ns = now.count();
    } else {
      refill(c, now);
    }
    c.hint_mbps = a.rate_hint;
  }

  // NAKs before acknowledgements: a rejected packet is also marked received (spec §5.3).
  for (size_t i = 0; i < a.nak_count; ++i) {
    const wire::NakRecord r = pkt.nak(i);
    ++stats_.naks_received;
    if (r.syndrome == static_cast<uint8_t>(Syndrome::kUnreachable)) {
      // The record names the newest packet of the stream the receiver refused on this path:
      // the stream is parked if some packet of it at or before that one is still in flight here
      // (a stale record, older than everything of the stream now in flight, is not news).
      for (uint16_t k = tp.head; k != kNil; k = c.pool[k].next) {
        const TxDesc& d = c.pool[k];
        if (seq_lt(r.path_seq, d.seq)) break;
        if (slots_[d.slot].m.src_stream == r.src_stream) {
          park(c, d.slot, now);
          break;
        }
      }
      continue;
    }
    if (r.syndrome == static_cast<uint8_t>(Syndrome::kRnr)) {
      const uint16_t idx = find_in_flight(c, path, r.path_seq);
      if (idx == kNil) continue;
      const MessageDesc& m = slots_[c.pool[idx].slot].m;
      if (m.src_stream == r.src_stream && m.msn == r.msn) rnr_nak(now, c, idx, r.rnr_timer);
      continue;
    }
    // A rejection may name a packet since moved off this path: this ACK, which also covers it,
    // must not resolve its copies as delivered (§4.3).
    const uint32_t slot = find_named(c, path, r.path_seq);
    if (slot == kNoSlot) continue;
    const MessageDesc& m = slots_[slot].m;
    if (m.src_stream != r.src_stream || m.msn != r.msn) continue;
    fail_message(c, slot, static_cast<Syndrome>(r.syndrome), now);
  }

  // Packets moved off this path are acknowledged by its ACKs too (the original, or a redundant
  // copy naming it, got through): §4.3, §5.2.
  if (tp.moved) resolve_moved(c, path, a);

  uint32_t newly = 0;
  bool rack_moved = false;
  // The path's records are in sequence order: nothing at or past `end` (cum_seq, or one past
  // the highest SACK bit) can be acknowledged by this ACK.
  uint32_t end = a.cum_seq;
  for (int w = 3; w >= 0; --w) {
    if (a.sack[w]) {
      end = a.cum_seq + 1 + static_cast<uint32_t>(w * 64 + 63 - std::countl_zero(a.sack[w])) + 1;
      break;
    }
  }
  for (uint16_t prev = kNil, idx = tp.head; idx != kNil;) {
    TxDesc& d = c.pool[idx];
    if (!seq_lt(d.seq, end)) break;
    const uint16_t next = d.next;
    const bool acked = seq_lt(d.seq, a.cum_seq) ||
                       (d.seq != a.cum_seq && sack_bit(a.sack, d.seq - a.cum_seq - 1));
    if (acked) {
      // Only a packet sent once dates the delivery: had a resend's later order been taken when
      // the original was what arrived, everything sent between the two, still in flight, would
      // look lost (a receiver stalled past the RTO made a cascade of such resends).
      if (!(d.flags & detail::kResent)) {
        if (order_lt(tp.delivered_order, static_cast<uint16_t>(d.tx_order + 1)))
          tp.delivered_order = static_cast<uint16_t>(d.tx_order + 1);
        if (!c.rack_valid || seq_lt(c.rack_ts, d.sent_ts)) {
          c.rack_ts = d.sent_ts;
          c.rack_valid = true;
          rack_moved = true;
        }
      } else if ((d.flags & detail::kLate) && !(b.flags & wire::kFlagNoEcho)) {
        judge_late(tp, d, a.echo_timestamp);  // (an ACK for a copy dates nothing)
      }
      list_remove(c, path, prev, idx);
      ack_desc(c, idx);
      ++newly;
    } else {
      prev = idx;
    }
    idx = next;
  }

  // Paths are FIFO: a packet transmitted before one that arrived, and still missing, is lost.
  // Retransmitted once; it is not suspected again until something sent after it arrives.
  // A record sent once and after everything delivered ends the search: every later record was
  // first sent after it (and a resend is later still).
  for (uint16_t idx = tp.head; idx != kNil; idx = c.pool[idx].next) {
    TxDesc& d = c.pool[idx];
    const bool lost = order_lt(d.tx_order, tp.delivered_order);
    if (!lost && !(d.flags & detail::kResent)) break;
    if (lost && !(d.flags & (detail::kRetxQueued | detail::kRnrWait))) {
      queue_retx(c, idx);
      ++pc.sack_gaps;
      ++stats_.sack_gaps;
    }
  }

  const uint32_t sample = ts32(now) - a.echo_timestamp;
  if (!(b.flags & wire::kFlagNoEcho) && static_cast<int32_t>(sample) >= 0) {
    if (tp.state == PathState::kProbing) {
      // Only an answer to a probe (or to data sent after the failure) proves the new route.
      if (seq_diff(static_cast<uint32_t>(tp.last_progress_ns), a.echo_timestamp) >= 0) {
        path_recovered(now, c, path, sample);
      }
    } else if (tp.state == PathState::kActive) {
      // Every echo is a sample, ACKs that acknowledge nothing new included (copies,
      // duplicates): taking only ACKs with progress left paths' RTTs stale under heavy loss
      // (the all-reduce at 10 % loss kept 0.80 instead of 0.84). Those flagged kFlagNoEcho
      // (share pushes, ACKs for a redundant copy) date nothing.
      const int64_t r = sample;
      if (!pc.min_rtt_ns || sample < pc.min_rtt_ns) pc.min_rtt_ns = std::max<uint32_t>(sample, 1);
      if (tp.srtt_ns == 0) {
        tp.srtt_ns = static_cast<uint32_t>(std::max<int64_t>(r, 1));
        tp.rttvar_ns = static_cast<uint32_t>(r / 2);
      } else {
        const int64_t dev = tp.srtt_ns > r ? tp.srtt_ns - r : r - tp.srtt_ns;
        tp.rttvar_ns = static_cast<uint32_t>((3 * int64_t{tp.rttvar_ns} + dev) / 4);
        tp.srtt_ns = static_cast<uint32_t>(std::max<int64_t>((7 * int64_t{tp.srtt_ns} + r) / 8, 1));
      }
      refresh_min_srtt(c);
    }
  }
  update_una(c, path);
  congestion_on_ack(now, c, path, newly, a.ecn_ce_count);
  if (newly && tp.state == PathState::kActive) {
    tp.backoff = 0;
    tp.deadline = tp.in_flight ? now + rto(tp) : Time::max();
    tp.last_progress_ns = now.count();
    // After the whole connection was silent (a stalled peer, a congested host), its paths
    // resume one by one as the backlog drains: only silence since then counts (§4.1).
    if (now.count() - c.last_progress_ns > 2 * srtt_ref(c, tp)) c.progress_since_ns = now.count();
    c.last_progress_ns = now.count();
    c.tlp_count = 0;
    c.tlp_backoff = 0;
    arm_tlp(now, c);
  }
  if (rack_moved && cfg_.late_detection) detect_late(now, c);
}

// The records moved off `path` (failover copies, on other paths' lists or waiting to go) whose
// original sequence this ACK of `path` acknowledges: the receiver has their packet, by the
// original or by a copy naming it, so they are acknowledged wherever they are now.
void EngineImpl::resolve_moved(Connection& c, uint16_t path, const wire::AckHeader& a) {
  auto covered = [&](uint32_t seq) {
    return seq_lt(seq, a.cum_seq) ||
           (seq != a.cum_seq && seq_lt(a.cum_seq, seq) && sack_bit(a.sack, seq - a.cum_seq - 1));
  };
  for (uint16_t p = 0; p < c.tx.size() && c.tx[path].moved; ++p) {
    if (p == path) continue;
    TxPath& tq = c.tx[p];
    bool changed = false;
    for (uint16_t prev = kNil, idx = tq.head; idx != kNil;) {
      const TxDesc& d = c.pool[idx];
      const uint16_t next = d.next;
      if ((d.flags & detail::kCopy) && d.orig_path == path && covered(d.orig_seq)) {
        list_remove(c, p, prev, idx);
        ack_desc(c, idx);
        changed = true;
      } else {
        prev = idx;
      }
      idx = next;
    }
    if (changed) update_una(c, p);
  }
  for (uint16_t prev = kNil, idx = c.move_head; idx != kNil && c.tx[path].moved;) {
    const TxDesc& d = c.pool[idx];
    const uint16_t next = d.next;
    if (d.orig_path == path && covered(d.orig_seq)) {
      if (prev == kNil) c.move_head = next;
      else c.pool[prev].next = next;
      if (c.move_tail == idx) c.move_tail = prev;
      ack_desc(c, idx);
    } else {
      prev = idx;
    }
    idx = next;
  }
}

// ECN AIMD (congestion.md §2): a CE echo halves the path's window, at most once per its RTT,
// and takes the same amount off the connection window; unmarked progress adds one packet per
// window's worth of acknowledgements to both, outside the RTT that follows a decrease.
void EngineImpl::congestion_on_ack(Time now, Connection& c, uint16_t path, uint32_t newly,
                                   uint16_t ce) {
  TxPath& tp = c.tx[path];
  const int64_t rtt = std::max<int64_t>(srtt_ref(c, tp), 1000);
  const bool settled = now.count() - tp.last_md_ns >= rtt;
  // The fraction of the path's packets that came back CE-marked, smoothed per packet (DCTCP's
  // alpha, gain 1/16, from 1): a path whose packets are all marked halves, marks that are rare
  // cut it by as little (congestion.md §2.2). An ACK may cover many packets; its marks count as
  // the newest.
  const uint32_t n = std::max<uint32_t>(newly, 1), m = std::min<uint32_t>(ce, n);
  uint32_t a = tp.alpha;
  for (uint32_t i = n - std::min<uint32_t>(n, 64); i < n; ++i)
    a = a - (a >> kAlphaShift) + ((i >= n - m ? kAlphaOne : 0) >> kAlphaShift);
  tp.alpha = static_cast<uint16_t>(a);
  if (ce) {
    if (!settled) return;
    const uint32_t old = tp.cwnd;
    const uint32_t cut = static_cast<uint32_t>(uint64_t{old} * tp.alpha / (2 * kAlphaOne));
    tp.cwnd = std::max(old - cut, kWinUnit);
    uint32_t& pw = c.plane_cwnd[tp.plane];
    const uint32_t dec = std::min(old - tp.cwnd, pw / 2);
    pw = std::max(pw - dec, kMinConnWindow * kWinUnit);
    tp.last_md_ns = now.count();
    ++stats_.ecn_decreases;
    return;
  }
  if (!newly || !settled) return;
  const uint64_t u2 = uint64_t{kWinUnit} * kWinUnit;
  // A window grows only while it is what limits (it was full before these ACKs): one that the
  // connection's window holds back would grow unchecked, and its next halving would then take
  // more off the connection than the path ever had in flight (congestion.md §2.3).
  if (tp.in_flight + newly >= window_packets(tp.cwnd))
    tp.cwnd = static_cast<uint32_t>(
        std::min<uint64_t>(tp.cwnd + newly * u2 / tp.cwnd, kPathWindow * kWinUnit));
  // The plane's window: one packet per RTT per plane (congestion.md §2.3), so a connection is as
  // aggressive as one flow at a bottleneck inside a plane, and planes, independent networks,
  // neither hold each other back nor share one window's cuts. One window for the connection
  // made 2, 4 and 8 planes 0.70, 0.64 and 0.53 of linear (Planes.GoodputGrowsLinearly...).
  uint32_t& pw = c.plane_cwnd[tp.plane];
  if (c.plane_in_flight[tp.plane] + newly >= window_packets(pw))
    pw = static_cast<uint32_t>(std::min<uint64_t>(pw + newly * u2 / pw,
                                                  uint64_t{cfg_.conn_window_max} * kWinUnit));
}

// An RNR NAK (congestion.md §6): wait out the back-off the responder named (its QP's
// min_rnr_timer; none named: rnr_delay), then resend; not a loss, not an RTO retry. The message
// fails with kRnr only after its QP's rnr_retry refusals (7: never).
void EngineImpl::rnr_nak(Time now, Connection& c, uint16_t idx, uint8_t rnr_timer) {
  TxDesc& d = c.pool[idx];
  ++stats_.rnr_naks_received;
  if (d.flags & detail::kRnrWait) return;
  detail::MsgSlot& s = slots_[d.slot];
  const uint8_t limit = s.m.rnr_retry == MessageDesc::kEngineRetries
                            ? cfg_.rnr_retry
                            : std::min(s.m.rnr_retry, kRnrInfinite);
  if (d.rnr_retries < UINT8_MAX) ++d.rnr_retries;
  if (limit != kRnrInfinite && d.rnr_retries > limit) {
    fail_message(c, d.slot, Syndrome::kRnr, now);
    return;
  }
  const Time wait = (rnr_timer & wire::kRnrTimerValid)
                        ? rnr_timer_delay(rnr_timer & wire::kRnrTimerCodeMask)
                        : cfg_.rnr_delay;
  s.resume_ns = std::max(s.resume_ns, (now + wait).count());
  c.rnr_deadline = std::min(c.rnr_deadline, Time(s.resume_ns));
  hold_message(c, d.slot);
}

// Every packet of a refused message still in flight was refused too, or will be (the receive is
// not there): all wait out the back-off, and send_new sends no more of it until then. Left to
// look lost, they were resent into the same refusal, timed their paths out and moved, until the
// resends had filled every path's SACK span and nothing could be sent at all (an 8 MiB SEND
// that came before its receive hung for good). Their paths answered, and will be quiet until
// the back-off ends: silence counts from then.
void EngineImpl::hold_message(Connection& c, uint32_t slot) {
  const int64_t resume = slots_[slot].resume_ns;
  for (uint16_t p = 0; p < c.paths_used; ++p) {
    TxPath& tp = c.tx[p];
    bool held = false;
    for (uint16_t i = tp.head; i != kNil; i = c.pool[i].next) {
      TxDesc& o = c.pool[i];
      if (o.slot != slot) continue;
      o.flags = static_cast<uint8_t>((o.flags | detail::kRnrWait) & ~detail::kRetxQueued);
      held = true;
    }
    if (held) tp.last_progress_ns = std::max(tp.last_progress_ns, resume);
  }
}

// The peer has no such stream (congestion.md §6.1): every message of that stream to that peer
// is parked, all their packets resolved (none was delivered; they must not look lost and get
// their paths suspected), and resent whole after a back-off that grows with how long the stream
// has been gone (rnr_delay .. rto_max), with fresh sequence numbers. They fail when the stream
// has been gone for the QP's timeout * (retry_cnt + 1). One NAK record per stream and path is
// enough, whatever the number of packets in flight.
void EngineImpl::park(Connection& c, uint32_t nak_slot, Time now) {
  const uint32_t src = slots_[nak_slot].m.src_stream, dst = slots_[nak_slot].m.dst_stream;
  const int64_t since = slots_[nak_slot].unreachable_ns ? slots_[nak_slot].unreachable_ns : now.count();
  const Time backoff = std::clamp((now - Time(since)) / 4, cfg_.rnr_delay, cfg_.rto_max);
  for (uint32_t slot = c.head; slot != kNoSlot;) {
    detail::MsgSlot& s = slots_[slot];
    const uint32_t next = s.next;
    if (s.m.src_stream != src || s.m.dst_stream != dst) {
      slot = next;
      continue;
    }
    abandon(c, slot, now);
    if (c.cursor == slot) c.cursor = next;
    if (s.prev != kNoSlot) slots_[s.prev].next = next;
    else c.head = next;
    if (next != kNoSlot) slots_[next].prev = s.prev;
    else c.tail = s.prev;
    s.prev = s.next = kNoSlot;
    if (s.unreachable_ns == 0) s.unreachable_ns = since;
    s.pkts_sent = s.pkts_acked = s.next_offset = 0;
    s.resume_ns = (now + backoff).count();
    c.parked.push_back(slot);  // in submission order: they resume in it
    slot = next;
  }
  c.park_deadline = std::min(c.park_deadline, now + backoff);
}

// Parked messages whose back-off ended go back to the end of the connection's queue, or fail.
void EngineImpl::resume_parked(Connection& c, Time now) {
  c.park_deadline = Time::max();
  size_t kept = 0;
  for (uint32_t slot : c.parked) {
    detail::MsgSlot& s = slots_[slot];
    if (s.resume_ns > now.count()) {
      c.parked[kept++] = slot;
      c.park_deadline = std::min(c.park_deadline, Time(s.resume_ns));
      continue;
    }
    if (unreachable_too_long(s, now)) {
      // The stream has been gone for its QP's whole timeout: unreachable, as far as it goes.
      done_.push_back({s.m.cookie, Syndrome::kRetryExceeded});
      free_slots_.push_back(slot);
      continue;
    }
    s.prev = c.tail;
    if (c.tail != kNoSlot) slots_[c.tail].next = slot;
    else c.head = slot;
    c.tail = slot;
    if (c.cursor == kNoSlot) c.cursor = slot;
  }
  c.parked.resize(kept);
}

// The engine's own stalls are left out, as for silence: a parked message whose back-off ended
// during a stall is checked at the first pass after it, without having asked again.
bool EngineImpl::unreachable_too_long(const detail::MsgSlot& s, Time now) const {
  if (s.unreachable_ns == 0 || s.m.timeout <= Time{0}) return false;
  return budget_spent(s, Time(s.unreachable_ns), now);
}

// The QP's retry_cnt, or the engine's for a message that names none.
uint32_t EngineImpl::retry_limit(const detail::MsgSlot& s) const {
  return s.m.retry_cnt == MessageDesc::kEngineRetries ? cfg_.max_retries : s.m.retry_cnt;
}

// Whether the QP's whole retry budget, timeout * (retry_cnt + 1), has passed since `since`,
// leaving out the time the engine itself was stalled meanwhile (§4.5).
bool EngineImpl::budget_spent(const detail::MsgSlot& s, Time since, Time now) const {
  return now - since - stalled_since(since) >= s.m.timeout * (int64_t{retry_limit(s)} + 1);
}

// ---------------------------------------------------------------------------------------------
// Resolution of packets and messages

void EngineImpl::ack_desc(Connection& c, uint16_t idx) {
  const uint32_t slot = c.pool[idx].slot;
  resolve(c, idx);
  detail::MsgSlot& s = slots_[slot];
  s.unreachable_ns = 0;  // the stream answered
  if (++s.pkts_acked == s.pkts_total) {
    done_.push_back({s.m.cookie, Syndrome::kOk});
    unlink(c, slot);
  }
}

// Stops tracking every packet of a message; the next packets on those paths carry the new
// ack floor, so the receiver skips them (spec §3.1). now == Time::min(): keep the timers.
void EngineImpl::abandon(Connection& c, uint32_t slot, Time now) {
  for (uint16_t p = 0; p < c.tx.size(); ++p) {
    TxPath& tp = c.tx[p];
    bool changed = false;
    for (uint16_t prev = kNil, idx = tp.head; idx != kNil;) {
      const uint16_t next = c.pool[idx].next;
      if (c.pool[idx].slot == slot) {
        list_remove(c, p, prev, idx);
        resolve(c, idx);
        changed = true;
      } else {
        prev = idx;
      }
      idx = next;
    }
    if (!changed) continue;
    update_una(c, p);
    if (tp.state != PathState::kActive) continue;
    if (tp.in_flight == 0) tp.deadline = Time::max();
    else if (now != Time::min()) tp.deadline = now + rto(tp);
  }
  for (uint16_t prev = kNil, idx = c.move_head; idx != kNil;) {
    const uint16_t next = c.pool[idx].next;
    if (c.pool[idx].slot == slot) {
      if (prev == kNil) c.move_head = next;
      else c.pool[prev].next = next;
      if (c.move_tail == idx) c.move_tail = prev;
      resolve(c, idx);
    } else {
      prev = idx;
    }
    idx = next;
  }
}

void EngineImpl::fail_message(Connection& c, uint32_t slot, Syndrome why, Time now) {
  abandon(c, slot, now);
  done_.push_back({slots_[slot].m.cookie, why});
  unlink(c, slot);
}

void EngineImpl::unlink(Connection& c, uint32_t slot) {
  detail::MsgSlot& s = slots_[slot];
  if (c.cursor == slot) c.cursor = s.next;
  if (s.prev != kNoSlot) slots_[s.prev].next = s.next;
  else c.head = s.next;
  if (s.next != kNoSlot) slots_[s.next].prev = s.prev;
  else c.tail = s.prev;
  s.prev = s.next = kNoSlot;
  free_slots_.push_back(slot);
}

// Host callbacks run last, once our state is consistent: they may submit or drop streams.
void EngineImpl::flush_completions() {
  for (size_t i = 0; i < done_.size(); ++i) {
    const Completion x = done_[i];
    if (x.why == Syndrome::kOk) host_.message_acked(x.cookie);
    else host_.message_failed(x.cookie, x.why);
  }
  done_.clear();
}

void EngineImpl::drop_stream(uint32_t src_stream) {
  for (Connection* c : conn_list_) {
    touch(*c);
    for (uint32_t s = c->head; s != kNoSlot;) {
      const uint32_t next = slots_[s].next;
      if (slots_[s].m.src_stream == src_stream) {
        abandon(*c, s, Time::min());
        unlink(*c, s);
      }
      s = next;
    }
    for (size_t i = 0; i < c->parked.size();) {
      if (slots_[c->parked[i]].m.src_stream == src_stream) {
        free_slots_.push_back(c->parked[i]);
        c->parked[i] = c->parked.back();
        c->parked.pop_back();
      } else {
        ++i;
      }
    }
  }
  settle();
}

void EngineImpl::reject(const RxRef& ref, Syndrome why) {
  Connection* c = find_conn(ref.peer_ip);
  if (!c || why == Syndrome::kOk) return;
  RecvDir* d = find_dir(*c, ref.dir);
  if (!d || ref.path >= d->paths.size()) return;
  // The packet stays marked received: the NAK, processed before the acknowledgements of the
  // same ACK, fails its message at the sender (spec §5.3).
  add_nak(d->paths[ref.path], ref.seq, ref.src_stream, ref.msn, why);
  ++stats_.naks_sent;
}

// ---------------------------------------------------------------------------------------------
// Path failure (congestion.md §4)

// When the path will count as failed if nothing changes; Time::max() when it cannot. The one
// rule for both on_timer and next_deadline, so they can never disagree.
Time EngineImpl::fail_deadline(const Connection& c, const TxPath& tp) const {
  if (tp.state != PathState::kActive || tp.in_flight == 0 || cfg_.fail_rtts == 0) return Time::max();
  // Silence only means failure while the connection's other paths are delivering.
  if (c.last_progress_ns <= tp.last_progress_ns) return Time::max();
  if (c.tx.size() - c.failed_paths < 2) return Time::max();
  // Before the path has its own sample, judge it by its slowest sibling, not its fastest.
  int64_t ref = tp.srtt_ns;
  if (!ref) {
    for (const TxPath& o : c.tx) {
      if (o.state == PathState::kActive) ref = std::max<int64_t>(ref, o.srtt_ns);
    }
  }
  if (!ref) return Time::max();
  return Time(std::max(tp.last_progress_ns, c.progress_since_ns) + int64_t{cfg_.fail_rtts} * ref);
}

bool EngineImpl::check_failure(Time now, Connection& c, uint16_t path) {
  if (fail_deadline(c, c.tx[path]) > now) return false;
  fail_path(now, c, path);
  return true;
}

// Moves every unresolved packet of the path to the failover queue (oldest first) and makes a
// probe due. The originals keep the path's ack floor down until their copies resolve.
void EngineImpl::fail_path(Time now, Connection& c, uint16_t path, bool count) {
  TxPath& tp = c.tx[path];
  if (count) {
    ++stats_.paths_failed;
    ++c.counters[path].failures;
  }
  tp.state = PathState::kFailed;
  ++c.failed_paths;
  refresh_min_srtt(c);
  for (uint16_t idx = tp.head; idx != kNil;) {
    TxDesc& d = c.pool[idx];
    const uint16_t next = d.next;
    if (!(d.flags & detail::kCopy)) {
      d.flags |= detail::kCopy;
      d.orig_path = path;
      d.orig_seq = d.seq;
      if (tp.moved == 0 || seq_lt(d.seq, tp.moved_floor)) tp.moved_floor = d.seq;
      ++tp.moved;
    }
    // Its first transmission on the next path will be its only one there so far.
    d.flags &= static_cast<uint8_t>(
        ~(detail::kRetxQueued | detail::kRnrWait | detail::kResent | detail::kLate));
    // rto_retries stays: the QP's retry count is spent across paths, so that it means "the
    // peer answers on no path" (§4.5).
    d.state = DescState::kMoving;
    d.next = kNil;
    if (c.move_tail != kNil) c.pool[c.move_tail].next = idx;
    else c.move_head = idx;
    c.move_tail = idx;
    idx = next;
  }
  tp.head = tp.tail = kNil;
  c.plane_in_flight[tp.plane] = static_cast<uint16_t>(c.plane_in_flight[tp.plane] - tp.in_flight);
  tp.in_flight = 0;
  update_una(c, path);
  tp.backoff = 0;
  tp.deadline = Time::max();
  tp.last_progress_ns = now.count();  // probing since
}

// A timeout or a silent tail (§4.1): the path is failed like one its siblings outran, so that its
// packets go out elsewhere at once and it is probed under new entropy, unless it is the last
// active path (then the packet is resent on it, and only the peer can be at fault).
bool EngineImpl::suspect(Time now, Connection& c, uint16_t path) {
  if (!cfg_.suspect_silent_paths || c.tx.size() - c.failed_paths < 2) return false;
  ++stats_.paths_suspected;
  fail_path(now, c, path);
  return true;
}

// Whether the silence that makes a path suspect is the whole connection's (§4.1): nothing was
// acknowledged on any path for the path's RTT, and another busy path has been silent for its own.
// That is the peer's or the fabric's doing (a peer engine off its CPU, every queue stalled at
// once), and suspecting the path would fail every busy path in turn, each moving its packets onto
// the others, all as silent: on this 2-core host a bulk transfer through the emulator failed 7 of
// its 8 paths at once whenever the emulator's process was descheduled for an RTO. When most
// active paths are silent so, none is suspected (a dead peer is the QP's retry limit's to find);
// when only a few are, with others idle, only the packet's first timeout (or a tail probe) is
// spared, so that busy paths that died together (two packets on one dead core link) still fail
// over to the idle ones.
bool EngineImpl::silent_together(const Connection& c, uint16_t path, const TxDesc& d,
                                 Time now) const {
  if (now.count() - c.last_progress_ns < srtt_ref(c, c.tx[path])) return false;
  unsigned silent = 1, active = 0;
  for (uint16_t q = 0; q < c.tx.size(); ++q) {
    const TxPath& o = c.tx[q];
    if (o.state != PathState::kActive) continue;
    ++active;
    if (q != path && o.in_flight && now.count() - o.last_progress_ns > srtt_ref(c, o)) ++silent;
  }
  if (silent < 2) return false;
  return 2 * silent > active || d.rto_retries <= 1;
}

// The QP's retry limit (§4.5): the peer silent on every path for timeout * (retry_cnt + 1)
// (since the message left or since the connection's last ACK progress, whichever is later),
// what an InfiniBand requester waits before RETRY_EXC (retry_cnt resends, each after the local
// ACK timeout), provided the packet was resent at least once (retry_cnt > 0). Our RTOs are far
// shorter than a QP's timeout, so the packet's own count of expiries says nothing about time:
// failing once it reached retry_cnt and the peer had been silent for one timeout failed QPs
// whose peer engine was merely off the CPU for ~130 ms on a starved host (ibv_rc_pingpong's
// 67 ms timeout: from a 1 ms RTO, 7 backed-off expiries take 127 ms). Silence, not
// the message's age: under heavy random loss a packet may time out many times while the peer
// keeps answering for the others, and that is not an unreachable peer. And silence to a resend:
// timers that ran late (the engine off the CPU) leave a long silence nobody asked the peer to
// break. Nor the time the engine itself was stalled (stalled()): a whole host paused for
// longer than the limit would otherwise fail the QP at the expiry after the first resend.
bool EngineImpl::out_of_retries(const Connection& c, const TxDesc& d, Time now) const {
  const detail::MsgSlot& s = slots_[d.slot];
  const uint32_t limit = retry_limit(s);
  if (s.m.timeout <= Time{0}) return d.rto_retries >= limit;
  return d.rto_retries >= std::min(limit, 1u) &&
         budget_spent(s, Time(std::max(s.first_tx_ns, c.last_progress_ns)), now);
}

void EngineImpl::stalled(Time from, Time to) {
  if (to <= from) return;
  const Stall st{from.count(), to.count()};
  if (stall_log_.size() < kStallLog) {
    stall_log_.push_back(st);
    return;
  }
  stall_log_[stall_next_] = st;
  stall_next_ = (stall_next_ + 1) % kStallLog;
}

// How long the owner stalled after `since`: a silence that long was not the peer's.
Time EngineImpl::stalled_since(Time since) const {
  int64_t total = 0;
  const size_t n = stall_log_.size();
  // Newest first; the log is in time order, so the walk stops at the first stall that ended
  // before `since` (at most kStallLog steps, and only when a packet's timer expired).
  for (size_t i = 0; i < n; ++i) {
    const Stall& st = stall_log_[(stall_next_ + n - 1 - i) % n];
    if (st.to_ns <= since.count()) break;
    total += st.to_ns - std::max(st.from_ns, since.count());
  }
  return Time(total);
}

void EngineImpl::path_recovered(Time now, Connection& c, uint16_t path, int64_t sample) {
  reinstate(now, c, path);
  ++stats_.paths_recovered;
  TxPath& tp = c.tx[path];
  tp.srtt_ns = static_cast<uint32_t>(std::max<int64_t>(sample, 1));
  tp.rttvar_ns = static_cast<uint32_t>(sample / 2);
  refresh_min_srtt(c);
}

// Back in service on a new route: its marks to be learnt again, a fresh window. The callers
// then give it its RTT (a sample, or none) and refresh the connection's smallest.
void EngineImpl::reinstate(Time now, Connection& c, uint16_t path) {
  TxPath& tp = c.tx[path];
  tp.state = PathState::kActive;
  tp.alpha = kAlphaOne;
  --c.failed_paths;
  tp.backoff = 0;
  tp.cwnd = cfg_.path_window_init * kWinUnit;
  tp.last_md_ns = INT64_MIN / 2;
  tp.last_progress_ns = now.count();
  tp.deadline = Time::max();
}

// ---------------------------------------------------------------------------------------------
// Timers

// Tail-loss probe (congestion.md §5): armed when everything is sent and something is in flight,
// two of the slowest busy path's smoothed RTTs ahead.
void EngineImpl::arm_tlp(Time now, Connection& c) {
  c.tlp_deadline = Time::max();
  if (!cfg_.tail_loss_probe || c.tlp_count >= std::max<uint8_t>(cfg_.tail_probes, 1) ||
      c.cursor != kNoSlot || c.in_flight == 0)
    return;
  int64_t rtt = 0;
  for (const TxPath& tp : c.tx) {
    if (tp.state == PathState::kActive && tp.in_flight) rtt = std::max<int64_t>(rtt, tp.srtt_ns);
  }
  if (rtt) c.tlp_deadline = now + Time((2 * rtt) << std::min<uint8_t>(c.tlp_backoff, 16));
}

// A busy path that answered nothing for two of its RTTs is suspected (§4.1): its packets go out
// on other paths now, so one packet in flight on a dead path costs a tail probe, not a QP's
// retries. Another busy path resends its newest unresolved packet: if that was lost it is
// recovered now; if it arrived, its ACK exposes any earlier hole on the path to the SACK rule.
void EngineImpl::tail_probe(Time now, Connection& c) {
  c.tlp_deadline = Time::max();
  ++c.tlp_count;
  bool in_place = false, moved = false;
  for (uint16_t p = 0; p < c.tx.size(); ++p) {
    TxPath& tp = c.tx[p];
    if (tp.state != PathState::kActive || tp.tail == kNil) continue;
    TxDesc& d = c.pool[tp.tail];
    if (d.flags & (detail::kRetxQueued | detail::kRnrWait)) continue;
    ++stats_.tail_probes;
    const bool silent = now.count() - tp.last_progress_ns >= 2 * srtt_ref(c, tp);
    if (silent && !silent_together(c, p, d, now) && suspect(now, c, p)) {
      moved = true;
      continue;
    }
    queue_retx(c, tp.tail);
    in_place = true;
  }
  // The next probe waits twice as long, unless this one only moved packets off suspected paths:
  // those are new on theirs. A probe that resent on the path it probed (slow, maybe, not dead)
  // or found nothing to probe backs off.
  if (in_place || !moved) ++c.tlp_backoff;
}

// How long past its path's smoothed RTT a packet may be late before it counts as lost: a
// quarter of that RTT (RFC 8985's reordering window), plus twice its variation, so that a path
// whose queue is growing (its samples spread) is given the time its samples say it takes.
int64_t EngineImpl::reorder_window(const TxPath& tp) const {
  return int64_t{tp.srtt_ns} / 8 + 2 * int64_t{tp.rttvar_ns};
}

// Time-based loss detection across the connection's paths (congestion.md §5.1, after RACK,
// RFC 8985): a packet is lost when a packet sent after it, on any path, was delivered and it has
// been out for its own path's RTT plus the reordering window. The per-path SACK rule finds a hole
// only once a later packet of the same path arrives; this finds the last packets of each path
// (a message's tail is one packet per path) and lost resends, in about one RTT instead of a tail
// probe's two or an RTO.
void EngineImpl::detect_late(Time now, Connection& c) {
  c.rack_deadline = Time::max();
  if (!c.rack_valid) return;
  const uint32_t now_ts = ts32(now);
  for (uint16_t p = 0; p < c.tx.size(); ++p) {
    TxPath& tp = c.tx[p];
    if (tp.state != PathState::kActive || tp.in_flight == 0) continue;
    // A path is judged by its own RTT only: before its first sample it may be the slow one.
    if (!tp.srtt_ns) continue;
    // Nor one that ECN marked in its last 4 RTTs: its queue is growing, so its packets are late
    // for that, not lost (a clean 64-host permutation at 100 Gbit/s resent 762 packets for
    // nothing and lost 5 % of its goodput when marked paths were judged; 3.612 against
    // 3.475 Tbit/s without them, 3.609 with no late detection at all).
    if (now.count() - tp.last_md_ns < 4 * int64_t{tp.srtt_ns}) continue;
    const int64_t limit = int64_t{tp.srtt_ns} + reorder_window(tp);
    for (uint16_t idx = tp.head; idx != kNil; idx = c.pool[idx].next) {
      TxDesc& d = c.pool[idx];
      if (!seq_lt(d.sent_ts, c.rack_ts)) {
        // Sent after the newest delivered packet: not judged. Records after one sent once were
        // first sent later still; a resend may sit before older ones.
        if (!(d.flags & detail::kResent)) break;
        continue;
      }
      if (d.flags & (detail::kRetxQueued | detail::kRnrWait)) continue;
      const int64_t age = seq_diff(d.sent_ts, now_ts);
      if (age >= limit) {
        // Resent on its own path, as a SACK hole is: suspecting a path here (it may be silent
        // because it is dead) cost the all-reduce at 10 % loss more than it saved a dead core
        // link (paths suspected for random loss wait out probes; docs/simulation.md).
        queue_retx(c, idx);
        d.flags |= detail::kLate;
        ++c.counters[p].late_losses;
        ++stats_.late_losses;
      } else {
        c.rack_deadline = std::min(c.rack_deadline, now + Time(limit - age));
        // Every record after one sent once was first sent after it, and a resend later still:
        // all are younger, so none is late yet and none is due sooner. Scanning them all made
        // this loop a fifth of the engine's instructions per packet in bulk transfers.
        if (!(d.flags & detail::kResent)) break;
      }
    }
  }
}

// Whether the peer has said anything on this connection since stamp (a packet's 32-bit send
// time, less than 2^31 ns before now): ACK progress on any path, or data of its own (lane 0
// receives the peer's traffic too). A peer that talks is not dead, so a timer waiting for it
// need not back off (W§6.3). The times are compared in 64 bits: comparing stamp wrap-aware with
// the low 32 bits of a time never set (0) called a peer that had never answered "heard" whenever
// the clock's low 32 bits were past 2^31, half of every 4.3 s, and the packet's timer then
// never backed off (the compliance suite's silent_peer check found it).
bool EngineImpl::heard_since(const Connection& c, uint32_t stamp, Time now) const {
  const int64_t sent = now.count() - static_cast<int32_t>(ts32(now) - stamp);
  if (c.last_progress_ns > sent) return true;
  for (const RecvDir& d : c.rx) {
    if (d.last_used_ns > sent) return true;
  }
  return false;
}

// A packet resent because it was late is acknowledged: if the ACK answers a packet sent before
// the resend (its echo is older by more than a quarter RTT), the original had arrived and the
// resend was for nothing (counted late_spurious). Widening the window on each, as RFC 8985 does
// on a DSACK, was tried: a third of the late resends of the all-reduce at 1 % loss are
// spurious (paths of ECMP-collided queues), and the wider window cost it 0.953 -> 0.947.
void EngineImpl::judge_late(const TxPath& tp, const TxDesc& d, uint32_t echo) {
  if (seq_lt(echo + tp.srtt_ns / 4, d.sent_ts)) ++stats_.late_spurious;
}

void EngineImpl::expire(Time now, Connection& c, uint16_t path) {
  TxPath& tp = c.tx[path];
  if (tp.in_flight == 0) {
    tp.deadline = Time::max();
    return;
  }
  // The oldest packet not waiting out an RNR back-off (una stops at the oldest unresolved one).
  uint16_t idx = tp.head;
  while (idx != kNil && (c.pool[idx].flags & detail::kRnrWait)) idx = c.pool[idx].next;
  if (idx == kNil) {
    tp.deadline = now + rto(tp);
    return;
  }
  ++stats_.timeouts;
  ++c.counters[path].timeouts;
  TxDesc& d = c.pool[idx];
  if (out_of_retries(c, d, now)) {
    fail_message(c, d.slot, Syndrome::kRetryExceeded, now);
    return;
  }
  if (d.rto_retries < kMaxBackoff) ++d.rto_retries;
  // Resent on another path while one is active; the path itself is probed (§4.1).
  const bool together = silent_together(c, path, d, now);
  if (!together && suspect(now, c, path)) return;
  // The timer backs off only while the peer is silent: a connection that made progress since
  // this packet last left is losing packets, not talking to a dead peer, and a resend that waits
  // twice as long each time it is unlucky again left an all-to-all at 10 % loss waiting out
  // back-offs of milliseconds (W§6.3). Its retry count grows either way (§4.5).
  const bool answered = !together && heard_since(c, d.sent_ts, now);
  if (!answered && tp.backoff < kMaxBackoff) ++tp.backoff;
  if (!(d.flags & detail::kRetxQueued)) queue_retx(c, idx);
  // A timeout is a loss, not a congestion signal: a bounded quarter off the path (§2.3).
  tp.cwnd = std::max(tp.cwnd - tp.cwnd / 4, kWinUnit);
  tp.deadline = now + rto(tp, answered ? 0 : d.rto_retries);
}

void EngineImpl::on_timer(Time now) {
  settle();
  reap_closed();
  // Only the connections whose deadline has come (congestion.md §7.1).
  due_now_.clear();
  for (clean_heap_top(); !heap_.empty() && heap_.front().first <= now; clean_heap_top()) {
    std::pop_heap(heap_.begin(), heap_.end(), std::greater<>{});
    Connection* c = by_id_.at(heap_.back().second);
    heap_.pop_back();
    c->in_heap = false;
    due_now_.push_back(c);
  }
  for (Connection* c : due_now_) {
    timer_conn(now, *c);
    touch(*c);
  }
  flush_completions();
  settle();
}

// A clock hand over the connections: up to max_visits of them, from where the last sweep
// stopped; those idle for conn_idle are forgotten (§4.6). Not a timer: an idle connection's
// deadline would keep the engine's next_deadline() from ever being clear.
size_t EngineImpl::sweep_idle(Time now, size_t max_visits) {
  size_t forgot = 0;
  for (size_t v = 0; v < max_visits && !conn_list_.empty(); ++v) {
    if (sweep_next_ >= conn_list_.size()) sweep_next_ = 0;
    Connection& c = *conn_list_[sweep_next_];
    if (idle_deadline(c) <= now && !acks_owed(c)) {
      forget(c);  // another connection takes its place in the list
      ++forgot;
      continue;
    }
    ++sweep_next_;
  }
  settle();
  return forgot;
}

bool EngineImpl::acks_owed(const Connection& c) const {
  for (const RecvDir& d : c.rx) {
    for (const RxPath& rp : d.paths) {
      if (rp.ack_pending) return true;
    }
  }
  return false;
}

void EngineImpl::timer_conn(Time now, Connection& c) {
  ++conn_visits_;
  for (uint16_t p = 0; p < c.tx.size(); ++p) {
    TxPath& tp = c.tx[p];
    if (tp.state == PathState::kActive) {
      if (tp.in_flight == 0) {
        tp.deadline = Time::max();
        continue;
      }
      if (check_failure(now, c, p)) continue;
      if (tp.deadline <= now) expire(now, c, p);
    } else if (tp.state == PathState::kProbing && tp.deadline <= now) {
      tp.state = PathState::kFailed;  // the next poll_tx sends another probe
      tp.deadline = Time::max();
    }
  }
  if (c.rack_deadline <= now) detect_late(now, c);
  if (c.tlp_deadline <= now) tail_probe(now, c);
  if (c.rnr_deadline <= now) {
    // Each message waits out its own back-off (its responder's min_rnr_timer).
    c.rnr_deadline = Time::max();
    for (uint16_t p = 0; p < c.tx.size(); ++p) {
      for (uint16_t idx = c.tx[p].head; idx != kNil; idx = c.pool[idx].next) {
        TxDesc& d = c.pool[idx];
        if (!(d.flags & detail::kRnrWait)) continue;
        const Time resume(slots_[d.slot].resume_ns);
        if (resume > now) {
          c.rnr_deadline = std::min(c.rnr_deadline, resume);
          continue;
        }
        d.flags &= static_cast<uint8_t>(~detail::kRnrWait);
        queue_retx(c, idx);
      }
    }
    // The message send_new holds may have nothing in flight any more: its back-off still wakes
    // the connection.
    if (c.cursor != kNoSlot && slots_[c.cursor].resume_ns > now.count())
      c.rnr_deadline = std::min(c.rnr_deadline, Time(slots_[c.cursor].resume_ns));
  }
  if (c.park_deadline <= now) resume_parked(c, now);
  // Its pacing wait is over: it is on the work list, and poll_tx paces it afresh. Left in its
  // deadline, a host whose transmit queue is full would be woken again at once, for ever.
  if (c.pace_at != Time::min() && c.pace_at <= now) c.pace_at = Time::min();
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

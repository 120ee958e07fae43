// SPDX-License-Identifier: Apache-2.0
// The transport's recovery (congestion.md §4, §5): path failure and re-probing, the QP's retry
// limit, tail probes, late-packet detection and the retransmission timers.
#include "datapath/transport/engine_impl.h"

#include <algorithm>

#include "datapath/transport/engine_util.h"
#include "datapath/transport/path_seq.h"

namespace metaroce::transport {

using detail::DescState;
using detail::kNil;
using detail::kNoSlot;

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

}  // namespace metaroce::transport

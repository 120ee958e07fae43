// SPDX-License-Identifier: Apache-2.0
// Shared-memory block the engine updates under a sequence lock, and what it puts in it.
#include "datapath/nic/telemetry_writer.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>

#include "datapath/nic/link_layer.h"
#include "datapath/nic/nic.h"
#include "datapath/transport/path_stats.h"

namespace metaroce::nic {

TelemetryWriter::TelemetryWriter(const std::string& run_dir, const std::string& link,
                                 uint32_t planes) {
  if (run_dir.empty()) return;
  const std::string dir = telemetry_dir(run_dir);
  mkdir(dir.c_str(), 0755);  // may exist
  file_ = dir + "/" + link + "." + std::to_string(getpid());
  int fd = open(file_.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return;
  if (ftruncate(fd, sizeof(TelemetryBlock)) != 0) {
    close(fd);
    unlink(file_.c_str());
    return;
  }
  void* map = mmap(nullptr, sizeof(TelemetryBlock), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (map == MAP_FAILED) {
    unlink(file_.c_str());
    return;
  }
  block_ = static_cast<TelemetryBlock*>(map);  // zero-filled by ftruncate
  block_->pid = static_cast<uint32_t>(getpid());
  block_->planes = planes;
  std::snprintf(block_->link, sizeof(block_->link), "%s", link.c_str());
  block_->version = kTelemetryVersion;
  std::atomic_thread_fence(std::memory_order_release);
  block_->magic = kTelemetryMagic;
}

TelemetryWriter::~TelemetryWriter() {
  if (!block_) return;
  munmap(block_, sizeof(TelemetryBlock));
  unlink(file_.c_str());
}

TelemetryBlock* TelemetryWriter::begin_update() {
  if (!block_) return nullptr;
  block_->seq.fetch_add(1, std::memory_order_acq_rel);  // odd: readers retry
  std::atomic_thread_fence(std::memory_order_release);
  return block_;
}

void TelemetryWriter::end_update() {
  block_->updated_unix_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                                std::chrono::system_clock::now().time_since_epoch())
                                .count();
  block_->seq.fetch_add(1, std::memory_order_release);
}

}  // namespace metaroce::nic

namespace metaroce::nic {

void publish_telemetry(TelemetryWriter& w, const Nic& nic, const LinkLayer& link,
                       uint64_t contexts, uint64_t stalls) {
  TelemetryBlock* b = w.begin_update();
  if (!b) return;
  uint32_t n = 0;
  auto put = [&](const char* name, uint64_t v) {
    if (n == kTelemetryCounters) return;
    std::snprintf(b->counters[n].name, sizeof(b->counters[n].name), "%s", name);
    b->counters[n++].value = v;
  };
  const LinkCounters& l = link.counters();
  put("contexts", contexts);
  put("qps", nic.qp_count());
  put("rx_frames", l.rx_frames);
  put("tx_frames", l.tx_frames);
  put("rx_drop_malformed", l.rx_drop_malformed);
  put("rx_drop_not_ours", l.rx_drop_not_ours);
  put("arp_requests", l.arp_requests);
  put("arp_replies", l.arp_replies);
  // What the ports themselves dropped or delayed: frames the backend lost for want of room or
  // buffers (port_rx_missed), frames the link had no room to send (port_tx_dropped), and kicks
  // that sent frames the backend had left queued (port_tx_late_kicks; io::PortStats).
  const io::PortStats ps = link.port_stats();
  put("port_rx_missed", ps.rx_missed);
  put("port_tx_dropped", ps.tx_dropped);
  put("port_tx_late_kicks", ps.tx_late_kicks);
  const NicCounters& d = nic.counters();
  put("naks_sent_access", d.naks_access);
  put("rnr", d.rnr);
  put("memory_faults", d.memory_faults);
  put("tx_payload_copied", d.tx_payload_copied);
  put("tx_payload_attached", d.tx_payload_attached);
  // Multicast (verbs-mapping.md §7): groups with members here now; datagrams sent to groups,
  // received for groups with members, the receives they took, received for other groups,
  // malformed; sent but not put on a port (no plane in service, no buffer).
  put("mcast_groups", nic.mcast_groups());
  put("mcast_tx", d.mcast_tx);
  put("mcast_rx", d.mcast_rx);
  put("mcast_rx_delivered", d.mcast_rx_delivered);
  put("mcast_rx_no_member", d.mcast_rx_no_member);
  put("mcast_rx_malformed", d.mcast_rx_malformed);
  put("mcast_tx_dropped", l.tx_mcast_dropped);
  // IGMP (wire.md §8): reports and leaves sent, queries answered, malformed messages dropped.
  put("igmp_reports", l.igmp_reports);
  put("igmp_leaves", l.igmp_leaves);
  put("igmp_queries", l.igmp_queries);
  put("igmp_rx_malformed", l.igmp_rx_malformed);
  const transport::EngineStats& e = nic.engine().stats();
  put("tx_packets", e.tx_packets);
  put("tx_bytes", e.tx_bytes);
  put("rx_packets", e.rx_packets);
  put("rx_bytes", e.rx_bytes);
  put("retransmits", e.retransmits);
  put("timeouts", e.timeouts);
  put("acks_sent", e.acks_sent);
  put("acks_received", e.acks_received);
  put("duplicates", e.duplicates);
  put("naks_sent", e.naks_sent);
  put("naks_received", e.naks_received);
  put("drop_malformed", e.drop_malformed);
  put("drop_version", e.drop_version);
  put("drop_unknown_conn", e.drop_unknown_conn);
  put("drop_token", e.drop_token);
  put("drop_out_of_window", e.drop_out_of_window);
  put("drop_rnr", e.drop_rnr);
  put("drop_unreachable", e.drop_unreachable);
  put("ecn_decreases", e.ecn_decreases);
  put("sack_gaps", e.sack_gaps);
  put("tail_probes", e.tail_probes);
  put("late_losses", e.late_losses);
  put("redundant_copies", e.redundant_copies);
  put("paths_failed", e.paths_failed);
  put("paths_suspected", e.paths_suspected);
  put("paths_recovered", e.paths_recovered);
  put("paths_reinstated", e.paths_reinstated);
  put("failover_resends", e.failover_resends);
  put("pacing_waits", e.pacing_waits);
  put("share_pushes", e.share_pushes);
  put("engine_stalls", stalls);
  b->num_counters = n;
  // Connections: one per peer some QP talks to; its QPs are its streams.
  const std::vector<const QueuePair*> qps = nic.qps();
  std::vector<uint32_t> peers;
  for (const QueuePair* qp : qps) {
    const uint32_t ip = qp->remote().ip;
    if (ip != 0 && std::find(peers.begin(), peers.end(), ip) == peers.end()) peers.push_back(ip);
  }
  // Each lane to a peer is a connection of its own (wire.md §3.4), lane 0 first.
  std::vector<std::pair<uint32_t, uint32_t>> conns;
  for (uint32_t ip : peers)
    for (uint32_t lane : transport::lanes(nic.engine(), ip)) conns.emplace_back(ip, lane);
  uint32_t c = 0;
  for (auto [ip, lane] : conns) {
    if (c == kTelemetryConns) break;
    const transport::ConnStats cs = transport::conn_stats(nic.engine(), ip, lane);
    if (!cs.exists) continue;
    TelemetryConn& tc = b->conns[c++];
    tc.peer_ip = ip;
    tc.lane = lane;
    tc.plane_mask = cs.plane_mask;
    tc.window = cs.window;
    tc.in_flight = cs.in_flight;
    tc.rate_hint_mbps = cs.rate_hint_mbps;
    tc.rx_rate_mbps = cs.rx_rate_mbps;
    tc.rx_hint_mbps = cs.rx_hint_mbps;
    tc.paths_active = cs.paths_active;
    const auto paths = transport::path_stats(nic.engine(), ip, lane);
    tc.num_paths = static_cast<uint32_t>(std::min<size_t>(paths.size(), kTelemetryPaths));
    for (uint32_t i = 0; i < tc.num_paths; ++i) {
      const transport::PathStats& ps = paths[i];
      TelemetryPath& tp = tc.paths[i];
      tp.path_id = ps.path_id;
      tp.udp_src_port = ps.udp_src_port;
      tp.plane = ps.plane;
      tp.state = ps.plane_down ? kTelemetryPlaneDown : static_cast<uint8_t>(ps.state);
      tp.window = ps.window;
      tp.in_flight = ps.in_flight;
      tp.tx_packets = ps.tx_packets;
      tp.tx_bytes = ps.tx_bytes;
      tp.retransmits = ps.retransmits;
      tp.timeouts = ps.timeouts;
      tp.ecn_ce_echoed = ps.ecn_ce_echoed;
      tp.sack_gaps = ps.sack_gaps;
      tp.failures = ps.failures;
      tp.rx_packets = ps.rx_packets;
      tp.rx_bytes = ps.rx_bytes;
      tp.duplicates = ps.duplicates;
      tp.ecn_ce_received = ps.ecn_ce_received;
      tp.srtt_ns = ps.srtt_ns;
      tp.rto_ns = ps.rto_ns;
    }
    uint32_t streams = 0;
    for (const QueuePair* qp : qps) {
      if (qp->remote().ip != ip || qp->lane() != lane) continue;
      if (streams < kTelemetryStreams) {
        TelemetryStream& ts = tc.streams[streams];
        ts.qpn = qp->qpn();
        ts.remote_qpn = qp->remote().qpn;
        ts.pid = qp->owner() ? qp->owner()->pid() : 0;
        ts.state = static_cast<uint8_t>(qp->state());
        ts.type = static_cast<uint8_t>(qp->init().type);
      }
      ++streams;
    }
    tc.num_streams = streams;
  }
  b->num_conns = c;
  w.end_update();
}

}  // namespace metaroce::nic

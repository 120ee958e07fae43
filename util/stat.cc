// SPDX-License-Identifier: Apache-2.0
// Printing the telemetry blocks of a link as a table or JSON.
#include "util/stat.h"

#include <unistd.h>

#include <cstdio>
#include <iomanip>
#include <ostream>
#include <sstream>
#include <thread>

#include "datapath/nic/telemetry.h"
#include "util/json_text.h"

namespace metaroce::util {
namespace {

constexpr const char* kStatHelp =
    "Usage: metaroce stat NAME [--json] [--watch SECONDS]\n"
    "\n"
    "Live counters of link NAME from the engine: device counters, then per connection (one per\n"
    "peer device and lane: lane 0 carries every QP with default settings, others the QPs with\n"
    "their own paths or planes; window, rate hint, and its streams, the QPs of every process\n"
    "that ride it) and per path (UDP source port, plane, state, packets, bytes, retransmissions, SACK\n"
    "gaps, ECN marks, smoothed RTT, window). Refreshed every 100 ms by the engine. --watch\n"
    "repeats every SECONDS until interrupted.\n";

const char* path_state(uint8_t s) {
  switch (s) {
    case 0: return "active";
    case 1: return "failed";
    case 2: return "probing";
    case nic::kTelemetryPlaneDown: return "plane-down";
  }
  return "?";
}

void print_text(std::ostream& o, const std::string& link,
                const std::vector<nic::TelemetrySnapshot>& snaps) {
  if (snaps.empty()) {
    o << link << ": no engine publishes counters (metaroce engine status)\n";
    return;
  }
  for (const auto& s : snaps) {
    o << link << "  engine pid " << s.pid << "  planes " << s.planes << "\n  counters:";
    int col = 0;
    for (const auto& c : s.counters) {
      if (c.value == 0) continue;  // the table shows what happened
      o << (col++ % 4 == 0 ? "\n    " : "  ") << std::left << std::setw(20) << c.name
        << std::right << std::setw(14) << c.value;
    }
    o << "\n";
    for (const auto& c : s.conns) {
      o << "  peer " << nic::format_ipv4(c.peer_ip) << "  lane 0x" << std::hex << c.lane
        << "  planes 0x" << c.plane_mask << std::dec << "  window " << c.window << "  in_flight "
        << c.in_flight << "  paths_active " << c.paths_active << "/" << c.num_paths
        << "  rate_hint " << c.rate_hint_mbps << " Mb/s  rx_rate " << c.rx_rate_mbps
        << " Mb/s  rx_hint " << c.rx_hint_mbps << " Mb/s\n";
      o << "    streams " << c.num_streams << ":";
      for (uint32_t i = 0; i < std::min(c.num_streams, nic::kTelemetryStreams); ++i)
        o << " qpn 0x" << std::hex << c.streams[i].qpn << "->0x" << c.streams[i].remote_qpn
          << std::dec << " (pid " << c.streams[i].pid << ")";
      o << "\n";
      o << "    PATH  SPORT  PLANE  STATE         TX_PKTS      TX_BYTES  RETX  SACK_GAPS  ECN_CE"
           "  RTT_US  WINDOW   RX_PKTS      RX_BYTES\n";
      for (uint32_t i = 0; i < c.num_paths; ++i) {
        const auto& p = c.paths[i];
        char line[256];
        std::snprintf(line, sizeof(line),
                      "    %4u  %5u  %5u  %-10s %10llu %13llu %5llu %10llu %7llu %7.1f %7u %9llu "
                      "%13llu\n",
                      p.path_id, p.udp_src_port, p.plane, path_state(p.state),
                      static_cast<unsigned long long>(p.tx_packets),
                      static_cast<unsigned long long>(p.tx_bytes),
                      static_cast<unsigned long long>(p.retransmits),
                      static_cast<unsigned long long>(p.sack_gaps),
                      static_cast<unsigned long long>(p.ecn_ce_echoed), p.srtt_ns / 1000.0,
                      p.window, static_cast<unsigned long long>(p.rx_packets),
                      static_cast<unsigned long long>(p.rx_bytes));
        o << line;
      }
    }
  }
}

OrderedJson connection_json(const nic::TelemetryConn& c) {
  OrderedJson streams = OrderedJson::array();
  for (uint32_t j = 0; j < std::min(c.num_streams, nic::kTelemetryStreams); ++j) {
    const auto& st = c.streams[j];
    streams.push_back(OrderedJson{{"qpn", st.qpn},
                                  {"remote_qpn", st.remote_qpn},
                                  {"pid", st.pid},
                                  {"state", unsigned{st.state}},
                                  {"type", st.type == 1 ? "UD" : "RC"}});
  }
  OrderedJson paths = OrderedJson::array();
  for (uint32_t j = 0; j < c.num_paths; ++j) {
    const auto& p = c.paths[j];
    paths.push_back(OrderedJson{{"path", p.path_id},
                                {"udp_src_port", p.udp_src_port},
                                {"plane", unsigned{p.plane}},
                                {"state", path_state(p.state)},
                                {"tx_packets", p.tx_packets},
                                {"tx_bytes", p.tx_bytes},
                                {"retransmits", p.retransmits},
                                {"timeouts", p.timeouts},
                                {"sack_gaps", p.sack_gaps},
                                {"ecn_ce", p.ecn_ce_echoed},
                                {"failures", p.failures},
                                {"srtt_ns", p.srtt_ns},
                                {"window", p.window},
                                {"in_flight", p.in_flight},
                                {"rx_packets", p.rx_packets},
                                {"rx_bytes", p.rx_bytes},
                                {"duplicates", p.duplicates}});
  }
  return OrderedJson{{"peer", nic::format_ipv4(c.peer_ip)},
                     {"lane", c.lane},
                     {"plane_mask", c.plane_mask},
                     {"num_paths", c.num_paths},
                     {"window", c.window},
                     {"in_flight", c.in_flight},
                     {"paths_active", c.paths_active},
                     {"rate_hint_mbps", c.rate_hint_mbps},
                     {"rx_rate_mbps", c.rx_rate_mbps},
                     {"rx_hint_mbps", c.rx_hint_mbps},
                     {"num_streams", c.num_streams},
                     {"streams", std::move(streams)},
                     {"paths", std::move(paths)}};
}

void print_json(std::ostream& o, const std::string& link,
                const std::vector<nic::TelemetrySnapshot>& snaps) {
  // One engine publishes the link (a stale block of an engine that died is removed by the
  // reader); the newest block wins if two are there for a moment.
  const nic::TelemetrySnapshot* s = nullptr;
  for (const auto& x : snaps)
    if (!s || x.updated_unix_ns > s->updated_unix_ns) s = &x;
  if (!s) {
    o << json_text(OrderedJson{{"link", link},
                               {"engine_pid", nullptr},
                               {"counters", OrderedJson::object()},
                               {"connections", OrderedJson::array()}});
    return;
  }
  OrderedJson counters = OrderedJson::object();
  for (const auto& c : s->counters) counters[c.name] = c.value;
  OrderedJson conns = OrderedJson::array();
  for (const auto& c : s->conns) conns.push_back(connection_json(c));
  o << json_text(OrderedJson{{"link", link},
                             {"engine_pid", s->pid},
                             {"planes", s->planes},
                             {"updated_unix_ns", s->updated_unix_ns},
                             {"counters", std::move(counters)},
                             {"connections", std::move(conns)}});
}

}  // namespace

int stat_command(const std::vector<std::string>& args, const Context& ctx, std::string* why_out) {
  std::string name;
  bool json = false;
  double watch = 0;
  auto error = [&](int status, const std::string& what) {
    *why_out = what;
    return status;
  };
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      *ctx.out << kStatHelp;
      return kExitOk;
    } else if (a == "--json") {
      json = true;
    } else if (a == "--watch") {
      if (i + 1 >= args.size()) return error(kExitUsage, "stat: --watch needs SECONDS");
      std::istringstream in(args[++i]);
      if (!(in >> watch) || !in.eof() || watch <= 0 || watch > 3600)
        return error(kExitUsage, "stat: --watch takes a number of seconds in (0, 3600]");
    } else if (!a.empty() && a[0] == '-') {
      return error(kExitUsage, "stat: unknown option '" + a + "'");
    } else if (name.empty()) {
      name = a;
    } else {
      return error(kExitUsage, "stat: one link name expected, got '" + a + "' too");
    }
  }
  if (name.empty()) return error(kExitUsage, "stat: missing link name");
  if (!check_name(name, nullptr)) return error(kExitUsage, "stat: invalid link name '" + name + "'");
  std::string why;
  if (!nic::LinkConfig::load(ctx.sysfs() + "/class/infiniband/" + name + "/" + nic::kConfigFile,
                             &why))
    return error(kExitError, "stat: no link '" + name + "' in " + ctx.rundir);
  for (;;) {
    auto snaps = nic::read_telemetry(ctx.rundir, name, &why);
    if (!snaps) return error(kExitError, "stat: " + why);
    if (json) print_json(*ctx.out, name, *snaps);
    else print_text(*ctx.out, name, *snaps);
    ctx.out->flush();
    if (watch <= 0) return kExitOk;
    std::this_thread::sleep_for(std::chrono::duration<double>(watch));
  }
}

}  // namespace metaroce::util

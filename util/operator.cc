// SPDX-License-Identifier: Apache-2.0
// capture, export and events: what an operator watches a link with.
#include "util/operator.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <map>
#include <ostream>
#include <set>
#include <sstream>
#include <thread>

#include "datapath/hostif/control.h"
#include "util/engine_client.h"

namespace metaroce::util {
namespace {

constexpr const char* kCaptureHelp =
    "Usage: metaroce capture NAME -w FILE [-c COUNT] [-s SNAPLEN] [--plane P] [-d SECONDS]\n"
    "\n"
    "Writes the frames link NAME sends and receives (every plane, or plane P) to FILE as pcap\n"
    "(`-` for standard output), until COUNT frames, SECONDS, or an interrupt. Frames of UDP-socket\n"
    "planes carry the headers the kernel puts on the wire. Read it with\n"
    "  tshark -X lua_script:/usr/share/metaroce/wireshark/metaroce.lua -r FILE\n";

constexpr const char* kExportHelp =
    "Usage: metaroce export [--listen ADDR:PORT]\n"
    "\n"
    "The counters of every link of the run dir (device, connection and path) in the Prometheus\n"
    "text format: printed once, or served at http://ADDR:PORT/metrics until interrupted.\n";

constexpr const char* kEventsHelp =
    "Usage: metaroce events NAME [-d SECONDS]\n"
    "\n"
    "A timestamped log of what happens to link NAME's paths: failures (a path declared dead),\n"
    "failovers (its packets resent elsewhere), probing and recovery, entropy re-picks (a new UDP\n"
    "source port), retransmission timeouts, planes going down. Until SECONDS or an interrupt.\n"
    "Times are those of the engine's counters, which it publishes every 100 ms.\n";

std::atomic<bool> g_stop{false};

void on_signal(int) { g_stop.store(true); }

bool parse_uint(const std::string& s, uint64_t max, uint64_t* out) {
  if (s.empty() || s.size() > 20) return false;
  uint64_t v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
    v = v * 10 + static_cast<uint64_t>(c - '0');
    if (v > max) return false;
  }
  *out = v;
  return true;
}

bool parse_seconds(const std::string& s, double* out) {
  std::istringstream in(s);
  return (in >> *out) && in.eof() && *out > 0 && *out <= 86400;
}

std::string iso_time(int64_t unix_ns) {
  const time_t secs = static_cast<time_t>(unix_ns / 1000000000);
  tm t{};
  gmtime_r(&secs, &t);
  char buf[64];
  const size_t n = strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%S", &t);
  std::snprintf(buf + n, sizeof(buf) - n, ".%03dZ", static_cast<int>(unix_ns / 1000000 % 1000));
  return buf;
}

const char* state_name(uint8_t s) {
  switch (s) {
    case 0: return "active";
    case 1: return "failed";
    case 2: return "probing";
    case nic::kTelemetryPlaneDown: return "plane-down";
  }
  return "unknown";
}

// --- capture -----------------------------------------------------------------------------------

int capture_impl(const std::vector<std::string>& args, const Context& ctx, std::string* why) {
  auto error = [&](int status, const std::string& what) {
    *why = what;
    return status;
  };
  std::string name, file;
  uint64_t count = 0, snaplen = 65535, plane = ~0ull;
  double seconds = 0;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    auto value = [&](std::string* v) {
      if (i + 1 >= args.size()) return false;
      *v = args[++i];
      return true;
    };
    std::string v;
    if (a == "--help" || a == "-h") {
      *ctx.out << kCaptureHelp;
      return kExitOk;
    } else if (a == "-w") {
      if (!value(&file) || file.empty()) return error(kExitUsage, "capture: -w needs a FILE");
    } else if (a == "-c") {
      if (!value(&v) || !parse_uint(v, 1ull << 40, &count) || count == 0)
        return error(kExitUsage, "capture: -c takes a count of frames, 1 or more");
    } else if (a == "-s") {
      if (!value(&v) || !parse_uint(v, 262144, &snaplen) || snaplen < 64)
        return error(kExitUsage, "capture: -s takes a snap length of 64..262144 bytes");
    } else if (a == "--plane") {
      if (!value(&v) || !parse_uint(v, nic::kMaxPlanes - 1, &plane))
        return error(kExitUsage, "capture: --plane takes a plane number, 0.." +
                                     std::to_string(nic::kMaxPlanes - 1));
    } else if (a == "-d") {
      if (!value(&v) || !parse_seconds(v, &seconds))
        return error(kExitUsage, "capture: -d takes seconds in (0, 86400]");
    } else if (!a.empty() && a[0] == '-') {
      return error(kExitUsage, "capture: unknown option '" + a + "'");
    } else if (name.empty()) {
      name = a;
    } else {
      return error(kExitUsage, "capture: one link name expected, got '" + a + "' too");
    }
  }
  if (name.empty()) return error(kExitUsage, "capture: missing link name");
  if (file.empty()) return error(kExitUsage, "capture: missing -w FILE");
  if (!link_exists(ctx, name)) return error(kExitError, "capture: no link '" + name + "' in " + ctx.rundir);
  EngineConnection conn(ctx.rundir);
  if (!conn.ok()) return error(kExitError, "capture: no engine serves " + ctx.rundir);
  const bool to_stdout = file == "-";
  const int fd = to_stdout ? dup(STDOUT_FILENO)
                           : open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return error(kExitError, "capture: cannot open " + file + ": " + std::strerror(errno));
  hostif::CaptureReq req;
  hostif::put_name(req.link, name);
  req.action = hostif::kCaptureStart;
  req.snaplen = static_cast<uint32_t>(snaplen);
  req.max_frames = count;
  req.planes = plane == ~0ull ? ~0u : 1u << plane;
  hostif::Message resp;
  StopOnSignal stopper;
  int e = conn.call(hostif::Op::kLinkCapture, &req, sizeof(req), &resp, {fd});
  close(fd);
  if (e == EBUSY) return error(kExitError, "capture: link " + name + " is being captured already");
  if (e) return error(kExitError, "capture: the engine refused: " + engine_reason(resp, e));
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  hostif::CaptureReq q = req;
  q.action = hostif::kCaptureQuery;
  while (!StopOnSignal::requested()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    if (seconds > 0 && std::chrono::steady_clock::now() >= end) break;
    if (conn.call(hostif::Op::kLinkCapture, q, &resp) != 0) break;
    auto r = resp.as<hostif::CaptureResp>();
    if (r && r->done) break;
  }
  q.action = hostif::kCaptureStop;
  e = conn.call(hostif::Op::kLinkCapture, q, &resp);
  auto r = resp.as<hostif::CaptureResp>();
  if (e || !r) return error(kExitError, "capture: the engine did not end the capture: " +
                                            engine_reason(resp, e));
  *ctx.err << "metaroce capture: " << r->frames << " frames of " << name << " written to "
           << (to_stdout ? "standard output" : file) << "\n";
  return kExitOk;
}

// --- export ------------------------------------------------------------------------------------

struct Metric {
  const char* name;
  const char* type;
  const char* help;
};

void family(std::ostream& o, const Metric& m) {
  o << "# HELP " << m.name << " " << m.help << "\n# TYPE " << m.name << " " << m.type << "\n";
}

std::string label(const std::string& v) {
  std::string out;
  for (char c : v) {
    if (c == '\\' || c == '"') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out;
}

}  // namespace

StopOnSignal::StopOnSignal() {
  g_stop.store(false);
  struct sigaction sa = {};
  sa.sa_handler = on_signal;
  sigaction(SIGINT, &sa, &old_int_);
  sigaction(SIGTERM, &sa, &old_term_);
}

StopOnSignal::~StopOnSignal() {
  sigaction(SIGINT, &old_int_, nullptr);
  sigaction(SIGTERM, &old_term_, nullptr);
}

bool StopOnSignal::requested() { return g_stop.load(); }

bool link_exists(const Context& ctx, const std::string& name) {
  std::string why;
  return check_name(name, nullptr) &&
         nic::LinkConfig::load(ctx.sysfs() + "/class/infiniband/" + name + "/" + nic::kConfigFile,
                               &why)
             .has_value();
}

const nic::TelemetrySnapshot* newest(const std::vector<nic::TelemetrySnapshot>& snaps) {
  const nic::TelemetrySnapshot* s = nullptr;
  for (const auto& x : snaps)
    if (!s || x.updated_unix_ns > s->updated_unix_ns) s = &x;
  return s;
}

std::string prometheus_text(
    const std::vector<std::pair<std::string, std::vector<nic::TelemetrySnapshot>>>& links) {
  std::ostringstream o;
  std::vector<std::pair<std::string, const nic::TelemetrySnapshot*>> snaps;
  for (const auto& [name, list] : links)
    if (const auto* s = newest(list)) snaps.emplace_back(name, s);
  // Device counters: every counter the engine publishes, a family each.
  std::set<std::string> names;
  for (const auto& [dev, s] : snaps)
    for (const auto& c : s->counters) names.insert(c.name);
  for (const std::string& n : names) {
    const bool gauge = n == "contexts" || n == "qps" || n == "mcast_groups";
    const std::string metric = "metaroce_device_" + n + (gauge ? "" : "_total");
    o << "# HELP " << metric << " MetaRoCE device counter " << n
      << " (metaroce stat; docs/spec/wire.md §7)\n# TYPE " << metric
      << (gauge ? " gauge\n" : " counter\n");
    for (const auto& [dev, s] : snaps)
      for (const auto& c : s->counters)
        if (n == c.name) o << metric << "{device=\"" << label(dev) << "\"} " << c.value << "\n";
  }
  family(o, {"metaroce_device_planes", "gauge", "Planes (ports) of the device."});
  for (const auto& [dev, s] : snaps)
    o << "metaroce_device_planes{device=\"" << label(dev) << "\"} " << s->planes << "\n";

  auto conn_labels = [](const std::string& dev, const nic::TelemetryConn& c) {
    std::ostringstream l;
    l << "device=\"" << label(dev) << "\",peer=\"" << nic::format_ipv4(c.peer_ip) << "\",lane=\""
      << c.lane << "\"";
    return l.str();
  };
  struct ConnGauge {
    Metric m;
    double (*value)(const nic::TelemetryConn&);
  };
  const ConnGauge conn_gauges[] = {
      {{"metaroce_connection_window_packets", "gauge", "Congestion window of the connection."},
       [](const nic::TelemetryConn& c) { return double(c.window); }},
      {{"metaroce_connection_in_flight_packets", "gauge", "Packets sent and not yet resolved."},
       [](const nic::TelemetryConn& c) { return double(c.in_flight); }},
      {{"metaroce_connection_paths", "gauge", "Paths (UDP source ports) of the connection."},
       [](const nic::TelemetryConn& c) { return double(c.num_paths); }},
      {{"metaroce_connection_paths_active", "gauge", "Paths in service."},
       [](const nic::TelemetryConn& c) { return double(c.paths_active); }},
      {{"metaroce_connection_rate_hint_bytes_per_second", "gauge",
        "Fair-share rate the receiver grants this sender, UDP payload (0: none)."},
       [](const nic::TelemetryConn& c) { return c.rate_hint_mbps * 1e6 / 8; }},
      {{"metaroce_connection_rx_rate_bytes_per_second", "gauge", "Rate received from the peer."},
       [](const nic::TelemetryConn& c) { return c.rx_rate_mbps * 1e6 / 8; }},
      {{"metaroce_connection_rx_hint_bytes_per_second", "gauge",
        "Fair-share rate this receiver grants the peer."},
       [](const nic::TelemetryConn& c) { return c.rx_hint_mbps * 1e6 / 8; }},
      {{"metaroce_connection_streams", "gauge", "Queue pairs riding the connection."},
       [](const nic::TelemetryConn& c) { return double(c.num_streams); }},
  };
  for (const ConnGauge& g : conn_gauges) {
    family(o, g.m);
    for (const auto& [dev, s] : snaps)
      for (const auto& c : s->conns) o << g.m.name << "{" << conn_labels(dev, c) << "} " << g.value(c) << "\n";
  }
  struct PathValue {
    Metric m;
    double (*value)(const nic::TelemetryPath&);
  };
  const PathValue path_values[] = {
      {{"metaroce_path_tx_packets_total", "counter", "Packets sent on the path."},
       [](const nic::TelemetryPath& p) { return double(p.tx_packets); }},
      {{"metaroce_path_tx_bytes_total", "counter", "Bytes sent on the path."},
       [](const nic::TelemetryPath& p) { return double(p.tx_bytes); }},
      {{"metaroce_path_rx_packets_total", "counter", "Packets received on the path."},
       [](const nic::TelemetryPath& p) { return double(p.rx_packets); }},
      {{"metaroce_path_rx_bytes_total", "counter", "Bytes received on the path."},
       [](const nic::TelemetryPath& p) { return double(p.rx_bytes); }},
      {{"metaroce_path_retransmits_total", "counter", "Packets resent on the path."},
       [](const nic::TelemetryPath& p) { return double(p.retransmits); }},
      {{"metaroce_path_timeouts_total", "counter", "Retransmission timeouts of the path."},
       [](const nic::TelemetryPath& p) { return double(p.timeouts); }},
      {{"metaroce_path_sack_gaps_total", "counter", "Holes the peer's SACKs reported."},
       [](const nic::TelemetryPath& p) { return double(p.sack_gaps); }},
      {{"metaroce_path_ecn_ce_echoed_total", "counter", "CE marks the peer echoed."},
       [](const nic::TelemetryPath& p) { return double(p.ecn_ce_echoed); }},
      {{"metaroce_path_ecn_ce_received_total", "counter", "CE-marked packets received."},
       [](const nic::TelemetryPath& p) { return double(p.ecn_ce_received); }},
      {{"metaroce_path_failures_total", "counter", "Times the path was declared failed."},
       [](const nic::TelemetryPath& p) { return double(p.failures); }},
      {{"metaroce_path_duplicates_total", "counter", "Duplicate packets received."},
       [](const nic::TelemetryPath& p) { return double(p.duplicates); }},
      {{"metaroce_path_srtt_seconds", "gauge", "Smoothed round-trip time."},
       [](const nic::TelemetryPath& p) { return double(p.srtt_ns) / 1e9; }},
      {{"metaroce_path_rto_seconds", "gauge", "Retransmission timeout."},
       [](const nic::TelemetryPath& p) { return double(p.rto_ns) / 1e9; }},
      {{"metaroce_path_window_packets", "gauge", "Congestion window of the path."},
       [](const nic::TelemetryPath& p) { return double(p.window); }},
      {{"metaroce_path_in_flight_packets", "gauge", "Packets in flight on the path."},
       [](const nic::TelemetryPath& p) { return double(p.in_flight); }},
      {{"metaroce_path_udp_source_port", "gauge", "The path's entropy: its UDP source port."},
       [](const nic::TelemetryPath& p) { return double(p.udp_src_port); }},
      {{"metaroce_path_state", "gauge",
        "0 active, 1 failed, 2 probing, 3 its plane is down."},
       [](const nic::TelemetryPath& p) { return double(p.state); }},
  };
  for (const PathValue& v : path_values) {
    family(o, v.m);
    for (const auto& [dev, s] : snaps)
      for (const auto& c : s->conns)
        for (uint32_t i = 0; i < std::min(c.num_paths, nic::kTelemetryPaths); ++i)
          o << v.m.name << "{" << conn_labels(dev, c) << ",path=\"" << c.paths[i].path_id
            << "\",plane=\"" << unsigned{c.paths[i].plane} << "\"} " << v.value(c.paths[i]) << "\n";
  }
  return o.str();
}

std::vector<std::string> path_events(const std::string& link, const nic::TelemetrySnapshot& a,
                                     const nic::TelemetrySnapshot& b) {
  std::vector<std::string> out;
  const std::string when = iso_time(b.updated_unix_ns) + " " + link + " ";
  auto key = [](const nic::TelemetryConn& c) { return std::pair{c.peer_ip, c.lane}; };
  std::map<std::pair<uint32_t, uint32_t>, const nic::TelemetryConn*> before;
  for (const auto& c : a.conns) before[key(c)] = &c;
  uint64_t failovers_a = 0, failovers_b = 0;
  for (const auto& c : a.counters)
    if (std::string(c.name) == "failover_resends") failovers_a = c.value;
  for (const auto& c : b.counters)
    if (std::string(c.name) == "failover_resends") failovers_b = c.value;
  for (const auto& c : b.conns) {
    std::ostringstream conn;
    conn << "peer " << nic::format_ipv4(c.peer_ip) << " lane 0x" << std::hex << c.lane << std::dec;
    auto it = before.find(key(c));
    if (it == before.end()) {
      out.push_back(when + conn.str() + ": connection up, " + std::to_string(c.num_paths) + " paths");
      continue;
    }
    const nic::TelemetryConn& old = *it->second;
    for (uint32_t i = 0; i < std::min(c.num_paths, nic::kTelemetryPaths); ++i) {
      const nic::TelemetryPath& p = c.paths[i];
      if (i >= old.num_paths) {
        out.push_back(when + conn.str() + " path " + std::to_string(p.path_id) + ": added, port " +
                      std::to_string(p.udp_src_port));
        continue;
      }
      const nic::TelemetryPath& q = old.paths[i];
      const std::string path = when + conn.str() + " path " + std::to_string(p.path_id) +
                               " (plane " + std::to_string(p.plane) + "): ";
      if (p.failures > q.failures)
        out.push_back(path + "failed (" + std::to_string(p.failures - q.failures) +
                      (p.failures - q.failures == 1 ? " time" : " times") + "), its packets moved");
      if (p.timeouts > q.timeouts)
        out.push_back(path + "retransmission timeout x" + std::to_string(p.timeouts - q.timeouts) +
                      ", rto " + std::to_string(p.rto_ns / 1000) + " us");
      if (p.udp_src_port != q.udp_src_port)
        out.push_back(path + "entropy re-picked, UDP source port " +
                      std::to_string(q.udp_src_port) + " -> " + std::to_string(p.udp_src_port));
      if (p.state != q.state)
        out.push_back(path + state_name(q.state) + " -> " + state_name(p.state));
    }
  }
  if (failovers_b > failovers_a)
    out.push_back(when + "failover: " + std::to_string(failovers_b - failovers_a) +
                  " packets resent on other paths");
  return out;
}

int capture_command(const std::vector<std::string>& args, const Context& ctx, std::string* why) {
  return capture_impl(args, ctx, why);
}

int export_command(const std::vector<std::string>& args, const Context& ctx, std::string* why) {
  std::string listen_at;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--help" || args[i] == "-h") {
      *ctx.out << kExportHelp;
      return kExitOk;
    } else if (args[i] == "--listen" && i + 1 < args.size()) {
      listen_at = args[++i];
    } else {
      *why = "export: unexpected argument '" + args[i] + "'";
      return kExitUsage;
    }
  }
  auto gather = [&]() {
    std::vector<std::pair<std::string, std::vector<nic::TelemetrySnapshot>>> links;
    std::error_code ec;
    std::vector<std::string> names;
    for (const auto& e : std::filesystem::directory_iterator(ctx.sysfs() + "/class/infiniband", ec))
      names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    for (const std::string& n : names) {
      std::string err;
      if (auto snaps = nic::read_telemetry(ctx.rundir, n, &err)) links.emplace_back(n, *snaps);
    }
    return prometheus_text(links);
  };
  if (listen_at.empty()) {
    *ctx.out << gather();
    return kExitOk;
  }
  const auto colon = listen_at.rfind(':');
  sockaddr_in a{};
  a.sin_family = AF_INET;
  uint64_t port = 0;
  if (colon == std::string::npos || inet_pton(AF_INET, listen_at.substr(0, colon).c_str(), &a.sin_addr) != 1 ||
      !parse_uint(listen_at.substr(colon + 1), 65535, &port) || port == 0) {
    *why = "export: --listen takes ADDR:PORT, e.g. 127.0.0.1:9477";
    return kExitUsage;
  }
  a.sin_port = htons(static_cast<uint16_t>(port));
  const int ls = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const int one = 1;
  setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (ls < 0 || bind(ls, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 || listen(ls, 16) != 0) {
    *why = "export: cannot listen on " + listen_at + ": " + std::strerror(errno);
    if (ls >= 0) close(ls);
    return kExitError;
  }
  StopOnSignal stopper;
  while (!StopOnSignal::requested()) {
    const int s = accept(ls, nullptr, nullptr);
    if (s < 0) continue;  // EINTR at the signal
    timeval tv{2, 0};
    setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    // The whole request head, however the client's writes were cut into segments: data left
    // unread at close() makes the kernel reset the connection, and the client may lose the reply.
    std::string head;
    char req[2048];
    while (head.size() < 8192 && head.find("\r\n\r\n") == std::string::npos) {
      const ssize_t n = recv(s, req, sizeof(req), 0);
      if (n <= 0) break;
      head.append(req, static_cast<size_t>(n));
    }
    const std::string line = head.substr(0, head.find("\r\n"));
    std::string reply;
    if (line.starts_with("GET /metrics ") || line == "GET /metrics") {
      const std::string body = gather();
      reply = "HTTP/1.0 200 OK\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
              "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
    } else {
      reply = "HTTP/1.0 404 Not Found\r\nContent-Length: 0\r\n\r\n";
    }
    size_t off = 0;
    while (off < reply.size()) {
      const ssize_t w = send(s, reply.data() + off, reply.size() - off, MSG_NOSIGNAL);
      if (w <= 0) break;
      off += static_cast<size_t>(w);
    }
    // Our side is done; whatever the client still sends is read and dropped, so that close()
    // does not reset a reply it has not read yet.
    shutdown(s, SHUT_WR);
    timeval drain{0, 200000};
    setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &drain, sizeof(drain));
    while (recv(s, req, sizeof(req), 0) > 0) {
    }
    close(s);
  }
  close(ls);
  return kExitOk;
}

int events_command(const std::vector<std::string>& args, const Context& ctx, std::string* why) {
  std::string name;
  double seconds = 0;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      *ctx.out << kEventsHelp;
      return kExitOk;
    } else if (a == "-d" && i + 1 < args.size()) {
      if (!parse_seconds(args[++i], &seconds)) {
        *why = "events: -d takes seconds in (0, 86400]";
        return kExitUsage;
      }
    } else if (!a.empty() && a[0] == '-') {
      *why = "events: unknown option '" + a + "'";
      return kExitUsage;
    } else if (name.empty()) {
      name = a;
    } else {
      *why = "events: one link name expected, got '" + a + "' too";
      return kExitUsage;
    }
  }
  if (name.empty()) {
    *why = "events: missing link name";
    return kExitUsage;
  }
  if (!link_exists(ctx, name)) {
    *why = "events: no link '" + name + "' in " + ctx.rundir;
    return kExitError;
  }
  StopOnSignal stopper;
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  std::optional<nic::TelemetrySnapshot> last;
  while (!StopOnSignal::requested() && (seconds <= 0 || std::chrono::steady_clock::now() < end)) {
    std::string err;
    auto snaps = nic::read_telemetry(ctx.rundir, name, &err);
    const nic::TelemetrySnapshot* now = snaps ? newest(*snaps) : nullptr;
    if (now && (!last || now->updated_unix_ns != last->updated_unix_ns)) {
      if (last && now->pid == last->pid) {
        for (const std::string& line : path_events(name, *last, *now)) *ctx.out << line << "\n";
      } else {
        *ctx.out << iso_time(now->updated_unix_ns) << " " << name << " engine pid " << now->pid
                 << ": watching " << now->conns.size() << " connections\n";
      }
      ctx.out->flush();
      last = *now;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  return kExitOk;
}

}  // namespace metaroce::util

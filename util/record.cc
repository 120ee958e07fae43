// SPDX-License-Identifier: Apache-2.0
// Writing and reading records of a link's per-path telemetry (util/record.h).
#include "util/record.h"

#include <chrono>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "util/operator.h"

namespace metaroce::util {
namespace {

using nlohmann::json;

constexpr const char* kRecordHelp =
    "Usage: metaroce record NAME -o FILE [-d SECONDS] [--max-size MIB]\n"
    "\n"
    "Writes every snapshot the engine publishes of link NAME's connections and paths (every\n"
    "100 ms) to FILE, until SECONDS, an interrupt, or FILE reaching MIB mebibytes (default 64).\n"
    "`metaroce top --replay FILE` plays it back; bench/plot_record draws it. The format is JSON\n"
    "lines (docs/operations.md, \"Records\").\n";

constexpr const char* kFormat = "metaroce-record";
// The order of a path's fields in a sample's "paths" arrays (written in the
// header too).
constexpr const char* kPathFields[] = {
    "path",       "udp_port", "plane",       "state",      "window",  "in_flight",
    "tx_packets", "tx_bytes", "retransmits", "timeouts",   "ecn_ce",  "sack_gaps",
    "failures",   "srtt_ns",  "rto_ns",      "rx_packets", "rx_bytes"};
constexpr size_t kPathFieldCount = std::size(kPathFields);

json path_array(const nic::TelemetryPath& p) {
  return json::array({p.path_id, p.udp_src_port, p.plane, p.state, p.window, p.in_flight,
                      p.tx_packets, p.tx_bytes, p.retransmits, p.timeouts, p.ecn_ce_echoed,
                      p.sack_gaps, p.failures, p.srtt_ns, p.rto_ns, p.rx_packets, p.rx_bytes});
}

nic::TelemetryPath path_from(const json& a) {
  if (!a.is_array() || a.size() != kPathFieldCount)
    throw std::runtime_error("a path is not 17 numbers");
  nic::TelemetryPath p{};
  p.path_id = a[0].get<uint16_t>();
  p.udp_src_port = a[1].get<uint16_t>();
  p.plane = a[2].get<uint8_t>();
  p.state = a[3].get<uint8_t>();
  p.window = a[4].get<uint32_t>();
  p.in_flight = a[5].get<uint32_t>();
  p.tx_packets = a[6].get<uint64_t>();
  p.tx_bytes = a[7].get<uint64_t>();
  p.retransmits = a[8].get<uint64_t>();
  p.timeouts = a[9].get<uint64_t>();
  p.ecn_ce_echoed = a[10].get<uint64_t>();
  p.sack_gaps = a[11].get<uint64_t>();
  p.failures = a[12].get<uint64_t>();
  p.srtt_ns = a[13].get<int64_t>();
  p.rto_ns = a[14].get<int64_t>();
  p.rx_packets = a[15].get<uint64_t>();
  p.rx_bytes = a[16].get<uint64_t>();
  return p;
}

nic::TelemetrySnapshot sample_from(const json& j) {
  nic::TelemetrySnapshot s;
  s.updated_unix_ns = j.at("t").get<int64_t>();
  s.pid = j.at("pid").get<uint32_t>();
  s.planes = j.at("planes").get<uint32_t>();
  for (const auto& [name, value] : j.at("counters").items()) {
    nic::TelemetryCounter c{};
    std::strncpy(c.name, name.c_str(), sizeof(c.name) - 1);
    c.value = value.get<uint64_t>();
    s.counters.push_back(c);
  }
  for (const json& jc : j.at("conns")) {
    nic::TelemetryConn c{};
    c.peer_ip = jc.at("peer").get<uint32_t>();
    c.lane = jc.at("lane").get<uint32_t>();
    c.plane_mask = jc.at("plane_mask").get<uint32_t>();
    c.window = jc.at("window").get<uint32_t>();
    c.in_flight = jc.at("in_flight").get<uint32_t>();
    c.paths_active = jc.at("paths_active").get<uint32_t>();
    const json& paths = jc.at("paths");
    if (paths.size() > nic::kTelemetryPaths)
      throw std::runtime_error("more paths than a connection has");
    c.num_paths = static_cast<uint32_t>(paths.size());
    for (size_t i = 0; i < paths.size(); ++i) c.paths[i] = path_from(paths[i]);
    s.conns.push_back(c);
  }
  return s;
}

bool parse_number(const std::string& s, double lo, double hi, double* out) {
  std::istringstream in(s);
  return (in >> *out) && in.eof() && *out > lo && *out <= hi;
}

}  // namespace

std::string record_header(const std::string& link, int64_t started_unix_ns) {
  json h = {{"format", kFormat},
            {"version", kRecordVersion},
            {"link", link},
            {"started_unix_ns", started_unix_ns},
            {"path_fields", kPathFields}};
  return h.dump();
}

std::string record_sample(const nic::TelemetrySnapshot& s) {
  json counters = json::object();
  for (const auto& c : s.counters)
    if (c.value) counters[std::string(c.name, strnlen(c.name, sizeof(c.name)))] = c.value;
  json conns = json::array();
  for (const auto& c : s.conns) {
    json paths = json::array();
    for (uint32_t i = 0; i < std::min(c.num_paths, nic::kTelemetryPaths); ++i)
      paths.push_back(path_array(c.paths[i]));
    conns.push_back({{"peer", c.peer_ip},
                     {"lane", c.lane},
                     {"plane_mask", c.plane_mask},
                     {"window", c.window},
                     {"in_flight", c.in_flight},
                     {"paths_active", c.paths_active},
                     {"paths", std::move(paths)}});
  }
  json j = {{"t", s.updated_unix_ns},
            {"pid", s.pid},
            {"planes", s.planes},
            {"counters", std::move(counters)},
            {"conns", std::move(conns)}};
  return j.dump();
}

std::optional<Recording> read_record(const std::string& path, std::string* err) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    *err = "cannot open '" + path + "': " + std::strerror(errno);
    return std::nullopt;
  }
  Recording r;
  std::string line;
  size_t n = 0;
  try {
    while (std::getline(in, line)) {
      ++n;
      if (in.eof() && !line.empty()) throw std::runtime_error("cut short (no end of line)");
      const json j = json::parse(line);
      if (n == 1) {
        if (!j.is_object() || j.value("format", "") != kFormat)
          throw std::runtime_error("not a metaroce record (no \"format\": \"metaroce-record\")");
        const int v = j.at("version").get<int>();
        if (v > kRecordVersion)
          throw std::runtime_error("version " + std::to_string(v) + ", this metaroce reads " +
                                   std::to_string(kRecordVersion));
        r.link = j.at("link").get<std::string>();
        r.started_unix_ns = j.at("started_unix_ns").get<int64_t>();
        continue;
      }
      r.samples.push_back(sample_from(j));
    }
  } catch (const std::exception& e) {
    *err = path + " line " + std::to_string(n) + ": " + e.what();
    return std::nullopt;
  }
  if (n == 0) {
    *err = path + ": empty, not a metaroce record";
    return std::nullopt;
  }
  return r;
}

int record_command(const std::vector<std::string>& args, const Context& ctx, std::string* why) {
  std::string name, out_path;
  double seconds = 0, max_mib = 64;
  auto usage = [&](const std::string& what) {
    *why = "record: " + what;
    return kExitUsage;
  };
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      *ctx.out << kRecordHelp;
      return kExitOk;
    } else if (a == "-o" || a == "-d" || a == "--max-size") {
      if (i + 1 >= args.size()) return usage(a + " needs a value");
      const std::string& v = args[++i];
      if (a == "-o")
        out_path = v;
      else if (a == "-d" && !parse_number(v, 0, 86400, &seconds))
        return usage("-d takes seconds in (0, 86400]");
      else if (a == "--max-size" && !parse_number(v, 0, 1 << 20, &max_mib))
        return usage("--max-size takes mebibytes in (0, 1048576]");
    } else if (!a.empty() && a[0] == '-') {
      return usage("unknown option '" + a + "'");
    } else if (name.empty()) {
      name = a;
    } else {
      return usage("one link name expected, got '" + a + "' too");
    }
  }
  if (name.empty()) return usage("missing link name");
  if (out_path.empty()) return usage("missing -o FILE");
  if (!link_exists(ctx, name)) {
    *why = "record: no link '" + name + "' in " + ctx.rundir;
    return kExitError;
  }
  std::ofstream out(out_path, std::ios::binary | std::ios::trunc);
  if (!out) {
    *why = "record: cannot write '" + out_path + "': " + std::strerror(errno);
    return kExitError;
  }
  StopOnSignal stopper;
  const auto limit = static_cast<uint64_t>(max_mib * 1024 * 1024);
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  uint64_t written = 0, samples = 0;
  const std::string header =
      record_header(name, std::chrono::duration_cast<std::chrono::nanoseconds>(
                              std::chrono::system_clock::now().time_since_epoch())
                              .count());
  out << header << '\n';
  written += header.size() + 1;
  int64_t last = 0;
  bool full = false;
  while (!StopOnSignal::requested() && (seconds <= 0 || std::chrono::steady_clock::now() < end)) {
    std::string err;
    auto snaps = nic::read_telemetry(ctx.rundir, name, &err);
    const nic::TelemetrySnapshot* s = snaps ? newest(*snaps) : nullptr;
    if (s && s->updated_unix_ns != last) {
      const std::string line = record_sample(*s);
      if (written + line.size() + 1 > limit) {
        full = true;
        break;
      }
      out << line << '\n';
      out.flush();
      written += line.size() + 1;
      ++samples;
      last = s->updated_unix_ns;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  *ctx.err << "record: " << samples << " snapshots of " << name << ", " << written << " bytes in "
           << out_path << (full ? " (stopped at --max-size)" : "") << "\n";
  if (!out) {
    *why = "record: writing '" + out_path + "' failed";
    return kExitError;
  }
  return kExitOk;
}

}  // namespace metaroce::util

// SPDX-License-Identifier: Apache-2.0
// The fabric's state folder, control protocol and statistics formatting (see fabric_control.h).
#include "datapath/fabric/fabric_control.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iomanip>
#include <sstream>

#include <nlohmann/json.hpp>

namespace metaroce::fabric {
namespace {

std::vector<std::string> split_words(const std::string& line) {
  std::vector<std::string> words;
  std::istringstream in(line);
  std::string w;
  while (in >> w) words.push_back(w);
  return words;
}

bool parse_u64(const std::string& s, uint64_t* out) {
  if (s.empty()) return false;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), *out, 10);
  return ec == std::errc() && p == s.data() + s.size();
}

bool parse_u32(const std::string& s, uint32_t* out) {
  uint64_t v = 0;
  if (!parse_u64(s, &v) || v > UINT32_MAX) return false;
  *out = static_cast<uint32_t>(v);
  return true;
}

// "*" (all), a plane number.
bool parse_planes(const std::string& s, const Fabric& f, std::vector<uint32_t>* out) {
  if (s == "*") {
    for (uint32_t p = 0; p < f.config().planes; ++p) out->push_back(p);
    return true;
  }
  uint32_t p = 0;
  if (!parse_u32(s, &p) || p >= f.config().planes) return false;
  out->push_back(p);
  return true;
}

// "*", "coreN", "edgeN" or "N" (core) -> link ids of one plane.
bool parse_links(const std::string& s, const Fabric& f, uint32_t plane,
                 std::vector<uint32_t>* out) {
  const uint32_t per_plane = f.config().links_per_plane + f.config().endpoints;
  if (s == "*") {
    for (uint32_t i = 0; i < per_plane; ++i) out->push_back(plane * per_plane + i);
    return true;
  }
  LinkId id{plane, LinkKind::kCore, 0};
  std::string num = s;
  if (s.rfind("core", 0) == 0) {
    num = s.substr(4);
  } else if (s.rfind("edge", 0) == 0) {
    id.kind = LinkKind::kEdge;
    num = s.substr(4);
  }
  if (!parse_u32(num, &id.index)) return false;
  auto idx = f.link_index(id);
  if (!idx) return false;
  out->push_back(*idx);
  return true;
}

std::string json_double(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.6g", v);
  return buf;
}

}  // namespace

bool parse_probability(const std::string& s, double* out) {
  if (s.empty() || s.size() > 32) return false;
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (end != s.c_str() + s.size() || !(v >= 0 && v <= 1)) return false;
  *out = v;
  return true;
}


bool check_fabric_name(const std::string& name, std::string* err) {
  const bool ok = !name.empty() && name.size() <= kMaxFabricNameLen &&
                  std::all_of(name.begin(), name.end(), [](char c) {
                    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
                           (c >= '0' && c <= '9') || c == '_' || c == '-';
                  });
  if (!ok)
    *err = "bad fabric name '" + name + "': expected 1.." + std::to_string(kMaxFabricNameLen) +
           " characters from [A-Za-z0-9_-]";
  return ok;
}

std::string socket_name(const std::string& name, uint32_t endpoint, uint32_t plane) {
  return "metaroce-fabric-" + name + "-e" + std::to_string(endpoint) + "-p" +
         std::to_string(plane);
}

std::string state_dir(const std::string& rundir, const std::string& name) {
  return rundir + "/fabric/" + name;
}

std::optional<FabricInfo> read_info(const std::string& rundir, const std::string& name,
                                    std::string* err) {
  const std::string dir = state_dir(rundir, name);
  std::ifstream in(dir + "/" + kInfoFile);
  if (!in) {
    *err = "no fabric named " + name + " (nothing at " + dir + ")";
    return std::nullopt;
  }
  FabricInfo info;
  std::string line;
  while (std::getline(in, line)) {
    const auto eq = line.find('=');
    if (eq == std::string::npos) continue;
    const std::string key = line.substr(0, eq), val = line.substr(eq + 1);
    uint32_t v = 0;
    if (!parse_u32(val, &v)) continue;  // unknown or malformed keys: checked below
    if (key == "endpoints") info.endpoints = v;
    if (key == "planes") info.planes = v;
    if (key == "links_per_plane") info.links_per_plane = v;
  }
  if (info.endpoints == 0 || info.endpoints > kMaxEndpoints || info.planes == 0 ||
      info.planes > kMaxPlanes) {
    *err = dir + "/" + kInfoFile + ": endpoints or planes missing or out of range";
    return std::nullopt;
  }
  std::ifstream pid_in(dir + "/" + kPidFile);
  long pid = 0;
  if (pid_in >> pid && pid > 0) info.pid = static_cast<pid_t>(pid);
  return info;
}

bool write_info(const std::string& dir, const FabricInfo& info, std::string* err) {
  const std::string path = dir + "/" + kInfoFile, tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << "# MetaRoCE fabric, written by `metaroce fabric run`\n"
        << "endpoints=" << info.endpoints << "\n"
        << "planes=" << info.planes << "\n"
        << "links_per_plane=" << info.links_per_plane << "\n"
        << "socket_prefix=metaroce-fabric-\n";
    out.close();
    if (!out) {
      *err = "cannot write " + tmp + ": " + std::strerror(errno);
      return false;
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    *err = "cannot write " + path + ": " + std::strerror(errno);
    return false;
  }
  return true;
}

std::optional<std::string> control_request(const std::string& rundir, const std::string& name,
                                           const std::string& line, std::string* err,
                                           std::chrono::milliseconds timeout) {
  const std::string path = state_dir(rundir, name) + "/" + kControlSocket;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof(addr.sun_path)) {
    *err = "control socket path too long: " + path;
    return std::nullopt;
  }
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    *err = std::string("socket: ") + std::strerror(errno);
    return std::nullopt;
  }
  auto fail = [&](const std::string& why) -> std::optional<std::string> {
    *err = why;
    ::close(fd);
    return std::nullopt;
  };
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0)
    return fail("fabric " + name + " does not answer on " + path + ": " + std::strerror(errno));
  const std::string req = line + "\n";
  if (::send(fd, req.data(), req.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(req.size()))
    return fail("cannot send to fabric " + name + ": " + std::strerror(errno));
  ::shutdown(fd, SHUT_WR);
  std::string reply;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  char buf[4096];
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return fail("fabric " + name + " did not reply in time");
    pollfd p{fd, POLLIN, 0};
    const int rc = ::poll(&p, 1, static_cast<int>(left.count()));
    if (rc < 0 && errno == EINTR) continue;
    if (rc <= 0) continue;
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return fail("reading from fabric " + name + ": " + std::strerror(errno));
    if (n == 0) break;
    reply.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return reply;
}

std::optional<uint64_t> parse_rate(const std::string& text) {
  if (text.empty() || text.size() > 24) return std::nullopt;
  std::string num = text;
  double scale = 1;
  switch (num.back()) {
    case 'k': case 'K': scale = 1e3; break;
    case 'm': case 'M': scale = 1e6; break;
    case 'g': case 'G': scale = 1e9; break;
    case 't': case 'T': scale = 1e12; break;
    default: break;
  }
  if (scale != 1) num.pop_back();
  if (num.empty() || !(std::isdigit(static_cast<unsigned char>(num[0])))) return std::nullopt;
  char* end = nullptr;
  const double v = std::strtod(num.c_str(), &end);
  if (end != num.c_str() + num.size() || !(v >= 0)) return std::nullopt;
  const double bps = v * scale;
  if (bps > 1e13 || (bps > 0 && bps < 1000)) return std::nullopt;  // 1 kbit/s .. 10 Tbit/s
  return static_cast<uint64_t>(std::llround(bps));
}

std::string format_rate(uint64_t bps) {
  if (bps == 0) return "unlimited";
  char buf[32];
  if (bps % 1'000'000'000 == 0) {
    std::snprintf(buf, sizeof(buf), "%lluG", static_cast<unsigned long long>(bps / 1'000'000'000));
  } else if (bps % 1'000'000 == 0) {
    std::snprintf(buf, sizeof(buf), "%lluM", static_cast<unsigned long long>(bps / 1'000'000));
  } else {
    std::snprintf(buf, sizeof(buf), "%llu", static_cast<unsigned long long>(bps));
  }
  return buf;
}

bool apply_setting(const std::string& setting, LinkParams* p, std::string* err) {
  if (setting == "down" || setting == "up") {
    p->up = setting == "up";
    return true;
  }
  const auto eq = setting.find('=');
  const std::string key = setting.substr(0, eq);
  const std::string val = eq == std::string::npos ? "" : setting.substr(eq + 1);
  auto bad = [&](const std::string& expect) {
    *err = "bad setting '" + setting + "': " + expect;
    return false;
  };
  if (eq == std::string::npos) return bad("expected KEY=VALUE, down or up");
  uint64_t n = 0;
  if (key == "loss") {
    if (!parse_probability(val, &p->loss)) return bad("a probability 0..1");
  } else if (key == "reorder") {
    if (!parse_probability(val, &p->reorder)) return bad("a probability 0..1");
  } else if (key == "dup") {
    if (!parse_probability(val, &p->duplicate)) return bad("a probability 0..1");
  } else if (key == "delay") {
    if (!parse_u64(val, &n) || n > 10'000'000) return bad("microseconds 0..10000000");
    p->delay = std::chrono::microseconds(n);
  } else if (key == "reorder_delay") {
    if (!parse_u64(val, &n) || n > 10'000'000) return bad("microseconds 0..10000000");
    p->reorder_delay = std::chrono::microseconds(n);
  } else if (key == "rate") {
    auto r = parse_rate(val);
    if (!r) return bad("bits/s like 100G, 800M, 0 (unlimited)");
    p->rate_bps = *r;
  } else if (key == "ecn") {
    if (!parse_u64(val, &n)) return bad("a byte count");
    p->ecn_threshold_bytes = n;
  } else if (key == "queue") {
    if (!parse_u64(val, &n) || n == 0 || n > (uint64_t{1} << 32)) return bad("bytes 1..4G");
    p->queue_bytes = n;
  } else {
    return bad("unknown key (loss, delay, rate, reorder, reorder_delay, dup, ecn, queue)");
  }
  return true;
}

std::string handle_request(Fabric& fabric, const std::string& line, Nanos now, bool* stop) {
  const auto words = split_words(line);
  if (words.empty()) return "error: empty request\n";
  const std::string& cmd = words[0];
  if (cmd == "stat") {
    if (words.size() == 1) return "ok\n" + stats_text(fabric, now);
    if (words.size() == 2 && words[1] == "json") return "ok\n" + stats_json(fabric, now);
    return "error: usage: stat [json]\n";
  }
  if (cmd == "stop") {
    *stop = true;
    return "ok\n";
  }
  if (cmd != "set") return "error: unknown request '" + cmd + "'\n";
  if (words.size() < 4) return "error: usage: set PLANE LINK SETTING...\n";
  std::vector<uint32_t> planes, links;
  if (!parse_planes(words[1], fabric, &planes))
    return "error: no plane '" + words[1] + "' (0.." +
           std::to_string(fabric.config().planes - 1) + ")\n";
  for (uint32_t p : planes)
    if (!parse_links(words[2], fabric, p, &links))
      return "error: no link '" + words[2] + "' (core0..core" +
             std::to_string(fabric.config().links_per_plane - 1) + ", edge0..edge" +
             std::to_string(fabric.config().endpoints - 1) + ")\n";
  // Every setting is checked against every link before any is changed.
  std::vector<LinkParams> updated;
  for (uint32_t l : links) {
    LinkParams p = fabric.params(l);
    for (size_t i = 3; i < words.size(); ++i) {
      std::string err;
      if (!apply_setting(words[i], &p, &err)) return "error: " + err + "\n";
    }
    updated.push_back(p);
  }
  for (size_t i = 0; i < links.size(); ++i) fabric.set_params(links[i], updated[i], now);
  return "ok\n" + std::to_string(links.size()) + " link(s) changed\n";
}

std::string stats_text(Fabric& fabric, Nanos now) {
  std::ostringstream o;
  o << std::left << std::setw(12) << "LINK" << std::right << std::setw(5) << "UP" << std::setw(10)
    << "RATE" << std::setw(9) << "LOSS" << std::setw(12) << "FRAMES_IN" << std::setw(12)
    << "FRAMES_OUT" << std::setw(14) << "BYTES_OUT" << std::setw(10) << "DROP_Q" << std::setw(10)
    << "DROP_LOSS" << std::setw(10) << "DROP_DOWN" << std::setw(10) << "CE" << std::setw(10)
    << "REORDERED" << std::setw(8) << "DUPS" << std::setw(10) << "QUEUE" << std::setw(10)
    << "MAX_QUEUE" << "\n";
  for (uint32_t i = 0; i < fabric.link_count(); ++i) {
    const LinkStats s = fabric.link_stats(i, now);
    const LinkParams& p = fabric.params(i);
    o << std::left << std::setw(12) << fabric.link_name(i) << std::right << std::setw(5)
      << (p.up ? "up" : "down") << std::setw(10) << format_rate(p.rate_bps) << std::setw(9)
      << json_double(p.loss) << std::setw(12) << s.frames_in << std::setw(12) << s.frames_out
      << std::setw(14) << s.bytes_out << std::setw(10) << s.drop_queue << std::setw(10)
      << s.drop_loss << std::setw(10) << s.drop_down << std::setw(10) << s.ce_marked
      << std::setw(10) << s.reordered << std::setw(8) << s.duplicated << std::setw(10)
      << s.queue_bytes << std::setw(10) << s.max_queue_bytes << "\n";
  }
  const FabricStats& f = fabric.stats();
  o << "fabric: frames_in " << f.frames_in << ", delivered " << f.delivered << ", flooded "
    << f.flooded << ", no_route " << f.dropped_no_route << ", no_record " << f.dropped_no_record
    << ", no_buffer " << f.dropped_no_buffer << "\n";
  return o.str();
}

std::string stats_json(Fabric& fabric, Nanos now) {
  using nlohmann::ordered_json;
  const FabricConfig& c = fabric.config();
  const FabricStats& f = fabric.stats();
  ordered_json links = ordered_json::array();
  for (uint32_t i = 0; i < fabric.link_count(); ++i) {
    const LinkStats s = fabric.link_stats(i, now);
    const LinkParams& p = fabric.params(i);
    const LinkId id = fabric.link_id(i);
    links.push_back(ordered_json{
        {"name", fabric.link_name(i)},
        {"plane", id.plane},
        {"kind", id.kind == LinkKind::kCore ? "core" : "edge"},
        {"index", id.index},
        {"up", p.up},
        {"rate_bps", p.rate_bps},
        {"loss", p.loss},
        {"delay_us", std::chrono::duration_cast<std::chrono::microseconds>(p.delay).count()},
        {"reorder", p.reorder},
        {"dup", p.duplicate},
        {"queue_limit", p.queue_bytes},
        {"ecn_threshold", p.ecn_threshold_bytes},
        {"frames_in", s.frames_in},
        {"bytes_in", s.bytes_in},
        {"frames_out", s.frames_out},
        {"bytes_out", s.bytes_out},
        {"drop_queue", s.drop_queue},
        {"drop_loss", s.drop_loss},
        {"drop_down", s.drop_down},
        {"ce_marked", s.ce_marked},
        {"reordered", s.reordered},
        {"duplicated", s.duplicated},
        {"queue_bytes", s.queue_bytes},
        {"max_queue_bytes", s.max_queue_bytes}});
  }
  const ordered_json j = {{"endpoints", c.endpoints},
                          {"planes", c.planes},
                          {"links_per_plane", c.links_per_plane},
                          {"fabric",
                           {{"frames_in", f.frames_in},
                            {"delivered", f.delivered},
                            {"flooded", f.flooded},
                            {"dropped_no_route", f.dropped_no_route},
                            {"dropped_no_record", f.dropped_no_record},
                            {"dropped_no_buffer", f.dropped_no_buffer}}},
                          {"links", std::move(links)}};
  return j.dump(2) + "\n";
}

}  // namespace metaroce::fabric

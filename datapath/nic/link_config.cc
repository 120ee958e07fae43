// SPDX-License-Identifier: Apache-2.0
// Reading and writing the link record shared by `metaroce` and the provider.
#include "datapath/nic/link_config.h"

#include <arpa/inet.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

namespace metaroce::nic {
namespace {

template <typename T>
bool parse_uint(const std::string& s, T& out, int base = 10) {
  if (s.empty()) return false;
  const char* first = s.data();
  const char* last = s.data() + s.size();
  if (base == 16 && s.size() > 2 && s[0] == '0' && (s[1] == 'x' || s[1] == 'X')) first += 2;
  auto [p, ec] = std::from_chars(first, last, out, base);
  return ec == std::errc() && p == last;
}

}  // namespace

std::optional<std::string> parse_udp_plane(const std::string& devargs) {
  if (devargs == "udp") return std::string();
  constexpr std::string_view kPrefix = "udp,iface=";
  if (!devargs.starts_with(kPrefix) || devargs.size() == kPrefix.size() ||
      devargs.find(',', kPrefix.size()) != std::string::npos)
    return std::nullopt;
  return devargs.substr(kPrefix.size());
}

std::string udp_plane(const std::string& iface) {
  return iface.empty() ? "udp" : "udp,iface=" + iface;
}

std::optional<uint32_t> parse_ipv4(const std::string& text) {
  in_addr a{};
  if (inet_pton(AF_INET, text.c_str(), &a) != 1) return std::nullopt;
  return ntohl(a.s_addr);
}

std::string format_ipv4(uint32_t ip) {
  in_addr a{htonl(ip)};
  char buf[INET_ADDRSTRLEN];
  inet_ntop(AF_INET, &a, buf, sizeof(buf));
  return buf;
}

void ipv4_to_gid(uint32_t ip, uint8_t gid[16]) {
  std::memset(gid, 0, 16);
  gid[10] = 0xff;
  gid[11] = 0xff;
  gid[12] = static_cast<uint8_t>(ip >> 24);
  gid[13] = static_cast<uint8_t>(ip >> 16);
  gid[14] = static_cast<uint8_t>(ip >> 8);
  gid[15] = static_cast<uint8_t>(ip);
}

std::optional<uint32_t> gid_to_ipv4(const uint8_t gid[16]) {
  for (int i = 0; i < 10; ++i)
    if (gid[i] != 0) return std::nullopt;
  if (gid[10] != 0xff || gid[11] != 0xff) return std::nullopt;
  return (uint32_t{gid[12]} << 24) | (uint32_t{gid[13]} << 16) | (uint32_t{gid[14]} << 8) |
         uint32_t{gid[15]};
}

std::optional<Limits> parse_limits(const std::string& text, const Limits& base, std::string* err) {
  Limits l = base;
  size_t i = 0;
  while (i <= text.size()) {
    size_t end = text.find(',', i);
    if (end == std::string::npos) end = text.size();
    const std::string item = text.substr(i, end - i);
    const size_t eq = item.find('=');
    const std::string key = item.substr(0, eq);
    uint32_t* field = key == "qp" ? &l.qp : key == "cq" ? &l.cq : key == "srq" ? &l.srq
                    : key == "pd" ? &l.pd : key == "mr" ? &l.mr : key == "ring-mib" ? &l.ring_mib
                    : nullptr;
    uint32_t v = 0;
    if (!field || eq == std::string::npos || !parse_uint(item.substr(eq + 1), v) || v == 0) {
      if (err) {
        *err = "bad limit '" + item + "': expected qp, cq, srq, pd, mr or ring-mib = a positive number";
      }
      return std::nullopt;
    }
    *field = v;
    i = end + 1;
  }
  return l;
}

std::string format_limits(const Limits& l) {
  std::string s = "qp=" + std::to_string(l.qp) + ",cq=" + std::to_string(l.cq) +
                  ",srq=" + std::to_string(l.srq) + ",pd=" + std::to_string(l.pd) +
                  ",mr=" + std::to_string(l.mr);
  if (l.ring_mib) s += ",ring-mib=" + std::to_string(l.ring_mib);
  return s;
}

std::optional<LinkConfig> LinkConfig::load(const std::string& path, std::string* err) {
  std::ifstream in(path);
  if (!in) {
    if (err) *err = path + ": " + std::strerror(errno);
    return std::nullopt;
  }
  std::ostringstream text;
  text << in.rdbuf();
  auto c = parse(text.str(), path, err);
  if (!c) return c;
  // <run dir>/sys/class/infiniband/<name>/metaroce.conf -> <run dir>
  const std::string tail = "/sys/class/infiniband/" + c->name + "/" + kConfigFile;
  if (path.size() > tail.size() && path.compare(path.size() - tail.size(), tail.size(), tail) == 0)
    c->run_dir = path.substr(0, path.size() - tail.size());
  return c;
}

std::optional<LinkConfig> LinkConfig::parse(const std::string& text, const std::string& origin,
                                            std::string* err) {
  std::istringstream in(text);
  LinkConfig c;
  std::string line;
  int lineno = 0;
  auto fail = [&](const std::string& why) {
    if (err) *err = origin + ":" + std::to_string(lineno) + ": " + why;
    return std::nullopt;
  };
  while (std::getline(in, line)) {
    ++lineno;
    if (line.empty() || line[0] == '#') continue;
    auto eq = line.find('=');
    if (eq == std::string::npos) return fail("expected key=value");
    std::string key = line.substr(0, eq), val = line.substr(eq + 1);
    bool ok = true;
    if (key == "name") {
      c.name = val;
    } else if (key == "devargs") {
      c.devargs = val;
    } else if (key == "ip") {
      auto ip = parse_ipv4(val);
      ok = ip.has_value();
      if (ok) c.ip = *ip;
    } else if (key == "prefix") {
      ok = parse_uint(val, c.prefix) && c.prefix >= 1 && c.prefix <= 32;
    } else if (key == "mtu") {
      ok = parse_uint(val, c.mtu);
    } else if (key == "udp_port") {
      ok = parse_uint(val, c.udp_port);
    } else if (key == "paths") {
      ok = parse_uint(val, c.paths) && c.paths >= 1 && c.paths <= 256;
    } else if (key == "node_guid") {
      ok = parse_uint(val, c.node_guid, 16);
    } else if (key == "rx_capacity_mbps") {
      ok = parse_uint(val, c.rx_capacity_mbps);
    } else if (key == "uverbs") {
      c.uverbs = val;
    } else if (key == "kernel") {
      c.kernel = val;
    } else if (key == "planes") {
      ok = parse_uint(val, c.planes) && c.planes >= 1 && c.planes <= kMaxPlanes;
    } else if (key == "limits" || key == "process_limits") {
      auto l = parse_limits(val, Limits{}, nullptr);
      ok = l.has_value();
      if (ok) (key == "limits" ? c.limits : c.process_limits) = *l;
    }  // unknown keys are ignored so older providers read newer files
    if (!ok) return fail("bad value for " + key + ": '" + val + "'");
  }
  if (c.name.empty() || c.devargs.empty() || c.ip == 0) return fail("name, devargs and ip are required");
  const auto parts = 1 + std::count(c.devargs.begin(), c.devargs.end(), kPlaneSeparator);
  if (parts != c.planes)
    return fail("planes=" + std::to_string(c.planes) + " but devargs holds " +
                std::to_string(parts) + " device string(s)");
  return c;
}

std::string LinkConfig::to_text() const {
  std::ostringstream o;
  o << "# MetaRoCE link, written by `metaroce link add`\n"
    << "name=" << name << "\n"
    << "devargs=" << devargs << "\n"
    << "ip=" << format_ipv4(ip) << "\n"
    << "prefix=" << unsigned{prefix} << "\n"
    << "mtu=" << mtu << "\n"
    << "udp_port=" << udp_port << "\n"
    << "paths=" << paths << "\n"
    << "node_guid=0x" << std::hex << node_guid << std::dec << "\n"
    << "uverbs=" << uverbs << "\n"
    << "planes=" << planes << "\n";
  if (rx_capacity_mbps) o << "rx_capacity_mbps=" << rx_capacity_mbps << "\n";
  if (!kernel.empty()) o << "kernel=" << kernel << "\n";
  if (!(limits == Limits{})) o << "limits=" << format_limits(limits) << "\n";
  if (!(process_limits == Limits{})) o << "process_limits=" << format_limits(process_limits) << "\n";
  return o.str();
}

bool LinkConfig::save(const std::string& path, std::string* err) const {
  std::string tmp = path + ".tmp";
  FILE* f = std::fopen(tmp.c_str(), "w");
  if (!f) {
    if (err) *err = tmp + ": " + std::strerror(errno);
    return false;
  }
  const std::string s = to_text();
  bool ok = std::fwrite(s.data(), 1, s.size(), f) == s.size();
  ok = (std::fclose(f) == 0) && ok;
  if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
    if (err) *err = path + ": " + std::strerror(errno);
    std::remove(tmp.c_str());
    return false;
  }
  return true;
}

}  // namespace metaroce::nic

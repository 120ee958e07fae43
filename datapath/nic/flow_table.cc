// SPDX-License-Identifier: Apache-2.0
// Header parsing, rule matching and steering of raw frames.
#include "datapath/nic/flow_table.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <new>

namespace metaroce::nic {
namespace {

constexpr uint16_t kEthIpv4 = 0x0800, kEthIpv6 = 0x86dd, kEthVlan = 0x8100;
constexpr uint8_t kTcp = 6, kUdp = 17;

uint16_t be16(const uint8_t* p) { return static_cast<uint16_t>(p[0] << 8 | p[1]); }
// The bytes of a network-order field as a frame holds them, in a host integer's memory.
uint16_t raw16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

bool masked_eq(const uint8_t* v, const uint8_t* m, const uint8_t* f, size_t n) {
  for (size_t i = 0; i < n; ++i)
    if ((v[i] & m[i]) != (f[i] & m[i])) return false;
  return true;
}
template <typename T>
bool masked_eq(T v, T m, T f) {
  return (v & m) == (f & m);
}

bool all_zero(const uint8_t* p, size_t n) {
  return std::all_of(p, p + n, [](uint8_t b) { return b == 0; });
}

}  // namespace

std::optional<FrameHeaders> parse_headers(std::span<const uint8_t> frame) {
  if (frame.size() < 14) return std::nullopt;
  FrameHeaders h;
  const uint8_t* p = frame.data();
  std::memcpy(h.dst_mac, p, 6);
  std::memcpy(h.src_mac, p + 6, 6);
  size_t off = 12;
  if (be16(p + off) == kEthVlan && frame.size() >= 18) {
    h.has_vlan = true;
    h.vlan_tag = raw16(p + 14);
    off = 16;
  }
  h.ether_type = raw16(p + off);
  off += 2;
  const uint16_t et = be16(p + off - 2);
  const size_t n = frame.size();
  size_t l4_off = 0;
  if (et == kEthIpv4 && n >= off + 20 && (p[off] >> 4) == 4 && (p[off] & 0xf) >= 5) {
    h.l3 = 4;
    h.tos = p[off + 1];
    h.ip_flags = p[off + 6] >> 5;
    h.ttl = p[off + 8];
    h.proto = p[off + 9];
    std::memcpy(h.src_ip, p + off + 12, 4);
    std::memcpy(h.dst_ip, p + off + 16, 4);
    l4_off = off + size_t{p[off] & 0xfu} * 4;
  } else if (et == kEthIpv6 && n >= off + 40 && (p[off] >> 4) == 6) {
    h.l3 = 6;
    h.tos = static_cast<uint8_t>((p[off] << 4) | (p[off + 1] >> 4));
    const uint8_t fl[4] = {0, static_cast<uint8_t>(p[off + 1] & 0xf), p[off + 2], p[off + 3]};
    std::memcpy(&h.flow_label, fl, 4);
    h.proto = p[off + 6];
    h.ttl = p[off + 7];
    std::memcpy(h.src_ip, p + off + 8, 16);
    std::memcpy(h.dst_ip, p + off + 24, 16);
    l4_off = off + 40;
  }
  if (h.l3 && (h.proto == kTcp || h.proto == kUdp) && n >= l4_off + 4) {
    h.l4 = h.proto;
    h.src_port = raw16(p + l4_off);
    h.dst_port = raw16(p + l4_off + 2);
  }
  return h;
}

bool matches(const hostif::FlowRule& r, const FrameHeaders& h) {
  if (!masked_eq(r.dst_mac, r.dst_mac_mask, h.dst_mac, 6) ||
      !masked_eq(r.src_mac, r.src_mac_mask, h.src_mac, 6) ||
      !masked_eq(r.ether_type, r.ether_type_mask, h.ether_type))
    return false;
  if (r.vlan_tag_mask && (!h.has_vlan || !masked_eq(r.vlan_tag, r.vlan_tag_mask, h.vlan_tag)))
    return false;
  if (r.l3 && r.l3 != h.l3) return false;
  if (r.l4 && r.l4 != h.l4) return false;
  return masked_eq(r.proto, r.proto_mask, h.proto) && masked_eq(r.tos, r.tos_mask, h.tos) &&
         masked_eq(r.ttl, r.ttl_mask, h.ttl) &&
         masked_eq(r.ip_flags, r.ip_flags_mask, h.ip_flags) &&
         masked_eq(r.src_ip, r.src_ip_mask, h.src_ip, 16) &&
         masked_eq(r.dst_ip, r.dst_ip_mask, h.dst_ip, 16) &&
         masked_eq(r.flow_label, r.flow_label_mask, h.flow_label) &&
         masked_eq(r.src_port, r.src_port_mask, h.src_port) &&
         masked_eq(r.dst_port, r.dst_port_mask, h.dst_port);
}

uint32_t toeplitz(std::span<const uint8_t> key, std::span<const uint8_t> input) {
  uint32_t result = 0;
  // The 32-bit window of the key at the current bit, shifted left one bit per input bit.
  uint32_t window = 0;
  for (size_t i = 0; i < 4; ++i) window = (window << 8) | (i < key.size() ? key[i] : 0);
  size_t next = 4;  // the key byte that feeds the window next
  for (uint8_t byte : input) {
    const uint8_t feed = next < key.size() ? key[next] : 0;
    ++next;
    for (int bit = 7; bit >= 0; --bit) {
      if (byte & (1u << bit)) result ^= window;
      window = (window << 1) | ((feed >> bit) & 1u);
    }
  }
  return result;
}

size_t rss_input(const FrameHeaders& h, uint64_t fields, uint8_t* out) {
  size_t n = 0;
  auto put = [&](const void* p, size_t len) {
    std::memcpy(out + n, p, len);
    n += len;
  };
  if (h.l3 == 4) {
    if (fields & hostif::kRssSrcIpv4) put(h.src_ip, 4);
    if (fields & hostif::kRssDstIpv4) put(h.dst_ip, 4);
  } else if (h.l3 == 6) {
    if (fields & hostif::kRssSrcIpv6) put(h.src_ip, 16);
    if (fields & hostif::kRssDstIpv6) put(h.dst_ip, 16);
  }
  uint64_t src = 0, dst = 0;
  if (h.l4 == kTcp) {
    src = hostif::kRssSrcPortTcp;
    dst = hostif::kRssDstPortTcp;
  } else if (h.l4 == kUdp) {
    src = hostif::kRssSrcPortUdp;
    dst = hostif::kRssDstPortUdp;
  }
  if (src && (fields & src)) put(&h.src_port, 2);
  if (dst && (fields & dst)) put(&h.dst_port, 2);
  return n;
}

bool rule_valid(const hostif::FlowRule& r) {
  // IP fields need an IP header, ports a transport header; IPv4 addresses are 4 bytes.
  const bool ip_fields = r.proto_mask || r.tos_mask || r.ttl_mask || r.ip_flags_mask ||
                         !all_zero(r.src_ip_mask, 16) || !all_zero(r.dst_ip_mask, 16) ||
                         r.flow_label_mask;
  if (ip_fields && !r.l3) return false;
  if ((r.src_port_mask || r.dst_port_mask) && !r.l4) return false;
  if (r.l3 != 0 && r.l3 != 4 && r.l3 != 6) return false;
  if (r.l4 != 0 && r.l4 != kTcp && r.l4 != kUdp) return false;
  if (r.l3 == 4 && (!all_zero(r.src_ip_mask + 4, 12) || !all_zero(r.dst_ip_mask + 4, 12) ||
                    r.flow_label_mask))
    return false;
  if (r.l3 == 4 && (r.ip_flags_mask & ~7u)) return false;
  if (r.l3 == 6 && r.ip_flags_mask) return false;
  return true;
}

int FlowTable::add(const Flow& f, uint32_t* id) {
  try {
    Flow n = f;
    while (next_id_ == 0 || find(next_id_)) ++next_id_;
    n.id = next_id_++;
    // Stable by priority: equal priorities keep their creation order.
    auto at = std::upper_bound(flows_.begin(), flows_.end(), n.priority,
                               [](uint32_t p, const Flow& x) { return p < x.priority; });
    flows_.insert(at, n);
    *id = n.id;
    return 0;
  } catch (const std::bad_alloc&) {
    return ENOMEM;
  }
}

bool FlowTable::remove(uint32_t id) {
  auto it = std::find_if(flows_.begin(), flows_.end(), [id](const Flow& f) { return f.id == id; });
  if (it == flows_.end()) return false;
  flows_.erase(it);
  return true;
}

const FlowTable::Flow* FlowTable::find(uint32_t id) const {
  for (const Flow& f : flows_)
    if (f.id == id) return &f;
  return nullptr;
}

uint32_t FlowTable::count_of(uint32_t qpn) const {
  uint32_t n = 0;
  for (const Flow& f : flows_) n += f.qpn == qpn;
  return n;
}

void FlowTable::remove_qp(uint32_t qpn) {
  std::erase_if(flows_, [qpn](const Flow& f) { return f.qpn == qpn; });
}

void FlowTable::steer(const FrameHeaders& h, std::vector<uint32_t>* qpns) const {
  auto add = [qpns](uint32_t qpn) {
    if (std::find(qpns->begin(), qpns->end(), qpn) == qpns->end()) qpns->push_back(qpn);
  };
  for (const Flow& f : flows_)
    if (f.type == hostif::FlowType::kSniffer) add(f.qpn);
  bool taken = false;
  bool trapped = false;
  uint32_t level = 0;
  for (const Flow& f : flows_) {
    if (f.type != hostif::FlowType::kNormal) continue;
    if (trapped && f.priority != level) break;  // a taker at a better priority traps it
    if (!matches(f.rule, h)) continue;
    add(f.qpn);
    taken = true;
    if (!f.dont_trap) {
      trapped = true;
      level = f.priority;
    }
  }
  if (taken) return;
  const bool multicast = h.dst_mac[0] & 1;
  for (const Flow& f : flows_) {
    if (f.type == hostif::FlowType::kAllDefault ||
        (f.type == hostif::FlowType::kMcDefault && multicast))
      add(f.qpn);
  }
}

}  // namespace metaroce::nic

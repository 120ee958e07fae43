// SPDX-License-Identifier: Apache-2.0
// ibv_create_flow's specifications (verbs-mapping.md §18), checked and normalised into the one
// rule the engine matches frames against. Pure, so tested alone.
#pragma once

#include <infiniband/verbs.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "datapath/hostif/control.h"

namespace metaroce::provider {

namespace flow_detail {

template <typename T>
bool read_spec(const uint8_t* p, size_t left, T* out) {
  if (left < sizeof(T)) return false;
  std::memcpy(out, p, sizeof(T));
  return out->size >= sizeof(T) && out->size <= left;
}

inline void set_l3(hostif::FlowRule& r, uint8_t l3, bool* bad) {
  if (r.l3 && r.l3 != l3) *bad = true;  // an IPv4 and an IPv6 header at once
  r.l3 = l3;
}

// An IPv4 specification's addresses (IPV4 and IPV4_EXT begin alike).
template <typename Spec>
void set_ipv4(hostif::FlowRule& r, const Spec& s, bool* bad) {
  set_l3(r, 4, bad);
  std::memcpy(r.src_ip, &s.val.src_ip, 4);
  std::memcpy(r.src_ip_mask, &s.mask.src_ip, 4);
  std::memcpy(r.dst_ip, &s.val.dst_ip, 4);
  std::memcpy(r.dst_ip_mask, &s.mask.dst_ip, 4);
}

}  // namespace flow_detail

// The specifications following attr, as one rule: 0, EINVAL (malformed, contradictory, a mask
// the NIC cannot apply) or EOPNOTSUPP (a kind of specification or flag not offered).
inline int parse_flow(const ibv_flow_attr& attr, hostif::CreateFlowReq* out) noexcept {
  if (attr.comp_mask) return EINVAL;
  if (attr.port != 1) return EINVAL;
  if (attr.flags & IBV_FLOW_ATTR_FLAGS_EGRESS) return EOPNOTSUPP;  // no egress rules
  if (attr.flags & ~uint32_t{IBV_FLOW_ATTR_FLAGS_DONT_TRAP}) return EINVAL;
  if (attr.type > IBV_FLOW_ATTR_SNIFFER) return EINVAL;
  // ibv_create_flow(3): only rules of specifications let a frame on to lower priorities.
  if ((attr.flags & IBV_FLOW_ATTR_FLAGS_DONT_TRAP) && attr.type != IBV_FLOW_ATTR_NORMAL)
    return EINVAL;
  hostif::CreateFlowReq req;
  req.type = static_cast<hostif::FlowType>(attr.type);
  req.priority = attr.priority;
  req.flags = (attr.flags & IBV_FLOW_ATTR_FLAGS_DONT_TRAP) ? uint32_t{hostif::kFlowDontTrap} : 0u;
  hostif::FlowRule& r = req.rule;
  // The specifications follow the attribute, each sized by its header. A well-formed list fits
  // the size the caller gave (when it gave one).
  const auto* p = reinterpret_cast<const uint8_t*>(&attr) + sizeof(attr);
  size_t left = attr.size > sizeof(attr) ? attr.size - sizeof(attr) : 64 * 1024;
  bool bad = false;
  for (uint8_t i = 0; i < attr.num_of_specs; ++i) {
    struct {
      ibv_flow_spec_type type;
      uint16_t size;
    } hdr;
    if (left < sizeof(hdr)) return EINVAL;
    std::memcpy(&hdr, p, sizeof(hdr));
    if (hdr.size < sizeof(hdr) || hdr.size > left) return EINVAL;
    if (hdr.type & IBV_FLOW_SPEC_INNER) return EOPNOTSUPP;  // no tunnels
    switch (hdr.type) {
      case IBV_FLOW_SPEC_ETH: {
        ibv_flow_spec_eth s;
        if (!flow_detail::read_spec(p, left, &s)) return EINVAL;
        std::memcpy(r.dst_mac, s.val.dst_mac, 6);
        std::memcpy(r.dst_mac_mask, s.mask.dst_mac, 6);
        std::memcpy(r.src_mac, s.val.src_mac, 6);
        std::memcpy(r.src_mac_mask, s.mask.src_mac, 6);
        r.ether_type = s.val.ether_type;
        r.ether_type_mask = s.mask.ether_type;
        r.vlan_tag = s.val.vlan_tag;
        r.vlan_tag_mask = s.mask.vlan_tag;
        break;
      }
      case IBV_FLOW_SPEC_IPV4: {
        ibv_flow_spec_ipv4 s;
        if (!flow_detail::read_spec(p, left, &s)) return EINVAL;
        flow_detail::set_ipv4(r, s, &bad);
        break;
      }
      case IBV_FLOW_SPEC_IPV4_EXT: {
        ibv_flow_spec_ipv4_ext s;
        if (!flow_detail::read_spec(p, left, &s)) return EINVAL;
        flow_detail::set_ipv4(r, s, &bad);
        r.proto = s.val.proto;
        r.proto_mask = s.mask.proto;
        r.tos = s.val.tos;
        r.tos_mask = s.mask.tos;
        r.ttl = s.val.ttl;
        r.ttl_mask = s.mask.ttl;
        r.ip_flags = s.val.flags;
        r.ip_flags_mask = s.mask.flags;
        break;
      }
      case IBV_FLOW_SPEC_IPV6: {
        ibv_flow_spec_ipv6 s;
        if (!flow_detail::read_spec(p, left, &s)) return EINVAL;
        flow_detail::set_l3(r, 6, &bad);
        std::memcpy(r.src_ip, s.val.src_ip, 16);
        std::memcpy(r.src_ip_mask, s.mask.src_ip, 16);
        std::memcpy(r.dst_ip, s.val.dst_ip, 16);
        std::memcpy(r.dst_ip_mask, s.mask.dst_ip, 16);
        r.flow_label = s.val.flow_label;
        r.flow_label_mask = s.mask.flow_label;
        r.proto = s.val.next_hdr;
        r.proto_mask = s.mask.next_hdr;
        r.tos = s.val.traffic_class;
        r.tos_mask = s.mask.traffic_class;
        r.ttl = s.val.hop_limit;
        r.ttl_mask = s.mask.hop_limit;
        break;
      }
      case IBV_FLOW_SPEC_TCP:
      case IBV_FLOW_SPEC_UDP: {
        ibv_flow_spec_tcp_udp s;
        if (!flow_detail::read_spec(p, left, &s)) return EINVAL;
        const uint8_t l4 = hdr.type == IBV_FLOW_SPEC_TCP ? 6 : 17;
        if (r.l4 && r.l4 != l4) bad = true;
        r.l4 = l4;
        r.src_port = s.val.src_port;
        r.src_port_mask = s.mask.src_port;
        r.dst_port = s.val.dst_port;
        r.dst_port_mask = s.mask.dst_port;
        break;
      }
      default:
        // ESP, tunnels, GRE, MPLS and actions (tag, drop, counters) are not offered.
        return EOPNOTSUPP;
    }
    p += hdr.size;
    left -= hdr.size;
  }
  // A port rule names its protocol; one that says which must also be IP.
  if (r.l4 && !r.l3) bad = true;
  if (bad) return EINVAL;
  *out = req;
  return 0;
}

}  // namespace metaroce::provider

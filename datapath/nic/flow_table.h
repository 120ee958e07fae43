// SPDX-License-Identifier: Apache-2.0
// Flow steering of raw Ethernet frames (docs/spec/verbs-mapping.md §18): the headers of a frame
// as rules see them, whether a rule matches them, and the table of a link's rules in the order
// they are tried.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "datapath/hostif/control.h"

namespace metaroce::nic {

// What a rule can look at in a frame; multi-byte fields as the frame holds them (network order).
struct FrameHeaders {
  uint8_t dst_mac[6] = {}, src_mac[6] = {};
  uint16_t ether_type = 0;  // after any VLAN tag
  bool has_vlan = false;
  uint16_t vlan_tag = 0;
  uint8_t l3 = 0;           // 4, 6, or 0 (another ether type, or a header cut short)
  uint8_t proto = 0, tos = 0, ttl = 0, ip_flags = 0;
  uint8_t src_ip[16] = {}, dst_ip[16] = {};  // IPv4: the first 4 bytes
  uint32_t flow_label = 0;  // IPv6, network order
  uint8_t l4 = 0;           // 6, 17, or 0
  uint16_t src_port = 0, dst_port = 0;
};

// The headers of an Ethernet frame, or nothing when it is shorter than an Ethernet header. An
// IP header is read whatever its checksum (steering does not verify it); one cut short leaves
// l3 (or l4) 0.
std::optional<FrameHeaders> parse_headers(std::span<const uint8_t> frame);

bool matches(const hostif::FlowRule& rule, const FrameHeaders& h);

// RSS (verbs-mapping.md §18): the Toeplitz hash of input under key (Microsoft's RSS function:
// for every input bit set, the 32 key bits starting at that bit's position, XORed), and the
// input a frame gives for the fields (hostif::RssField): source then destination address of
// its IP version, then source then destination port of its transport, those the fields name
// and the frame has. Returns the input's length (at most 36 bytes).
uint32_t toeplitz(std::span<const uint8_t> key, std::span<const uint8_t> input);
size_t rss_input(const FrameHeaders& h, uint64_t fields, uint8_t* out);

// Whether a NIC can apply the rule as asked (verbs-mapping.md §18): IP fields need an IP
// version, ports a transport, an IPv4 rule says nothing past 4 address bytes. Masks may be
// partial (rdma-core's tests mask a MAC with itself).
bool rule_valid(const hostif::FlowRule& rule);

class FlowTable {
 public:
  struct Flow {
    uint32_t id = 0;
    uint32_t qpn = 0;
    hostif::FlowType type = hostif::FlowType::kNormal;
    uint32_t priority = 0;
    bool dont_trap = false;
    hostif::FlowRule rule;
  };
  // 0 or ENOMEM; *id the new flow's.
  int add(const Flow& f, uint32_t* id);
  bool remove(uint32_t id);
  const Flow* find(uint32_t id) const;
  // QPs the frame goes to, in the order of their flows, each once: every sniffer; the normal
  // flows that match at the best priority with one (and, past a DONT_TRAP flow, at the next
  // priority too); if no normal flow took it, the default flows (multicast ones only for a
  // multicast destination).
  void steer(const FrameHeaders& h, std::vector<uint32_t>* qpns) const;
  // Flows attached to qpn.
  uint32_t count_of(uint32_t qpn) const;
  void remove_qp(uint32_t qpn);
  size_t size() const { return flows_.size(); }

 private:
  std::vector<Flow> flows_;  // by priority, then creation
  uint32_t next_id_ = 1;
};

}  // namespace metaroce::nic

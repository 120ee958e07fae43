// SPDX-License-Identifier: Apache-2.0
// Links (with PFC when asked), ECMP switches and the leaf-spine and fat-tree topologies of the
// simulator.
#include "sim/network.h"

#include <algorithm>

namespace metaroce::sim {

uint32_t Link::backlog() const {
  const Ns ahead = busy_until_ - q_.now();
  // Without PFC all of it; with PFC what is left of the frame being sent, then the FIFO.
  const uint32_t sending =
      ahead <= 0 ? 0 : static_cast<uint32_t>(static_cast<double>(ahead) * p_.gbps / 8);
  return p_.pfc.on ? static_cast<uint32_t>(fifo_bytes_) + sending : sending;
}

Ns Link::drains_to(uint32_t bytes) const {
  const uint32_t b = backlog();
  if (b <= bytes) return q_.now();
  return q_.now() + static_cast<Ns>((b - bytes) * 8 / p_.gbps) + 1;
}

// A packet that joins the queue: CE-marked if more than the marking threshold is ahead of it,
// and counted.
void Link::admit(Packet& pkt, uint32_t ahead, uint32_t size) {
  if (ahead > p_.ecn_bytes) {
    pkt.ce = true;
    ++c_.ce_marked;
  }
  c_.max_backlog = std::max(c_.max_backlog, ahead + size);
  ++c_.packets;
  c_.bytes += size;
}

void Link::send(Packet&& pkt) {
  if (p_.pfc.on) {
    send_fifo(std::move(pkt));
    return;
  }
  if (!up_) {
    ++c_.drop_down;
    return;
  }
  const uint32_t size = pkt.wire_bytes();
  const uint32_t ahead = backlog();
  if (ahead + size > p_.queue_bytes) {
    ++c_.drop_queue;
    return;
  }
  if (p_.loss > 0 && rng_.uniform() < p_.loss) {
    ++c_.drop_loss;
    return;
  }
  admit(pkt, ahead, size);
  const Ns start = std::max(q_.now(), busy_until_);
  busy_until_ = start + static_cast<Ns>(size * 8 / p_.gbps);
  const Ns arrival = busy_until_ + p_.delay_ns;
  auto shared = std::make_shared<Packet>(std::move(pkt));
  Node* to = to_;
  Link* self = this;
  q_.at(arrival, [to, self, shared] {
    // A link that failed while the packet was on it loses it.
    if (!self->up_) {
      ++self->c_.drop_down;
      return;
    }
    to->receive(std::move(*shared));
  });
}

// What may arrive over this link once its far end has sent PAUSE: the frame that crossed xoff,
// a link delay of line rate while the PAUSE travels, the frame the transmitter had begun, and
// the link delay of bytes already on the wire.
uint32_t Link::headroom_limit() const {
  const auto wire = static_cast<uint32_t>(static_cast<double>(p_.delay_ns) * p_.gbps / 8);
  return p_.pfc.xoff_bytes + 2 * wire + 2 * PfcParams::kMaxFrame;
}

void Link::send_fifo(Packet&& pkt) {
  if (!up_) {
    ++c_.drop_down;
    return;
  }
  const uint32_t size = pkt.wire_bytes();
  // Lossless: a switch holds what its upstream link brought, up to that link's headroom (a
  // packet past it is a sizing bug, counted so that it shows); a host's NIC holds what its
  // transport committed (the transport stops at kNicQueue).
  if (Link* in = pkt.via) {
    if (in->held_ + size > in->headroom_limit()) {
      ++c_.drop_queue;
      ++in->c_.drop_headroom;
      return;
    }
  }
  if (p_.loss > 0 && rng_.uniform() < p_.loss) {
    ++c_.drop_loss;
    return;
  }
  admit(pkt, backlog(), size);
  if (pkt.via) pkt.via->hold(size);
  fifo_bytes_ += size;
  fifo_.push_back(std::move(pkt));
  if (!tx_busy_ && !paused_) start_tx();
}

void Link::start_tx() {
  on_tx_ = std::move(fifo_.front());
  fifo_.pop_front();
  const uint32_t size = on_tx_.wire_bytes();
  fifo_bytes_ -= size;
  tx_busy_ = true;
  busy_until_ = q_.now() + static_cast<Ns>(size * 8 / p_.gbps);
  q_.at(busy_until_, [this] { tx_done(); });
}

void Link::tx_done() {
  Packet pkt = std::move(on_tx_);
  tx_busy_ = false;
  // Its last bit has left: the switch it waited in frees its buffer.
  if (pkt.via) pkt.via->release(pkt.wire_bytes());
  if (up_) {
    auto shared = std::make_shared<Packet>(std::move(pkt));
    q_.at(q_.now() + p_.delay_ns, [this, shared] { arrive(shared); });
  } else {
    ++c_.drop_down;
  }
  if (!fifo_.empty() && !paused_) start_tx();
}

void Link::arrive(std::shared_ptr<Packet> pkt) {
  if (!up_) {
    ++c_.drop_down;
    return;
  }
  pkt->via = this;
  to_->receive(std::move(*pkt));
}

void Link::hold(uint32_t bytes) {
  held_ += bytes;
  c_.max_held = std::max(c_.max_held, held_);
  if (!xoff_sent_ && held_ > p_.pfc.xoff_bytes) {
    xoff_sent_ = true;
    ++c_.pause_frames;
    q_.at(q_.now() + p_.delay_ns, [this] { set_paused(true); });
  }
}

void Link::release(uint32_t bytes) {
  held_ -= bytes;
  if (xoff_sent_ && held_ <= p_.pfc.xon_bytes) {
    xoff_sent_ = false;
    q_.at(q_.now() + p_.delay_ns, [this] { set_paused(false); });
  }
}

void Link::set_paused(bool paused) {
  if (paused == paused_) return;
  paused_ = paused;
  if (paused) {
    paused_since_ = q_.now();
    return;
  }
  paused_ns_ += q_.now() - paused_since_;
  if (!tx_busy_ && !fifo_.empty()) start_tx();
}

void Switch::route(uint32_t dst_ip, std::vector<Link*> links) {
  auto it = std::lower_bound(routes_.begin(), routes_.end(), dst_ip,
                             [](const auto& r, uint32_t ip) { return r.first < ip; });
  routes_.insert(it, {dst_ip, std::move(links)});
}

void Switch::receive(Packet&& p) {
  auto it = std::lower_bound(routes_.begin(), routes_.end(), p.dst_ip,
                             [](const auto& r, uint32_t ip) { return r.first < ip; });
  const std::vector<Link*>* cand = (it != routes_.end() && it->first == p.dst_ip) ? &it->second
                                                                                 : &default_;
  if (cand->empty()) return;
  // ECMP: a hash of the 5-tuple (UDP, fixed destination port) and this switch's seed.
  uint64_t h = seed_ ^ (uint64_t{p.src_ip} << 32 | p.dst_ip);
  h ^= uint64_t{p.sport} * 0x9e3779b97f4a7c15ull;
  h ^= h >> 29;
  h *= 0xbf58476d1ce4e5b9ull;
  h ^= h >> 32;
  (*cand)[h % cand->size()]->send(std::move(p));
}

// The far end of a host's downlink: hands what arrives to the endpoint attached to the host.
class Topology::HostPort final : public Node {
 public:
  HostPort(Topology& t, uint32_t host) : t_(t), host_(host) {}
  void receive(Packet&& p) override {
    if (Node* n = t_.hosts_nodes_[host_]) n->receive(std::move(p));
  }

 private:
  Topology& t_;
  uint32_t host_;
};

Topology::Topology(EventQueue& q, Rng& rng, const TopologyParams& p)
    : q_(q), rng_(rng), hosts_(p.hosts) {
  hosts_nodes_.assign(p.hosts, nullptr);
  up_.assign(size_t{p.hosts} * p.planes, nullptr);
  core_.resize(p.planes);
  for (uint32_t h = 0; h < p.hosts; ++h) ports_.push_back(std::make_unique<HostPort>(*this, h));
  if (p.kind == TopologyKind::kFatTree) build_fat_tree(p);
  else build_leaf_spine(p);
}

Link* Topology::link(const LinkParams& lp, Node* to, std::string name) {
  links_.push_back(std::make_unique<Link>(q_, rng_, lp, to, std::move(name)));
  return links_.back().get();
}

void Topology::build_leaf_spine(const TopologyParams& p) {
  const uint32_t leaves = (p.hosts + p.hosts_per_leaf - 1) / p.hosts_per_leaf;
  for (uint32_t pl = 0; pl < p.planes; ++pl) {
    const std::string pn = "p" + std::to_string(pl) + ".";
    std::vector<Switch*> leaf, spine;
    for (uint32_t l = 0; l < leaves; ++l) {
      switches_.push_back(std::make_unique<Switch>(p.seed * 1000003 + pl * 1009 + l));
      leaf.push_back(switches_.back().get());
    }
    for (uint32_t s = 0; s < p.spines; ++s) {
      switches_.push_back(std::make_unique<Switch>(p.seed * 1000003 + pl * 1009 + 500 + s));
      spine.push_back(switches_.back().get());
    }
    // leaf l -> spine s and back, `parallel` links each way.
    std::vector<std::vector<Link*>> leaf_up(leaves), spine_down(size_t{p.spines} * leaves);
    for (uint32_t l = 0; l < leaves; ++l) {
      for (uint32_t s = 0; s < p.spines; ++s) {
        for (uint32_t k = 0; k < p.parallel; ++k) {
          const std::string id = std::to_string(l) + "-" + std::to_string(s) + "." + std::to_string(k);
          Link* u = link(p.fabric_link, spine[s], pn + "up" + id);
          Link* d = link(p.fabric_link, leaf[l], pn + "down" + id);
          leaf_up[l].push_back(u);
          spine_down[s * leaves + l].push_back(d);
          core_[pl].push_back(u);
          core_[pl].push_back(d);
        }
      }
    }
    for (uint32_t h = 0; h < p.hosts; ++h) {
      const uint32_t l = h / p.hosts_per_leaf;
      up_[pl * p.hosts + h] = link(p.host_link, leaf[l], pn + "host" + std::to_string(h) + ".up");
      Link* down = link(p.host_link, ports_[h].get(), pn + "host" + std::to_string(h) + ".down");
      leaf[l]->route(ip_of(h), {down});
      for (uint32_t s = 0; s < p.spines; ++s) spine[s]->route(ip_of(h), spine_down[s * leaves + l]);
    }
    for (uint32_t l = 0; l < leaves; ++l) leaf[l]->set_default(leaf_up[l]);
  }
}

// Al-Fares et al. 2008, section 3: pod p holds edge switches (p, e) and aggregation switches
// (p, a), e, a < k/2, every edge joined to every aggregation switch of its pod; aggregation
// switch (p, a) joins cores a*k/2 .. a*k/2 + k/2 - 1; host h sits on edge (h / (k/2)^2,
// h % (k/2)^2 / (k/2)). The paper's two-level tables become: up by ECMP until a switch has the
// destination below it, then down along the one way there.
void Topology::build_fat_tree(const TopologyParams& p) {
  const uint32_t k = p.k, half = k / 2, per_pod = half * half;
  for (uint32_t pl = 0; pl < p.planes; ++pl) {
    const std::string pn = "p" + std::to_string(pl) + ".";
    // Each switch's ECMP seed drawn from one generator: unrelated seeds, so that a switch's
    // choice does not repeat the one above or below it (no polarisation).
    Rng seeds(p.seed * 1000003 + uint64_t{pl} * 100003);
    std::vector<Switch*> edge, agg, core;  // edge[pod * half + e], agg[pod * half + a]
    auto make = [&](std::vector<Switch*>& v, uint32_t n) {
      for (uint32_t i = 0; i < n; ++i) {
        switches_.push_back(std::make_unique<Switch>(seeds.next()));
        v.push_back(switches_.back().get());
      }
    };
    make(edge, k * half);
    make(agg, k * half);
    make(core, per_pod);
    // agg_down[(p * half + a) * half + e]: aggregation (p, a) -> edge (p, e);
    // core_down[c * k + p]: core c -> the aggregation switch of pod p it joins.
    std::vector<Link*> agg_down(size_t{k} * half * half), core_down(size_t{per_pod} * k);
    for (uint32_t pod = 0; pod < k; ++pod) {
      for (uint32_t e = 0; e < half; ++e) {
        std::vector<Link*> up;
        for (uint32_t a = 0; a < half; ++a) {
          const std::string id =
              std::to_string(pod) + "." + std::to_string(e) + "-" + std::to_string(a);
          up.push_back(link(p.fabric_link, agg[pod * half + a], pn + "edgeup" + id));
          agg_down[(pod * half + a) * half + e] =
              link(p.fabric_link, edge[pod * half + e], pn + "aggdown" + id);
        }
        edge[pod * half + e]->set_default(std::move(up));
      }
      for (uint32_t a = 0; a < half; ++a) {
        std::vector<Link*> up;
        for (uint32_t j = 0; j < half; ++j) {
          const uint32_t c = a * half + j;
          const std::string id =
              std::to_string(pod) + "." + std::to_string(a) + "-" + std::to_string(c);
          Link* u = link(p.fabric_link, core[c], pn + "aggup" + id);
          Link* d = link(p.fabric_link, agg[pod * half + a], pn + "coredown" + id);
          up.push_back(u);
          core_down[size_t{c} * k + pod] = d;
          core_[pl].push_back(u);
          core_[pl].push_back(d);
        }
        agg[pod * half + a]->set_default(std::move(up));
      }
    }
    for (uint32_t h = 0; h < p.hosts; ++h) {
      const uint32_t pod = h / per_pod, e = h % per_pod / half;
      const std::string hn = pn + "host" + std::to_string(h);
      Switch* sw = edge[pod * half + e];
      up_[pl * p.hosts + h] = link(p.host_link, sw, hn + ".up");
      sw->route(ip_of(h), {link(p.host_link, ports_[h].get(), hn + ".down")});
      for (uint32_t a = 0; a < half; ++a)
        agg[pod * half + a]->route(ip_of(h), {agg_down[(pod * half + a) * half + e]});
      for (uint32_t c = 0; c < per_pod; ++c)
        core[c]->route(ip_of(h), {core_down[size_t{c} * k + pod]});
    }
  }
}

Topology::~Topology() = default;

std::vector<Link*> Topology::core_links(uint32_t plane) const { return core_.at(plane); }

Link* Topology::busiest_core_link(uint32_t plane) const {
  const std::vector<Link*>& core = core_.at(plane);
  return *std::max_element(core.begin(), core.end(), [](Link* a, Link* b) {
    return a->counters().packets < b->counters().packets;
  });
}

}  // namespace metaroce::sim

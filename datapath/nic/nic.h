// SPDX-License-Identifier: Apache-2.0
// The software NIC's core for one link (docs/design.md, "The engine"): verbs objects (protection
// domains, memory regions, completion queues, shared receive queues, queue pairs) on rings
// shared with their drivers, the transport host that places data at its final address, and the
// link's one transport engine, so every QP to a peer device is a stream of one connection.
//
// Single-threaded and free of DPDK, verbs headers and threads: the runner drives it with
// packets (from the link layer), doorbells (new WQEs in the rings) and a clock, and it reaches
// application memory only through each owner's Memory. Every object belongs to an Owner (a
// driver's context); an owner names only its own objects, and reaches other owners' memory
// only through rkeys, as RDMA allows.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

#include "datapath/hostif/control.h"
#include "datapath/hostif/queues.h"
#include "datapath/nic/access_batch.h"
#include "datapath/nic/completion_queue.h"
#include "datapath/nic/flow_table.h"
#include "datapath/nic/link_config.h"
#include "datapath/nic/memory.h"
#include "datapath/nic/mr_table.h"
#include "datapath/nic/queue_pair.h"
#include "datapath/nic/shared_receive_queue.h"
#include "datapath/transport/engine.h"

namespace metaroce::nic {

inline constexpr uint32_t kMaxSge = hostif::kMaxSge;
inline constexpr uint32_t kMaxInline = hostif::kMaxInline;
inline constexpr uint32_t kMaxQpWr = hostif::kMaxQpWr;
inline constexpr uint32_t kMaxCqe = hostif::kMaxCqe;
inline constexpr uint32_t kMaxSrqWr = hostif::kMaxSrqWr;
inline constexpr uint32_t kMaxMrSize = hostif::kMaxMrSize;
inline constexpr uint32_t kMaxRdAtomic = hostif::kMaxRdAtomic;
inline constexpr uint32_t kAtomicSize = hostif::kAtomicSize;
inline constexpr uint32_t kGrhLen = 40;       // what a UD receive buffer holds before the payload
inline constexpr uint32_t kMaxQps = hostif::kMaxQps;
inline constexpr uint32_t kMaxCqs = hostif::kMaxCqs;
inline constexpr uint32_t kMaxSrqs = hostif::kMaxSrqs;
inline constexpr uint32_t kMaxPds = hostif::kMaxPds;

// ibv_access_flags values the NIC looks at.
enum AccessFlag : unsigned {
  kLocalWrite = 1,
  kRemoteWrite = 2,
  kRemoteRead = 4,
  kRemoteAtomic = 8,
  kMwBind = 16,      // memory windows may be bound to the region
  kOnDemand = 64,    // IBV_ACCESS_ON_DEMAND: nothing is pinned (nothing ever is); with address 0
                     // and length UINT64_MAX, the whole address space (implicit ODP)
};
inline constexpr unsigned kMrAccessKnown =
    kLocalWrite | kRemoteWrite | kRemoteRead | kRemoteAtomic | kMwBind | kOnDemand;
// ibv_rereg_mr's flags (IBV_REREG_MR_CHANGE_*).
enum ReregFlag : unsigned { kReregTranslation = 1, kReregPd = 2, kReregAccess = 4 };

// Who created an object: a driver context (a process's ibv_context), or a test.
class Owner {
 public:
  virtual ~Owner() = default;
  // The address space its memory regions lie in.
  virtual Memory& memory() = 0;
  // An asynchronous event for the object the driver calls `handle` (ibv_get_async_event).
  virtual void async_event(uint64_t handle, hostif::AsyncEvent ev) = 0;
  // A completion event on CQ `cq_id`, created with a channel (ibv_get_cq_event).
  virtual void cq_event(uint32_t cq_id, uint64_t handle) = 0;
  // The process it belongs to (telemetry), 0 for none.
  virtual uint32_t pid() const = 0;
};

// Lanes (wire.md §3.4): 0 is the connection of QPs with default settings; shared lanes are
// named by their settings; an isolated QP's lane is this bit with its QP number.
inline constexpr uint32_t kSharedLane = 0x40000000;
inline constexpr uint32_t kIsolatedLane = 0x80000000;

struct NicCounters {
  uint64_t rx_packets = 0;
  uint64_t naks_access = 0, rnr = 0;
  uint64_t memory_faults = 0;  // application memory that could not be read or written
  // Payload bytes sent: read into a packet by the NIC (a copy before the port's own), or
  // attached to it for the port to copy from application memory itself (FrameSink::attach_tail).
  uint64_t tx_payload_copied = 0, tx_payload_attached = 0;
  // Raw Ethernet (verbs-mapping.md §18): frames sent by raw QPs, frames steered to one, and
  // frames steered to a QP that had no receive posted (dropped, as a NIC does).
  uint64_t raw_tx = 0, raw_rx = 0, raw_rx_no_recv = 0;
  uint64_t cm_dropped = 0;  // CM messages that were not one packet of a SEND (docs/spec/cm.md)
  // Multicast (verbs-mapping.md §7, wire.md §8): datagrams sent to groups; received for a
  // group with members here, and how many receives they took; received for a group nobody
  // here joined; malformed (dropped).
  uint64_t mcast_tx = 0, mcast_rx = 0, mcast_rx_delivered = 0, mcast_rx_no_member = 0,
           mcast_rx_malformed = 0;
};

// A frame a raw QP sent, for the link layer to put on the port (and loop back); or, with a
// group, the UDP payload of a datagram a UD QP sent to that multicast group (wire.md §8), which
// the link layer frames to the group's address and delivers to this device's members too.
// Its WQE (qpn, msn) completes once it left.
struct RawFrame {
  std::vector<uint8_t> bytes;
  uint32_t group = 0;
  uint16_t src_port = 0;
  uint32_t qpn = 0, msn = 0;  // the sender's QP and WQE
};

struct NicConfig {
  LinkConfig link;
  transport::EngineConfig engine;  // local_ip, paths, planes, sizes: see nic_config()
};
// The NIC of a link as the engine runs it: windows, packet sizes and paths from the record.
NicConfig nic_config(const LinkConfig& link, uint64_t seed);
// The largest verbs MTU (256..4096) whose packets fit a link of link_mtu bytes with every header.
uint32_t verbs_mtu_for(uint32_t link_mtu);
// What the engine may ask a transmit buffer to hold beyond a packet's payload.
uint32_t max_transport_packet(uint32_t link_mtu);

// Where the transport's packets go: the link layer, which puts Ethernet/IP/UDP in front.
class FrameSink : public transport::TxSink {
 public:
  // Sends what was committed since the last flush. A packet whose payload could not be read
  // (its buffer contains one of `bad`) is dropped instead, as a loss the transport recovers.
  virtual void flush(std::span<uint8_t* const> bad) = 0;
  // The bytes `at` of the packet being built (its payload's end) are to be sent from `src`,
  // which stays readable until flush() returns, instead of being copied into the packet first.
  // False: the caller copies them (the port cannot, or `at` is not in the packet).
  virtual bool attach_tail(std::span<uint8_t> /*at*/, const uint8_t* /*src*/) { return false; }
};

class Nic final : private transport::Host {
 public:
  explicit Nic(const NicConfig& cfg);
  ~Nic() override;
  Nic(const Nic&) = delete;
  Nic& operator=(const Nic&) = delete;

  const LinkConfig& config() const { return cfg_.link; }
  // The transport's shortest timer (its minimum retransmission timeout): how long a packet of
  // this link may wait unseen before a peer takes it for lost.
  transport::Time shortest_timer() const { return cfg_.engine.rto_min; }
  uint32_t active_mtu() const { return active_mtu_; }

  // --- objects: 0 or an errno (EINVAL: not one of the owner's; EBUSY: still in use) ----------
  int alloc_pd(Owner* o, uint32_t* pd);
  int dealloc_pd(Owner* o, uint32_t pd);
  // iova: the address verbs use for byte 0 of [addr, addr + length) (ibv_reg_mr_iova2). want:
  // 0, or the key the region must have (a kernel context's: the module chose it); EBUSY when it
  // is taken.
  int reg_mr(Owner* o, uint32_t pd, uint64_t addr, uint64_t length, uint64_t iova,
             unsigned int access, uint32_t* lkey, uint32_t* rkey, uint32_t want = 0);
  int reg_mr(Owner* o, uint32_t pd, uint64_t addr, uint64_t length, unsigned int access,
             uint32_t* lkey, uint32_t* rkey) {
    return reg_mr(o, pd, addr, length, addr, access, lkey, rkey);
  }
  // ibv_rereg_mr: what flags (ReregFlag) name changes, in place; the keys stay. A new
  // translation is [addr, addr + length) at IOVA addr.
  int rereg_mr(Owner* o, uint32_t lkey, unsigned flags, uint32_t pd, uint64_t addr,
               uint64_t length, unsigned int access);
  int dereg_mr(Owner* o, uint32_t lkey);
  // Memory windows (verbs-mapping.md §13): type 1 or 2, in pd; binds go through a QP's send
  // queue (WqeOp::kBindMw, kLocalInv, kSendInv).
  int alloc_mw(Owner* o, uint32_t pd, uint8_t type, uint32_t* rkey);
  int dealloc_mw(Owner* o, uint32_t rkey);
  // 0 when lkey names a region of o in pd covering [addr, addr + length), else EFAULT.
  int check_mr(Owner* o, uint32_t lkey, uint32_t pd, uint64_t addr, uint64_t length) const;
  // ring: a segment formatted by hostif::init_cq; the NIC uses it until destroy_cq.
  int create_cq(Owner* o, hostif::CqHeader* ring, uint64_t handle, bool channel, uint32_t* id);
  int destroy_cq(Owner* o, uint32_t id);
  // ibv_resize_cq: ring (formatted by init_cq) replaces the CQ's; EINVAL when what it holds
  // does not fit (the old ring stays). The driver does not poll meanwhile.
  int resize_cq(Owner* o, uint32_t id, hostif::CqHeader* ring);
  int create_srq(Owner* o, uint32_t pd, hostif::SrqHeader* ring, uint64_t handle, uint32_t* id);
  // A tag-matching SRQ (verbs-mapping.md §19): max_tags tags, every completion into cq.
  int create_tm_srq(Owner* o, uint32_t pd, uint32_t cq, uint32_t max_tags,
                    hostif::SrqHeader* ring, uint64_t handle, uint32_t* id);
  // One ibv_post_srq_ops operation on o's TM SRQ req.srq, its completion written to the SRQ's
  // CQ when signaled (or when it fails there: IBV_WC_TM_ERR). EINVAL: not o's TM SRQ, an opcode,
  // SGE or key that is wrong; ENOMEM: the list is full (*handle: the added tag's).
  int srq_tag_op(Owner* o, const hostif::SrqTagOpReq& req, uint32_t* handle);
  int destroy_srq(Owner* o, uint32_t id);
  // ring: a segment formatted by hostif::init_qp (qpn 0); the NIC writes the QP number it
  // chooses into the header and *qpn: req.qpn when set (a kernel context's: the module chose
  // it; EBUSY when taken). An XRC target QP (req.type kXrcTgt) may outlive o while other
  // contexts hold it open: keep is what keeps ring mapped, and goes with the QP.
  int create_qp(Owner* o, const hostif::CreateQpReq& req, hostif::QpHeader* ring, uint32_t* qpn,
                std::shared_ptr<void> keep = {});
  int modify_qp(Owner* o, const hostif::ModifyQpReq& req);
  int destroy_qp(Owner* o, uint32_t qpn);

  // --- XRC (verbs-mapping.md §17): 0 or an errno -------------------------------------------
  // A domain named by a file's inode is shared by every owner that opens it; without a key,
  // o gets a domain of its own. EAGAIN: no domain of that file and !create; EINVAL: one exists
  // and exclusive (ibv_open_xrcd(3), as the kernel answers).
  struct XrcdKey {
    uint64_t dev = 0, ino = 0;
    bool operator==(const XrcdKey&) const = default;
  };
  int open_xrcd(Owner* o, const XrcdKey* key, bool create, bool exclusive, uint32_t* xrcd);
  // One of o's opens goes; EBUSY while it is o's last and o has SRQs or QP handles in it.
  int close_xrcd(Owner* o, uint32_t xrcd);
  // An SRQ of domain xrcd (which o opened), of pd, completing into cq; *id is its number.
  int create_xrc_srq(Owner* o, uint32_t pd, uint32_t xrcd, uint32_t cq, hostif::SrqHeader* ring,
                     uint64_t handle, uint32_t* id);
  // Another handle to XRC target QP qpn of domain xrcd (o must have opened it); *keep: the
  // QP's ring, for the engine to hand out again. close_qp drops one handle; the QP goes with
  // its last.
  int open_qp(Owner* o, uint32_t xrcd, uint32_t qpn, uint64_t handle, std::shared_ptr<void>* keep);
  int close_qp(Owner* o, uint32_t qpn, uint64_t handle);
  // The XRC SRQ numbered srqn if it belongs to domain xrcd (a target QP's), else nullptr.
  SharedReceiveQueue* xrc_srq(uint32_t srqn, uint32_t xrcd);
  // Raw packet QPs' flow steering (verbs-mapping.md §18): a rule steering frames to o's raw QP
  // req.qpn. EINVAL: not o's raw QP, a rule a NIC could not apply; EOPNOTSUPP: the link has no
  // Ethernet port. destroy_flow: EINVAL for a flow that is not o's. A QP with flows is busy.
  int create_flow(Owner* o, const hostif::CreateFlowReq& req, uint32_t* id);
  int destroy_flow(Owner* o, uint32_t id);
  // RSS: an indirection table of 1 << log_size of o's WQs (QPs of type kWq), and a raw packet
  // QP spreading what its flows steer over a table's WQs by the Toeplitz hash of req.fields
  // (ring as for create_qp). EINVAL for what is not o's, a function other than Toeplitz, a key
  // of 0 or more than 64 bytes, fields unknown; a WQ in a table, a table an RSS QP uses, are
  // busy (EBUSY).
  int create_ind_table(Owner* o, const hostif::IndTableReq& req, uint32_t* id);
  int destroy_ind_table(Owner* o, uint32_t id);
  int create_rss_qp(Owner* o, const hostif::CreateRssQpReq& req, hostif::QpHeader* ring,
                    uint32_t* qpn);
  // Whether the link's plane 0 carries Ethernet frames (not a UDP-socket plane): the link layer
  // says so; raw QPs and flows exist only then.
  void set_raw_ethernet(bool yes) { raw_ethernet_ = yes; }
  // The largest frame a raw QP may send or receive: the link MTU, an Ethernet header, a VLAN tag.
  uint32_t max_raw_frame() const { return cfg_.link.mtu + 18; }
  // Destroys every object of o, users first (its process is gone or closed the device).
  void release(Owner* o);
  // Objects of each kind o holds (metaroce engine status; tests of reclamation).
  struct ObjectCounts {
    uint32_t pds = 0, mrs = 0, cqs = 0, srqs = 0, qps = 0;  // mrs: regions and windows
    uint32_t xrcds = 0;                                      // opens of XRC domains
    uint32_t flows = 0, ind_tables = 0;                      // raw frames' steering (§18)
    bool any() const { return pds || mrs || cqs || srqs || qps || xrcds || flows || ind_tables; }
  };
  ObjectCounts owned_by(const Owner* o) const;

  // --- direct verbs (infiniband/metaroce_dv.h): 0 or an errno ----------------------------
  // EINVAL: not o's RC QP, or values out of range (num_paths past 256, planes the device lacks).
  int set_qp_paths(Owner* o, const hostif::SetQpPathsReq& req);
  int query_qp_conn(Owner* o, uint32_t qpn, hostif::QpConnResp* out) const;
  // ENOTCONN: the QP has no peer yet.
  int query_paths(Owner* o, uint32_t qpn, uint32_t first, hostif::QueryPathsResp* out) const;
  int repath(Owner* o, uint32_t qpn, uint32_t path, uint16_t* udp_sport);
  // A plane's port went down or came up (the link layer says so): transport::Engine::set_plane_up.
  void set_plane_up(transport::Time now, uint8_t plane, bool up);
  uint32_t planes_up() const { return engine_->planes_up(); }
  // The verbs port went down or came back (the link layer says so). The engine hears of it
  // through take_port_change and raises IBV_EVENT_PORT_ERR / PORT_ACTIVE in every context
  // of the device.
  void set_port_active(bool active) {
    port_active_.store(active, std::memory_order_release);
    port_changed_.store(true, std::memory_order_release);
  }
  bool port_active() const { return port_active_.load(std::memory_order_acquire); }
  bool take_port_change() { return port_changed_.exchange(false, std::memory_order_acq_rel); }
  // The lane a QP's settings give (wire.md §3.4): 0 for the defaults.
  uint32_t lane_for(const QueuePair& qp) const;
  // The plane mask of every plane the device has.
  uint32_t every_plane() const { return (1u << cfg_.engine.num_planes) - 1; }
  bool owns_anything(const Owner* o) const { return owned_by(o).any(); }

  // --- datapath (the runner's thread) ------------------------------------------------------
  // One received MetaRoCE packet (the UDP payload) from src_ip.
  void on_packet(transport::Time now, uint32_t src_ip, uint16_t src_port, bool ecn_ce,
                 std::span<const uint8_t> udp_payload, uint8_t plane = 0);
  // After a burst of on_packet: application memory written, completions published, events
  // raised. The packets' bytes must stay valid until this returns.
  void end_rx(transport::Time now);
  // Doorbells (WQEs posted since the last poll), timers (unless held: the runner is catching up
  // after a stall of its own), transmission. Returns true if it did anything.
  bool poll_tx(transport::Time now, FrameSink& sink, bool timers = true);
  // WQEs posted and not taken yet: a runner about to sleep checks this after announcing it.
  bool has_new_work() const;
  transport::Time next_deadline() const;
  // Peers whose hardware address the link layer should ask for (UD destinations, RTR peers).
  std::vector<uint32_t> take_resolve_requests();
  // A frame from the port (or one of ours looped back) that is not the transport's: steered by
  // the flow rules to raw QPs. True when some flow took it. Its bytes must stay valid until
  // end_rx, like a packet's.
  bool on_raw_frame(std::span<const uint8_t> frame);
  // Frames raw QPs sent in the last poll_tx, for the link layer to transmit.
  std::vector<RawFrame> take_raw_frames() { return std::exchange(raw_out_, {}); }
  // Those frames that left (or were lost, as on a port that is down): each one's WQE completes.
  void raw_frames_left(std::span<const std::pair<uint32_t, uint32_t>> qpn_msn);

  // --- multicast (verbs-mapping.md §7) -------------------------------------------------------
  // ibv_attach_mcast/ibv_detach_mcast of o's UD QP qpn to the IPv4 group `group` (host order).
  // EINVAL: not o's UD QP, not a multicast address; ENOMEM: kMaxMcastGroups groups or
  // kMaxMcastQpAttach QPs in the group; EOPNOTSUPP: the link carries no Ethernet frames.
  // Attaching twice is one attachment; detach: EINVAL when not attached.
  int attach_mcast(Owner* o, uint32_t qpn, uint32_t group);
  int detach_mcast(Owner* o, uint32_t qpn, uint32_t group);
  uint32_t mcast_groups() const { return static_cast<uint32_t>(groups_.size()); }
  bool mcast_member(uint32_t group) const { return groups_.count(group) != 0; }
  template <class F>
  void for_each_mcast_group(F&& f) const {
    for (const auto& g : groups_) f(g.first);
  }
  // Groups that gained their first member here (true) or lost their last (false) since the
  // last call, in order: what the link layer tells the network (IGMP, wire.md §8).
  std::vector<std::pair<uint32_t, bool>> take_group_changes() {
    return std::exchange(group_changes_, {});
  }
  bool has_group_changes() const { return !group_changes_.empty(); }
  // A datagram sent to group (from the port, or one of ours looped back): each QP attached to
  // the group takes a copy. False when no QP here is attached to it (the flow rules of raw QPs
  // may want the frame). Its bytes must stay valid until end_rx.
  bool on_datagram(uint32_t src_ip, uint32_t group, std::span<const uint8_t> udp_payload);
  // Where a UD QP's send WQE msn to group gathers its datagram (headers and payload, len
  // bytes); handed to the link layer once read, as a raw QP's frame. nullptr without memory.
  uint8_t* datagram_tx_buffer(uint32_t qpn, uint32_t msn, uint32_t group, uint32_t len);

  // --- connection management (docs/spec/cm.md) ----------------------------------------------
  // CM messages travel between engines as SEND messages of stream kCmStream to stream kCmStream
  // (no QP has number 1), reliable and at most once like any message, each in one packet.
  static constexpr uint32_t kCmStream = 1;
  static constexpr uint32_t kCmMaxMessage = 256;  // fits the smallest verbs MTU
  struct CmEvent {
    enum Kind : uint8_t { kMessage, kDelivered, kFailed } kind = kMessage;
    uint32_t peer_ip = 0;
    uint64_t token = 0;          // kDelivered, kFailed: cm_send's
    std::vector<uint8_t> bytes;  // kMessage
  };
  // Sends bytes (at most kCmMaxMessage) to the engine at peer_ip; whether the peer's transport
  // took it comes back as a kDelivered or kFailed event naming token. Datapath thread.
  void cm_send(uint32_t peer_ip, std::span<const uint8_t> bytes, uint64_t token);
  // What arrived and what became of what was sent, since the last call. Datapath thread.
  std::vector<CmEvent> take_cm_events() { return std::exchange(cm_events_, {}); }
  bool has_cm_events() const { return !cm_events_.empty(); }

  // --- observation ---------------------------------------------------------------------------
  const transport::Engine& engine() const { return *engine_; }
  const NicCounters& counters() const { return counters_; }
  size_t qp_count() const { return qps_.size(); }
  const QueuePair* find_qp(uint32_t qpn) const;
  QueuePair* find_qp(uint32_t qpn) { return qp_of(qpn); }
  // Every QP (telemetry: which QPs are streams of which connection).
  std::vector<const QueuePair*> qps() const { return {qp_list_.begin(), qp_list_.end()}; }

  // --- for queue pairs ---------------------------------------------------------------------
  transport::Engine& transport() { return *engine_; }
  // Drops everything the transport holds for stream qpn (the QP reset, failed or went away).
  void forget_stream(uint32_t qpn);
  const MrTable& mrs() const { return mrs_; }
  MrTable& mrs() { return mrs_; }  // window binds and invalidations, in send-queue order
  // Queues a write into application memory, carried out at end_rx; origin names what fails.
  void queue_write(Memory* m, uint64_t addr, std::span<const uint8_t> data, uint32_t qpn,
                   uint32_t msn);
  // Queues a read of application memory into a transmit buffer, carried out before the
  // buffer is sent; or, where the memory can be seen in place and the packet's port copies it
  // itself, attaches it to the packet instead (FrameSink::attach_tail).
  void queue_read(Memory* m, uint64_t addr, std::span<uint8_t> out, uint32_t qpn, uint32_t msn);
  // Carries out the queued writes now (an atomic must see the writes before it).
  void flush_writes();
  // Queues the answer to a READ (mem: the region's memory) or an atomic (mem nullptr: engine
  // memory at addr). A READ's source is probed first, one byte per page at end_rx, so that a
  // region whose memory is gone is a remote access error for `request`, not a hang.
  void queue_read_response(const transport::MessageDesc& msg, Memory* mem, uint64_t addr,
                           const transport::Segment* request);
  // Bytes that live until the end of the pass (what a queued write takes its data from).
  uint8_t* scratch(uint32_t n);
  // Where a raw QP's send WQE msn gathers its frame of len bytes; sent (and its WQE completed)
  // once the reads of the pass are done, unless one failed. nullptr without memory.
  uint8_t* raw_tx_buffer(uint32_t qpn, uint32_t msn, uint32_t len);
  NicCounters& mutable_counters() { return counters_; }
  void note_dirty(CompletionQueue* cq);
  void want_resolve(uint32_t ip);
  transport::Time now() const { return now_; }
  static uint64_t cookie(uint32_t qpn, uint32_t msn) { return (uint64_t{qpn} << 32) | msn; }
  // A message a QP sends on its own, with no WQE (tag matching's rendezvous READ and FIN):
  // id is the QP's name for it.
  static constexpr uint64_t kQpOwnTag = uint64_t{1} << 62;
  static uint64_t own_cookie(uint32_t qpn, uint32_t id) { return kQpOwnTag | cookie(qpn, id); }
  // The segment deliver() is placing (its writes' failures are NAKed through it).
  const transport::Segment* current_segment() const { return current_; }

 private:
  struct CmOut {
    std::vector<uint8_t> bytes;
    uint32_t peer_ip = 0;
    uint64_t token = 0;
  };
  std::unordered_map<uint64_t, CmOut> cm_out_;      // by cookie (kCmTag | sequence)
  std::unordered_map<uint32_t, uint32_t> cm_msn_;   // next msn of stream kCmStream, per peer
  uint64_t cm_next_ = 0;
  std::vector<CmEvent> cm_events_;
  bool cm_message(uint64_t c) const;  // a cookie of cm_send's
  void cm_done(uint64_t c, bool delivered);

  struct ReadResponse {
    Memory* mem = nullptr;  // nullptr: engine memory
    uint64_t addr = 0;
    uint32_t length = 0;
    uint32_t qpn = 0;       // the responder QP
    bool failed = false;    // its source could not be read: not sent
  };
  // What a queued access belongs to, so that a failure reaches it.
  struct Origin {
    uint64_t cookie = 0;        // (qpn, msn), or a read response's cookie
    transport::RxRef rx{};      // writes and probes: the packet to reject
    bool has_rx = false;
  };

  // transport::Host
  void gather(uint64_t cookie, uint32_t offset, std::span<uint8_t> out) override;
  transport::Syndrome deliver(const transport::Segment& seg) override;
  int rnr_timer(uint32_t qpn) override;
  void message_acked(uint64_t cookie) override;
  void message_failed(uint64_t cookie, transport::Syndrome why) override;

  QueuePair* qp_of(uint32_t qpn);
  CompletionQueue* cq_of(Owner* o, uint32_t id);
  SharedReceiveQueue* srq_of(Owner* o, uint32_t id);
  bool pd_of(Owner* o, uint32_t pd) const;
  uint32_t add_origin(uint64_t cookie, const transport::Segment* seg);
  void access_failed(const Origin& o);
  void read_failed(uint64_t cookie);
  void publish_completions();
  void destroy_qp_now(QueuePair* qp);
  // Tells the transport the lane of qp (once it has a peer), closing the isolated lane it
  // leaves.
  void apply_lane(QueuePair* qp);

  const NicConfig cfg_;
  const uint32_t active_mtu_;
  transport::Time now_{};
  std::unique_ptr<transport::Engine> engine_;
  MrTable mrs_;
  std::unordered_map<uint32_t, Owner*> pds_;  // pd -> owner
  uint32_t next_pd_ = 1;
  std::unordered_map<uint32_t, std::unique_ptr<CompletionQueue>> cqs_;
  uint32_t next_cq_ = 1;
  std::unordered_map<uint32_t, std::unique_ptr<SharedReceiveQueue>> srqs_;
  uint32_t next_srq_ = 1;  // SRQ numbers are 24-bit (an XRC initiator names them) and never 0
  struct Xrcd {
    bool named = false;  // shared by the inode of key
    XrcdKey key;
    std::unordered_map<const Owner*, uint32_t> opens;  // per owner, how many times it opened it
  };
  std::unordered_map<uint32_t, Xrcd> xrcds_;
  uint32_t next_xrcd_ = 1;
  bool xrcd_open_by(Owner* o, uint32_t xrcd) const;
  // Whether o has SRQs or target QP handles in domain xrcd.
  bool xrcd_busy(const Owner* o, uint32_t xrcd) const;
  uint32_t alloc_srq_id();
  std::unordered_map<uint32_t, std::unique_ptr<QueuePair>> qps_;
  // qp_of's answers by the QPN's low bits, checked against the QP's own number: every packet
  // names its QP, and QPNs are handed out in sequence, so hundreds of QPs rarely share a slot.
  // A QP leaves it as it is destroyed.
  std::array<QueuePair*, 1024> qp_cache_{};
  std::atomic<bool> port_active_{true}, port_changed_{false};
  std::vector<QueuePair*> qp_list_;  // drain order
  uint32_t next_qpn_;
  NicCounters counters_;

  AccessBatch writes_, reads_, probes_;
  std::vector<Origin> origins_;
  std::vector<uint32_t> failed_;  // origins of accesses that failed, handled at end_rx
  // A failed access of an address space that is gone: not a fault of its application (it
  // exited), so nothing is rejected; its objects are about to be reclaimed.
  void record_failure(uint32_t origin, const Memory* m);
  std::vector<uint8_t*> failed_reads_;
  // A payload read: attached to the packet being built when it can be (queue_read).
  void read_payload(Memory* m, uint64_t addr, std::span<uint8_t> out, uint64_t cookie);
  FrameSink* tx_sink_ = nullptr;  // the packets' sink while poll_tx builds them
  DirectMemory in_place_;         // writes into memory seen in place (queue_write)
  uint8_t probe_byte_ = 0;
  std::vector<std::unique_ptr<uint8_t[]>> scratch_blocks_;
  size_t scratch_used_ = 0;  // in the last block
  const transport::Segment* current_ = nullptr;
  std::vector<CompletionQueue*> dirty_cqs_;
  std::unordered_map<uint64_t, ReadResponse> reads_pending_;  // key: cookie with kReadRespTag
  std::vector<transport::MessageDesc> pending_reads_;         // submitted after on_packet
  uint32_t next_read_id_ = 0;
  std::vector<uint32_t> resolve_;
  // Raw Ethernet: flows, frames being gathered, frames for the link layer.
  FlowTable flows_;
  std::unordered_map<uint32_t, Owner*> flow_owner_;
  bool raw_ethernet_ = true;
  std::vector<RawFrame> raw_pending_;
  // Multicast groups (host-order address) -> the QPs attached, in attach order.
  std::unordered_map<uint32_t, std::vector<uint32_t>> groups_;
  std::vector<uint32_t> group_scratch_;
  std::vector<std::pair<uint32_t, bool>> group_changes_;
  void leave_groups(uint32_t qpn);
  std::vector<RawFrame> raw_out_;
  std::vector<uint32_t> steer_scratch_;
  void finish_raw_sends();
  struct IndTable {
    Owner* owner = nullptr;
    std::vector<uint32_t> wqns;
    uint32_t users = 0;  // RSS QPs
  };
  std::unordered_map<uint32_t, IndTable> ind_tables_;
  uint32_t next_ind_table_ = 1;
  struct Rss {
    uint32_t table = 0;
    std::vector<uint8_t> key;
    uint64_t fields = 0;
  };
  std::unordered_map<uint32_t, Rss> rss_;  // by RSS QP number
  // The WQ of an RSS QP's table that a frame goes to.
  QueuePair* rss_target(const Rss& rss, const FrameHeaders& h);
  bool wq_in_table(uint32_t wqn) const;
};

}  // namespace metaroce::nic

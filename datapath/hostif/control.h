// SPDX-License-Identifier: Apache-2.0
// The control protocol between a driver and the engine (docs/spec/verbs-mapping.md §10): one
// SOCK_SEQPACKET connection per device context to <run dir>/engine.sock, strict request and
// response, each message a Header followed by the operation's fixed-size body, descriptors in
// SCM_RIGHTS. What travels here is rare (object creation, state changes); the data path is the
// shared rings of queues.h. The engine checks the sender's credentials on every message
// (SCM_CREDENTIALS: a driver sets SO_PASSCRED on its socket before connecting, so that they
// travel even with what it sends before the engine accepted it) and every field of every body.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "datapath/hostif/queues.h"

namespace metaroce::hostif {

inline constexpr uint32_t kControlMagic = 0x4c43524d;  // "MRCL"
inline constexpr uint16_t kControlVersion = 1;
inline constexpr const char* kEngineSocket = "engine.sock";  // inside the run dir
inline constexpr size_t kMaxMessage = 8192;
inline constexpr size_t kMaxFds = 4;

enum class Op : uint16_t {
  // A device context (any user).
  kHello = 1,        // first message: which link; the engine answers with the device
  kAllocPd = 2,
  kDeallocPd = 3,
  kRegMr = 4,
  kDeregMr = 5,
  kCreateCq = 6,     // + the completion channel's write end when it has one
  kDestroyCq = 7,
  kCreateSrq = 8,
  kDestroySrq = 9,
  kCreateQp = 10,
  kModifyQp = 11,
  kDestroyQp = 12,
  kModifySrq = 13,
  // Direct verbs (infiniband/metaroce_dv.h; verbs-mapping.md §11).
  kSetQpPaths = 14,   // paths, planes and lane of an RC QP
  kQueryQpConn = 15,  // the connection a QP rides
  kQueryPaths = 16,   // a page of its connection's paths
  kRepath = 17,       // a new entropy value for one of them
  kQueryDevice = 18,  // what only the engine knows of the device (planes up)
  kReregMr = 19,      // ibv_rereg_mr
  kCheckMr = 20,      // ibv_advise_mr: does an lkey of the PD cover a range
  kAllocMw = 21,      // ibv_alloc_mw
  kDeallocMw = 22,    // ibv_dealloc_mw (IdReq: its rkey)
  kResizeCq = 23,     // ibv_resize_cq: a new ring (fd) takes the old one's completions
  // XRC (verbs-mapping.md §17).
  kOpenXrcd = 24,     // ibv_open_xrcd: + the file whose inode names a shared domain
  kCloseXrcd = 25,    // ibv_close_xrcd (IdReq: the domain)
  kCreateXrcSrq = 26, // ibv_create_srq_ex of type XRC
  kOpenQp = 27,       // ibv_open_qp: another handle to an XRC target QP of a domain
  kCloseQp = 28,      // ibv_destroy_qp of an XRC target QP handle
  // Raw packet QPs (verbs-mapping.md §18): flow steering rules.
  kCreateFlow = 29,   // ibv_create_flow
  kDestroyFlow = 30,  // ibv_destroy_flow (IdReq: the flow)
  // RSS: receive work queues are QPs of type kWq (kCreateQp, kModifyQp, kDestroyQp).
  kCreateIndTable = 31,   // ibv_create_rwq_ind_table
  kDestroyIndTable = 32,  // ibv_destroy_rwq_ind_table (IdReq)
  kCreateRssQp = 33,      // ibv_create_qp_ex of a raw packet QP with RX_HASH and IND_TABLE
  // Tag matching (verbs-mapping.md §19).
  kCreateTmSrq = 34,  // ibv_create_srq_ex of type TM (answered as kCreateSrq)
  kSrqTagOp = 35,     // one ibv_post_srq_ops operation, carried out before the answer
  // RDMA CM (docs/spec/cm.md): a connection that opens with kCmOpen instead of kHello is one
  // librdmacm event channel (a /dev/infiniband/rdma_cm file of the preload).
  kCmOpen = 36,       // first message; fd: the channel's event socket. Answer: CmOpenResp
  kCmCommand = 37,    // one ucma command: CmCommandReq, then its body, then `extra` bytes
  // Multicast (verbs-mapping.md §7): McastReq.
  kAttachMcast = 38,  // ibv_attach_mcast
  kDetachMcast = 39,  // ibv_detach_mcast
  // Shared memory regions (docs/design.md): pages of a region the engine may reach in the
  // memfd (the fd) instead of with system calls. MapPagesReq.
  kMapPages = 40,
  // Administration (uid 0, or the engine's own user: a user who runs an engine for a private run
  // dir administers it): what `metaroce link` and `metaroce engine` ask.
  kLinkOpen = 100,
  kLinkClose = 101,
  kShutdown = 102,
  kEngineInfo = 103,
  kSessionInfo = 104,  // the index-th context the engine serves, ENOENT past the last
  kLinkPlane = 105,    // set a plane of a link administratively up or down
  kLinkCapture = 106,  // start, query or stop writing a link's frames as pcap (one fd)
};

struct Header {
  uint32_t magic = kControlMagic;
  uint16_t version = kControlVersion;
  Op op = Op::kHello;
  uint32_t seq = 0;     // echoed in the response
  int32_t status = 0;   // response: 0 or a positive errno
};
static_assert(sizeof(Header) == 16);

inline constexpr size_t kNameLen = 64;

// kHello. Fds: the write end of the context's async event pipe; none with kHelloKernel.
// kHelloKernel: the context is a kernel device's (docs/spec/kernel.md): its objects are kernel
// objects too, named in its requests by their kernel numbers (a QP's number, a region's key, a
// CQ's or SRQ's id as `handle`), and its events are raised through the metaroce_ib module.
inline constexpr uint32_t kHelloKernel = 1;
struct HelloReq {
  uint32_t abi = kAbiVersion;
  uint32_t flags = 0;
  char link[kNameLen] = {};
};
// Fds: the doorbell eventfd, the status page (read-only memfd).
struct HelloResp {
  uint32_t abi = kAbiVersion;
  uint32_t ip = 0;            // the link's IPv4, host order
  uint32_t link_mtu = 0;
  uint32_t active_mtu = 0;    // largest verbs MTU the link carries, bytes
  uint16_t paths = 0, planes = 0;
  uint32_t max_qp_wr = 0, max_sge = 0, max_inline = 0, max_cqe = 0, max_srq_wr = 0;
  uint32_t max_rd_atomic = 0;
  uint32_t status_bytes = 0;
  uint32_t engine_pid = 0;
  uint32_t datapath = 0;      // the thread serving the link: StatusPage::sleeping[datapath]
  uint32_t reserved[3] = {};
};

// kCmOpen's answer: the channel's number (what MIGRATE_ID names a channel by).
struct CmOpenResp {
  uint32_t channel = 0;
  uint32_t reserved = 0;
};
// kCmCommand: the ucma header's command and response size, the body (the kernel's struct for
// the command, as librdmacm wrote it after the header) and `extra` bytes (SET_OPTION's value).
// The answer's body is the response (at most `out` bytes).
struct CmCommandReq {
  uint32_t cmd = 0;
  uint16_t out = 0;
  uint16_t body_len = 0;
  uint16_t extra_len = 0;
  uint16_t reserved[3] = {};
};

// [va, va + len) of the process is [off, off + len) of its memfd of shared pages; page-aligned.
struct SharedPiece {
  uint64_t va = 0, off = 0, len = 0;
};
inline constexpr uint32_t kMaxMapPieces = 64;
struct MapPagesReq {  // kMapPages: pieces of region `lkey` of PD `pd`; more may follow
  uint32_t lkey = 0;
  uint32_t pd = 0;
  uint32_t count = 0;
  uint32_t reserved = 0;
  SharedPiece pieces[kMaxMapPieces];
};

struct McastReq {  // kAttachMcast, kDetachMcast
  uint32_t qpn = 0;
  uint32_t group = 0;  // IPv4 multicast address, host order
};

struct PdResp {
  uint32_t pd = 0;
  uint32_t reserved = 0;
};
struct IdReq {  // kDeallocPd, kDestroyCq, kDestroySrq, kDestroyQp, kDeregMr
  uint32_t id = 0;
  uint32_t reserved = 0;
};

struct RegMrReq {
  uint32_t pd = 0;
  uint32_t access = 0;  // ibv_access_flags the NIC knows (nic::kMrAccessKnown)
  uint64_t addr = 0;
  uint64_t length = 0;
  uint64_t iova = 0;    // the address verbs use for byte 0 (ibv_reg_mr_iova2); addr for reg_mr
  uint32_t key = 0;     // kernel contexts: the kernel region's key, which the NIC then uses
  uint32_t reserved = 0;
};
struct ReregMrReq {
  uint32_t lkey = 0;
  uint32_t flags = 0;   // IBV_REREG_MR_CHANGE_* (nic::ReregFlag)
  uint32_t pd = 0;      // CHANGE_PD
  uint32_t access = 0;  // CHANGE_ACCESS
  uint64_t addr = 0;    // CHANGE_TRANSLATION
  uint64_t length = 0;
};
struct CheckMrReq {
  uint32_t lkey = 0, pd = 0;
  uint64_t addr = 0, length = 0;
};
struct AllocMwReq {
  uint32_t pd = 0;
  uint32_t type = 0;  // 1 or 2 (IBV_MW_TYPE_*)
};
struct AllocMwResp {
  uint32_t rkey = 0;
  uint32_t reserved = 0;
};
struct RegMrResp {
  uint32_t lkey = 0, rkey = 0;
};

// Fds (optional): the channel's event socket, where the engine writes `handle` per event.
struct CreateCqReq {
  uint32_t cqe = 0;
  uint32_t has_channel = 0;
  uint64_t handle = 0;  // the driver's name for the CQ in events (its ibv_cq's address)
};
// Fds: the CQ's segment.
struct CreateCqResp {
  uint32_t id = 0;
  uint32_t bytes = 0;
};

struct ResizeCqReq {
  uint32_t id = 0;
  uint32_t cqe = 0;
};
// Fds: the CQ's new segment (CreateCqResp's fields).

struct CreateSrqReq {
  uint32_t pd = 0, max_wr = 0, max_sge = 0, reserved = 0;
  uint64_t handle = 0;  // element of its async events
};
struct CreateSrqResp {
  uint32_t id = 0;
  uint32_t bytes = 0;
};
// A tag-matching SRQ: a plain SRQ's fields, its tag list's size, the CQ of its completions.
struct CreateTmSrqReq {
  uint32_t pd = 0, max_wr = 0, max_sge = 0, max_tags = 0;
  uint32_t cq = 0, reserved = 0;
  uint64_t handle = 0;
};
// enum ibv_ops_wr_opcode values.
enum class TagOp : uint32_t { kAdd = 0, kDel = 1, kSync = 2 };
struct SrqTagOpReq {
  uint32_t srq = 0;
  TagOp op = TagOp::kAdd;
  uint32_t signaled = 0;        // IBV_OPS_SIGNALED: a completion when it succeeds
  uint32_t unexpected_cnt = 0;  // kAdd, kSync: the application's count
  uint32_t handle = 0;          // kDel: the tag
  uint32_t num_sge = 0;         // kAdd: 0 or 1
  uint64_t wr_id = 0;
  uint64_t recv_wr_id = 0;      // kAdd: the wr_id of the tag's receive completions
  uint64_t tag = 0, mask = 0;   // kAdd
  Sge sge{};                    // kAdd: where a matched message's payload goes
};
// Answer: the tag's handle (kAdd).
struct SrqTagOpResp {
  uint32_t handle = 0;
  uint32_t reserved = 0;
};
struct ModifySrqReq {
  uint32_t id = 0;
  uint32_t limit = 0;
};

// kXrcTgt: xrcd names the domain, and pd, the CQs, srq and caps are not used; kXrcIni: no
// receive CQ or SRQ (recv_cq 0).
struct CreateQpReq {
  uint32_t pd = 0, send_cq = 0, recv_cq = 0, srq = 0;  // srq 0: none
  QpType type = QpType::kRc;
  uint32_t sq_sig_all = 0;
  QpCaps caps;
  uint32_t xrcd = 0;
  uint32_t qpn = 0;     // kernel contexts: the kernel QP's number, which the NIC then uses
  uint32_t flags = 0;   // kQpBlockSelfMcast; other bits: EINVAL
  uint64_t handle = 0;  // element of its async events (its ibv_qp's address)
};
// CreateQpReq::flags: a UD QP takes no multicast datagram it sent itself
// (IBV_QP_CREATE_BLOCK_SELF_MCAST_LB).
inline constexpr uint32_t kQpBlockSelfMcast = 1;
struct CreateQpResp {
  uint32_t qpn = 0;
  uint32_t bytes = 0;
};

// kOpenXrcd. Fds (has_fd): the file whose inode names the domain, shared by every context of the
// device that opens the same file; without one, a domain of its own. Answer: XrcdResp.
struct OpenXrcdReq {
  uint32_t oflags = 0;  // O_CREAT, O_EXCL (ibv_open_xrcd(3)); other bits are ignored
  uint32_t has_fd = 0;
};
struct XrcdResp {
  uint32_t xrcd = 0;
  uint32_t reserved = 0;
};
// kCreateXrcSrq: an SRQ of an XRC domain, whose completions go to cq. Answer: CreateSrqResp,
// whose id is the SRQ number initiators name (24 bits).
struct CreateXrcSrqReq {
  uint32_t pd = 0, max_wr = 0, max_sge = 0, xrcd = 0, cq = 0, reserved = 0;
  uint64_t handle = 0;
};
// kOpenQp (answer: CreateQpResp and the QP's segment) and kCloseQp: one handle of an XRC target
// QP, named by its domain and number; handle is the element of the events it gets.
struct OpenQpReq {
  uint32_t xrcd = 0;
  uint32_t qpn = 0;
  uint64_t handle = 0;
};

// A flow steering rule (ibv_create_flow), normalised: every field a frame may be matched on, with
// its mask (a mask bit set: that bit of the field must equal the value's); all-zero masks
// match anything. Multi-byte fields are in network byte order, as in the frame and in verbs'
// specs. l3 and l4 say which headers the frame must have at all (0: any).
struct FlowRule {
  uint8_t dst_mac[6] = {}, dst_mac_mask[6] = {};
  uint8_t src_mac[6] = {}, src_mac_mask[6] = {};
  uint16_t ether_type = 0, ether_type_mask = 0;  // after any VLAN tag
  uint16_t vlan_tag = 0, vlan_tag_mask = 0;      // the 802.1Q TCI; masked: the frame has a tag
  uint8_t l3 = 0;                                // 0, 4 (IPv4) or 6 (IPv6)
  uint8_t l4 = 0;                                // 0, 6 (TCP) or 17 (UDP)
  uint8_t proto = 0, proto_mask = 0;             // IPv4 protocol / IPv6 next header
  uint8_t tos = 0, tos_mask = 0;                 // IPv4 TOS / IPv6 traffic class
  uint8_t ttl = 0, ttl_mask = 0;                 // IPv4 TTL / IPv6 hop limit
  uint8_t ip_flags = 0, ip_flags_mask = 0;       // IPv4 flags (3 bits)
  uint8_t src_ip[16] = {}, src_ip_mask[16] = {};  // IPv4: the first 4 bytes
  uint8_t dst_ip[16] = {}, dst_ip_mask[16] = {};
  uint32_t flow_label = 0, flow_label_mask = 0;  // IPv6, 20 bits, network order
  uint16_t src_port = 0, src_port_mask = 0;
  uint16_t dst_port = 0, dst_port_mask = 0;
};
enum class FlowType : uint32_t { kNormal = 0, kAllDefault = 1, kMcDefault = 2, kSniffer = 3 };
enum FlowFlag : uint32_t { kFlowDontTrap = 1 };
struct CreateFlowReq {
  uint32_t qpn = 0;
  FlowType type = FlowType::kNormal;
  uint32_t priority = 0;  // lower first
  uint32_t flags = 0;     // FlowFlag
  FlowRule rule;
};
struct FlowResp {
  uint32_t flow = 0;
  uint32_t reserved = 0;
};

// RSS (verbs-mapping.md §18).
inline constexpr uint32_t kMaxIndTableLog = 8;  // 256 WQs per indirection table
inline constexpr uint32_t kMaxRssKey = 64;       // bytes of a Toeplitz key
struct IndTableReq {
  uint32_t log_size = 0;  // 1 << log_size entries
  uint32_t reserved = 0;
  uint32_t wqn[1u << kMaxIndTableLog] = {};
};
struct IndTableResp {
  uint32_t table = 0;
  uint32_t reserved = 0;
};
enum RssField : uint64_t {  // ibv_rx_hash_fields
  kRssSrcIpv4 = 1 << 0, kRssDstIpv4 = 1 << 1, kRssSrcIpv6 = 1 << 2, kRssDstIpv6 = 1 << 3,
  kRssSrcPortTcp = 1 << 4, kRssDstPortTcp = 1 << 5, kRssSrcPortUdp = 1 << 6,
  kRssDstPortUdp = 1 << 7,
};
inline constexpr uint64_t kRssFields = 0xff;
inline constexpr uint32_t kRssToeplitz = 1;  // IBV_RX_HASH_FUNC_TOEPLITZ
// Answer: CreateQpResp and the QP's segment (its state).
struct CreateRssQpReq {
  uint32_t pd = 0, table = 0;
  uint32_t function = kRssToeplitz;
  uint32_t key_len = 0;
  uint8_t key[kMaxRssKey] = {};
  uint64_t fields = 0;   // RssField
  uint64_t handle = 0;
};

// Attributes of ibv_modify_qp the engine needs, already checked by the driver against verbs'
// rules (and checked again for range by the engine).
struct QpRemote {
  uint32_t ip = 0;           // peer IPv4 (from the IPv4-mapped dgid), host order
  uint32_t qpn = 0;          // dest_qp_num
  uint32_t path_mtu = 4096;  // bytes
  uint32_t rq_psn = 0, sq_psn = 0;
  uint32_t qkey = 0;
  uint8_t timeout = 14;      // 4.096 us * 2^timeout, 0 = infinite
  uint8_t retry_cnt = 7;
  uint8_t rnr_retry = 7;
  uint8_t min_rnr_timer = 12;
  uint8_t max_rd_atomic = 1;
  uint8_t max_dest_rd_atomic = 1;
  uint8_t reserved[2] = {};
};
enum ModifyFlag : uint32_t { kModState = 1, kModRemote = 2, kModAccess = 4 };
struct ModifyQpReq {
  uint32_t qpn = 0;
  uint32_t what = 0;        // ModifyFlag
  QpState state = QpState::kReset;
  uint32_t access = 0;      // qp_access_flags
  QpRemote remote;
};

// --- direct verbs ---
enum QpPathFlag : uint32_t { kQpIsolated = 1, kQpNoRateHints = 2 };
// kSetQpPaths. num_paths 0: the device's default; plane_mask 0: every plane.
struct SetQpPathsReq {
  uint32_t qpn = 0;
  uint16_t num_paths = 0;
  uint16_t reserved = 0;
  uint32_t plane_mask = 0;
  uint32_t flags = 0;       // QpPathFlag
};
// kQueryQpConn (IdReq: the qpn).
struct QpConnResp {
  uint32_t conn_id = 0;     // 0: no connection yet
  uint32_t lane = 0;
  uint32_t peer_ip = 0;     // host order, 0 before RTR
  uint16_t num_paths = 0, paths_active = 0;
  uint32_t plane_mask = 0;
  uint32_t flags = 0;       // QpPathFlag in force
  uint32_t streams = 0;     // QPs of the device on the same lane to the same peer
  uint32_t rate_hint_mbps = 0;
  uint32_t reserved = 0;
};
// kQueryPaths: paths [first, first + count) of the QP's connection.
struct QueryPathsReq {
  uint32_t qpn = 0;
  uint32_t first = 0;
};
struct PathEntry {
  uint16_t path_id = 0, udp_sport = 0;
  uint8_t plane = 0, state = 0;  // state: transport::PathState, 3 = its plane is down
  uint16_t reserved = 0;
  uint32_t cwnd_pkts = 0, inflight_pkts = 0;
  uint64_t inflight_bytes = 0;
  int64_t srtt_ns = 0, min_rtt_ns = 0;
  uint64_t tx_pkts = 0, tx_bytes = 0, retx_pkts = 0, ecn_marks = 0, sack_gaps = 0, timeouts = 0;
  uint32_t rate_hint_mbps = 0;
  uint32_t reserved2 = 0;
};
static_assert(sizeof(PathEntry) == 96);
inline constexpr uint32_t kPathsPerPage = 64;
struct QueryPathsResp {
  uint32_t total = 0;   // paths of the connection
  uint32_t count = 0;   // entries that follow
  PathEntry entries[kPathsPerPage];
};
static_assert(sizeof(Header) + sizeof(QueryPathsResp) <= kMaxMessage);
struct RepathReq {
  uint32_t qpn = 0;
  uint32_t path = 0;
};
struct RepathResp {
  uint32_t udp_sport = 0;
  uint32_t reserved = 0;
};
struct QueryDeviceResp {
  uint32_t wire_version = 0;
  uint32_t planes_up = 0;   // mask
  uint32_t max_streams = 0;
  uint32_t port_active = 0;  // 1: the verbs port is ACTIVE (verbs-mapping.md §8)
};
// kLinkPlane (admin).
struct LinkPlaneReq {
  char link[kNameLen] = {};
  uint32_t plane = 0;
  uint32_t up = 0;
};

// kLinkCapture. Fds (start): the file the pcap goes to, its global header not yet written.
struct CaptureReq {
  char link[kNameLen] = {};
  uint32_t action = 0;       // kCaptureStop, kCaptureStart, kCaptureQuery
  uint32_t snaplen = 0;      // bytes kept per frame
  uint64_t max_frames = 0;   // 0: until stopped
  uint32_t planes = ~0u;     // bit p: plane p
  uint32_t reserved = 0;
};
inline constexpr uint32_t kCaptureStop = 0, kCaptureStart = 1, kCaptureQuery = 2;
struct CaptureResp {
  uint64_t frames = 0;       // written so far
  uint32_t done = 0;         // max_frames reached, or the file refused a write
  uint32_t reserved = 0;
};

// kLinkOpen / kLinkClose: a link recorded under the run dir.
struct LinkReq {
  char link[kNameLen] = {};
};
// kLinkOpen's answer (and kEngineInfo's per link): one line of reason on failure.
struct TextResp {
  char text[256] = {};
};
struct EngineInfoResp {
  uint32_t pid = 0;
  uint32_t links = 0;
  uint32_t sessions = 0;
  uint32_t cm_ids = 0;  // RDMA CM ids of every channel (docs/spec/cm.md)
  // Links whose port wakes a napping engine when a frame arrives (a receive descriptor:
  // af_packet, af_xdp, UDP sockets, in-process links; not memif); the datapath's naps and how
  // many a frame or a doorbell ended (the rest ran their time).
  uint32_t links_port_wake = 0;
  uint32_t datapath_threads = 0;  // the links are divided among them
  uint64_t naps = 0, naps_frame = 0, naps_doorbell = 0;
  int32_t datapath_nice = 0;  // the nice value the datapath threads run at
  uint32_t reserved = 0;
};
struct SessionInfoReq {
  uint32_t index = 0;
  uint32_t reserved = 0;
};
struct SessionInfoResp {
  uint32_t pid = 0;
  uint32_t pds = 0, mrs = 0, cqs = 0, srqs = 0, qps = 0;
  char link[kNameLen] = {};
  // How its memory is reached: regions with shared pages and their bytes; accesses by a plain
  // copy and by the fallback (process_vm_readv/writev); its system calls for them.
  uint32_t mrs_shared = 0;
  uint32_t reserved = 0;
  uint64_t shared_bytes = 0, direct_accesses = 0, fallback_accesses = 0, memory_syscalls = 0;
};

// --- framing ---------------------------------------------------------------------------------

// One message as it travels: header, body bytes, descriptors.
struct Message {
  Header header;
  std::vector<uint8_t> body;
  std::vector<int> fds;
  uint32_t pid = 0, uid = 0;  // sender credentials (receiver side, when the socket passes them)

  template <typename T>
  std::optional<T> as() const {
    if (body.size() != sizeof(T)) return std::nullopt;
    T t;
    std::memcpy(&t, body.data(), sizeof(T));
    return t;
  }
  template <typename T>
  void set(const T& t) {
    body.resize(sizeof(T));
    std::memcpy(body.data(), &t, sizeof(T));
  }
};

// Sends one message (header + body + fds) with MSG_NOSIGNAL and `flags`; 0 or an errno.
int send_message(int sock, const Message& m, int flags = 0);
// Receives one message; 0, ECONNRESET when the peer closed, EBADMSG for a message that is
// not one (bad magic, version, truncated, too many fds: received fds are closed), or an errno.
// Credentials are filled when the socket has SO_PASSCRED set.
int recv_message(int sock, Message* m);

// Copies a name into a fixed field; false when it does not fit.
bool put_name(char (&dst)[kNameLen], const std::string& name);
std::string get_name(const char (&src)[kNameLen]);

// Closes every descriptor of m (a message whose fds nobody takes).
void close_fds(Message* m);

}  // namespace metaroce::hostif

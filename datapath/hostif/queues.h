// SPDX-License-Identifier: Apache-2.0
// The queue-level interface between a driver (the libibverbs provider, a unit test) and the
// engine: the layout of the rings they share in memory, as a hardware NIC shares descriptor
// rings with its driver, and the few helpers both sides use on them. Plain data of fixed width in
// the host's byte order, no pointers; ABI version kAbiVersion (docs/spec/verbs-mapping.md §10).
//
// Every ring index is a free-running 32-bit counter written by exactly one side (single producer,
// single consumer) and read by the other with acquire semantics. The engine treats everything a
// driver writes as untrusted: indices are masked, counts clamped, keys checked on use, and no
// lock is ever shared with a driver (a process killed while holding one would stop the engine).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

namespace metaroce::hostif {

inline constexpr uint32_t kAbiVersion = 4;  // 2: RegMrReq carries an IOVA; rereg, MW ops;
                                            // 3: 48-byte CQEs (a TM tag), TM SRQ requests;
                                            // 4: a sleeping flag per datapath thread

// Limits of the interface (the engine may grant less; ibv_query_device reports these).
inline constexpr uint32_t kMaxSge = 16;
inline constexpr uint32_t kMaxInline = 1024;
inline constexpr uint32_t kMaxQpWr = 16384;
inline constexpr uint32_t kMaxCqe = (1u << 22) - 1;  // a 256 MiB ring, as many as ConnectX offers
inline constexpr uint32_t kMaxSrqWr = 16384;
// Tag matching (verbs-mapping.md §19): a TM SRQ's list, and its tag-list operations in flight
// (they are carried out before ibv_post_srq_ops returns: max_ops bounds nothing more).
inline constexpr uint32_t kMaxTmTags = 1024;
inline constexpr uint32_t kMaxTmOps = 1024;
// The largest rendezvous request header the NIC reads from a first segment (TMH and RVH).
inline constexpr uint32_t kMaxRndvHdr = 64;
inline constexpr uint32_t kMaxMrSize = 1u << 31;  // bytes per MR (transport offsets are 32-bit)
inline constexpr uint32_t kMaxRdAtomic = 16;  // outstanding READ/atomic requests per QP, each way
inline constexpr uint32_t kAtomicSize = 8;    // FETCH_ADD and CMP_SWP operate on 8 aligned bytes
// Objects per link (all processes together).
inline constexpr uint32_t kMaxQps = 16384;
inline constexpr uint32_t kMaxCqs = 16384;
inline constexpr uint32_t kMaxSrqs = 16384;
inline constexpr uint32_t kMaxPds = 65536;
// Multicast (verbs-mapping.md §7): groups a device has members in, QPs attached to one group.
inline constexpr uint32_t kMaxMcastGroups = 1024;
inline constexpr uint32_t kMaxMcastQpAttach = 256;

inline constexpr uint32_t kCqMagic = 0x5143524d;   // "MRCQ"
inline constexpr uint32_t kQpMagic = 0x5051524d;   // "MRQP"
inline constexpr uint32_t kSrqMagic = 0x5253524d;  // "MRSR"
inline constexpr uint32_t kStatusMagic = 0x5445524d;  // "MRET"

// An index written by one side only, on a cache line of its own.
struct alignas(64) Index {
  std::atomic<uint32_t> v{0};
  uint32_t load() const { return v.load(std::memory_order_acquire); }
  uint32_t peek() const { return v.load(std::memory_order_relaxed); }
  void store(uint32_t x) { v.store(x, std::memory_order_release); }
};
static_assert(sizeof(Index) == 64);
static_assert(std::atomic<uint32_t>::is_always_lock_free, "indices are shared between processes");

// --- work requests -----------------------------------------------------------------------------

enum class WqeOp : uint8_t {
  kSend, kSendImm, kWrite, kWriteImm, kRead, kCmpSwp, kFetchAdd,
  kBindMw,    // local: binds a memory window (fields: see SendWqe)
  kLocalInv,  // local: invalidates the type 2 window named by rkey
  kSendInv,   // a SEND whose responder invalidates the type 2 window named by rkey
  kAtomicWrite,  // 8 bytes stored whole at remote_addr (verbs-mapping.md §3): see SendWqe
};
inline constexpr uint8_t kWqeOpCount = 11;
// Operations the NIC carries out itself, with no message to the peer.
constexpr bool is_local(WqeOp op) { return op == WqeOp::kBindMw || op == WqeOp::kLocalInv; }

constexpr bool is_atomic(WqeOp op) { return op == WqeOp::kCmpSwp || op == WqeOp::kFetchAdd; }
// Operations whose WQE waits for a response from the peer (limited by max_rd_atomic).
constexpr bool needs_response(WqeOp op) { return op == WqeOp::kRead || is_atomic(op); }

// kGathered: the SGEs' bytes were copied into the slot's inline area at post time (the SGEs
// stay, for the NIC to check their keys and bounds; it sends the copy).
enum WqeFlag : uint8_t { kSignaled = 1, kSolicited = 2, kFence = 4, kGathered = 8 };

struct Sge {
  uint64_t addr;
  uint32_t length;
  uint32_t lkey;
};
static_assert(sizeof(Sge) == 16);

// A send WQE's fixed part. In its ring slot it is followed by max_sge Sge entries, then by
// max_inline bytes of inline payload; the slot stride is in the QP header.
// kBindMw: rkey = the window's current rkey, imm = its new rkey (host order), remote_addr and
// compare_add = the range bound (IOVA of the region, length; length 0 unbinds), swap = the
// region's lkey << 32 | the window's access flags; no SGEs. kLocalInv and kSendInv: rkey = the
// rkey to invalidate. kAtomicWrite: the 8 bytes are compare_add as memory holds them (not a
// number) when the WQE has no SGE and no inline data (ibv_wr_atomic_write), else its SGEs or
// inline data, which must hold exactly 8 (ibv_post_send).
struct SendWqe {
  uint64_t wr_id;
  WqeOp op;
  uint8_t flags;          // WqeFlag
  uint16_t num_sge;       // SGEs used; 0 with inline_len > 0: the payload is inline
  uint32_t inline_len;
  uint32_t imm;           // network byte order, as in ibv_send_wr
  uint32_t rkey;          // RDMA and atomics; UD: the Q_Key
  uint64_t remote_addr;
  uint64_t compare_add;   // kCmpSwp: compare value; kFetchAdd: addend (host order)
  uint64_t swap;          // kCmpSwp: value stored when the compare matches
  uint32_t ud_ip;         // UD: destination IPv4, host order
  uint32_t ud_qpn;        // UD: destination QP
  uint32_t xrc_srqn;      // XRC initiator: the SRQ of the target's XRC domain it is for
  uint32_t reserved;
};
static_assert(sizeof(SendWqe) == 64);

// A receive WQE's fixed part, followed in its slot by max_sge Sge entries.
struct RecvWqe {
  uint64_t wr_id;
  uint32_t num_sge;
  uint32_t reserved;
};
static_assert(sizeof(RecvWqe) == 16);

// --- completions -------------------------------------------------------------------------------

// Values are those of enum ibv_wc_status and ibv_wc_opcode (the provider pins them with
// static_asserts); named here so that the engine needs no verbs header.
enum class WcStatus : uint32_t {
  kSuccess = 0, kLocLenErr = 1, kLocQpOpErr = 2, kLocEecOpErr = 3, kLocProtErr = 4,
  kWrFlushErr = 5, kMwBindErr = 6, kBadRespErr = 7, kLocAccessErr = 8, kRemInvReqErr = 9,
  kRemAccessErr = 10, kRemOpErr = 11, kRetryExcErr = 12, kRnrRetryExcErr = 13,
  kLocRddViolErr = 14, kRemInvRdReqErr = 15, kRemAbortErr = 16, kInvEecnErr = 17,
  kInvEecStateErr = 18, kFatalErr = 19, kRespTimeoutErr = 20, kGeneralErr = 21,
  kTmErr = 22,  // a tag list operation that could not be carried out (verbs-mapping.md §19)
};
enum class WcOpcode : uint32_t {
  kSend = 0, kRdmaWrite = 1, kRdmaRead = 2, kCompSwap = 3, kFetchAdd = 4, kBindMw = 5,
  kLocalInv = 6, kTso = 7, kAtomicWrite = 9, kRecv = 128, kRecvRdmaWithImm = 129,
  // Tag matching (verbs-mapping.md §19): list operations, and receives of a TM SRQ.
  kTmAdd = 130, kTmDel = 131, kTmSync = 132, kTmRecv = 133, kTmNoTag = 134,
};
inline constexpr uint32_t kWcWithImm = 1 << 1;  // IBV_WC_WITH_IMM
inline constexpr uint32_t kWcWithInv = 1 << 3;  // IBV_WC_WITH_INV: imm is the invalidated rkey
inline constexpr uint32_t kWcGrh = 1 << 0;      // IBV_WC_GRH
inline constexpr uint32_t kWcTmSyncReq = 1 << 4;    // IBV_WC_TM_SYNC_REQ: report the unexpected count
inline constexpr uint32_t kWcTmMatch = 1 << 5;      // IBV_WC_TM_MATCH: tag and context are valid
inline constexpr uint32_t kWcTmDataValid = 1 << 6;  // IBV_WC_TM_DATA_VALID: the data is in place

// The queue entry a completion retires, so that the driver of an engine that died between
// staging a completion and publishing it can tell which work it accounts for
// (cq_recover_staged, first_unreported).
enum class CqeQueue : uint32_t {
  kNone = 0,  // no posted entry (tag list operations, rendezvous reads, provider's own)
  kSend = 1,  // wqe: the send queue counter of the WQE
  kRecv = 2,  // wqe: the receive queue counter of the WQE
  kSrq = 3,   // wqe: the SRQ slot, srq: the engine's SRQ id
};

struct Cqe {
  uint64_t wr_id;
  WcStatus status;
  WcOpcode opcode;
  uint32_t vendor_err;
  uint32_t byte_len;
  uint32_t imm;       // network byte order
  uint32_t qp_num;
  uint32_t src_qp;
  uint32_t wc_flags;  // kWcWithImm, kWcGrh, kWcTm*
  uint64_t tag;       // kWcTmMatch: the message's tag (imm then holds its TMH context)
  CqeQueue queue;     // what it retires (the driver's only after the engine is gone)
  uint32_t wqe;
  uint32_t srq;
  uint32_t seq;       // the ring position it was staged at, plus one (CqProducer::stage)
};
static_assert(sizeof(Cqe) == 64);

// Asynchronous event types (enum ibv_event_type values).
enum class AsyncEvent : uint32_t {
  kCqErr = 0, kQpFatal = 1, kQpReqErr = 2, kQpAccessErr = 3, kCommEst = 4, kSqDrained = 5,
  kPathMig = 6, kPathMigErr = 7, kDeviceFatal = 8, kPortActive = 9, kPortErr = 10,
  kLidChange = 11, kPkeyChange = 12, kSmChange = 13, kSrqErr = 14, kSrqLimitReached = 15,
  kQpLastWqeReached = 16,
};

// One asynchronous event as ibv_get_async_event reads it from a context's async descriptor
// (the layout of struct ib_uverbs_async_event_desc): the engine writes them, and so does the
// provider for the events it raises itself (the engine gone).
struct AsyncEventDesc {
  uint64_t element;     // the QP, SRQ or CQ handle the driver gave, or the context
  uint32_t event_type;  // AsyncEvent (ibv_event_type)
  uint32_t reserved;
};
static_assert(sizeof(AsyncEventDesc) == 16);

// --- queue states ------------------------------------------------------------------------------

enum class QpState : uint32_t { kReset, kInit, kRtr, kRts, kErr };
// kXrcIni: an XRC initiator (send queue only; each WQE names the target's SRQ); kXrcTgt: an XRC
// target (no queues of its own: its messages go to SRQs of its XRC domain); kRaw: Ethernet frames
// out of and into the link's port (verbs-mapping.md §18).
// kWq: a receive work queue (ibv_create_wq) of frames; kRss: a raw packet QP that spreads the
// frames steered to it over the WQs of an indirection table by a hash of their headers.
enum class QpType : uint32_t { kRc, kUd, kUc, kXrcIni, kXrcTgt, kRaw, kWq, kRss };

// --- shared segments ---------------------------------------------------------------------------
// Each object's rings live in one segment of their own (a sealed memfd the engine creates and
// both sides map), header first. Offsets are from the segment's start.

// Completion queue: the engine produces at head, the driver consumes at tail.
struct CqHeader {
  uint32_t magic;
  uint32_t version;
  uint32_t entries;     // power of two
  uint32_t capacity;    // completions it holds (entries - 1)
  uint32_t ring_offset;
  uint32_t reserved[11];
  Index head;           // engine
  Index tail;           // driver
  // Driver: 1 arms the next completion event, 2 only a solicited one (ibv_req_notify_cq); the
  // engine swaps it to 0 when it raises the event.
  Index armed;
  Index overflow;       // engine: nonzero once a completion was lost
};
static_assert(sizeof(CqHeader) == 64 * 5);

// Queue pair: send and receive rings, each produced by the driver and retired by the engine.
struct QpHeader {
  uint32_t magic;
  uint32_t version;
  uint32_t qpn;
  QpType type;
  uint32_t sq_entries, sq_stride, sq_offset, max_send_wr;  // entries: power of two
  uint32_t rq_entries, rq_stride, rq_offset, max_recv_wr;
  uint32_t max_send_sge, max_recv_sge, max_inline, reserved;
  Index sq_head;        // driver: WQEs posted
  Index sq_done;        // engine: WQEs retired; their slots are free
  Index rq_head;        // driver
  Index rq_done;        // engine
  Index state;          // engine: QpState, which post_send/post_recv check
};
static_assert(sizeof(QpHeader) == 64 * 6);

// Shared receive queue. Receives live in slots; a slot goes from the driver to the engine through
// the posted ring (in posting order, which is the order messages claim them) and back through
// the free ring once its receive completed (in any order).
struct SrqHeader {
  uint32_t magic;
  uint32_t version;
  uint32_t max_wr;       // slots
  uint32_t entries;      // of each index ring, power of two >= max_wr
  uint32_t stride;       // of a slot
  uint32_t max_sge;
  uint32_t slots_offset, posted_offset, free_offset;
  uint32_t reserved[7];
  Index posted_head;     // driver
  Index posted_tail;     // engine: receives claimed
  Index free_head;       // engine: slots returned
  Index free_tail;       // driver: slots taken
  Index limit;           // driver arms (ibv_modify_srq); the engine swaps it to 0 when it fires
};
static_assert(sizeof(SrqHeader) == 64 * 6);

// Datapath threads an engine may run (links are divided among them; docs/design.md).
inline constexpr uint32_t kMaxDatapathThreads = 8;

// The engine's page every driver maps read-only: whether the datapath thread that serves its
// link sleeps (HelloResp::datapath names it; the doorbell the driver got is that thread's).
struct StatusPage {
  uint32_t magic;
  uint32_t version;
  uint32_t engine_pid;
  uint32_t reserved[13];
  Index sleeping[kMaxDatapathThreads];  // nonzero: write the doorbell eventfd after posting
};
static_assert(sizeof(StatusPage) <= 4096);

// --- layouts -----------------------------------------------------------------------------------

constexpr uint32_t round_up(uint32_t x, uint32_t to) { return (x + to - 1) / to * to; }
constexpr uint32_t pow2_at_least(uint32_t x) {
  uint32_t p = 1;
  while (p < x) p <<= 1;
  return p;
}
inline constexpr uint32_t kPage = 4096;

struct CqLayout {
  uint32_t entries, ring_offset, bytes;
};
// A CQ of at least cqe completions (1..kMaxCqe).
constexpr CqLayout cq_layout(uint32_t cqe) {
  CqLayout l{};
  l.entries = pow2_at_least(cqe + 1);
  l.ring_offset = sizeof(CqHeader);
  l.bytes = round_up(l.ring_offset + l.entries * static_cast<uint32_t>(sizeof(Cqe)), kPage);
  return l;
}

struct QpCaps {
  uint32_t max_send_wr = 1, max_recv_wr = 1, max_send_sge = 1, max_recv_sge = 1, max_inline = 0;
};
struct QpLayout {
  uint32_t sq_entries, sq_stride, sq_offset, rq_entries, rq_stride, rq_offset, bytes;
};
constexpr uint32_t send_stride(uint32_t max_sge, uint32_t max_inline) {
  return round_up(static_cast<uint32_t>(sizeof(SendWqe) + sizeof(Sge) * max_sge) + max_inline, 64);
}
constexpr uint32_t recv_stride(uint32_t max_sge) {
  return round_up(static_cast<uint32_t>(sizeof(RecvWqe) + sizeof(Sge) * max_sge), 16);
}
constexpr QpLayout qp_layout(const QpCaps& c) {
  QpLayout l{};
  l.sq_entries = pow2_at_least(c.max_send_wr ? c.max_send_wr : 1);
  l.sq_stride = send_stride(c.max_send_sge, c.max_inline);
  l.sq_offset = sizeof(QpHeader);
  l.rq_entries = pow2_at_least(c.max_recv_wr ? c.max_recv_wr : 1);
  l.rq_stride = recv_stride(c.max_recv_sge);
  l.rq_offset = round_up(l.sq_offset + l.sq_entries * l.sq_stride, 64);
  l.bytes = round_up(l.rq_offset + l.rq_entries * l.rq_stride, kPage);
  return l;
}

struct SrqLayout {
  uint32_t entries, stride, slots_offset, posted_offset, free_offset, bytes;
};
constexpr SrqLayout srq_layout(uint32_t max_wr, uint32_t max_sge) {
  SrqLayout l{};
  l.entries = pow2_at_least(max_wr ? max_wr : 1);
  l.stride = recv_stride(max_sge);
  l.slots_offset = sizeof(SrqHeader);
  l.posted_offset = round_up(l.slots_offset + max_wr * l.stride, 64);
  l.free_offset = round_up(l.posted_offset + l.entries * 4, 64);
  l.bytes = round_up(l.free_offset + l.entries * 4, kPage);
  return l;
}

// Formats a segment of the layout's size (zeroed) as an empty queue. The SRQ's free ring starts
// with every slot in it.
void init_cq(void* seg, uint32_t cqe);
void init_qp(void* seg, uint32_t qpn, QpType type, const QpCaps& caps);
void init_srq(void* seg, uint32_t max_wr, uint32_t max_sge);
void init_status(void* seg, uint32_t engine_pid);

// Checks that a segment of `bytes` bytes holds a queue of this ABI whose rings fit inside it (a
// driver checks what the engine handed it before touching it).
bool valid_cq(const void* seg, size_t bytes);
bool valid_qp(const void* seg, size_t bytes);
bool valid_srq(const void* seg, size_t bytes);

// --- accessors -------------------------------------------------------------------------------

inline Cqe* cq_ring(CqHeader* h) { return reinterpret_cast<Cqe*>(reinterpret_cast<char*>(h) + h->ring_offset); }

inline uint8_t* sq_slot(QpHeader* h, uint32_t index) {
  return reinterpret_cast<uint8_t*>(h) + h->sq_offset +
         size_t{index & (h->sq_entries - 1)} * h->sq_stride;
}
inline uint8_t* rq_slot(QpHeader* h, uint32_t index) {
  return reinterpret_cast<uint8_t*>(h) + h->rq_offset +
         size_t{index & (h->rq_entries - 1)} * h->rq_stride;
}
inline SendWqe* send_wqe(uint8_t* slot) { return reinterpret_cast<SendWqe*>(slot); }
inline Sge* send_sges(uint8_t* slot) { return reinterpret_cast<Sge*>(slot + sizeof(SendWqe)); }
// Inline bytes follow the QP's max_send_sge SGE entries.
inline uint8_t* send_inline(uint8_t* slot, uint32_t max_sge) {
  return slot + sizeof(SendWqe) + sizeof(Sge) * max_sge;
}
inline RecvWqe* recv_wqe(uint8_t* slot) { return reinterpret_cast<RecvWqe*>(slot); }
inline Sge* recv_sges(uint8_t* slot) { return reinterpret_cast<Sge*>(slot + sizeof(RecvWqe)); }

inline uint8_t* srq_slot(SrqHeader* h, uint32_t slot) {
  return reinterpret_cast<uint8_t*>(h) + h->slots_offset + size_t{slot} * h->stride;
}
inline uint32_t* srq_posted_ring(SrqHeader* h) {
  return reinterpret_cast<uint32_t*>(reinterpret_cast<char*>(h) + h->posted_offset);
}
inline uint32_t* srq_free_ring(SrqHeader* h) {
  return reinterpret_cast<uint32_t*>(reinterpret_cast<char*>(h) + h->free_offset);
}

// --- the driver's side -------------------------------------------------------------------------
// Single producer per ring: callers serialise posts to one queue (the provider holds a lock per
// queue, as a hardware driver does per ring).

// Reserves the next send slot, or nullptr when max_send_wr WQEs are outstanding; publish with
// sq_post().
uint8_t* sq_reserve(QpHeader* h);
void sq_post(QpHeader* h);
uint8_t* rq_reserve(QpHeader* h);
void rq_post(QpHeader* h);
// Posts one receive into an SRQ: 0, or ENOMEM when every slot is outstanding.
int srq_post(SrqHeader* h, uint64_t wr_id, const Sge* sge, uint32_t num_sge);
// Takes up to n completions; returns how many.
// Driver: removes the completions of QP qpn not yet polled, keeping the others in order (a
// QP moved to RESET); returns how many went. The caller excludes its own pollers.
int cq_clean(CqHeader* h, uint32_t qpn);
int cq_poll(CqHeader* h, int n, Cqe* out);
// Once the engine is gone (it died or removed the device), the driver completes what is still
// outstanding itself, as flushed work: it becomes the CQ's producer. False when the CQ is full.
bool cq_push_orphan(CqHeader* h, const Cqe& c);
// Once the engine is gone: the completions it staged after head and never published (it died
// within a pass) are published, as flushed, since the data they announce may not have reached
// memory. They are found by the position each was staged at; returns how many (the last that
// many before the new head). The caller excludes its own pollers.
uint32_t cq_recover_staged(CqHeader* h);
// Once the engine is gone: the first entry of a queue, between the engine's done index and the
// driver's head, that no completion in `recovered` (cq_recover_staged's) retires, for QP qpn's
// send or receive queue. The engine stages a completion before it moves done past its entry.
uint32_t first_unreported(uint32_t done, uint32_t head, uint32_t qpn, CqeQueue queue,
                          std::span<const Cqe> recovered);

// --- the engine's side -------------------------------------------------------------------------

// Completion producer with staging: completions are written into the ring at once but become
// visible to the driver only at publish(), so that the engine can make the data they announce
// visible first (docs/design.md, "Application memory").
// It reads the ring's geometry once, at construction (right after init_cq, before any driver
// saw the segment): a driver may scribble over its header afterwards.
class CqProducer {
 public:
  explicit CqProducer(CqHeader* h)
      : h_(h), ring_(cq_ring(h)), mask_(h->entries - 1), capacity_(h->capacity),
        published_(h->head.peek()), staged_head_(published_) {}
  // False (and the overflow recorded) when the ring is full.
  bool stage(const Cqe& c);
  // Makes staged completions visible. Returns true when they should raise a completion event:
  // the CQ was armed (solicited-only arming counts as arming for any completion: the engine does
  // not track the solicited bit, and a spurious event costs the application one empty poll).
  bool publish();
  bool has_staged() const { return staged_head_ != published_; }
  CqHeader* header() const { return h_; }
  // Nonzero once a completion was lost.
  bool overflowed() const { return h_->overflow.peek() != 0; }
  uint32_t capacity() const { return capacity_; }
  // Staged completions not yet published, most recent last (to amend one before publish()).
  uint32_t staged() const { return staged_head_ - published_; }
  Cqe& staged_at(uint32_t i) { return ring_[(published_ + i) & mask_]; }
  // Moves to ring `to` (formatted by init_cq, not yet shared with the driver) what the driver
  // has not polled, published and staged, in order, with the armed and overflow state; from
  // then on completions go there (ibv_resize_cq: the driver does not poll meanwhile). False,
  // and nothing moved, when they and `owed` more do not fit.
  bool move_to(CqHeader* to, uint32_t owed = 0);

 private:
  CqHeader* h_;
  Cqe* ring_;
  uint32_t mask_;
  uint32_t capacity_;
  uint32_t published_;    // what the driver may read (head as the engine last wrote it)
  uint32_t staged_head_;
};

}  // namespace metaroce::hostif

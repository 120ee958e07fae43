// SPDX-License-Identifier: Apache-2.0
// Registered memory of every kind an application has, reached by a remote peer (docs/design.md,
// "Shared memory regions"): one process, devices A and B, an RC QP between them; A writes into
// (and reads from) regions of B and every byte is checked, with guard bytes around each region.
//   - a region that does not start or end on a page (its whole pages shared, the rest not);
//   - a stack buffer, a file-backed mapping, huge pages (hugetlbfs where reserved, and THP);
//   - fork: the child has its own copy, its stores do not reach the parent (with ibv_fork_init,
//     RDMAV_FORK_SAFE=1, the region is not mapped in the child at all);
//   - ibv_rereg_mr to a new buffer; MADV_DONTNEED under a live region;
//   - memory the engine cannot reach (PROT_NONE, read-only written, a hole): EFAULT at reg_mr;
//   - free and reallocate under a live region: no crash, the new memory is not the region's;
//   - last, the region unmapped: the engine's access fails with an error completion.
//
//   mr_memory --a DEV --b DEV [--metaroce PATH]
// With --metaroce, `metaroce engine status --json` must show B's shared regions (unless
// METAROCE_SHARED_MR=0). Exit status 0 only if every check passed.
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "tests/integration/test_support.h"

const char* const metaroce::test::kProgram = "mr_memory";
using namespace metaroce::test;

namespace {

const size_t kPage = static_cast<size_t>(sysconf(_SC_PAGESIZE));
constexpr uint8_t kGuard = 0xEE;

uint8_t pattern(uint32_t seed, size_t i) { return static_cast<uint8_t>((seed * 131 + i * 7) ^ (i >> 9)); }

struct Side : DeviceBasics {
  ibv_qp* qp = nullptr;
};

Side open_side(const std::string& dev) {
  Side s;
  static_cast<DeviceBasics&>(s) = open_basics(dev, 16);
  return s;
}

// A fresh RC QP on each side (a_qp: A's, made by the caller), connected.
void connect(Side& a, Side& b, ibv_qp* a_qp = nullptr) {
  for (Side* s : {&a, &b}) {
    if (s->qp) ibv_destroy_qp(s->qp);
    ibv_qp_init_attr attr{};
    attr.send_cq = attr.recv_cq = s->cq;
    attr.qp_type = IBV_QPT_RC;
    attr.cap.max_send_wr = attr.cap.max_recv_wr = 8;
    attr.cap.max_send_sge = attr.cap.max_recv_sge = 1;
    s->qp = s == &a && a_qp ? a_qp : ibv_create_qp(s->pd, &attr);
    if (!s->qp) die("create qp");
    modify_to_init(s->qp, IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ);
  }
  RcPeer to_b{b.qp->qp_num, b.gid.raw}, to_a{a.qp->qp_num, a.gid.raw};
  modify_to_rts(a.qp, to_b);
  modify_to_rts(b.qp, to_a);
}

Side A, B;
uint8_t* a_buf = nullptr;  // A's source and sink, 4 MiB
ibv_mr* a_mr = nullptr;
constexpr size_t kABytes = 4u << 20;

// One WRITE (or READ) of len bytes between A's buffer and [addr, addr + len) of B's region.
ibv_wc_status transfer(bool write, uint64_t addr, uint32_t rkey, size_t len) {
  ibv_sge sge{reinterpret_cast<uintptr_t>(a_buf), static_cast<uint32_t>(len), a_mr->lkey};
  ibv_send_wr wr{}, *bad = nullptr;
  wr.opcode = write ? IBV_WR_RDMA_WRITE : IBV_WR_RDMA_READ;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.wr.rdma.remote_addr = addr;
  wr.wr.rdma.rkey = rkey;
  if (ibv_post_send(A.qp, &wr, &bad)) die("post_send");
  ibv_wc wc{};
  for (int n = 0; (n = ibv_poll_cq(A.cq, 1, &wc)) == 0;) {}
  return wc.status;
}

// Writes a pattern over all of region [p, p + len) of B, checks it there and the guard bytes
// around it, reads it back and checks that.
void write_read_check(const char* what, uint8_t* p, size_t len, ibv_mr* mr, uint32_t seed,
                      size_t guard = 0) {
  for (size_t i = 0; i < len; ++i) a_buf[i] = pattern(seed, i);
  CHECK(transfer(true, reinterpret_cast<uintptr_t>(p), mr->rkey, len) == IBV_WC_SUCCESS,
        "%s: WRITE failed", what);
  size_t bad = 0;
  for (size_t i = 0; i < len; ++i) bad += p[i] != pattern(seed, i);
  for (size_t i = 1; i <= guard; ++i) bad += (p[-static_cast<ptrdiff_t>(i)] != kGuard) + (p[len - 1 + i] != kGuard);
  CHECK(bad == 0, "%s: %zu bytes wrong after WRITE", what, bad);
  std::memset(a_buf, 0, len);
  CHECK(transfer(false, reinterpret_cast<uintptr_t>(p), mr->rkey, len) == IBV_WC_SUCCESS,
        "%s: READ failed", what);
  bad = 0;
  for (size_t i = 0; i < len; ++i) bad += a_buf[i] != pattern(seed, i);
  CHECK(bad == 0, "%s: %zu bytes wrong after READ", what, bad);
}

constexpr int kRemote = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;

ibv_mr* reg(void* p, size_t len) {
  ibv_mr* mr = ibv_reg_mr(B.pd, p, len, kRemote);
  if (!mr) die("reg_mr");
  return mr;
}

uint8_t* anon(size_t bytes) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) die("mmap");
  return static_cast<uint8_t*>(p);
}

bool sharing() {
  const char* v = std::getenv("METAROCE_SHARED_MR");
  return !v || std::strcmp(v, "0") != 0;
}

// What `metaroce engine status --json` says.
std::string engine_status(const char* metaroce) {
  const std::string cmd = std::string(metaroce) + " engine status --json";
  FILE* f = popen(cmd.c_str(), "r");
  std::string out;
  char buf[4096];
  while (f && std::fgets(buf, sizeof(buf), f)) out += buf;
  if (f) pclose(f);
  return out;
}

// The sum of a field over the engine's contexts.
uint64_t engine_sum(const char* metaroce, const char* field) {
  const std::string out = engine_status(metaroce);
  const std::string key = std::string("\"") + field + "\": ";
  uint64_t sum = 0;
  for (size_t at = out.find(key); at != std::string::npos; at = out.find(key, at + 1))
    sum += std::strtoull(out.c_str() + at + key.size(), nullptr, 10);
  return sum;
}

// From 100 bytes into a page to 100 bytes before the end of another: the whole pages shared,
// the first and last bytes reached by system call, the bytes around it untouched.
void unaligned(const char* metaroce) {
  uint8_t* base = anon(8 * kPage);
  std::memset(base, kGuard, 8 * kPage);
  ibv_mr* mr = reg(base + 100, 8 * kPage - 200);
  write_read_check("unaligned", base + 100, 8 * kPage - 200, mr, 1, 100);
  if (metaroce) {
    const uint64_t shared = engine_sum(metaroce, "mrs_shared");
    const uint64_t direct = engine_sum(metaroce, "direct_accesses");
    if (sharing())  // A's 4 MiB buffer and this one
      CHECK(shared >= 2 && direct > 0, "engine status: %lu shared regions, %lu direct accesses",
            static_cast<unsigned long>(shared), static_cast<unsigned long>(direct));
    else
      CHECK(shared == 0 && direct == 0, "METAROCE_SHARED_MR=0, yet %lu shared regions",
            static_cast<unsigned long>(shared));
  }
  ibv_dereg_mr(mr);
  munmap(base, 8 * kPage);
  std::puts("ok unaligned region");
}

void stack_region() {
  alignas(64) uint8_t buf[3 * 4096 + 300];
  std::memset(buf, kGuard, sizeof(buf));
  ibv_mr* mr = reg(buf + 16, sizeof(buf) - 32);
  write_read_check("stack", buf + 16, sizeof(buf) - 32, mr, 2, 16);
  ibv_dereg_mr(mr);
  std::puts("ok stack buffer");
}

void file_region() {
  char path[] = "/tmp/metaroce-mr-memory-XXXXXX";
  const int fd = mkstemp(path);
  if (fd < 0) die("mkstemp");
  unlink(path);
  const size_t len = 4 * kPage;
  if (ftruncate(fd, static_cast<off_t>(len))) die("ftruncate");
  auto* p = static_cast<uint8_t*>(mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
  if (p == MAP_FAILED) die("mmap file");
  ibv_mr* mr = reg(p, len);
  write_read_check("file", p, len, mr, 3);
  uint8_t back[64];
  CHECK(pread(fd, back, sizeof(back), 100) == sizeof(back) &&
            std::memcmp(back, a_buf + 100, sizeof(back)) == 0,
        "the WRITE did not reach the file");
  ibv_dereg_mr(mr);
  munmap(p, len);
  close(fd);
  std::puts("ok file-backed mapping");
}

void huge_regions() {
  const size_t huge = 2u << 20;
  void* h = mmap(nullptr, huge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB,
                 -1, 0);
  if (h != MAP_FAILED) {
    ibv_mr* mr = reg(h, huge);
    write_read_check("hugetlb", static_cast<uint8_t*>(h) + 4000, 1u << 20, mr, 4);
    ibv_dereg_mr(mr);
    munmap(h, huge);
    std::puts("ok hugetlbfs page");
  } else {
    std::puts("note: no 2 MiB page reserved: hugetlbfs not tried");
  }
  // Transparent huge pages: 4 MiB aligned to 2 MiB, asked to be huge.
  uint8_t* raw = anon(3 * huge);
  auto* t = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + huge - 1) & ~(huge - 1));
  madvise(t, 2 * huge, MADV_HUGEPAGE);
  std::memset(t, 1, 2 * huge);
  ibv_mr* mr = reg(t, 2 * huge);
  write_read_check("thp", t + 12345, 3u << 20, mr, 5);
  ibv_dereg_mr(mr);
  munmap(raw, 3 * huge);
  std::puts("ok transparent huge pages");
}

// The child's pages are its own: what it stores does not reach the parent's region, and what
// the peer writes there afterwards does not reach the child. With ibv_fork_init (libibverbs
// excludes the region from fork) the child has no mapping there at all. (The child's copy is
// made as it starts, so what the peer writes while fork returns may reach it: docs/design.md.)
void fork_child() {
  const size_t len = 4 * kPage;
  uint8_t* p = anon(len);
  std::memset(p, 0x21, len);
  ibv_mr* mr = reg(p, len);
  const bool excluded = ibv_is_fork_initialized() == IBV_FORK_ENABLED;
  int up[2], go[2];
  if (pipe(up) || pipe(go)) die("pipe");
  const pid_t pid = fork();
  if (pid == 0) {
    unsigned char vec = 0;
    if (excluded) _exit(mincore(p, kPage, &vec) == -1 && errno == ENOMEM ? 0 : 3);
    bool ok = p[0] == 0x21 && p[len - 1] == 0x21;
    std::memset(p, 0x77, len);
    char c = 1;
    ok &= write(up[1], &c, 1) == 1 && read(go[0], &c, 1) == 1;  // the parent's WRITE is done
    ok &= p[0] == 0x77 && p[len - 1] == 0x77;
    _exit(ok ? 0 : 4);
  }
  char c = 1;
  if (!excluded && read(up[0], &c, 1) != 1) die("pipe read");
  write_read_check("fork parent", p, len, mr, 6);
  if (write(go[1], &c, 1) != 1) die("pipe write");
  int status = 0;
  waitpid(pid, &status, 0);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "fork child: status %d", status);
  size_t bad = 0;
  for (size_t i = 0; i < len; ++i) bad += p[i] != pattern(6, i);
  CHECK(bad == 0, "fork: %zu bytes of the parent changed by its child", bad);
  for (int fd : {up[0], up[1], go[0], go[1]}) close(fd);
  ibv_dereg_mr(mr);
  munmap(p, len);
  std::puts(excluded ? "ok fork (region excluded from the child)" : "ok fork (child's own copy)");
}

void rereg() {
  const size_t len = 4 * kPage;
  uint8_t* x = anon(len);
  uint8_t* y = anon(len);
  std::memset(x, 0x31, len);
  ibv_mr* mr = reg(x, len);
  if (ibv_rereg_mr(mr, IBV_REREG_MR_CHANGE_TRANSLATION, nullptr, y, len, 0)) die("rereg_mr");
  write_read_check("rereg", y, len, mr, 7);
  size_t bad = 0;
  for (size_t i = 0; i < len; ++i) bad += x[i] != 0x31;
  CHECK(bad == 0, "rereg: %zu bytes of the old buffer written", bad);
  ibv_dereg_mr(mr);
  munmap(x, len);
  munmap(y, len);
  std::puts("ok rereg_mr to a new buffer");
}

// Memory the engine could not reach is refused at registration with EFAULT, as a NIC refuses
// pages it cannot pin; read-only memory registered for remote reads only is accepted.
void unreachable() {
  const size_t len = 4 * kPage;
  uint8_t* p = anon(len);
  std::memset(p, 0x5a, len);
  // With ibv_fork_init, libibverbs itself first marks the range MADV_DONTFORK, which a hole
  // fails with ENOMEM before the provider is asked (as it would before any NIC's kernel).
  const bool fork_safe = ibv_is_fork_initialized() == IBV_FORK_ENABLED;
  auto refused = [&](const char* what, void* addr, size_t n, int access, int want = EFAULT) {
    errno = 0;
    ibv_mr* mr = ibv_reg_mr(B.pd, addr, n, access);
    if (mr || errno != want) {
      std::fprintf(stderr, "mr_memory: %s: registered (%p) or errno %d, not %d\n", what,
                   static_cast<void*>(mr), errno, want);
      std::exit(1);
    }
  };
  if (mprotect(p + kPage, kPage, PROT_NONE)) die("mprotect");
  refused("PROT_NONE page", p, len, kRemote);
  if (mprotect(p + kPage, kPage, PROT_READ)) die("mprotect");
  refused("read-only page with LOCAL_WRITE", p, len, kRemote);
  ibv_mr* ro = ibv_reg_mr(B.pd, p + kPage, kPage, IBV_ACCESS_REMOTE_READ);
  if (!ro) die("reg_mr of read-only memory for remote reads");
  ibv_dereg_mr(ro);
  if (munmap(p + 2 * kPage, kPage)) die("munmap");
  refused("a hole", p + kPage, 2 * kPage, IBV_ACCESS_REMOTE_READ, fork_safe ? ENOMEM : EFAULT);
  munmap(p, 2 * kPage);
  munmap(p + 3 * kPage, kPage);
  std::puts("ok unreachable memory refused with EFAULT");
}

// MADV_DONTNEED under a live region, then the peer writes: the application sees the bytes.
void dontneed() {
  const size_t len = 8 * kPage;
  uint8_t* p = anon(len);
  std::memset(p, 0x41, len);
  ibv_mr* mr = reg(p, len);
  madvise(p, len, MADV_DONTNEED);
  write_read_check("dontneed", p, len, mr, 8);
  ibv_dereg_mr(mr);
  munmap(p, len);
  std::puts("ok MADV_DONTNEED under a live region");
}

// free, then new memory at the same address, under a live region: the peer's WRITE completes
// and, where the pages were shared, lands in the region's old pages as a NIC's lands in the
// pages it pinned, not in the new memory. Then deregistration leaves the new memory alone.
void free_and_reallocate() {
  const size_t len = 4 * kPage;
  uint8_t* p = anon(len);
  ibv_mr* mr = reg(p, len);
  munmap(p, len);
  if (mmap(p, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) != p)
    die("mmap fixed");
  std::memset(p, 0x33, len);
  for (size_t i = 0; i < len; ++i) a_buf[i] = pattern(9, i);
  CHECK(transfer(true, reinterpret_cast<uintptr_t>(p), mr->rkey, len) == IBV_WC_SUCCESS,
        "WRITE into a freed-and-reallocated region failed");
  size_t changed = 0;
  for (size_t i = 0; i < len; ++i) changed += p[i] != 0x33;
  if (sharing()) CHECK(changed == 0, "%zu bytes of the new memory written", changed);
  ibv_dereg_mr(mr);
  size_t after = 0;
  for (size_t i = 0; i < len; ++i) after += p[i] != 0x33;
  CHECK(after == changed, "deregistration changed the new memory (%zu bytes)", after - changed);
  munmap(p, len);
  std::puts("ok free and reallocate under a live region");
}

// A's accesses to its own memory as the engine counts them (its context's direct and system-call
// accesses), from `metaroce engine status --json`.
uint64_t accesses_of(const char* metaroce, const std::string& link) {
  const std::string out = engine_status(metaroce);
  const size_t at = out.find("\"link\": \"" + link + "\"");
  uint64_t n = 0;
  for (const char* key : {"\"direct_accesses\": ", "\"fallback_accesses\": "}) {
    const size_t k = at == std::string::npos ? std::string::npos : out.find(key, at);
    if (k != std::string::npos) n += std::strtoull(out.c_str() + k + std::strlen(key), nullptr, 10);
  }
  return n;
}

// Small SENDs posted with the ibv_wr_* interface are copied into their WQE at post time, as
// ibv_post_send's are: the engine sends them without reading A's memory (and B gets each byte).
void wr_sends_gathered(const char* metaroce) {
  ibv_qp_init_attr_ex attr{};
  attr.send_cq = attr.recv_cq = A.cq;
  attr.qp_type = IBV_QPT_RC;
  attr.cap.max_send_wr = attr.cap.max_recv_wr = 8;
  attr.cap.max_send_sge = attr.cap.max_recv_sge = 1;
  attr.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
  attr.pd = A.pd;
  attr.send_ops_flags = IBV_QP_EX_WITH_SEND;
  ibv_qp* qp = ibv_create_qp_ex(A.ctx, &attr);
  if (!qp) die("create_qp_ex");
  ibv_qp_ex* qpx = ibv_qp_to_qp_ex(qp);
  connect(A, B, qp);
  uint8_t* rx = anon(kPage);
  ibv_mr* rx_mr = reg(rx, kPage);
  const uint64_t before = accesses_of(metaroce, A.ctx->device->name);
  constexpr int kSends = 64;
  size_t bad = 0;
  for (int i = 0; i < kSends; ++i) {
    ibv_sge r{reinterpret_cast<uintptr_t>(rx), 16, rx_mr->lkey};
    ibv_recv_wr rwr{}, *rbad = nullptr;
    rwr.sg_list = &r;
    rwr.num_sge = 1;
    if (ibv_post_recv(B.qp, &rwr, &rbad)) die("post_recv");
    for (int k = 0; k < 16; ++k) a_buf[k] = pattern(10 + i, k);
    ibv_wr_start(qpx);
    qpx->wr_id = i;
    qpx->wr_flags = IBV_SEND_SIGNALED;
    ibv_wr_send(qpx);
    ibv_wr_set_sge(qpx, a_mr->lkey, reinterpret_cast<uintptr_t>(a_buf), 16);
    if (ibv_wr_complete(qpx)) die("wr_complete");
    std::memset(a_buf, 0, 16);  // after post: a copy made later would send zeros
    ibv_wc wc{};
    for (int got = 0; got < 2;) {
      ibv_cq* cq = got == 0 ? A.cq : B.cq;
      int n;
      while ((n = ibv_poll_cq(cq, 1, &wc)) == 0) {}
      CHECK(n == 1 && wc.status == IBV_WC_SUCCESS, "wr send %d: %s", i, ibv_wc_status_str(wc.status));
      ++got;
    }
    for (int k = 0; k < 16; ++k) bad += rx[k] != pattern(10 + i, k);
  }
  CHECK(bad == 0, "wr sends: %zu bytes wrong at B", bad);
  const uint64_t after = accesses_of(metaroce, A.ctx->device->name);
  CHECK(after - before < kSends, "the engine read A's memory for the wr sends (%lu accesses)",
        static_cast<unsigned long>(after - before));
  ibv_dereg_mr(rx_mr);
  munmap(rx, kPage);
  std::puts("ok ibv_wr_* sends copied at post");
}

// The region's memory unmapped: the engine cannot read its first (partial) page; the READ
// completes in error, the QP with it, and nothing else happens. Last: the QP is spent.
void unmapped() {
  uint8_t* base = anon(4 * kPage);
  ibv_mr* mr = reg(base + 64, 4 * kPage - 128);
  munmap(base, 4 * kPage);
  const ibv_wc_status st = transfer(false, reinterpret_cast<uintptr_t>(base + 64), mr->rkey, 256);
  CHECK(st == IBV_WC_REM_ACCESS_ERR || st == IBV_WC_REM_OP_ERR,
        "READ of unmapped memory: %s", ibv_wc_status_str(st));
  ibv_dereg_mr(mr);
  std::printf("ok unmapped memory: %s\n", ibv_wc_status_str(st));
}

}  // namespace

int main(int argc, char** argv) {
  std::string a_dev = "mrA", b_dev = "mrB";
  const char* metaroce = nullptr;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--a")) a_dev = argv[i + 1];
    else if (!std::strcmp(argv[i], "--b")) b_dev = argv[i + 1];
    else if (!std::strcmp(argv[i], "--metaroce")) metaroce = argv[i + 1];
  }
  A = open_side(a_dev);
  B = open_side(b_dev);
  connect(A, B);
  a_buf = anon(kABytes);
  a_mr = ibv_reg_mr(A.pd, a_buf, kABytes, kRemote);
  if (!a_mr) die("reg_mr A");
  unaligned(metaroce);
  stack_region();
  file_region();
  huge_regions();
  fork_child();
  rereg();
  dontneed();
  unreachable();
  free_and_reallocate();
  if (metaroce && !(std::getenv("METAROCE_COPY_AT_POST") &&
                    std::strcmp(std::getenv("METAROCE_COPY_AT_POST"), "0") == 0))
    wr_sends_gathered(metaroce);
  unmapped();
  std::printf("%s: %d failure(s)\n", kProgram, failures);
  return failures ? 1 : 0;
}

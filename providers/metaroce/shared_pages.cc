// SPDX-License-Identifier: Apache-2.0
// Moving registered pages into the memfd the engine maps, and back.
#include "providers/metaroce/shared_pages.h"

#include <fcntl.h>
#include <infiniband/verbs.h>
#include <linux/userfaultfd.h>
#include <pthread.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <string>

#ifndef UFFD_USER_MODE_ONLY
#define UFFD_USER_MODE_ONLY 1
#endif
#ifndef UFFD_FEATURE_WP_UNPOPULATED
#define UFFD_FEATURE_WP_UNPOPULATED (1 << 13)
#endif
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
#ifndef MFD_NOEXEC_SEAL
#define MFD_NOEXEC_SEAL 0x0008U
#endif

namespace metaroce::provider {

namespace {

// The memory calls themselves, made as system calls: an interposer of mmap and mremap (UCX's
// UCM patches libc's) would hear of mappings that change nothing the application sees, and UCX
// 1.13's mremap drops MREMAP_FIXED's new address.
void* sys_mmap(void* at, size_t len, int prot, int flags, int fd, off_t off) {
  return reinterpret_cast<void*>(syscall(SYS_mmap, at, len, prot, flags, fd, off));
}
void* sys_mremap(void* from, size_t len, void* to) {
  return reinterpret_cast<void*>(
      syscall(SYS_mremap, from, len, len, MREMAP_MAYMOVE | MREMAP_FIXED, to));
}
int sys_munmap(void* at, size_t len) { return static_cast<int>(syscall(SYS_munmap, at, len)); }
int sys_madvise(uint64_t at, size_t len, int advice) {
  return static_cast<int>(syscall(SYS_madvise, at, len, advice));
}

uint64_t page_size() {
  static const uint64_t p = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  return p;
}

std::string read_file(const char* path) {
  std::string s;
  const int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return s;
  char buf[16384];
  for (ssize_t n; (n = read(fd, buf, sizeof(buf))) != 0;) {
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) break;
    s.append(buf, static_cast<size_t>(n));
  }
  close(fd);
  return s;
}

// Threads of this process now (a stale answer errs towards more).
int threads() {
  const std::string s = read_file("/proc/self/status");
  const size_t at = s.find("\nThreads:");
  return at == std::string::npos ? 2 : std::atoi(s.c_str() + at + 9);
}

// The features userfaultfd offers here (0 when none can be had).
uint64_t uffd_features(int* flags) {
  static int ok_flags = -1;
  static uint64_t features = 0;
  if (ok_flags == -1) {
    ok_flags = -2;
    for (int f : {O_CLOEXEC | O_NONBLOCK, O_CLOEXEC | O_NONBLOCK | UFFD_USER_MODE_ONLY}) {
      const int fd = static_cast<int>(syscall(SYS_userfaultfd, f));
      if (fd < 0) continue;
      uffdio_api api{UFFD_API, 0, 0};
      if (ioctl(fd, UFFDIO_API, &api) == 0) {
        ok_flags = f;
        features = api.features;
      }
      close(fd);
      break;
    }
  }
  *flags = ok_flags;
  return ok_flags < 0 ? 0 : features;
}

// Stores into a range wait (in the kernel) while its pages move; they land once the fence is
// gone, in whatever then maps the range.
class WriteFence {
 public:
  WriteFence() = default;
  ~WriteFence() {
    if (fd_ >= 0) close(fd_);
  }
  WriteFence(const WriteFence&) = delete;
  WriteFence& operator=(const WriteFence&) = delete;

  // shmem: the range maps the memfd (else private anonymous memory).
  bool arm(uint64_t s, uint64_t len, bool shmem) {
    int flags = 0;
    const uint64_t have = uffd_features(&flags);
    if (flags < 0) return false;
    uint64_t want = 0;
    if (shmem) {
      if (!(have & UFFD_FEATURE_WP_HUGETLBFS_SHMEM)) return false;
      want = UFFD_FEATURE_WP_HUGETLBFS_SHMEM;  // unpopulated pages are protected by markers
    } else if (have & UFFD_FEATURE_WP_UNPOPULATED) {
      want = UFFD_FEATURE_WP_UNPOPULATED;
    } else if (sys_madvise(s, len, MADV_POPULATE_WRITE) != 0) {
      return false;  // an unpopulated page would take its store unprotected
    }
    fd_ = static_cast<int>(syscall(SYS_userfaultfd, flags));
    if (fd_ < 0) return false;
    uffdio_api api{UFFD_API, want, 0};
    uffdio_register reg{{s, len}, UFFDIO_REGISTER_MODE_WP, 0};
    uffdio_writeprotect wp{{s, len}, UFFDIO_WRITEPROTECT_MODE_WP};
    return ioctl(fd_, UFFDIO_API, &api) == 0 && ioctl(fd_, UFFDIO_REGISTER, &reg) == 0 &&
           ioctl(fd_, UFFDIO_WRITEPROTECT, &wp) == 0;
  }

 private:
  int fd_ = -1;
};

// Replaces [s, s + len) with `fresh` (len bytes mapped elsewhere) in one step, its bytes copied
// first. False (nothing changed) when the kernel refuses.
bool swap_in(uint64_t s, uint64_t len, void* fresh) {
  std::memcpy(fresh, reinterpret_cast<void*>(s), len);
  if (sys_mremap(fresh, len, reinterpret_cast<void*>(s)) != MAP_FAILED) return true;
  sys_munmap(fresh, len);
  return false;
}

// A private copy of [s, s + len) in place of the shared pages.
bool make_private(uint64_t s, uint64_t len) {
  void* t = sys_mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  return t != MAP_FAILED && swap_in(s, len, t);
}

}  // namespace

// One line of /proc/self/maps.
struct SharedPages::Vma {
  uint64_t start = 0, end = 0, off = 0, ino = 0;
  char perms[5] = {};
  std::string path;
};

namespace {

// The mappings overlapping [lo, hi) (everything when hi is 0), in address order.
template <typename Vma>
std::vector<Vma> read_maps(uint64_t lo, uint64_t hi) {
  std::vector<Vma> out;
  const std::string s = read_file("/proc/self/maps");
  size_t pos = 0;
  while (pos < s.size()) {
    size_t nl = s.find('\n', pos);
    if (nl == std::string::npos) nl = s.size();
    const std::string line = s.substr(pos, nl - pos);
    pos = nl + 1;
    Vma v;
    unsigned dev_major = 0, dev_minor = 0;
    int path_at = 0;
    if (std::sscanf(line.c_str(), "%" SCNx64 "-%" SCNx64 " %4s %" SCNx64 " %x:%x %" SCNu64 " %n",
                    &v.start, &v.end, v.perms, &v.off, &dev_major, &dev_minor, &v.ino,
                    &path_at) < 7)
      continue;
    if (hi && (v.end <= lo || v.start >= hi)) continue;
    if (path_at > 0 && static_cast<size_t>(path_at) < line.size()) v.path = line.substr(path_at);
    out.push_back(std::move(v));
  }
  return out;
}

// Private anonymous read-write memory that is not the calling thread's stack.
template <typename Vma>
bool qualifies(const Vma& v, uint64_t sp) {
  if (std::strcmp(v.perms, "rw-p") != 0) return false;
  if (!v.path.empty() && v.path != "[heap]" && v.path.rfind("[anon:", 0) != 0) return false;
  return !(v.start <= sp && sp < v.end);
}

}  // namespace

int SharedPages::reachable(uint64_t addr, uint64_t len, bool write) {
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t lo = addr & ~(page - 1), hi = (addr + len + page - 1) & ~(page - 1);
  uint64_t covered = lo;
  for (const Vma& v : read_maps<Vma>(lo, hi)) {
    if (v.start > covered || v.perms[0] != 'r' || (write && v.perms[1] != 'w')) return EFAULT;
    // One byte per mapping: what a mapping is (a driver's, a device's) holds for all of it.
    uint8_t byte = 0;
    const iovec local{&byte, 1};
    const iovec remote{reinterpret_cast<void*>(std::max(v.start, lo)), 1};
    if (process_vm_readv(getpid(), &local, 1, &remote, 1, 0) != 1 && errno == EFAULT) return EFAULT;
    covered = v.end;
    if (covered >= hi) return 0;
  }
  return covered >= hi ? 0 : EFAULT;
}

SharedPages& SharedPages::process() {
  static SharedPages* store = [] {
    auto* s = new SharedPages;  // never destroyed: regions may outlive static destructors
    pthread_atfork([] { process().mu_.lock(); }, [] { process().mu_.unlock(); },
                   [] {
                     process().after_fork_in_child();
                     process().mu_.unlock();
                   });
    return s;
  }();
  return *store;
}

int SharedPages::fd() const {
  std::lock_guard lock(mu_);
  return fd_;
}

uint64_t SharedPages::shared_bytes() const {
  std::lock_guard lock(mu_);
  uint64_t n = 0;
  for (const auto& [off, r] : by_off_)
    if (r.live) n += r.len;
  return n;
}

bool SharedPages::ensure_fd() {
  if (fd_ >= 0) return true;
  int fd = memfd_create("metaroce-mr", MFD_CLOEXEC | MFD_ALLOW_SEALING | MFD_NOEXEC_SEAL);
  if (fd < 0 && errno == EINVAL) fd = memfd_create("metaroce-mr", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return false;
  struct stat st {};
  // The engine maps it: it must never shrink under that mapping.
  if (ftruncate(fd, static_cast<off_t>(kStoreBytes)) != 0 ||
      fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_SEAL) != 0 || fstat(fd, &st) != 0) {
    close(fd);
    return false;
  }
  fd_ = fd;
  ino_ = st.st_ino;
  free_ = {{0, kStoreBytes}};
  return true;
}

uint64_t SharedPages::alloc(uint64_t len) {
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < len) continue;
    const uint64_t off = it->first, rest = it->second - len;
    free_.erase(it);
    if (rest) free_[off + len] = rest;
    return off;
  }
  return UINT64_MAX;
}

void SharedPages::free_offsets(uint64_t off, uint64_t len) {
  fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(off),
            static_cast<off_t>(len));
  auto next = free_.lower_bound(off);
  if (next != free_.end() && off + len == next->first) {
    len += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == off) {
      prev->second += len;
      return;
    }
  }
  free_[off] = len;
}

bool SharedPages::convert(uint64_t s, uint64_t e, uint64_t* off) {
  const uint64_t len = e - s;
  *off = alloc(span_of(len));
  if (*off == UINT64_MAX) return false;
  WriteFence fence;
  void* t = MAP_FAILED;
  if (threads() == 1 || fence.arm(s, len, false))
    t = sys_mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, static_cast<off_t>(*off));
  if (t == MAP_FAILED || !swap_in(s, len, t)) {
    free_offsets(*off, span_of(len));
    return false;
  }
  // libibverbs excluded the region from fork before asking us (ibv_fork_init): so is its
  // new mapping.
  if (ibv_is_fork_initialized() == IBV_FORK_ENABLED)
    sys_madvise(s, len, MADV_DONTFORK);
  return true;
}

bool SharedPages::still_mapped(const std::vector<Vma>& vmas, uint64_t off, const Range& r) const {
  uint64_t covered = 0;
  for (const Vma& v : vmas) {
    if (v.ino != ino_ || v.perms[3] != 's' || v.end <= r.va || v.start >= r.va + r.len) continue;
    const uint64_t from = std::max(v.start, r.va), to = std::min(v.end, r.va + r.len);
    if (v.off + (from - v.start) == off + (from - r.va)) covered += to - from;
  }
  return covered == r.len;
}

void SharedPages::orphan_stale(uint64_t a, uint64_t b, const std::vector<Vma>& vmas) {
  for (auto it = by_va_.lower_bound(a); it != by_va_.begin();) {  // one may start before a
    --it;
    a = it->first;
    break;
  }
  for (auto it = by_va_.lower_bound(a); it != by_va_.end() && it->first < b;) {
    Range& r = by_off_.at(it->second);
    if (r.va + r.len <= a || still_mapped(vmas, it->second, r)) {
      ++it;
      continue;
    }
    r.live = false;  // the application unmapped or moved them: its region keeps the old pages
    it = by_va_.erase(it);
  }
}

bool SharedPages::held(uint64_t s, uint64_t e) const {
  for (auto it = held_.begin(); it != held_.end() && it->first < e; ++it)
    if (it->second > s) return true;
  return false;
}

std::vector<std::pair<uint64_t, uint64_t>> SharedPages::unheld(uint64_t s, uint64_t e) const {
  std::vector<std::pair<uint64_t, uint64_t>> runs{{s, e}};
  for (auto it = held_.begin(); it != held_.end() && it->first < e; ++it) {
    std::vector<std::pair<uint64_t, uint64_t>> next;
    for (auto [from, to] : runs) {
      if (it->second <= from || it->first >= to) {
        next.push_back({from, to});
        continue;
      }
      if (from < it->first) next.push_back({from, it->first});
      if (it->second < to) next.push_back({it->second, to});
    }
    runs = std::move(next);
  }
  return runs;
}

SharedPages::Lease SharedPages::acquire(uint64_t addr, uint64_t len, bool share) {
  std::lock_guard lock(mu_);
  const uint64_t p = page_size();
  const uint64_t end = addr + len < addr || addr + len > UINT64_MAX - p ? UINT64_MAX : addr + len;
  const uint64_t a = (addr + p - 1) / p * p, b = end / p * p;
  Lease lease;
  if (share && a < b && ensure_fd()) lease.pieces = share_pages(a, b);
  // Every other page of the region is the engine's to reach by system call: held.
  uint64_t at = addr / p * p;
  const uint64_t span_end = end == UINT64_MAX ? UINT64_MAX : (end + p - 1) / p * p;
  for (const SharedPiece& piece : lease.pieces) {
    if (at < piece.va) lease.held.push_back({at, piece.va});
    at = piece.va + piece.len;
  }
  if (at < span_end) lease.held.push_back({at, span_end});
  for (auto [from, to] : lease.held) held_.emplace(from, to);
  return lease;
}

std::vector<SharedPiece> SharedPages::share_pages(uint64_t a, uint64_t b) {
  std::vector<SharedPiece> pieces;
  uint64_t lo = a, hi = b;  // the live ranges overlapping [a, b) may reach beyond it
  if (auto it = by_va_.lower_bound(a); it != by_va_.begin()) lo = std::min(lo, std::prev(it)->first);
  if (auto it = by_va_.lower_bound(b); it != by_va_.begin()) {
    const Range& r = by_off_.at(std::prev(it)->second);
    hi = std::max(hi, r.va + r.len);
  }
  const std::vector<Vma> vmas = read_maps<Vma>(lo, hi);
  orphan_stale(a, b, vmas);
  int sp_marker = 0;
  const auto sp = reinterpret_cast<uintptr_t>(&sp_marker);
  for (const Vma& v : vmas) {
    const uint64_t s = std::max(v.start, a), e = std::min(v.end, b);
    if (s >= e) continue;
    if (v.ino == ino_ && v.perms[3] == 's') {  // already moved: a reference to each range
      auto it = by_va_.upper_bound(s);
      if (it != by_va_.begin()) --it;
      for (; it != by_va_.end() && it->first < e; ++it) {
        Range& r = by_off_.at(it->second);
        const uint64_t from = std::max(s, r.va), to = std::min(e, r.va + r.len);
        if (from >= to) continue;
        ++r.refs;
        pieces.push_back({from, it->second + (from - r.va), to - from});
      }
      continue;
    }
    if (!qualifies(v, sp)) continue;
    for (auto [from, to] : unheld(s, e)) {  // pages another region reaches by system call stay
      uint64_t off = 0;
      if (!convert(from, to, &off)) continue;
      by_off_[off] = {from, to - from, 1, true};
      by_va_[from] = off;
      pieces.push_back({from, off, to - from});
    }
  }
  return pieces;
}

SharedPages::Revert SharedPages::revert(uint64_t off, const Range& r) {
  // Still ours where the region left them? Then they move back to private memory.
  if (!still_mapped(read_maps<Vma>(r.va, r.va + r.len), off, r))
    return Revert::kGone;  // unmapped or moved since
  WriteFence fence;
  if (threads() > 1 && !fence.arm(r.va, r.len, true)) return Revert::kKept;
  return make_private(r.va, r.len) ? Revert::kDone : Revert::kKept;
}

void SharedPages::release(const Lease& lease) {
  std::lock_guard lock(mu_);
  for (auto [from, to] : lease.held)
    for (auto [it, last] = held_.equal_range(from); it != last; ++it)
      if (it->second == to) {
        held_.erase(it);
        break;
      }
  for (const SharedPiece& piece : lease.pieces) {
    auto it = by_off_.upper_bound(piece.off);
    if (it == by_off_.begin()) continue;
    --it;
    Range& r = it->second;
    if (piece.off >= it->first + r.len || r.refs == 0 || --r.refs > 0) continue;
    const uint64_t off = it->first;
    if (r.live) {
      // Pages another region reaches by system call (or no write fence here): shared until
      // reused.
      const Revert done = held(r.va, r.va + r.len) ? Revert::kKept : revert(off, r);
      if (done == Revert::kKept) continue;
      by_va_.erase(r.va);
      r.live = false;
    }
    // The pages are free once nothing of this process maps them: an application that moved a
    // registered buffer with mremap (as realloc does) still uses them, and keeps them.
    const uint64_t span = span_of(r.len);
    bool mapped = false;
    for (const Vma& v : read_maps<Vma>(0, 0))
      mapped |= v.ino == ino_ && v.perms[3] == 's' && v.off < off + span &&
                off < v.off + (v.end - v.start);
    by_off_.erase(it);
    if (mapped) continue;  // those offsets are lost to the allocator
    free_offsets(off, span);
  }
}

void SharedPages::after_fork_in_child() {
  // The child's pages are its own copies, as a kernel with copy-on-fork of pinned pages gives
  // (a region excluded from fork is not mapped here at all). Nothing is freed: the parent's.
  if (fd_ < 0) return;
  for (const Vma& v : read_maps<Vma>(0, 0))
    if (v.ino == ino_ && v.perms[3] == 's') make_private(v.start, v.end - v.start);
  close(fd_);
  fd_ = -1;
  ino_ = 0;
  by_off_.clear();
  by_va_.clear();
  free_.clear();
  held_.clear();
}

}  // namespace metaroce::provider

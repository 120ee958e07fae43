// SPDX-License-Identifier: Apache-2.0
// Registered memory the engine reaches without a system call (docs/design.md, "Shared memory
// regions"; FreeFlow's approach): at ibv_reg_mr the whole pages inside the region move into a
// memfd that the engine maps too, at the same virtual addresses, and at the last ibv_dereg_mr
// that holds them they move back to private memory. The engine reaches everything else (the
// partial first and last pages, memory that does not qualify) with process_vm_readv/writev, and
// since both are the same pages either way, the two paths always agree.
//
// What qualifies: private, anonymous, read-write mappings (malloc, mmap, [heap], named
// anonymous memory, transparent huge pages) other than the main stack and the calling thread's
// own stack. Not: file-backed or already-shared mappings, hugetlbfs, read-only memory. While
// other threads run, the pages move under a userfaultfd write-protect so that a store made
// meanwhile waits and lands in the moved page; where no userfaultfd can be had (seccomp, an old
// kernel), only a single-threaded process's pages move.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <vector>

#include "datapath/hostif/control.h"

namespace metaroce::provider {

using hostif::SharedPiece;  // [va, va + len) of the process is [off, off + len) of the memfd

class SharedPages {
 public:
  // The process's store (a child after fork starts with none: its pages are private copies).
  static SharedPages& process();

  // What a region holds: its shared pieces (a reference each), and the pages the engine reaches
  // by system call for it (its partial first and last pages, what did not qualify, all of it
  // for an on-demand region). No page in `held` moves either way while the region lives: a
  // write-protected page fails the engine's process_vm_writev, and without the fence its store
  // could fall between the copy and the swap.
  struct Lease {
    std::vector<SharedPiece> pieces;
    std::vector<std::pair<uint64_t, uint64_t>> held;  // [start, end), page-aligned
  };
  // The whole pages of [addr, addr + len) that qualify, moved into the memfd unless they already
  // are (none with share false: an on-demand region); the rest is held.
  Lease acquire(uint64_t addr, uint64_t len, bool share = true);
  // Drops the references and holds; pages no region holds move back to private memory.
  void release(const Lease& lease);
  // The memfd (sealed against shrinking), or -1 before the first acquire that moved a page.
  int fd() const;
  // Bytes of the process that live in the memfd now (tests, diagnostics).
  uint64_t shared_bytes() const;

  // 0 when the engine can reach [addr, addr + len): mapped throughout, readable (writable too
  // when `write`), and readable with process_vm_readv (where the engine's copies go: a device's
  // memory or a driver's mapping fails it); EFAULT, what the kernel answers for pages it cannot
  // pin, when not. A process where process_vm_readv is not allowed at all is not refused.
  static int reachable(uint64_t addr, uint64_t len, bool write);

  // Size of the memfd's sparse address space (a quarter of it can be shared at once).
  static constexpr uint64_t kStoreBytes = uint64_t{1} << 40;
  // The offsets a range of len bytes holds: mremap (realloc) can grow a mapping of the memfd in
  // place or move it, and the growth maps the offsets that follow; growth up to 4 times stays
  // in the range's own (unused, zero) offsets instead of another range's pages.
  static constexpr uint64_t span_of(uint64_t len) { return 4 * len; }

 private:
  struct Range {
    uint64_t va = 0, len = 0;
    uint32_t refs = 0;
    bool live = true;  // false once the application unmapped or moved its pages (orphan)
  };
  struct Vma;
  bool ensure_fd();
  // Whether range r (at offset off) is still all mapped where it was, per vmas.
  bool still_mapped(const std::vector<Vma>& vmas, uint64_t off, const Range& r) const;
  void orphan_stale(uint64_t a, uint64_t b, const std::vector<Vma>& vmas);
  std::vector<SharedPiece> share_pages(uint64_t a, uint64_t b);  // acquire's moves
  bool convert(uint64_t s, uint64_t e, uint64_t* off);
  enum class Revert { kDone, kKept, kGone };
  Revert revert(uint64_t off, const Range& r);
  uint64_t alloc(uint64_t len);
  void free_offsets(uint64_t off, uint64_t len);
  void after_fork_in_child();
  bool held(uint64_t s, uint64_t e) const;  // whether any held span meets [s, e)
  // [s, e) less the held spans.
  std::vector<std::pair<uint64_t, uint64_t>> unheld(uint64_t s, uint64_t e) const;

  mutable std::mutex mu_;
  int fd_ = -1;
  uint64_t ino_ = 0;
  std::map<uint64_t, Range> by_off_;    // every range, orphans included
  std::map<uint64_t, uint64_t> by_va_;  // live ranges: va -> off
  std::map<uint64_t, uint64_t> free_;   // unused offsets: off -> len
  std::multimap<uint64_t, uint64_t> held_;  // every lease's held pages: start -> end
};

}  // namespace metaroce::provider

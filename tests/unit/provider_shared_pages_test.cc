// SPDX-License-Identifier: Apache-2.0
// Registered pages moved into the memfd the engine maps, and back (providers/metaroce/
// shared_pages.h): which memory qualifies, that no byte is lost on the way there or back (other
// threads storing meanwhile included), fork, and memory the application unmaps or moves while a
// region holds it.
#include "providers/metaroce/shared_pages.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>

namespace metaroce::provider {
namespace {

const uint64_t kPage = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));

// The /proc/self/maps line of the mapping holding p.
std::string mapping_of(const void* p) {
  std::ifstream in("/proc/self/maps");
  const auto a = reinterpret_cast<uintptr_t>(p);
  for (std::string line; std::getline(in, line);) {
    unsigned long s = 0, e = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx", &s, &e) == 2 && s <= a && a < e) return line;
  }
  return "";
}
bool shared(const void* p) { return mapping_of(p).find("metaroce-mr") != std::string::npos; }

uint8_t* anon(size_t pages) {
  void* p = mmap(nullptr, pages * kPage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  return p == MAP_FAILED ? nullptr : static_cast<uint8_t*>(p);
}

void fill(uint8_t* p, size_t n, uint8_t seed) {
  for (size_t i = 0; i < n; ++i) p[i] = static_cast<uint8_t>(seed + i * 7);
}
bool filled(const uint8_t* p, size_t n, uint8_t seed) {
  for (size_t i = 0; i < n; ++i)
    if (p[i] != static_cast<uint8_t>(seed + i * 7)) return false;
  return true;
}

TEST(SharedPages, WholePagesMoveAndComeBackWithEveryByte) {
  SharedPages store;
  uint8_t* buf = anon(6);
  fill(buf, 6 * kPage, 1);
  // A region from mid page 0 to mid page 4: pages 1-3 are whole.
  auto pieces = store.acquire(reinterpret_cast<uintptr_t>(buf) + 100, 4 * kPage);
  ASSERT_EQ(pieces.pieces.size(), 1u);
  EXPECT_EQ(pieces.pieces[0].va, reinterpret_cast<uintptr_t>(buf) + kPage);
  EXPECT_EQ(pieces.pieces[0].len, 3 * kPage);
  EXPECT_FALSE(shared(buf)) << "a partial page stays private (other data lives there)";
  EXPECT_TRUE(shared(buf + kPage));
  EXPECT_FALSE(shared(buf + 4 * kPage));
  EXPECT_TRUE(filled(buf, 6 * kPage, 1));
  // The engine's view is the memfd: what it writes there the application reads, and back.
  const uint8_t engine_byte = 0xA5;
  ASSERT_EQ(pwrite(store.fd(), &engine_byte, 1, static_cast<off_t>(pieces.pieces[0].off + 5)), 1);
  EXPECT_EQ(buf[kPage + 5], 0xA5);
  buf[kPage + 6] = 0x5A;
  uint8_t seen = 0;
  ASSERT_EQ(pread(store.fd(), &seen, 1, static_cast<off_t>(pieces.pieces[0].off + 6)), 1);
  EXPECT_EQ(seen, 0x5A);
  EXPECT_EQ(store.shared_bytes(), 3 * kPage);
  store.release(pieces);
  EXPECT_FALSE(shared(buf + kPage)) << "back to private memory";
  EXPECT_EQ(store.shared_bytes(), 0u);
  EXPECT_EQ(buf[kPage + 5], 0xA5);
  EXPECT_EQ(buf[kPage + 6], 0x5A);
  buf[kPage + 5] = buf[kPage + 6] = 0;
  fill(buf + kPage + 5, 2, static_cast<uint8_t>(1 + (kPage + 5) * 7));
  EXPECT_TRUE(filled(buf, 6 * kPage, 1));
  munmap(buf, 6 * kPage);
}

TEST(SharedPages, OverlappingRegionsShareTheirPages) {
  SharedPages store;
  uint8_t* buf = anon(8);
  fill(buf, 8 * kPage, 3);
  const auto base = reinterpret_cast<uintptr_t>(buf);
  auto first = store.acquire(base, 4 * kPage);
  auto second = store.acquire(base + 2 * kPage, 6 * kPage);  // pages 2-3 already moved
  ASSERT_EQ(first.pieces.size(), 1u);
  ASSERT_EQ(second.pieces.size(), 2u);
  EXPECT_EQ(second.pieces[0].va, base + 2 * kPage);
  EXPECT_EQ(second.pieces[0].off, first.pieces[0].off + 2 * kPage) << "the same pages, not a copy";
  store.release(first);
  EXPECT_TRUE(shared(buf + 2 * kPage)) << "the second region still holds them";
  store.release(second);
  for (int i = 0; i < 8; ++i) EXPECT_FALSE(shared(buf + i * kPage)) << i;
  EXPECT_TRUE(filled(buf, 8 * kPage, 3));
  munmap(buf, 8 * kPage);
}

TEST(SharedPages, OnlyPrivateAnonymousWritableMemoryQualifies) {
  SharedPages store;
  uint8_t stack_buf[3 * 4096 * 4];  // the calling thread's own stack
  EXPECT_TRUE(store.acquire(reinterpret_cast<uintptr_t>(stack_buf), sizeof(stack_buf)).pieces.empty());
  void* sh = mmap(nullptr, 4 * kPage, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  EXPECT_TRUE(store.acquire(reinterpret_cast<uintptr_t>(sh), 4 * kPage).pieces.empty()) << "shared";
  void* ro = mmap(nullptr, 4 * kPage, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  EXPECT_TRUE(store.acquire(reinterpret_cast<uintptr_t>(ro), 4 * kPage).pieces.empty()) << "read-only";
  char path[] = "/tmp/metaroce-shared-pages-XXXXXX";
  const int fd = mkstemp(path);
  ASSERT_GE(fd, 0);
  unlink(path);
  ASSERT_EQ(ftruncate(fd, static_cast<off_t>(4 * kPage)), 0);
  void* file = mmap(nullptr, 4 * kPage, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
  EXPECT_TRUE(store.acquire(reinterpret_cast<uintptr_t>(file), 4 * kPage).pieces.empty()) << "a file";
  EXPECT_TRUE(store.acquire(reinterpret_cast<uintptr_t>(stack_buf) + 1, 100).pieces.empty())
      << "no whole page";
  munmap(sh, 4 * kPage);
  munmap(ro, 4 * kPage);
  munmap(file, 4 * kPage);
  close(fd);
}

// What the engine could not reach is refused at registration (EFAULT), as pages a NIC cannot
// pin are: a hole, PROT_NONE, read-only memory asked to be written.
TEST(SharedPages, ReachableIsMappedReadableAndWritableWhereAsked) {
  auto* p = static_cast<uint8_t*>(
      mmap(nullptr, 6 * kPage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  ASSERT_NE(p, MAP_FAILED);
  const auto at = [&](size_t page) { return reinterpret_cast<uint64_t>(p + page * kPage); };
  EXPECT_EQ(SharedPages::reachable(at(0) + 100, 6 * kPage - 200, true), 0);
  ASSERT_EQ(mprotect(p + 2 * kPage, kPage, PROT_READ), 0);  // three mappings now: rw, r, rw
  EXPECT_EQ(SharedPages::reachable(at(0), 6 * kPage, false), 0) << "adjacent mappings";
  EXPECT_EQ(SharedPages::reachable(at(0), 6 * kPage, true), EFAULT) << "read-only, written";
  EXPECT_EQ(SharedPages::reachable(at(3), 3 * kPage, true), 0);
  ASSERT_EQ(mprotect(p + 4 * kPage, kPage, PROT_NONE), 0);
  EXPECT_EQ(SharedPages::reachable(at(3), 3 * kPage, false), EFAULT) << "PROT_NONE";
  EXPECT_EQ(SharedPages::reachable(at(5) + 1, 10, true), 0) << "the page after it";
  ASSERT_EQ(munmap(p + 4 * kPage, kPage), 0);
  EXPECT_EQ(SharedPages::reachable(at(3), 3 * kPage, false), EFAULT) << "a hole";
  EXPECT_EQ(SharedPages::reachable(at(4), kPage, false), EFAULT) << "nothing mapped";
  ASSERT_EQ(munmap(p + 5 * kPage, kPage), 0);
  EXPECT_EQ(SharedPages::reachable(at(3) + kPage - 1, 2, false), EFAULT) << "ends past the mapping";
  munmap(p, 4 * kPage);
}

// Another thread stores into the region (each 8-byte word once, in order) while it moves there
// and back: every store must be found.
TEST(SharedPages, StoresOfOtherThreadsDuringTheMoveAreKept) {
  SharedPages store;
  constexpr size_t kPages = 64;
  uint8_t* buf = anon(kPages);
  auto* words = reinterpret_cast<std::atomic<uint64_t>*>(buf);
  const size_t n = kPages * kPage / 8;
  std::atomic<bool> go{false};
  std::thread writer([&] {
    while (!go.load()) {}
    for (int round = 1; round <= 40; ++round)
      for (size_t i = 0; i < n; ++i) words[i].store(round * n + i, std::memory_order_relaxed);
  });
  go = true;
  for (int i = 0; i < 20; ++i) {
    auto pieces = store.acquire(reinterpret_cast<uintptr_t>(buf), kPages * kPage);
    EXPECT_EQ(pieces.pieces.size(), 1u);
    store.release(pieces);
  }
  writer.join();
  size_t lost = 0;
  for (size_t i = 0; i < n; ++i) lost += words[i].load() != 40 * n + i;
  EXPECT_EQ(lost, 0u);
  munmap(buf, kPages * kPage);
}

// The child of fork gets private copies (a kernel's copy-on-fork of pinned pages): its stores do
// not reach the parent, nor the parent's the child.
TEST(SharedPages, AForkedChildHasItsOwnCopy) {
  SharedPages& store = SharedPages::process();
  uint8_t* buf = anon(4);
  fill(buf, 4 * kPage, 9);
  auto pieces = store.acquire(reinterpret_cast<uintptr_t>(buf), 4 * kPage);
  ASSERT_EQ(pieces.pieces.size(), 1u);
  int to_child[2], to_parent[2];
  ASSERT_EQ(pipe(to_child), 0);
  ASSERT_EQ(pipe(to_parent), 0);
  const pid_t pid = fork();
  if (pid == 0) {
    bool ok = !shared(buf) && filled(buf, 4 * kPage, 9);
    std::memset(buf, 0xEE, 4 * kPage);
    char c = 0;
    ok &= write(to_parent[1], &c, 1) == 1 && read(to_child[0], &c, 1) == 1;
    ok &= buf[0] == 0xEE;  // the parent wrote meanwhile
    _exit(ok ? 0 : 1);
  }
  char c = 0;
  ASSERT_EQ(read(to_parent[0], &c, 1), 1);
  EXPECT_TRUE(filled(buf, 4 * kPage, 9)) << "the child's stores reached the parent";
  buf[0] = 0x11;
  ASSERT_EQ(write(to_child[1], &c, 1), 1);
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  EXPECT_TRUE(shared(buf));
  store.release(pieces);
  EXPECT_EQ(buf[0], 0x11);
  for (int fd : {to_child[0], to_child[1], to_parent[0], to_parent[1]}) close(fd);
  munmap(buf, 4 * kPage);
}

// The application unmaps a registered buffer and maps new memory there (free, then malloc):
// the old region keeps the old pages, as a NIC keeps the pages it pinned, and a new region over
// the new memory gets pages of its own.
TEST(SharedPages, MemoryReplacedUnderALiveRegionIsNotTheRegionsAnyMore) {
  SharedPages store;
  uint8_t* buf = anon(4);
  fill(buf, 4 * kPage, 5);
  auto old = store.acquire(reinterpret_cast<uintptr_t>(buf), 4 * kPage);
  ASSERT_EQ(old.pieces.size(), 1u);
  ASSERT_EQ(munmap(buf, 4 * kPage), 0);
  ASSERT_EQ(mmap(buf, 4 * kPage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED,
                 -1, 0), buf);
  fill(buf, 4 * kPage, 6);
  auto fresh = store.acquire(reinterpret_cast<uintptr_t>(buf), 4 * kPage);
  ASSERT_EQ(fresh.pieces.size(), 1u);
  EXPECT_NE(fresh.pieces[0].off, old.pieces[0].off);
  uint8_t seen = 0;
  ASSERT_EQ(pread(store.fd(), &seen, 1, static_cast<off_t>(old.pieces[0].off)), 1);
  EXPECT_EQ(seen, 5) << "the old region still sees the old bytes";
  store.release(old);
  EXPECT_TRUE(shared(buf)) << "releasing the old region leaves the new one alone";
  EXPECT_TRUE(filled(buf, 4 * kPage, 6));
  store.release(fresh);
  EXPECT_TRUE(filled(buf, 4 * kPage, 6));
  munmap(buf, 4 * kPage);
}

// realloc grows a large buffer with mremap, moving it: the pages go with it and must not be
// freed under it, and its growth is not another region's pages.
TEST(SharedPages, PagesMovedByTheApplicationStayItsOwn) {
  SharedPages store;
  uint8_t* buf = anon(4);
  uint8_t* other = anon(4);
  fill(buf, 4 * kPage, 7);
  fill(other, 4 * kPage, 8);
  auto pieces = store.acquire(reinterpret_cast<uintptr_t>(buf), 4 * kPage);
  auto others = store.acquire(reinterpret_cast<uintptr_t>(other), 4 * kPage);
  ASSERT_EQ(pieces.pieces.size(), 1u);
  ASSERT_EQ(others.pieces.size(), 1u);
  auto* moved = static_cast<uint8_t*>(mremap(buf, 4 * kPage, 16 * kPage, MREMAP_MAYMOVE));
  ASSERT_NE(moved, MAP_FAILED);
  std::memset(moved + 4 * kPage, 0xCC, 12 * kPage);
  EXPECT_TRUE(filled(other, 4 * kPage, 8)) << "the growth reached another region's pages";
  store.release(pieces);
  EXPECT_TRUE(filled(moved, 4 * kPage, 7));
  EXPECT_EQ(moved[16 * kPage - 1], 0xCC);
  store.release(others);
  EXPECT_TRUE(filled(other, 4 * kPage, 8));
  munmap(moved, 16 * kPage);
  munmap(other, 4 * kPage);
}

// A page a region reaches by system call (its partial edge, all of an on-demand region) never
// moves while it lives, either way: the engine's process_vm_writev would meet the write fence,
// or without one land between the copy and the swap.
TEST(SharedPages, PagesAnotherRegionReachesBySystemCallStayWhereTheyAre) {
  SharedPages store;
  uint8_t* buf = anon(4);
  const auto base = reinterpret_cast<uintptr_t>(buf);
  auto edges = store.acquire(base + 100, 3 * kPage - 200);  // whole page 1; pages 0, 2 held
  ASSERT_EQ(edges.pieces.size(), 1u);
  EXPECT_EQ(edges.pieces[0].va, base + kPage);
  ASSERT_EQ(edges.held.size(), 2u);
  auto whole = store.acquire(base + 2 * kPage, 2 * kPage);
  ASSERT_EQ(whole.pieces.size(), 1u);
  EXPECT_EQ(whole.pieces[0].va, base + 3 * kPage) << "page 2 is held by the first region";
  EXPECT_FALSE(shared(buf + 2 * kPage));
  store.release(edges);
  EXPECT_FALSE(shared(buf + kPage)) << "page 1 held by nobody: back to private memory";
  store.release(whole);

  auto all = store.acquire(0, SIZE_MAX, false);  // implicit on-demand paging
  EXPECT_TRUE(all.pieces.empty());
  auto none = store.acquire(base, 4 * kPage);
  EXPECT_TRUE(none.pieces.empty()) << "everything is held";
  store.release(none);
  store.release(all);
  // (Pages that came back one range at a time may be several mappings now: several pieces.)
  auto again = store.acquire(base, 4 * kPage);
  uint64_t bytes = 0;
  for (const SharedPiece& p : again.pieces) bytes += p.len;
  ASSERT_EQ(bytes, 4 * kPage);
  auto odp = store.acquire(base + kPage, kPage, false);
  store.release(again);
  EXPECT_TRUE(shared(buf + kPage)) << "an on-demand region still reaches page 1: it stays";
  store.release(odp);
  auto reused = store.acquire(base, 4 * kPage);
  auto offset_of = [](const SharedPages::Lease& l, uint64_t va) {
    for (const SharedPiece& p : l.pieces)
      if (p.va <= va && va < p.va + p.len) return p.off + (va - p.va);
    return UINT64_MAX;
  };
  EXPECT_EQ(offset_of(reused, base + kPage), offset_of(again, base + kPage))
      << "the page left shared is reused";
  store.release(reused);
  EXPECT_FALSE(shared(buf));
  munmap(buf, 4 * kPage);
}

}  // namespace
}  // namespace metaroce::provider

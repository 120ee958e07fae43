// SPDX-License-Identifier: Apache-2.0
// A kernel context's memory: accesses by registered address reach the region's mapping (the
// module's pinned pages; anonymous pages here), and nothing else.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <vector>

#include "datapath/engine/kernel_device.h"
#include "datapath/engine/mapped_memory.h"

namespace metaroce::engine {
namespace {

constexpr size_t kPage = 4096;

// A mapping of `pages` fresh pages whose region starts `offset` bytes in, as MRIB_IOC_MR says.
std::unique_ptr<RegionMapping> pages(size_t n, uint32_t offset) {
  void* p = mmap(nullptr, n * kPage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  EXPECT_NE(p, MAP_FAILED);
  return std::make_unique<RegionMapping>(p, n * kPage, offset);
}

size_t write_at(MappedMemory& m, uint64_t addr, const void* src, uint32_t len) {
  const nic::Access a{addr, static_cast<uint8_t*>(const_cast<void*>(src)), len};
  return m.write({&a, 1});
}
size_t read_at(MappedMemory& m, uint64_t addr, void* dst, uint32_t len) {
  const nic::Access a{addr, static_cast<uint8_t*>(dst), len};
  return m.read({&a, 1});
}

TEST(MappedMemoryTest, AccessesLandAtTheRegionsOffsetInItsMapping) {
  MappedMemory m(42);
  EXPECT_EQ(m.pid(), 42u);
  auto map = pages(2, 100);
  uint8_t* base = map->start();
  const uint64_t iova = 0x7f0000001064;  // 100 bytes into a page, as the module reports it
  m.add(7 << 8, iova, 5000, true, std::move(map));
  const char msg[] = "kernel pages";
  ASSERT_EQ(write_at(m, iova + 4090, msg, sizeof(msg)), 1u) << "across the page boundary";
  EXPECT_EQ(std::memcmp(base + 4090, msg, sizeof(msg)), 0);
  char back[sizeof(msg)] = {};
  ASSERT_EQ(read_at(m, iova + 4090, back, sizeof(back)), 1u);
  EXPECT_STREQ(back, msg);
  char one;
  EXPECT_EQ(read_at(m, iova - 1, &one, 1), 0u) << "before the region";
  EXPECT_EQ(read_at(m, iova + 4999, &one, 1), 1u);
  EXPECT_EQ(read_at(m, iova + 4999, back, 2), 0u) << "past its end";
}

TEST(MappedMemoryTest, AReadOnlyRegionIsNeverWrittenAndARemovedOneNeverReached) {
  MappedMemory m(1);
  auto ro = pages(1, 0);
  uint8_t* ro_base = ro->start();
  m.add(1 << 8, 0x10000, kPage, false, std::move(ro));
  const uint8_t x = 0xab;
  EXPECT_EQ(write_at(m, 0x10000, &x, 1), 0u);
  EXPECT_EQ(ro_base[0], 0);
  uint8_t y = 1;
  EXPECT_EQ(read_at(m, 0x10000, &y, 1), 1u);
  EXPECT_EQ(y, 0);

  // The same addresses registered twice (two keys, one writable): either serves what it may,
  // and removing one leaves the other.
  auto rw = pages(1, 0);
  uint8_t* rw_base = rw->start();
  m.add(2 << 8, 0x10000, kPage, true, std::move(rw));
  EXPECT_EQ(write_at(m, 0x10010, &x, 1), 1u);
  EXPECT_EQ(rw_base[0x10], 0xab);
  EXPECT_EQ(m.regions(), 2u);
  auto gone = m.remove(2 << 8);
  ASSERT_NE(gone, nullptr);
  EXPECT_EQ(write_at(m, 0x10010, &x, 1), 0u) << "only the read-only one is left";
  EXPECT_NE(m.remove(1 << 8), nullptr);
  EXPECT_EQ(read_at(m, 0x10000, &y, 1), 0u);
  EXPECT_EQ(m.remove(1 << 8), nullptr);
  EXPECT_EQ(m.regions(), 0u);
}

TEST(MappedMemoryTest, ABatchStopsAtItsFirstUnreachableAccess) {
  MappedMemory m(1);
  m.add(3 << 8, 0x20000, 64, true, pages(1, 0));
  uint8_t a[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  const nic::Access batch[3] = {{0x20000, a, 8}, {0x30000, a, 8}, {0x20010, a, 8}};
  EXPECT_EQ(m.write(batch), 1u);
}

// What a kernel-free context's fallback sees: the accesses handed to it, in order.
class RecordingMemory final : public nic::Memory {
 public:
  size_t read(std::span<const nic::Access> a) override { return take(a); }
  size_t write(std::span<const nic::Access> a) override { return take(a); }
  std::vector<uint64_t> addrs;
  size_t calls = 0;
  size_t fail_at = SIZE_MAX;  // the index (over all accesses) that fails

 private:
  size_t take(std::span<const nic::Access> a) {
    ++calls;
    for (size_t i = 0; i < a.size(); ++i) {
      if (addrs.size() == fail_at) return i;
      addrs.push_back(a[i].addr);
    }
    return a.size();
  }
};

// A sealed memfd as the provider makes one (shared_pages.cc).
int sealed_memfd(uint64_t size, unsigned seals = F_SEAL_SHRINK) {
  const int fd = memfd_create("metaroce-mr-test", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  EXPECT_GE(fd, 0);
  EXPECT_EQ(ftruncate(fd, static_cast<off_t>(size)), 0);
  if (seals) EXPECT_EQ(fcntl(fd, F_ADD_SEALS, seals), 0);
  return fd;
}

TEST(MappedMemoryTest, SharedPiecesAreCopiedDirectlyAndTheRestGoesToTheFallbackInOrder) {
  RecordingMemory fallback;
  MappedMemory m(7, &fallback);
  const int fd = sealed_memfd(uint64_t{1} << 32);
  ASSERT_EQ(m.map_shared(fd, 3 * kPage), 0);
  // Region 9: pages at 0x100000 (memfd offset 2 pages) and 0x102000 (offset 0), separately.
  m.add_piece(9, {0x100000, 2 * kPage, kPage});
  m.add_piece(9, {0x102000, 0, kPage});
  uint8_t x[16] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
  const nic::Access batch[5] = {{0x100010, x, 16},   // direct
                                {0x0ff000, x, 16},   // before: fallback
                                {0x101000, x, 16},   // between the pieces: fallback
                                {0x102ff8, x, 8},    // direct, last bytes of the second piece
                                {0x100ffc, x, 8}};   // across a piece's end: fallback
  EXPECT_EQ(m.write(batch), 5u);
  EXPECT_EQ(fallback.addrs, (std::vector<uint64_t>{0x0ff000, 0x101000, 0x100ffc}));
  EXPECT_EQ(fallback.calls, 2u) << "consecutive fallback accesses go in one call";
  uint8_t back[16] = {};
  ASSERT_EQ(pread(fd, back, 16, static_cast<off_t>(2 * kPage + 0x10)), 16);
  EXPECT_EQ(std::memcmp(back, x, 16), 0);
  ASSERT_EQ(pread(fd, back, 8, static_cast<off_t>(kPage - 8)), 8);
  EXPECT_EQ(std::memcmp(back, x, 8), 0);
  const MappedMemory::Stats s = m.stats();
  EXPECT_EQ(s.shared_regions, 1u);
  EXPECT_EQ(s.shared_bytes, 2 * kPage);
  EXPECT_EQ(s.direct, 2u);
  EXPECT_EQ(s.fallback, 3u);
  // The fallback's failure is the batch's: the first access not done.
  fallback.fail_at = fallback.addrs.size() + 1;
  EXPECT_EQ(m.read(batch), 2u) << "access 2 (the second for the fallback) failed";
  // Gone with the region.
  EXPECT_EQ(m.remove(9), nullptr);
  fallback.fail_at = SIZE_MAX;
  const size_t before = fallback.addrs.size();
  EXPECT_EQ(m.read({batch, 1}), 1u);
  EXPECT_EQ(fallback.addrs.size(), before + 1) << "a removed piece is not reached directly";
  close(fd);
}

TEST(MappedMemoryTest, OnlyASealedMemfdIsMappedAndItGrows) {
  MappedMemory m(7);
  const int unsealed = sealed_memfd(1 << 20, 0);
  EXPECT_EQ(m.map_shared(unsealed, kPage), EINVAL) << "it could shrink under the mapping";
  const int fd = sealed_memfd(uint64_t{4} << 30);
  EXPECT_EQ(m.map_shared(fd, (uint64_t{4} << 30) + 1), EINVAL) << "past its end";
  ASSERT_EQ(m.map_shared(fd, kPage), 0);
  m.add_piece(1, {0x200000, (uint64_t{3} << 30), kPage});
  ASSERT_EQ(m.map_shared(fd, (uint64_t{3} << 30) + kPage), 0) << "grown past the first GiB";
  const uint8_t v = 0x5c;
  ASSERT_EQ(write_at(m, 0x200000, &v, 1), 1u);
  uint8_t back = 0;
  ASSERT_EQ(pread(fd, &back, 1, static_cast<off_t>(uint64_t{3} << 30)), 1);
  EXPECT_EQ(back, 0x5c);
  const int other = sealed_memfd(1 << 20);
  EXPECT_EQ(m.map_shared(other, kPage), EINVAL) << "one memfd per context";
  char path[] = "/tmp/metaroce-mapped-XXXXXX";
  const int file = mkstemp(path);
  unlink(path);
  EXPECT_EQ(MappedMemory(1).map_shared(file, 0), EINVAL) << "not a memfd";
  for (int f : {unsealed, fd, other, file}) close(f);
}

}  // namespace
}  // namespace metaroce::engine

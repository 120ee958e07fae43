// SPDX-License-Identifier: Apache-2.0
// A kernel context's memory: accesses by registered address reach the region's mapping (the
// module's pinned pages; anonymous pages here), and nothing else.
#include <sys/mman.h>

#include <gtest/gtest.h>

#include <cstring>
#include <memory>

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

}  // namespace
}  // namespace metaroce::engine

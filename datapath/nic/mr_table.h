// SPDX-License-Identifier: Apache-2.0
// The NIC's memory-region table: key allocation and the checks every local and remote access
// goes through (key, protection domain, access right, bounds). A region remembers the address
// space it lies in, so an rkey reaches the memory of the process that registered it. Memory
// windows (type 1 and 2) share the key space: a window is an rkey onto part of a region, valid
// only while bound (docs/spec/verbs-mapping.md §13).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "datapath/nic/memory.h"

namespace metaroce::nic {

class Owner;

struct MemoryRegion {
  uint64_t addr = 0;        // where the region starts in the addresses verbs use for it (its IOVA)
  uint64_t length = 0;
  unsigned int access = 0;  // ibv_access_flags values
  uint32_t pd = 0;
  uint32_t key = 0;         // lkey == rkey
  Memory* mem = nullptr;
  const Owner* owner = nullptr;
  bool valid = false;
  uint64_t va = 0;          // where byte 0 lies in mem (== addr unless registered with an IOVA)
  uint8_t mw_type = 0;      // 0: a region; 1, 2: a memory window of that type
  bool bound = false;       // window: reachable (access, addr, length, va, mem are the bind's)
  uint32_t qpn = 0;         // type 2 window: the QP it is bound to, the only one it serves
  uint32_t parent = 0;      // bound window: its region's key
  uint32_t windows = 0;     // region: windows bound to it (dereg answers EBUSY meanwhile)

  // The address in mem of verbs address a (checked to lie in the region).
  uint64_t translate(uint64_t a) const { return va + (a - addr); }
};

enum class MrCheck : uint8_t { kOk, kBadKey, kBadPd, kNoAccess, kOutOfBounds };

class MrTable {
 public:
  // Returns the new key, or 0 when the table is full (2^24 regions). iova: the address verbs
  // use for byte 0 (local SGEs and remote accesses alike); va: where it lies in mem. With `want`
  // (a key another authority chose: the kernel module's), the region takes exactly that key, or
  // 0 when its index is taken.
  uint32_t add(uint32_t pd, uint64_t iova, uint64_t va, uint64_t length, unsigned int access,
               Memory* mem, const Owner* owner, uint32_t want = 0);
  // The window whose key has key's index, whatever its low byte (a type 2 window's key is the
  // application's to change with every bind); nullptr when there is none.
  MemoryRegion* window_at(uint32_t key, const Owner* owner);
  // The region of key, to change in place (ibv_rereg_mr); nullptr when there is none.
  MemoryRegion* find_mutable(uint32_t key, const Owner* owner);
  // The region of key if it belongs to owner (nullptr: any owner).
  const MemoryRegion* find(uint32_t key, const Owner* owner = nullptr) const;
  bool remove(uint32_t key);
  // Checks that [addr, addr + len) lies in the region named by key (an lkey: windows do not
  // count), which belongs to pd and grants every bit of `need`. On success *mr is the region.
  MrCheck check(uint32_t key, uint32_t pd, unsigned int need, uint64_t addr, uint64_t len,
                const MemoryRegion** mr) const;
  // The same for an rkey arriving at QP qpn: a region, or a window bound (type 2: to qpn).
  MrCheck check_remote(uint32_t key, uint32_t pd, uint32_t qpn, unsigned int need, uint64_t addr,
                       uint64_t len, const MemoryRegion** mr) const;

  // --- memory windows: 0 or an errno ---
  // A new unbound window of type 1 or 2 in pd; *rkey its key.
  int add_window(uint32_t pd, uint8_t type, const Owner* owner, uint32_t* rkey);
  // Binds window `rkey` (its current key) of pd as new_rkey (same index, any low byte) onto
  // [addr, addr + length) of region lkey with `access`, for QP qpn (type 2; type 1: 0). Length
  // 0 unbinds. EINVAL: no such window or region, another PD, a type 2 window already bound, a
  // key of another index; EACCES: the region does not allow windows, or the access does not
  // fit it; ERANGE: the range is outside the region.
  int bind_window(uint32_t rkey, uint32_t new_rkey, uint32_t pd, uint32_t qpn, uint32_t lkey,
                  uint64_t addr, uint64_t length, unsigned int access);
  // Invalidates the type 2 window currently named rkey in pd; qpn nonzero: it must be bound to
  // that QP (a remote invalidation). EINVAL otherwise.
  int invalidate_window(uint32_t rkey, uint32_t pd, uint32_t qpn);
  size_t size() const { return live_; }
  // Every key of owner (for reclaiming a process's objects).
  std::vector<uint32_t> keys_of(const Owner* owner) const;

 private:
  static MrCheck check_range(const MemoryRegion& r, uint32_t pd, unsigned int need, uint64_t addr,
                             uint64_t len, const MemoryRegion** mr);
  void unbind(MemoryRegion& window);
  // ibv_access_flags values this table looks at (nic.h names them for the rest of the NIC).
  static constexpr unsigned kMwLocalWrite = 1, kMwRemoteWrite = 2, kMwRemoteAtomic = 8,
                            kMwBindAccess = 16;
  std::vector<MemoryRegion> regions_;  // index = key >> 8; key & 0xff = generation
  std::vector<uint32_t> free_;
  size_t live_ = 0;
};

}  // namespace metaroce::nic

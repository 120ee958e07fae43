// SPDX-License-Identifier: Apache-2.0
// An in-memory point-to-point link between two io::Port ends, for tests of the layers above
// (and loopback); thread-safe, bounded queues, optional deterministic drop of every Nth frame.
#pragma once

#include <memory>
#include <utility>

#include "datapath/io/port.h"

namespace metaroce::io {

struct MemLinkConfig {
  uint32_t queue_frames = 4096;  // per direction; beyond it frames are dropped and counted
  uint32_t frame_size = 9216;
  uint32_t drop_every = 0;       // 0: no loss; N: drop every Nth frame in each direction
};

std::pair<std::unique_ptr<Port>, std::unique_ptr<Port>> make_mem_link(const MemLinkConfig& cfg);

}  // namespace metaroce::io

// SPDX-License-Identifier: Apache-2.0
// The publishing side of telemetry.h: one block per link, written by the engine.
#pragma once

#include <string>

#include "datapath/nic/telemetry.h"

namespace metaroce::nic {

class Nic;
class LinkLayer;

class TelemetryWriter {
 public:
  // Creates <run dir>/stat/<link>.<pid>; a writer that could not is inert (ok() false).
  TelemetryWriter(const std::string& run_dir, const std::string& link, uint32_t planes);
  ~TelemetryWriter();
  TelemetryWriter(const TelemetryWriter&) = delete;
  TelemetryWriter& operator=(const TelemetryWriter&) = delete;

  bool ok() const { return block_ != nullptr; }
  // Opens an update: the returned block may be written until end_update().
  TelemetryBlock* begin_update();
  void end_update();

 private:
  std::string file_;
  TelemetryBlock* block_ = nullptr;
};

// Refreshes the block of a link from its NIC and link layer; contexts: driver contexts open on
// the link, stalls: the engine's own (both shown as counters).
void publish_telemetry(TelemetryWriter& w, const Nic& nic, const LinkLayer& link,
                       uint64_t contexts, uint64_t stalls);

}  // namespace metaroce::nic

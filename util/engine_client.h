// SPDX-License-Identifier: Apache-2.0
// The command's side of the engine's control socket: starting the engine of a run dir when none
// serves it, and the administrator's requests (open and close links, status, shutdown).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "datapath/hostif/control.h"

namespace metaroce::util {

// A connection to the engine of rundir; closed when destroyed.
class EngineConnection {
 public:
  // Connects; !ok() (and errno) when no engine listens there.
  explicit EngineConnection(const std::string& rundir);
  ~EngineConnection();
  EngineConnection(const EngineConnection&) = delete;
  EngineConnection& operator=(const EngineConnection&) = delete;
  bool ok() const { return sock_ >= 0; }
  // One request: the engine's status (0 or an errno), or the errno of the exchange; *resp the
  // answer (its descriptors closed).
  int call(hostif::Op op, const void* body, size_t len, hostif::Message* resp,
           const std::vector<int>& fds = {});
  template <typename T>
  int call(hostif::Op op, const T& body, hostif::Message* resp) {
    return call(op, &body, sizeof(T), resp);
  }

 private:
  int sock_ = -1;
  uint32_t seq_ = 0;
};

// Starts `program --rundir rundir --daemon [extra...]` and waits until it serves (or says why
// not). false and *why when it cannot.
bool start_engine(const std::string& program, const std::string& rundir,
                  const std::vector<std::string>& extra, std::string* why);

// The engine's reason in a failed answer, or strerror(status).
std::string engine_reason(const hostif::Message& resp, int status);

}  // namespace metaroce::util

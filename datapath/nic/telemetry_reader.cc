// SPDX-License-Identifier: Apache-2.0
// Reading the telemetry blocks processes publish (the `metaroce stat` side).
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>

#include "datapath/nic/telemetry.h"

namespace metaroce::nic {

std::string telemetry_dir(const std::string& run_dir) { return run_dir + "/stat"; }

namespace {

// Copies the block under its sequence lock; nullopt if it is not a valid block.
std::optional<TelemetrySnapshot> snapshot(const std::string& file) {
  int fd = open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return std::nullopt;
  struct stat st {};
  if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) < sizeof(TelemetryBlock)) {
    close(fd);
    return std::nullopt;
  }
  void* map = mmap(nullptr, sizeof(TelemetryBlock), PROT_READ, MAP_SHARED, fd, 0);
  close(fd);
  if (map == MAP_FAILED) return std::nullopt;
  const auto* b = static_cast<const TelemetryBlock*>(map);
  std::optional<TelemetrySnapshot> out;
  // A writer descheduled mid-update (odd sequence) holds readers up for as long as it is off
  // its core, which on a loaded host outlasts any number of spins: after the first hundred,
  // each try waits 50 us (up to 45 ms in all) rather than give up on a live engine.
  for (int attempt = 0; attempt < 1000 && !out; ++attempt) {
    if (attempt >= 100) std::this_thread::sleep_for(std::chrono::microseconds(50));
    const uint64_t before = b->seq.load(std::memory_order_acquire);
    if (before & 1) continue;
    if (b->magic != kTelemetryMagic || b->version != kTelemetryVersion) break;
    TelemetrySnapshot s;
    s.file = file;
    s.pid = b->pid;
    s.planes = b->planes;
    s.updated_unix_ns = b->updated_unix_ns;
    const uint32_t nc = std::min(b->num_counters, kTelemetryCounters);
    s.counters.assign(b->counters, b->counters + nc);
    const uint32_t nconn = std::min(b->num_conns, kTelemetryConns);
    s.conns.assign(b->conns, b->conns + nconn);
    std::atomic_thread_fence(std::memory_order_acquire);
    if (b->seq.load(std::memory_order_relaxed) == before) out = std::move(s);
  }
  munmap(map, sizeof(TelemetryBlock));
  return out;
}

}  // namespace

std::optional<std::vector<TelemetrySnapshot>> read_telemetry(const std::string& run_dir,
                                                             const std::string& link,
                                                             std::string* err) {
  const std::string dir = telemetry_dir(run_dir);
  std::vector<TelemetrySnapshot> result;
  DIR* d = opendir(dir.c_str());
  if (!d) {
    if (errno == ENOENT) return result;  // nobody published yet
    if (err) *err = dir + ": " + std::strerror(errno);
    return std::nullopt;
  }
  const std::string prefix = link + ".";
  while (dirent* e = readdir(d)) {
    std::string name = e->d_name;
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    const std::string pid_text = name.substr(prefix.size());
    if (pid_text.empty() || pid_text.find_first_not_of("0123456789") != std::string::npos) continue;
    const pid_t pid = static_cast<pid_t>(std::stol(pid_text));
    const std::string file = dir + "/" + name;
    if (kill(pid, 0) != 0 && errno == ESRCH) {
      unlink(file.c_str());  // the process is gone: its counters with it
      continue;
    }
    if (auto s = snapshot(file)) result.push_back(std::move(*s));
  }
  closedir(d);
  return result;
}

}  // namespace metaroce::nic

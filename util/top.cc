// SPDX-License-Identifier: Apache-2.0
// `metaroce top`: the model (rows from two snapshots), the frame and the loop
// (util/top.h).
#include "util/top.h"

#include <poll.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <termios.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <deque>
#include <filesystem>
#include <iostream>
#include <map>
#include <optional>
#include <sstream>
#include <thread>
#include <tuple>

#include "util/operator.h"
#include "util/record.h"

namespace metaroce::util {
namespace {

constexpr const char* kTopHelp =
    "Usage: metaroce top [NAME...] [-d SECONDS] [-n FRAMES] [--sort KEY]\n"
    "       metaroce top --replay FILE [--speed X] [-n FRAMES] [--sort KEY]\n"
    "\n"
    "A live view of every connection's paths on links NAME (all links of the run dir by default):\n"
    "per path its rate, smoothed RTT and RTT against the connection's best path, ECN-marked and\n"
    "retransmitted packets per packet sent, window and state (active, failed, probing,\n"
    "plane-dn, or flapped: failed and back since the last refresh), the worst paths marked '*'\n"
    "(and red on a terminal), and the last path events below. Refreshed every SECONDS (default\n"
    "1). KEY: rate (default), rtt, ecn, retx, state, path. On a terminal (80x24 at least): q "
    "quits,\n"
    "s changes the sort. Not on a terminal: one plain frame per refresh, until FRAMES, an\n"
    "interrupt, or the engine going away (exit 1).\n"
    "--replay plays a `metaroce record` file, X times as fast as it was recorded (default 1).\n";

constexpr int kMinWidth = 80, kMinHeight = 24;
constexpr size_t kEventsKept = 200;

const char* state_short(uint8_t s) {
  switch (s) {
    case 0:
      return "active";
    case 1:
      return "failed";
    case 2:
      return "probing";
    case nic::kTelemetryPlaneDown:
      return "plane-dn";
  }
  return "?";
}

std::string fit(std::string s, size_t width) {
  if (s.size() > width) s.resize(width);
  return s;
}

// The terminal in raw mode (no echo, keys one at a time, signals kept) on the
// alternate screen, restored whatever way the view ends.
class Terminal {
 public:
  Terminal() {
    if (tcgetattr(STDIN_FILENO, &saved_) == 0) {
      termios raw = saved_;
      raw.c_lflag &= static_cast<tcflag_t>(~(ICANON | ECHO));
      raw.c_cc[VMIN] = 0;
      raw.c_cc[VTIME] = 0;
      have_ = tcsetattr(STDIN_FILENO, TCSANOW, &raw) == 0;
    }
    std::fputs("\x1b[?1049h\x1b[?25l", stdout);
  }
  ~Terminal() {
    std::fputs("\x1b[?25h\x1b[?1049l", stdout);
    std::fflush(stdout);
    if (have_) tcsetattr(STDIN_FILENO, TCSANOW, &saved_);
  }
  // A key pressed within ms milliseconds, or 0.
  static char key(int ms) {
    pollfd p{STDIN_FILENO, POLLIN, 0};
    if (poll(&p, 1, ms) <= 0) return 0;
    char c = 0;
    return read(STDIN_FILENO, &c, 1) == 1 ? c : 0;
  }

 private:
  termios saved_{};
  bool have_ = false;
};

bool terminal_size(int* w, int* h) {
  winsize ws{};
  if (ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) != 0 || ws.ws_col == 0) return false;
  *w = ws.ws_col;
  *h = ws.ws_row;
  return true;
}

std::vector<std::string> all_links(const Context& ctx) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(ctx.sysfs() + "/class/infiniband", ec))
    out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

std::optional<nic::TelemetrySnapshot> newest_of(const Context& ctx, const std::string& link) {
  std::string err;
  auto snaps = nic::read_telemetry(ctx.rundir, link, &err);
  const nic::TelemetrySnapshot* s = snaps ? newest(*snaps) : nullptr;
  if (!s) return std::nullopt;
  return *s;
}

std::string clock_text(int64_t unix_ns) {
  const time_t secs = static_cast<time_t>(unix_ns / 1000000000);
  tm t{};
  gmtime_r(&secs, &t);
  char buf[40];
  std::strftime(buf, sizeof(buf), "%Y-%m-%d %H:%M:%SZ", &t);
  return buf;
}

// What the loop shows: per link the last two snapshots and the events between
// them.
struct View {
  std::map<std::string, nic::TelemetrySnapshot> last, prev;
  std::deque<std::string> events;
  uint64_t events_total = 0;  // ever taken, so that plain frames print each event once
  int64_t now_ns = 0;

  void take(const std::string& link, const nic::TelemetrySnapshot& s) {
    auto it = last.find(link);
    if (it != last.end()) {
      if (it->second.updated_unix_ns == s.updated_unix_ns) return;
      if (it->second.pid == s.pid)
        for (std::string& e : path_events(link, it->second, s)) {
          events.push_back(std::move(e));
          ++events_total;
        }
      prev[link] = std::move(it->second);
    }
    last[link] = s;
    now_ns = std::max(now_ns, s.updated_unix_ns);
    while (events.size() > kEventsKept) events.pop_front();
  }
  std::vector<PathRow> rows() const {
    std::vector<PathRow> out;
    for (const auto& [link, s] : last) {
      auto p = prev.find(link);
      auto r = path_rows(link, p == prev.end() || p->second.pid != s.pid ? nullptr : &p->second, s);
      out.insert(out.end(), r.begin(), r.end());
    }
    return out;
  }
};

struct Options {
  std::vector<std::string> links;
  std::string replay;
  double delay = 1, speed = 1;
  uint64_t frames = 0;  // 0: no limit
  TopSort sort = TopSort::kRate;
};

int parse_options(const std::vector<std::string>& args, const Context& ctx, Options* o,
                  std::string* why) {
  auto usage = [&](const std::string& what) {
    *why = "top: " + what;
    return kExitUsage;
  };
  auto number = [](const std::string& s, double lo, double hi, double* out) {
    std::istringstream in(s);
    return (in >> *out) && in.eof() && *out > lo && *out <= hi;
  };
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      *ctx.out << kTopHelp;
      return -1;
    }
    const bool takes = a == "-d" || a == "-n" || a == "--sort" || a == "--replay" || a == "--speed";
    if (takes && i + 1 >= args.size()) return usage(a + " needs a value");
    if (a == "-d") {
      if (!number(args[++i], 0.0499, 3600, &o->delay))
        return usage("-d takes seconds in [0.05, 3600]");
    } else if (a == "--speed") {
      if (!number(args[++i], 0, 1e6, &o->speed)) return usage("--speed takes a factor in (0, 1e6]");
    } else if (a == "-n") {
      double n;
      if (!number(args[++i], 0, 1e9, &n) || n != static_cast<uint64_t>(n))
        return usage("-n takes a whole number of frames, at least 1");
      o->frames = static_cast<uint64_t>(n);
    } else if (a == "--replay") {
      o->replay = args[++i];
    } else if (a == "--sort") {
      const std::string& k = args[++i];
      int found = -1;
      for (int s = 0; s < kTopSorts; ++s)
        if (k == to_string(static_cast<TopSort>(s))) found = s;
      if (found < 0)
        return usage("--sort takes rate, rtt, ecn, retx, state or path, not '" + k + "'");
      o->sort = static_cast<TopSort>(found);
    } else if (!a.empty() && a[0] == '-') {
      return usage("unknown option '" + a + "'");
    } else {
      o->links.push_back(a);
    }
  }
  if (!o->replay.empty() && !o->links.empty()) return usage("--replay takes no link names");
  for (const std::string& l : o->links)
    if (!link_exists(ctx, l)) {
      *why = "top: no link '" + l + "' in " + ctx.rundir;
      return kExitError;
    }
  return kExitOk;
}

// An event as a terminal shows it: its time of day (not its date), and "peer" and lane 0 left
// out, so that most fit 80 columns.
std::string terminal_event(std::string e) {
  if (e.size() > 11 && e[4] == '-' && e[10] == 'T') e.erase(0, 11);
  for (const std::string cut : {std::string(" lane 0x0"), std::string(" peer")}) {
    if (auto at = e.find(cut); at != std::string::npos) e.erase(at, cut.size());
  }
  return e;
}

}  // namespace

const char* to_string(TopSort s) {
  switch (s) {
    case TopSort::kRate:
      return "rate";
    case TopSort::kRtt:
      return "rtt";
    case TopSort::kEcn:
      return "ecn";
    case TopSort::kRetx:
      return "retx";
    case TopSort::kState:
      return "state";
    case TopSort::kPath:
      return "path";
  }
  return "?";
}

std::vector<PathRow> path_rows(const std::string& link, const nic::TelemetrySnapshot* before,
                               const nic::TelemetrySnapshot& after) {
  std::vector<PathRow> out;
  const double dt = before ? (after.updated_unix_ns - before->updated_unix_ns) / 1e9 : 0;
  for (const nic::TelemetryConn& c : after.conns) {
    const nic::TelemetryConn* old = nullptr;
    if (before)
      for (const auto& b : before->conns)
        if (b.peer_ip == c.peer_ip && b.lane == c.lane) old = &b;
    int64_t best = 0;
    const uint32_t n = std::min(c.num_paths, nic::kTelemetryPaths);
    for (uint32_t i = 0; i < n; ++i)
      if (c.paths[i].state == 0 && c.paths[i].srtt_ns > 0 && (!best || c.paths[i].srtt_ns < best))
        best = c.paths[i].srtt_ns;
    for (uint32_t i = 0; i < n; ++i) {
      const nic::TelemetryPath& p = c.paths[i];
      PathRow r;
      r.link = link;
      r.peer_ip = c.peer_ip;
      r.lane = c.lane;
      r.path = p.path_id;
      r.udp_port = p.udp_src_port;
      r.plane = p.plane;
      r.state = p.state;
      r.window = p.window;
      r.in_flight = p.in_flight;
      r.rtt_us = p.srtt_ns / 1e3;
      r.rtt_ratio = best && p.srtt_ns > 0 ? static_cast<double>(p.srtt_ns) / best : 0;
      const nic::TelemetryPath* q = old && i < old->num_paths ? &old->paths[i] : nullptr;
      if (q && dt > 0 && p.tx_packets >= q->tx_packets) {
        const double pkts = static_cast<double>(p.tx_packets - q->tx_packets);
        r.rate_mbps = (p.tx_bytes - q->tx_bytes) * 8 / dt / 1e6;
        if (pkts > 0) {
          r.ecn_pct = 100.0 * (p.ecn_ce_echoed - q->ecn_ce_echoed) / pkts;
          r.retx_pct = 100.0 * (p.retransmits - q->retransmits) / pkts;
        }
      }
      r.flapped = p.state == 0 && q && p.failures > q->failures;
      r.worst = p.state != 0 || r.flapped || r.rtt_ratio >= 2 || r.retx_pct >= 1;
      out.push_back(std::move(r));
    }
  }
  return out;
}

void sort_rows(std::vector<PathRow>& rows, TopSort by) {
  auto key = [by](const PathRow& r) -> double {
    switch (by) {
      case TopSort::kRate:
        return -r.rate_mbps;
      case TopSort::kRtt:
        return -r.rtt_ratio;
      case TopSort::kEcn:
        return -r.ecn_pct;
      case TopSort::kRetx:
        return -r.retx_pct;
      case TopSort::kState:
        return r.flapped ? -0.5 : -static_cast<double>(r.state);
      case TopSort::kPath:
        return 0;
    }
    return 0;
  };
  std::stable_sort(rows.begin(), rows.end(), [&](const PathRow& a, const PathRow& b) {
    if (key(a) != key(b)) return key(a) < key(b);
    return std::tie(a.link, a.peer_ip, a.lane, a.path) <
           std::tie(b.link, b.peer_ip, b.lane, b.path);
  });
}

std::vector<std::string> render_top(const std::vector<PathRow>& rows,
                                    const std::vector<std::string>& events, const std::string& when,
                                    TopSort by, int width, int height, bool color) {
  const auto w = static_cast<size_t>(std::max(width, kMinWidth));
  const size_t conn_w = 16 + (w - kMinWidth);  // extra columns widen the connection's name
  std::vector<std::string> out;
  size_t failed = 0;
  for (const PathRow& r : rows) failed += r.state != 0;
  char line[512];
  std::snprintf(line, sizeof(line), "top  %s  %zu paths, %zu not active  sort %s%s", when.c_str(),
                rows.size(), failed, to_string(by), color ? "  q:quit s:sort" : "");
  out.push_back(fit(line, w));
  std::snprintf(line, sizeof(line), " %-*s %4s %2s %5s %-8s %7s %7s %5s %5s %5s %5s",
                static_cast<int>(conn_w), "CONNECTION", "PATH", "PL", "SPORT", "STATE", "MBIT/S",
                "RTT_US", "xBEST", "ECN%", "RETX%", "WIN");
  out.push_back(fit(line, w));
  const size_t limit = height > 0 ? static_cast<size_t>(height) : SIZE_MAX;
  // The events get at least six lines (a heading and five events) when there
  // are any.
  const size_t event_lines = events.empty() ? 0 : std::min<size_t>(events.size(), 5) + 1;
  const size_t room =
      limit == SIZE_MAX ? rows.size()
                        : (limit > out.size() + event_lines ? limit - out.size() - event_lines : 0);
  // Rows that do not fit give their last line to a count of them.
  const size_t shown = rows.size() <= room ? rows.size() : (room ? room - 1 : 0);
  for (size_t i = 0; i < shown; ++i) {
    const PathRow& r = rows[i];
    std::string conn = r.link + ">" + nic::format_ipv4(r.peer_ip);
    if (r.lane) conn += "/" + std::to_string(r.lane);
    char ratio[16] = "-";
    if (r.rtt_ratio > 0) std::snprintf(ratio, sizeof(ratio), "%.1f", r.rtt_ratio);
    std::snprintf(line, sizeof(line), "%c%-*s %4u %2u %5u %-8s %7.0f %7.1f %5s %5.1f %5.1f %5u",
                  r.worst ? '*' : ' ', static_cast<int>(conn_w), fit(conn, conn_w).c_str(), r.path,
                  r.plane, r.udp_port, r.flapped ? "flapped" : state_short(r.state), r.rate_mbps,
                  r.rtt_us, ratio, r.ecn_pct, r.retx_pct, r.window);
    std::string l = fit(line, w);
    if (color && r.worst) l = "\x1b[1;31m" + l + "\x1b[0m";
    out.push_back(std::move(l));
  }
  if (shown < rows.size() && room)
    out.push_back(fit("  ... " + std::to_string(rows.size() - shown) + " more paths", w));
  if (!events.empty()) {
    const size_t left = limit == SIZE_MAX ? events.size() + 1 : limit - std::min(limit, out.size());
    if (left >= 2) {
      out.push_back(color ? "\x1b[7m" + fit("EVENTS", w) + "\x1b[0m" : "EVENTS");
      const size_t n = std::min(events.size(), left - 1);
      // On a terminal an event is shortened (terminal_event) and cut at the edge; plain frames,
      // which go to logs, keep it whole.
      for (size_t i = events.size() - n; i < events.size(); ++i) {
        out.push_back(height > 0 ? fit(terminal_event(events[i]), w) : events[i]);
      }
    }
  }
  return out;
}

namespace {

void show(const std::vector<std::string>& lines, bool tty, std::ostream& out) {
  if (tty) {
    std::string screen = "\x1b[H";
    for (size_t i = 0; i < lines.size(); ++i)
      screen += lines[i] + "\x1b[K" + (i + 1 < lines.size() ? "\n" : "");
    screen += "\x1b[J";
    std::fputs(screen.c_str(), stdout);
    std::fflush(stdout);
    return;
  }
  for (const std::string& l : lines) out << l << "\n";
  out << "\n";
  out.flush();
}

// Waits the refresh out, answering keys meanwhile on a terminal (s: the next sort, at once).
// Returns whether q was pressed.
bool wait_refresh(double secs, bool tty, TopSort* sort) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(secs);
  while (!StopOnSignal::requested() && std::chrono::steady_clock::now() < until) {
    if (!tty) {
      std::this_thread::sleep_for(std::min<std::chrono::duration<double>>(
          until - std::chrono::steady_clock::now(), std::chrono::milliseconds(50)));
      continue;
    }
    const char k = Terminal::key(50);
    if (k == 'q' || k == 'Q') return true;
    if (k == 's' || k == 'S') {
      *sort = static_cast<TopSort>((static_cast<int>(*sort) + 1) % kTopSorts);
      return false;
    }
  }
  return false;
}

// Takes each link's newest snapshot; false once no engine publishes any of them, having done so.
// A read that finds nothing while the engine last seen still runs (a block being rewritten, a
// reader descheduled past its sequence lock's retries) is not its death: the view stays.
bool take_live(View& view, const Options& o, const Context& ctx, bool* seen) {
  bool any = false;
  for (const std::string& l : o.links)
    if (auto s = newest_of(ctx, l)) {
      view.take(l, *s);
      any = true;
    }
  if (!any && *seen) {
    for (const auto& [link, s] : view.last)
      if (::kill(static_cast<pid_t>(s.pid), 0) == 0 || errno == EPERM) return true;
    return false;
  }
  *seen |= any;
  return true;
}

// The frame's events: a terminal shows the last ones; a plain frame, which goes to a log, those
// new since the last frame.
std::vector<std::string> frame_events(const View& view, bool tty, uint64_t* shown) {
  const size_t fresh = std::min<uint64_t>(view.events.size(), view.events_total - *shown);
  *shown = view.events_total;
  return {tty ? view.events.begin() : view.events.end() - static_cast<ptrdiff_t>(fresh),
          view.events.end()};
}

}  // namespace

int top_command(const std::vector<std::string>& args, const Context& ctx, std::string* why) {
  Options o;
  if (int st = parse_options(args, ctx, &o, why); st != kExitOk) return st < 0 ? kExitOk : st;
  std::optional<Recording> rec;
  if (!o.replay.empty()) {
    std::string err;
    rec = read_record(o.replay, &err);
    if (!rec) {
      *why = "top: " + err;
      return kExitError;
    }
  } else if (o.links.empty()) {
    o.links = all_links(ctx);
    if (o.links.empty()) {
      *why = "top: no links in " + ctx.rundir + " (metaroce link add)";
      return kExitError;
    }
  }
  int width = kMinWidth, height = 0;
  const bool tty = isatty(STDOUT_FILENO) && isatty(STDIN_FILENO) && ctx.out == &std::cout;
  if (tty && (!terminal_size(&width, &height) || width < kMinWidth || height < kMinHeight)) {
    *why = "top: the terminal is " + std::to_string(width) + "x" + std::to_string(height) +
           ", the view needs " + std::to_string(kMinWidth) + "x" + std::to_string(kMinHeight) +
           " (or run it with its output not on a terminal)";
    return kExitError;
  }
  StopOnSignal stopper;
  std::optional<Terminal> term;
  if (tty) term.emplace();
  View view;
  int status = kExitOk;
  size_t next = 0;  // the replay's next sample
  bool seen = false;
  uint64_t events_shown = 0;
  bool quit = false;
  for (uint64_t frame = 0; !quit && !StopOnSignal::requested() && (!o.frames || frame < o.frames);
       ++frame) {
    if (rec) {
      if (next >= rec->samples.size()) break;
      // Every sample up to one delay of record time past the first unseen one.
      const int64_t until =
          rec->samples[next].updated_unix_ns + static_cast<int64_t>(o.delay * 1e9);
      while (next < rec->samples.size() && rec->samples[next].updated_unix_ns <= until)
        view.take(rec->link, rec->samples[next++]);
    } else if (!take_live(view, o, ctx, &seen)) {
      *why = "top: no engine serves " + o.links[0] + (o.links.size() > 1 ? " or the others" : "") +
             " any more (it exited)";
      status = kExitError;
      break;
    }
    if (tty) terminal_size(&width, &height);
    auto rows = view.rows();
    sort_rows(rows, o.sort);
    const std::string when = view.now_ns ? clock_text(view.now_ns) : "waiting for the engine";
    show(render_top(rows, frame_events(view, tty, &events_shown), when, o.sort, width,
                    tty ? height : 0, tty),
         tty, *ctx.out);
    if (rec && next >= rec->samples.size() && !tty) break;
    quit = wait_refresh(rec ? o.delay / o.speed : o.delay, tty, &o.sort);
  }
  return status;
}

}  // namespace metaroce::util

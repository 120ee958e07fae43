// SPDX-License-Identifier: Apache-2.0
// librdmacm without a kernel (docs/spec/cm.md §1): librdmacm opens /dev/infiniband/rdma_cm and
// writes the kernel's ucma commands to it, the kernel writing each answer into the caller's
// memory before write() returns. Where the run dir of SYSFS_PATH says its engine is the host's
// CM, this file answers instead: open() of that path gives one end of a socket pair whose other
// end the engine writes the channel's events into (so poll() and O_NONBLOCK behave as on the
// kernel's file), fstat() calls it a character device, write() sends each command to the
// engine over a connection of its own and copies the answer to where the command points, and
// close() ends both. Every other descriptor and path goes to libc untouched. Plain C++ with no
// library but libc: every program of `metaroce exec` loads it.
// open/open64 and fstat/fstat64 are defined apart here, so the headers must not rename one to
// the other (meson builds with 64-bit file offsets; on LP64 the two are the same ABI anyway).
#undef _FILE_OFFSET_BITS
#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <rdma/rdma_user_cm.h>
#include <stdarg.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "datapath/hostif/control.h"

namespace {

constexpr const char* kCmPath = "/dev/infiniband/rdma_cm";
constexpr int kMaxFd = 1 << 16;

// Joins (multicast) are counted in the same table as ids, under their handle with this bit.
constexpr uint32_t kJoinKey = 1u << 16;

struct Count {
  uint32_t id;
  uint32_t delivered;  // events GET_EVENT handed out for it (DESTROY_ID, MIGRATE_ID report it)
  bool destroyed;      // its later events are dropped
};

struct Channel {
  int cmd = -1;                 // connection to the engine
  uint32_t number = 0;          // the engine's name for the channel
  uint32_t seq = 0;
  pthread_mutex_t cmd_mu = PTHREAD_MUTEX_INITIALIZER;    // one command at a time
  pthread_mutex_t count_mu = PTHREAD_MUTEX_INITIALIZER;  // counts
  Count* counts = nullptr;
  size_t ncounts = 0, cap = 0;
  int users = 0;        // calls inside it now (g_table_mu)
  bool closed = false;  // the application closed it: freed by the last user
};

Channel* g_channels[kMaxFd];  // by the application's descriptor
// Taken to look a channel up for a call, and to close one: a thread blocked in GET_EVENT while
// another closes the descriptor wakes (the engine ends the channel) and frees it on its way out.
pthread_mutex_t g_table_mu = PTHREAD_MUTEX_INITIALIZER;

using OpenFn = int (*)(const char*, int, ...);
using FstatFn = int (*)(int, struct stat*);
using WriteFn = ssize_t (*)(int, const void*, size_t);
using CloseFn = int (*)(int);

template <typename Fn>
Fn next(const char* name) {
  return reinterpret_cast<Fn>(dlsym(RTLD_NEXT, name));
}

Channel* channel_of(int fd) {
  if (fd < 0 || fd >= kMaxFd) return nullptr;
  return __atomic_load_n(&g_channels[fd], __ATOMIC_ACQUIRE);
}

// The engine socket of SYSFS_PATH's run dir when that run dir is the host's CM, else false.
bool engine_socket(sockaddr_un* addr) {
  const char* sysfs = getenv("SYSFS_PATH");
  if (!sysfs || !*sysfs) return false;
  char path[sizeof(addr->sun_path)];
  int n = snprintf(path, sizeof(path), "%s/class/misc/rdma_cm/metaroce", sysfs);
  if (n <= 0 || static_cast<size_t>(n) >= sizeof(path) || access(path, F_OK) != 0) return false;
  // SYSFS_PATH is <run dir>/sys.
  n = snprintf(path, sizeof(path), "%s", sysfs);
  while (n > 1 && path[n - 1] == '/') path[--n] = 0;
  char* slash = strrchr(path, '/');
  if (!slash) return false;
  *slash = 0;
  std::memset(addr, 0, sizeof(*addr));
  addr->sun_family = AF_UNIX;
  n = snprintf(addr->sun_path, sizeof(addr->sun_path), "%s/%s", path[0] ? path : "",
               metaroce::hostif::kEngineSocket);
  return n > 0 && static_cast<size_t>(n) < sizeof(addr->sun_path);
}

// One request on the channel's connection and its answer: the status (0 or an errno) and up
// to `out` bytes of body into resp (*got: how many). fd: a descriptor to pass, or -1.
int call(int sock, uint32_t* seq, metaroce::hostif::Op op, const void* body, size_t len, int fd,
         void* resp, size_t out, size_t* got) {
  using metaroce::hostif::Header;
  Header h;
  h.op = op;
  h.seq = ++*seq;
  iovec iov[2] = {{&h, sizeof(h)}, {const_cast<void*>(body), len}};
  msghdr m{};
  m.msg_iov = iov;
  m.msg_iovlen = len ? 2 : 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))];
  if (fd >= 0) {
    std::memset(control, 0, sizeof(control));
    m.msg_control = control;
    m.msg_controllen = sizeof(control);
    cmsghdr* c = CMSG_FIRSTHDR(&m);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
  }
  ssize_t n;
  do {
    n = sendmsg(sock, &m, MSG_NOSIGNAL);
  } while (n < 0 && errno == EINTR);
  if (n < 0) return errno == EPIPE || errno == ECONNRESET ? ENODEV : errno;
  static thread_local char buf[metaroce::hostif::kMaxMessage];
  for (;;) {
    do {
      n = recv(sock, buf, sizeof(buf), 0);
    } while (n < 0 && errno == EINTR);
    if (n <= 0) return ENODEV;  // the engine is gone
    if (static_cast<size_t>(n) < sizeof(Header)) return EPROTO;
    Header r;
    std::memcpy(&r, buf, sizeof(r));
    if (r.magic != metaroce::hostif::kControlMagic || r.seq != h.seq || r.op != op) return EPROTO;
    if (r.status) return r.status;
    const size_t body_len = static_cast<size_t>(n) - sizeof(Header);
    *got = body_len < out ? body_len : out;
    if (*got) std::memcpy(resp, buf + sizeof(Header), *got);
    return 0;
  }
}

// Keeps every live id's entry and the latest destroyed ones (whose events may still be in the
// socket); older destroyed entries go once the table is large.
void compact(Channel* c) {
  constexpr size_t kKeepDestroyed = 256;
  size_t destroyed = 0;
  for (size_t i = 0; i < c->ncounts; ++i) destroyed += c->counts[i].destroyed;
  size_t drop = destroyed > kKeepDestroyed ? destroyed - kKeepDestroyed : 0;
  size_t j = 0;
  for (size_t i = 0; i < c->ncounts; ++i) {
    if (c->counts[i].destroyed && drop) {
      --drop;
      continue;
    }
    c->counts[j++] = c->counts[i];
  }
  c->ncounts = j;
}

Count* count_of(Channel* c, uint32_t id, bool add) {
  for (size_t i = 0; i < c->ncounts; ++i)
    if (c->counts[i].id == id) return &c->counts[i];
  if (!add) return nullptr;
  if (c->ncounts >= 1024) compact(c);
  if (c->ncounts == c->cap) {
    const size_t cap = c->cap ? c->cap * 2 : 16;
    auto* more = static_cast<Count*>(realloc(c->counts, cap * sizeof(Count)));
    if (!more) return nullptr;
    c->counts = more;
    c->cap = cap;
  }
  c->counts[c->ncounts] = {id, 0, false};
  return &c->counts[c->ncounts++];
}

int open_channel(int flags) {
  sockaddr_un addr;
  if (!engine_socket(&addr)) return -2;  // not ours: libc opens the path
  int pair[2];
  const int cloexec = (flags & O_CLOEXEC) ? SOCK_CLOEXEC : 0;
  if (socketpair(AF_UNIX, SOCK_SEQPACKET | cloexec, 0, pair) != 0) return -1;
  auto* c = static_cast<Channel*>(calloc(1, sizeof(Channel)));
  if (!c || pair[0] >= kMaxFd) {
    free(c);
    close(pair[0]);
    close(pair[1]);
    errno = c ? EMFILE : ENOMEM;
    return -1;
  }
  pthread_mutex_init(&c->cmd_mu, nullptr);
  pthread_mutex_init(&c->count_mu, nullptr);
  c->cmd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  int one = 1;
  int err = ENODEV;
  if (c->cmd >= 0 && setsockopt(c->cmd, SOL_SOCKET, SO_PASSCRED, &one, sizeof(one)) == 0 &&
      connect(c->cmd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    metaroce::hostif::CmOpenResp r;
    size_t got = 0;
    err = call(c->cmd, &c->seq, metaroce::hostif::Op::kCmOpen, nullptr, 0, pair[1], &r,
               sizeof(r), &got);
    if (!err && got != sizeof(r)) err = EPROTO;
    c->number = r.channel;
  }
  close(pair[1]);  // the engine holds its own copy
  if (err) {
    if (c->cmd >= 0) close(c->cmd);
    free(c);
    close(pair[0]);
    errno = err;
    return -1;
  }
  if (flags & O_NONBLOCK) fcntl(pair[0], F_SETFL, O_NONBLOCK);
  __atomic_store_n(&g_channels[pair[0]], c, __ATOMIC_RELEASE);
  return pair[0];
}

// GET_EVENT: the next event of the channel, read from its socket (blocking unless the
// descriptor is O_NONBLOCK, as the kernel's file).
ssize_t get_event(int fd, Channel* c, const rdma_ucm_get_event& g, uint16_t out, size_t len) {
  for (;;) {
    rdma_ucm_event_resp ev;
    ssize_t n;
    do {
      n = recv(fd, &ev, sizeof(ev), 0);
    } while (n < 0 && errno == EINTR);
    if (n < 0) return -1;
    if (n == 0 && __atomic_load_n(&c->closed, __ATOMIC_ACQUIRE)) {
      // The application closed the channel while this thread waited on it: with the kernel's
      // file the wait goes on (the read holds the file) and no event ever comes, so it does
      // here. Programs exit with such a thread (rping's CM thread) and must not see an error.
      for (;;) pause();
    }
    if (n != static_cast<ssize_t>(sizeof(ev))) {
      errno = n == 0 ? ENODEV : EPROTO;  // the engine is gone
      return -1;
    }
    // A connection request counts as an event of its listener (named in `reserved`), as the
    // kernel counts it; a multicast event counts for its id and its join (named there too).
    const bool request = ev.event == 4;  // RDMA_CM_EVENT_CONNECT_REQUEST
    const bool joined = ev.event == 12 || ev.event == 13;  // RDMA_CM_EVENT_MULTICAST_*
    const uint32_t owner = request ? ev.reserved : ev.id;
    const uint32_t join = joined ? kJoinKey | ev.reserved : 0;
    ev.reserved = 0;
    pthread_mutex_lock(&c->count_mu);
    Count* k = count_of(c, owner, true);
    if (request && k && !k->destroyed)
      if (Count* child = count_of(c, ev.id, true)) *child = {ev.id, 0, false};  // a new id
    Count* j = join ? count_of(c, join, true) : nullptr;
    k = count_of(c, owner, true);  // the table may have moved (found again: it adds nothing)
    const bool drop = (k && k->destroyed) || (j && j->destroyed);  // a join left is gone
    if (k && !drop) ++k->delivered;
    if (j && !drop) ++j->delivered;
    pthread_mutex_unlock(&c->count_mu);
    if (drop) {
      if (ev.event == 4) {  // its new id is nobody's: the requester hears it rejected
        rdma_ucm_destroy_id d{};
        d.id = ev.id;
        rdma_ucm_destroy_id_resp r;
        size_t got;
        metaroce::hostif::CmCommandReq q;
        q.cmd = RDMA_USER_CM_CMD_DESTROY_ID;
        q.out = sizeof(r);
        q.body_len = sizeof(d);
        char req[sizeof(q) + sizeof(d)];
        std::memcpy(req, &q, sizeof(q));
        std::memcpy(req + sizeof(q), &d, sizeof(d));
        pthread_mutex_lock(&c->cmd_mu);
        call(c->cmd, &c->seq, metaroce::hostif::Op::kCmCommand, req, sizeof(req), -1, &r,
             sizeof(r), &got);
        pthread_mutex_unlock(&c->cmd_mu);
      }
      continue;
    }
    std::memcpy(reinterpret_cast<void*>(static_cast<uintptr_t>(g.response)), &ev,
                out < sizeof(ev) ? out : sizeof(ev));
    return static_cast<ssize_t>(len);
  }
}

ssize_t command(int fd, Channel* c, const void* buf, size_t len) {
  struct Hdr {
    uint32_t cmd;
    uint16_t in, out;
  } h;
  if (len < sizeof(h)) {
    errno = EINVAL;
    return -1;
  }
  std::memcpy(&h, buf, sizeof(h));
  const auto* body = static_cast<const uint8_t*>(buf) + sizeof(h);
  const size_t body_len = len - sizeof(h);
  if (h.in > body_len) {
    errno = EINVAL;
    return -1;
  }
  if (h.cmd == RDMA_USER_CM_CMD_GET_EVENT) {
    rdma_ucm_get_event g;
    if (body_len < sizeof(g)) {
      errno = EINVAL;
      return -1;
    }
    std::memcpy(&g, body, sizeof(g));
    return get_event(fd, c, g, h.out, len);
  }
  // Where the answer goes: the command's `response` (after `uid` in CREATE_ID).
  uint64_t response = 0;
  const size_t at = h.cmd == RDMA_USER_CM_CMD_CREATE_ID ? 8 : 0;
  if (h.out && body_len >= at + 8) std::memcpy(&response, body + at, 8);
  if (h.out && !response) {
    errno = EFAULT;
    return -1;
  }
  // SET_OPTION's value travels along; MIGRATE_ID names the new channel by the engine's number.
  uint8_t req[sizeof(metaroce::hostif::CmCommandReq) + 512 + 256];
  metaroce::hostif::CmCommandReq q;
  q.cmd = h.cmd;
  q.out = h.out;
  q.body_len = static_cast<uint16_t>(body_len > 512 ? 512 : body_len);
  std::memcpy(req + sizeof(q), body, q.body_len);
  uint32_t id = 0;
  Channel* from = nullptr;  // MIGRATE_ID: the channel the id leaves
  if (h.cmd == RDMA_USER_CM_CMD_SET_OPTION) {
    rdma_ucm_set_option o;
    if (body_len < sizeof(o)) {
      errno = EINVAL;
      return -1;
    }
    std::memcpy(&o, body, sizeof(o));
    if (o.optlen > 256 || (o.optlen && !o.optval)) {
      errno = EINVAL;
      return -1;
    }
    q.extra_len = static_cast<uint16_t>(o.optlen);
    if (o.optlen)
      std::memcpy(req + sizeof(q) + q.body_len, reinterpret_cast<const void*>(o.optval), o.optlen);
  } else if (h.cmd == RDMA_USER_CM_CMD_MIGRATE_ID) {
    // Written to the new channel; fd is the descriptor of the channel the id is on now.
    rdma_ucm_migrate_id m;
    if (body_len < sizeof(m)) {
      errno = EINVAL;
      return -1;
    }
    std::memcpy(&m, body, sizeof(m));
    from = channel_of(static_cast<int>(m.fd));  // the caller holds both descriptors open
    if (!from) {
      errno = EINVAL;  // not a channel of this process
      return -1;
    }
    id = m.id;
    m.fd = from->number;
    std::memcpy(req + sizeof(q), &m, sizeof(m));
  } else if (h.cmd == RDMA_USER_CM_CMD_DESTROY_ID || h.cmd == RDMA_USER_CM_CMD_LEAVE_MCAST) {
    rdma_ucm_destroy_id d;  // LEAVE_MCAST's too, naming the join
    if (body_len < sizeof(d)) {
      errno = EINVAL;
      return -1;
    }
    std::memcpy(&d, body, sizeof(d));
    id = h.cmd == RDMA_USER_CM_CMD_LEAVE_MCAST ? kJoinKey | (d.id & 0xffff) : d.id;
  }
  std::memcpy(req, &q, sizeof(q));
  uint8_t answer[512];
  size_t got = 0;
  pthread_mutex_lock(&c->cmd_mu);
  const int err = call(c->cmd, &c->seq, metaroce::hostif::Op::kCmCommand, req,
                       sizeof(q) + q.body_len + q.extra_len, -1, answer,
                       h.out < sizeof(answer) ? h.out : sizeof(answer), &got);
  pthread_mutex_unlock(&c->cmd_mu);
  if (err) {
    errno = err;
    return -1;
  }
  if (h.cmd == RDMA_USER_CM_CMD_DESTROY_ID || h.cmd == RDMA_USER_CM_CMD_MIGRATE_ID ||
      h.cmd == RDMA_USER_CM_CMD_LEAVE_MCAST) {
    // What was handed out for the id (the engine cannot know what was read): librdmacm waits
    // until it has acknowledged that many. A migrated id keeps its count on its new channel;
    // what the old one still holds of it is dropped there.
    Channel* old = from ? from : c;
    pthread_mutex_lock(&old->count_mu);
    Count* k = count_of(old, id, true);
    const uint32_t delivered = k ? k->delivered : 0;
    if (k) k->destroyed = true;
    pthread_mutex_unlock(&old->count_mu);
    if (from) {
      pthread_mutex_lock(&c->count_mu);
      if (Count* n = count_of(c, id, true)) *n = {id, delivered, false};
      pthread_mutex_unlock(&c->count_mu);
    }
    if (got >= sizeof(uint32_t)) std::memcpy(answer, &delivered, sizeof(delivered));
  }
  const bool joined =
      h.cmd == RDMA_USER_CM_CMD_JOIN_IP_MCAST || h.cmd == RDMA_USER_CM_CMD_JOIN_MCAST;
  if ((h.cmd == RDMA_USER_CM_CMD_CREATE_ID || joined) && got >= sizeof(uint32_t)) {
    uint32_t fresh;  // a handle the engine gives again starts a new count
    std::memcpy(&fresh, answer, sizeof(fresh));
    if (joined) fresh = kJoinKey | (fresh & 0xffff);
    pthread_mutex_lock(&c->count_mu);
    if (Count* k = count_of(c, fresh, true)) *k = {fresh, 0, false};
    pthread_mutex_unlock(&c->count_mu);
  }
  if (got) std::memcpy(reinterpret_cast<void*>(static_cast<uintptr_t>(response)), answer, got);
  return static_cast<ssize_t>(len);
}

void free_channel(Channel* c) {
  close(c->cmd);
  free(c->counts);
  free(c);
}

Channel* acquire(int fd) {
  if (!channel_of(fd)) return nullptr;
  pthread_mutex_lock(&g_table_mu);
  Channel* c = channel_of(fd);
  if (c) ++c->users;
  pthread_mutex_unlock(&g_table_mu);
  return c;
}

void release(Channel* c) {
  pthread_mutex_lock(&g_table_mu);
  const bool last = --c->users == 0 && c->closed;
  pthread_mutex_unlock(&g_table_mu);
  if (last) free_channel(c);
}

// close() of a channel's descriptor: the engine hears it (its connection ends), which also
// wakes a GET_EVENT blocked on the descriptor.
void forget(int fd) {
  pthread_mutex_lock(&g_table_mu);
  Channel* c = channel_of(fd);
  if (c) {
    __atomic_store_n(&g_channels[fd], nullptr, __ATOMIC_RELEASE);
    c->closed = true;
    shutdown(c->cmd, SHUT_RDWR);
  }
  const bool now = c && c->users == 0;
  pthread_mutex_unlock(&g_table_mu);
  if (now) free_channel(c);
}

}  // namespace

extern "C" {

// open and open64: the rdma_cm path is ours where the run dir serves it, else libc's `name`.
static int open_as(const char* name, OpenFn* real, const char* path, int flags, mode_t mode) {
  if (std::strcmp(path, kCmPath) == 0) {
    const int fd = open_channel(flags);
    if (fd != -2) return fd;
  }
  if (!*real) *real = next<OpenFn>(name);
  return (*real)(path, flags, mode);
}

#define METAROCE_MODE_ARG(flags, mode)              \
  mode_t mode = 0;                                  \
  if ((flags) & (O_CREAT | O_TMPFILE)) {            \
    va_list ap;                                     \
    va_start(ap, flags);                            \
    mode = va_arg(ap, mode_t);                      \
    va_end(ap);                                     \
  }

__attribute__((visibility("default"))) int open(const char* path, int flags, ...) {
  METAROCE_MODE_ARG(flags, mode)
  static OpenFn real = nullptr;
  return open_as("open", &real, path, flags, mode);
}

__attribute__((visibility("default"))) int open64(const char* path, int flags, ...) {
  METAROCE_MODE_ARG(flags, mode)
  static OpenFn real = nullptr;
  return open_as("open64", &real, path, flags, mode);
}

static int fake_stat(struct stat* st) {
  std::memset(st, 0, sizeof(*st));
  struct stat real {};
  st->st_mode = S_IFCHR | 0666;
  // The kernel's rdma_cm node where there is one (librdmacm may compare device numbers).
  st->st_rdev = stat(kCmPath, &real) == 0 && S_ISCHR(real.st_mode) ? real.st_rdev : makedev(10, 58);
  return 0;
}

__attribute__((visibility("default"))) int fstat(int fd, struct stat* st) {
  if (channel_of(fd)) return fake_stat(st);
  static FstatFn real = nullptr;
  if (!real) real = next<FstatFn>("fstat");
  return real(fd, st);
}

__attribute__((visibility("default"))) int fstat64(int fd, struct stat64* st) {
  if (channel_of(fd)) return fake_stat(reinterpret_cast<struct stat*>(st));
  using Fn = int (*)(int, struct stat64*);
  static Fn real = nullptr;
  if (!real) real = next<Fn>("fstat64");
  return real(fd, st);
}

__attribute__((visibility("default"))) ssize_t write(int fd, const void* buf, size_t len) {
  if (Channel* c = acquire(fd)) {
    const ssize_t n = command(fd, c, buf, len);
    const int e = errno;
    release(c);
    errno = e;
    return n;
  }
  static WriteFn real = nullptr;
  if (!real) real = next<WriteFn>("write");
  return real(fd, buf, len);
}

__attribute__((visibility("default"))) int close(int fd) {
  static CloseFn real = nullptr;
  if (!real) real = next<CloseFn>("close");
  if (channel_of(fd)) forget(fd);
  return real(fd);
}

}  // extern "C"

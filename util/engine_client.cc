// SPDX-License-Identifier: Apache-2.0
// Control-socket client of the metaroce command.
#include "util/engine_client.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace metaroce::util {

EngineConnection::EngineConnection(const std::string& rundir) {
  const std::string path = rundir + "/" + hostif::kEngineSocket;
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  if (path.size() >= sizeof(a.sun_path)) {
    errno = ENAMETOOLONG;
    return;
  }
  std::memcpy(a.sun_path, path.c_str(), path.size() + 1);
  const int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (s < 0) return;
  // Our credentials go with every message, whenever the engine gets to accept us.
  int one = 1;
  setsockopt(s, SOL_SOCKET, SO_PASSCRED, &one, sizeof(one));
  if (connect(s, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    const int e = errno;
    close(s);
    errno = e;
    return;
  }
  sock_ = s;
}

EngineConnection::~EngineConnection() {
  if (sock_ >= 0) close(sock_);
}

int EngineConnection::call(hostif::Op op, const void* body, size_t len, hostif::Message* resp,
                           const std::vector<int>& fds) {
  hostif::Message req;
  req.fds = fds;  // sent, still ours
  req.header.op = op;
  req.header.seq = ++seq_;
  if (len) req.body.assign(static_cast<const uint8_t*>(body), static_cast<const uint8_t*>(body) + len);
  int e = hostif::send_message(sock_, req);
  if (!e) e = hostif::recv_message(sock_, resp);
  if (e) return e;
  hostif::close_fds(resp);
  if (resp->header.seq != req.header.seq) return EPROTO;
  return resp->header.status;
}

bool start_engine(const std::string& program, const std::string& rundir,
                  const std::vector<std::string>& extra, std::string* why) {
  if (access(program.c_str(), X_OK) != 0) {
    *why = "cannot run the engine " + program + ": " + std::strerror(errno);
    return false;
  }
  int err_pipe[2];
  if (pipe2(err_pipe, O_CLOEXEC) != 0) {
    *why = std::string("pipe: ") + std::strerror(errno);
    return false;
  }
  std::vector<std::string> args = {program, "--rundir", rundir, "--daemon"};
  args.insert(args.end(), extra.begin(), extra.end());
  const pid_t pid = fork();
  if (pid < 0) {
    *why = std::string("fork: ") + std::strerror(errno);
    return false;
  }
  if (pid == 0) {
    // The daemon's own messages (why it cannot start) go to our stderr through the pipe.
    dup2(err_pipe[1], 2);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(program.c_str(), argv.data());
    _exit(127);
  }
  close(err_pipe[1]);
  std::string text;
  char buf[256];
  ssize_t n;
  while ((n = read(err_pipe[0], buf, sizeof(buf))) > 0) text.append(buf, static_cast<size_t>(n));
  close(err_pipe[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return true;
  while (!text.empty() && (text.back() == '\n' || text.back() == '\r')) text.pop_back();
  const auto nl = text.rfind('\n');
  if (nl != std::string::npos) text = text.substr(nl + 1);
  *why = "the engine did not start" + (text.empty() ? std::string() : ": " + text);
  return false;
}

std::string engine_reason(const hostif::Message& resp, int status) {
  if (auto t = resp.as<hostif::TextResp>(); t && t->text[0])
    return std::string(t->text, strnlen(t->text, sizeof(t->text)));
  return std::strerror(status);
}

}  // namespace metaroce::util

#include "programs/launch.h"

#include <c10/util/Exception.h>

#include <arpa/inet.h>
#include <errno.h>  // program_invocation_short_name (GNU)
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <thread>

namespace fsdp::programs {
namespace {

// This program's name, for its messages ("fsdp_bench", "ckpt_bench").
const char* program() {
  return program_invocation_short_name;
}

}  // namespace

LoopbackSocket loopback_socket(bool listen) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  TORCH_CHECK(fd >= 0, program(), ": socket() failed");
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;  // the kernel picks
  socklen_t len = sizeof(a);
  const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
                  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0 && (!listen || ::listen(fd, 64) == 0);
  if (!ok) close(fd);
  TORCH_CHECK(ok, program(), ": no free port on 127.0.0.1");
  return {fd, ntohs(a.sin_port)};
}

// Bound and closed: the port stays free for the caller's rank 0 to bind.
int free_port() {
  const LoopbackSocket s = loopback_socket(false);
  close(s.fd);
  return s.port;
}

std::map<std::string, std::string> rank_env(int rank, int world_size, int port) {
  return {{"RANK", std::to_string(rank)},
          {"LOCAL_RANK", std::to_string(rank)},
          {"WORLD_SIZE", std::to_string(world_size)},
          {"MASTER_ADDR", "127.0.0.1"},
          {"MASTER_PORT", std::to_string(port)}};
}

std::string file_text(const std::string& path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

namespace {

std::string tail(const std::string& path, size_t max_chars = 3000) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  std::string t = s.str();
  return t.size() > max_chars ? "..." + t.substr(t.size() - max_chars) : t;
}

std::string temp_dir() {
  std::string tmpl =
      (std::getenv("TMPDIR") ? std::getenv("TMPDIR") : "/tmp") + std::string("/") + program() + ".XXXXXX";
  TORCH_CHECK(mkdtemp(tmpl.data()) != nullptr, program(), ": cannot create a directory under $TMPDIR or /tmp");
  return tmpl;
}

}  // namespace

std::string self_exe() {
  char buf[4096];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  TORCH_CHECK(n > 0, program(), ": cannot read /proc/self/exe");
  return std::string(buf, static_cast<size_t>(n));
}

RankFiles launch_ranks(const RankLaunch& l, const std::string& progress) {
  const bool split_stdout = l.split_stdout;
  RankFiles files;
  files.dir = temp_dir();
  const int port = free_port();
  std::vector<pid_t> pids;
  for (int r = 0; r < l.world_size; ++r) {
    const std::string base = files.dir + "/rank" + std::to_string(r);
    files.outs.push_back(base + ".report");
    files.logs.push_back(base + ".log");
    if (split_stdout) files.stdouts.push_back(base + ".stdout");
    std::vector<std::string> args = l.argv;
    for (auto& a : args) {
      if (a == "{out}") a = files.outs.back();
    }
    const pid_t parent = getpid();
    const pid_t pid = fork();
    if (pid < 0) {
      for (pid_t p : pids) {
        kill(p, SIGKILL);
        waitpid(p, nullptr, 0);
      }
      TORCH_CHECK(false, program(), ": fork failed for rank ", r, " of ", l.label);
    }
    if (pid == 0) {
      // A rank never outlives the driver (killed by a timeout, Ctrl-C): it would hold memory and ports.
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(1);
      for (const auto& [k, v] : rank_env(r, l.world_size, port)) setenv(k.c_str(), v.c_str(), 1);
      setenv("OMP_NUM_THREADS", std::to_string(l.threads_per_rank).c_str(), 1);
      // The rank's output goes to its files, never into the driver's stdout (the table or JSON).
      const int fd = open(files.logs.back().c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      const int out = split_stdout ? open(files.stdouts.back().c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644) : fd;
      if (fd < 0 || out < 0 || dup2(out, 1) < 0 || dup2(fd, 2) < 0) _exit(126);
      close(fd);
      if (out != fd) close(out);
      std::vector<char*> cargs;
      cargs.reserve(args.size() + 1);
      for (auto& a : args) cargs.push_back(a.data());
      cargs.push_back(nullptr);
      execv(cargs[0], cargs.data());
      std::perror(cargs[0]);
      _exit(127);
    }
    pids.push_back(pid);
  }

  const bool tty = isatty(2) != 0;
  const auto start = std::chrono::steady_clock::now();
  auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); };
  if (!tty) std::fprintf(stderr, "%s %s ...\n", progress.c_str(), l.label.c_str());
  std::string failure;
  int running = l.world_size;
  std::vector<bool> done(pids.size(), false);
  while (running > 0 && failure.empty()) {
    for (size_t r = 0; r < pids.size(); ++r) {
      if (done[r]) continue;
      int status = 0;
      if (waitpid(pids[r], &status, WNOHANG) != pids[r]) continue;
      done[r] = true;
      --running;
      if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        failure = "rank " + std::to_string(r) +
                  (WIFSIGNALED(status) ? " was killed by signal " + std::to_string(WTERMSIG(status)) +
                                             (WTERMSIG(status) == SIGKILL ? " (out of memory?)" : "")
                                       : " exited with status " + std::to_string(WEXITSTATUS(status)));
      }
    }
    if (failure.empty() && elapsed() > l.run_timeout_s) {
      failure = "did not finish within " + std::to_string(l.run_timeout_s) + " s (--run-timeout)";
    }
    if (tty) std::fprintf(stderr, "\r%s %s  %6.1f s ", progress.c_str(), l.label.c_str(), elapsed());
    if (running > 0 && failure.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  for (size_t r = 0; r < pids.size(); ++r) {
    if (done[r]) continue;
    kill(pids[r], SIGKILL);
    waitpid(pids[r], nullptr, 0);
  }
  if (!failure.empty()) {
    if (tty) std::fprintf(stderr, "\n");
    std::ostringstream msg;
    msg << program() << ": " << l.label << ": " << failure << ". Output of each rank:\n";
    for (int r = 0; r < l.world_size; ++r) {
      msg << "--- rank " << r << " (" << files.logs[r] << ")\n" << tail(files.logs[r]) << "\n";
      if (split_stdout) msg << "--- rank " << r << " stdout\n" << tail(files.stdouts[r]) << "\n";
    }
    TORCH_CHECK(false, msg.str());
  }
  std::fprintf(stderr, tty ? "\r%s %s  %6.1f s\n" : "%s %s done in %.1f s\n", progress.c_str(), l.label.c_str(),
               elapsed());
  return files;
}

void RankFiles::remove() const {
  for (const auto* list : {&outs, &logs, &stdouts}) {
    for (const auto& f : *list) std::remove(f.c_str());
  }
  rmdir(dir.c_str());
}

}  // namespace fsdp::programs

// Small helpers shared by perf's test suites.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <perf/detail/cpu.h>
#include <perf/setup.h>
#include <spawn.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <torch/cuda.h>
#include <torch/nn/module.h>
#include <unistd.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

// Expects `statement` to throw c10::Error whose message contains `text`.
#define PERF_EXPECT_THROW_MSG(statement, text)                                                  \
  do {                                                                                          \
    try {                                                                                       \
      statement;                                                                                \
      ADD_FAILURE() << "expected c10::Error containing \"" << (text) << "\" from: " #statement; \
    } catch (const c10::Error& e_) {                                                            \
      EXPECT_NE(std::string(e_.what_without_backtrace()).find(text), std::string::npos)         \
          << "message was: " << e_.what_without_backtrace();                                    \
    }                                                                                           \
  } while (0)

namespace test_util {

// Sets an environment variable for one scope, restoring the previous value.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    ::setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (old_) {
      ::setenv(name_.c_str(), old_->c_str(), 1);
    } else {
      ::unsetenv(name_.c_str());
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::string name_;
  std::optional<std::string> old_;
};

// A fresh temporary folder, removed at scope exit. POSIX calls, not std::filesystem:
// libtorch.so exports its own copies of some std::filesystem symbols, and
// remove_all resolved there crashes (seen with the 2.11 wheel and GCC 12).
struct TempDir {
  TempDir() {
    std::string pattern = "/tmp/perf_test_XXXXXX";
    EXPECT_NE(::mkdtemp(pattern.data()), nullptr);
    path = pattern;
  }
  ~TempDir() {
    if (std::system(("rm -rf '" + path + "'").c_str()) != 0)
      std::fprintf(stderr, "could not remove %s\n", path.c_str());
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string operator/(const std::string& name) const { return path + "/" + name; }
  std::string path;
};

// Runs a shell command; true when it exits 0 (a named function: with
// _FORTIFY_SOURCE, std::system's result must be used).
inline bool run_command(const std::string& command) { return std::system(command.c_str()) == 0; }

// A shell command's stdout, trailing newlines trimmed; throws if it fails, with the end of its stderr.
// Both go to files, not a pipe: a process the command leaves behind (a compile worker of Inductor's, say)
// cannot keep the test waiting for the end of a pipe it still holds.
namespace detail {
// What a command whose output went to these files gave: its stdout, trailing newlines trimmed; throws if its
// wait status is not a zero exit, with the end of its stderr.
inline std::string command_output(const std::string& command, int status, const std::string& out_path,
                                  const std::string& err_path) {
  const auto read = [](const std::string& path) {
    std::ifstream in(path);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  std::string out = read(out_path);
  if (status == -1 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    std::string err = read(err_path);
    if (err.size() > 6000) err = "...\n" + err.substr(err.size() - 6000);  // a traceback's end, not a log
    const std::string how = status == -1          ? "could not start"
                            : WIFSIGNALED(status) ? "killed by signal " + std::to_string(WTERMSIG(status))
                                                  : "exit " + std::to_string(WEXITSTATUS(status));
    throw std::runtime_error("command failed (" + how + "): " + command + "\nits stderr:\n" + err);
  }
  while (!out.empty() && (out.back() == '\n' || out.back() == '\r')) out.pop_back();
  return out;
}
}  // namespace detail

inline std::string output_of(const std::string& command) {
  TempDir dir;
  const std::string out_path = dir / "stdout", err_path = dir / "stderr";
  const int status = std::system(("( " + command + " ) > '" + out_path + "' 2> '" + err_path + "'").c_str());
  return detail::command_output(command, status, out_path, err_path);
}

// Plays a CPU with (or without) native bf16 for one scope.
class ScopedCpuBf16 {
 public:
  explicit ScopedCpuBf16(bool native) : saved_(perf::detail::cpu_bf16()) {
    perf::detail::cpu_bf16().avx512_bf16 = native;
    perf::detail::cpu_bf16().amx_bf16 = false;
  }
  ~ScopedCpuBf16() { perf::detail::cpu_bf16() = saved_; }
  ScopedCpuBf16(const ScopedCpuBf16&) = delete;
  ScopedCpuBf16& operator=(const ScopedCpuBf16&) = delete;

 private:
  perf::detail::CpuBf16 saved_;
};

// The intra-op threads and the job's process count on this machine (both set by
// perf::init_process_group), put back at scope exit; `processes` plays that many.
class ScopedJobThreads {
 public:
  explicit ScopedJobThreads(std::optional<int> processes = std::nullopt)
      : threads_(at::get_num_threads()), processes_(perf::detail::job_processes_here().load()) {
    if (processes) perf::detail::job_processes_here().store(*processes);
  }
  ~ScopedJobThreads() {
    if (at::get_num_threads() != threads_) at::set_num_threads(threads_);
    perf::detail::job_processes_here().store(processes_);
  }
  ScopedJobThreads(const ScopedJobThreads&) = delete;
  ScopedJobThreads& operator=(const ScopedJobThreads&) = delete;

 private:
  int threads_;
  int processes_;
};

// LibTorch's warnings (TORCH_WARN) on this thread, collected for one scope instead of printed.
class CollectWarnings : public c10::WarningHandler {
 public:
  CollectWarnings() : guard_(this) {}
  void process(const c10::Warning& w) override { messages.push_back(w.msg()); }
  std::vector<std::string> messages;

 private:
  c10::WarningUtils::WarningHandlerGuard guard_;  // after `messages`: restores the handler before they go
};

// Paths CMake gives the build (test_paths.cpp), each overridden by the
// environment variable of the same name when the binary runs elsewhere:
// PERF_PYTHON, PERF_SOURCE_DIR, PERF_TEST_PACKAGES, PERF_FAKE_NVML.
std::string reference_python();
std::string source_dir();
std::string test_packages();
std::string fake_nvml_library();
// How long one Python that a test starts (python() below) may run before it prints every thread's stack
// and exits 1: PERF_TEST_PYTHON_TIMEOUT seconds, else 15 s less than ctest's limit for a test
// (PERF_TEST_TIMEOUT, which scripts/gpu-check.sh lowers), so that a stuck Python fails its test with the
// place it was stuck, where ctest would kill the test with nothing from Python.
int python_timeout_s();

// tests/compiled/models.py, whose factories and losses the test packages export.
inline std::string compiled_models() { return source_dir() + "/tests/compiled/models.py"; }

// The exporter's refusal, in an export's log, of a package that AOTInductor
// built wrong from a graph that Inductor's Python wrapper computes right
// (tools/export_compiled.py, diagnose_compiled_step): the graph perf made is
// right and torch's compiler is at fault. "" for any other log.
inline std::string aoti_fault(const std::string& log) {
  const auto at = log.find("the compiled training step is wrong");
  if (at == std::string::npos ||
      log.find("The same graph compiled by Inductor's Python wrapper is right", at) == std::string::npos)
    return "";
  return log.substr(at, log.find('\n', at) - at);
}

// A CUDA test package: exported by the build on this machine (inductor compiles
// for the GPU it sees; tests/compiled/make_cuda_packages.py, with the same
// arguments), else here into `dir` by tools/export_compiled.py with `args`
// (the factory first; --device cuda added). "" after a failed export, which is
// reported with its log: a test failure, or a skip where the exporter refused
// the package as AOTInductor's fault (aoti_fault; the test cannot run, and
// nothing of perf's is wrong). An export that already failed at build time (its
// line in the build's stamp) is not tried again: on a lent GPU each costs
// 30-60 s of the test, twice (ctest, then the one-process run), for the same
// refusal; the build's log is reported instead.
inline std::string cuda_test_package(const std::string& name, const std::string& args, const TempDir& dir) {
  auto failed = [&](const std::string& what, const std::string& log) {
    const std::string fault = aoti_fault(log);
    if (fault.empty()) {
      ADD_FAILURE() << what << ":\n" << log;
    } else {
      [&] {
        GTEST_SKIP() << "skipped: " << name << " cannot be made with this torch: its AOTInductor builds the step "
                     << "wrong, and the exporter refused it (" << what << "): " << fault;
      }();
    }
    return std::string();
  };
  const std::string built_dir = test_packages() + "/cuda/";
  std::string built = built_dir + name;
  if (std::ifstream(built).good()) return built;
  std::ifstream stamp(built_dir + "stamp");
  for (std::string line; std::getline(stamp, line);) {
    if (line.rfind(name + ": FAILED", 0) != 0) continue;
    std::ifstream text(built_dir + name.substr(0, name.size() - 4) + ".log");
    std::ostringstream what;
    what << "the build's export of " << name << " failed (" << built_dir << "stamp: " << line << ")";
    return failed(what.str(), std::string(std::istreambuf_iterator<char>(text), {}));
  }
  std::string pkg = dir / name;
  const std::string log = dir / (name + ".log");
  const std::string cmd = reference_python() + " " + source_dir() + "/tools/export_compiled.py " + args +
                          " --device cuda -o " + pkg + " > " + log + " 2>&1";
  if (run_command(cmd)) return pkg;
  std::ifstream text(log);
  return failed(cmd, std::string(std::istreambuf_iterator<char>(text), {}));
}

namespace detail {

// test_util::python()'s Python: tests/python_server.py, which imports torch once and forks a child per snippet
// (about 2 s saved a snippet: 60 in the quick tests). One per test process, started at its first snippet with
// that moment's environment and Python, and again when either has changed. A snippet runs in a Python of its
// own, as before, in a fork of the test process and once a server has failed. PERF_TEST_PYTHON_SERVER=0 turns
// it off.
class PythonServer {
 public:
  // The wait status of the snippet's child, or nullopt where the server cannot run it.
  static std::optional<int> run(const std::string& python, const std::string& code, const std::string& out_path,
                                const std::string& err_path) {
    static std::mutex mutex;
    static std::unique_ptr<PythonServer> server;
    const char* off = std::getenv("PERF_TEST_PYTHON_SERVER");
    if (off != nullptr && std::string(off) == "0") return std::nullopt;
    std::lock_guard<std::mutex> lock(mutex);
    static bool failed = false;  // a server that ended is not started again
    if (failed || (server && server->process_ != ::getpid())) return std::nullopt;
    // Another environment or Python (a test's ScopedEnv, say): a new server, at the price of the Python that the
    // snippet would otherwise start; the old one served at least one snippet.
    if (!server || server->python_ != python || server->env_ != environment()) server.reset(new PythonServer(python));
    if (server->fd_ < 0) {
      failed = true;
      return std::nullopt;
    }
    char cwd[4096];
    if (::getcwd(cwd, sizeof cwd) == nullptr) return std::nullopt;
    std::string request;
    for (const std::string& f : {code, out_path, err_path, std::string(cwd)})
      request += std::to_string(f.size()) + "\n" + f;
    bool alive = true;
    for (size_t sent = 0; alive && sent < request.size();) {
      const ssize_t n = ::send(server->fd_, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
      alive = n > 0;
      sent += alive ? static_cast<size_t>(n) : 0;
    }
    std::string reply;
    for (char c = 0; alive && c != '\n';) {
      alive = ::recv(server->fd_, &c, 1, 0) == 1;
      reply += c;
    }
    if (alive) return std::stoi(reply);
    failed = true;
    std::fprintf(stderr,
                 "test_util::python: the Python server (tests/python_server.py) has ended; each snippet "
                 "runs in a Python of its own from here\n");
    server.reset();
    return std::nullopt;
  }
  ~PythonServer() {
    if (fd_ >= 0) ::close(fd_);  // the server reads the end and exits
  }
  PythonServer(const PythonServer&) = delete;
  PythonServer& operator=(const PythonServer&) = delete;

 private:
  explicit PythonServer(const std::string& python) : python_(python), env_(environment()), process_(::getpid()) {
    const std::string script = source_dir() + "/tests/python_server.py";
    if (!std::ifstream(script).good()) return;  // a binary run without its sources: a Python per snippet
    int fds[2];
    if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) return;
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, fds[1], 0);
    // Not the test's stdout and stderr: ctest waits for every process that holds them.
    posix_spawn_file_actions_addopen(&actions, 1, "/dev/null", O_WRONLY, 0);
    posix_spawn_file_actions_addopen(&actions, 2, "/dev/null", O_WRONLY, 0);
    const std::string command = "exec " + python + " '" + script + "'";
    const char* argv[] = {"sh", "-c", command.c_str(), nullptr};
    pid_t pid = 0;
    const bool started =
        ::posix_spawn(&pid, "/bin/sh", &actions, nullptr, const_cast<char* const*>(argv), ::environ) == 0;
    posix_spawn_file_actions_destroy(&actions);
    ::close(fds[1]);
    if (started) {
      fd_ = fds[0];
    } else {
      ::close(fds[0]);
    }
  }
  static std::vector<std::string> environment() {
    std::vector<std::string> env;
    for (char** e = ::environ; *e != nullptr; ++e) env.emplace_back(*e);
    return env;
  }
  int fd_ = -1;
  std::string python_;
  std::vector<std::string> env_;
  pid_t process_;
};

// The code a shell passes to `python -c "..."`: inside double quotes it drops a backslash before a backslash or
// a newline (and before ", $ or `, which, like $ and ` alone, give nullopt: such code runs as a shell command).
inline std::optional<std::string> unquoted(const std::string& code) {
  std::string out;
  for (size_t i = 0; i < code.size(); ++i) {
    const char c = code[i];
    if (c == '$' || c == '`' || c == '"') return std::nullopt;
    if (c == '\\' && i + 1 < code.size() && (code[i + 1] == '\\' || code[i + 1] == '\n')) {
      if (code[++i] == '\\') out += '\\';
      continue;
    }
    out += c;
  }
  return out;
}

}  // namespace detail

// Runs a Python snippet with the interpreter of the venv that provided
// LibTorch (PERF_PYTHON, set by CMake; the environment variable PERF_PYTHON
// overrides it when the binary runs on another machine) and returns its stdout,
// trimmed; throws as output_of() does. The snippet runs as `python -c "<code>"`
// (a shell's double quotes: use single quotes and no $ inside), in a child of
// detail::PythonServer where it can.
inline std::string python(const std::string& code) {
  const std::string full = "import faulthandler\nfaulthandler.dump_traceback_later(" +
                           std::to_string(python_timeout_s()) + ", exit=True)\n" + code;
  const std::string command = reference_python() + " -c \"" + full + "\"";
  if (const auto plain = detail::unquoted(full)) {
    TempDir dir;
    const std::string out_path = dir / "stdout", err_path = dir / "stderr";
    if (const auto status = detail::PythonServer::run(reference_python(), *plain, out_path, err_path))
      return detail::command_output(command, *status, out_path, err_path);
  }
  return output_of(command);
}

// Python defining perf_test::relayout, a custom op whose real kernel returns its input channels-last and
// whose fake (meta) kernel says contiguous: a kernel whose strides the compiler mispredicts, and which
// AOTInductor's generated code reads in the wrong order (the exporter's refusal tests).
inline constexpr const char* kMispredictedRelayoutOp =
    "@torch.library.custom_op('perf_test::relayout', mutates_args=())\n"
    "def relayout(x: torch.Tensor) -> torch.Tensor:\n"
    "    return torch.empty_like(x, memory_format=torch.channels_last).copy_(x)\n"
    "@relayout.register_fake\n"
    "def _(x):\n"
    "    return torch.empty_like(x, memory_format=torch.contiguous_format)\n";

// python() with tools/ on the path and `import os, sys, torch, export_compiled as e`
// done: the exporter's tests call its functions directly.
inline std::string exporter_python(const std::string& code) {
  return python("import os, sys\nsys.path.insert(0, '" + source_dir() +
                "/tools')\nimport torch, export_compiled as e\n" + code);
}

// exporter_python() on a simulated CUDA device (tests/compiled/simulated_cuda.py): `models` and `sim`
// imported and sim.simulate() done. Where torch has no cuDNN, no fake convolution takes cuDNN's layout:
// it prints "skipped: ..." and runs nothing else.
inline std::string simulated_cuda_python(const std::string& code) {
  return exporter_python("sys.path.insert(0, '" + source_dir() +
                         "/tests/compiled')\n"
                         "import models, simulated_cuda as sim\n"
                         "if not torch.backends.cudnn.is_available():\n"
                         "    print('skipped: this torch has no cuDNN, so no fake convolution takes its layout')\n"
                         "    sys.exit(0)\n"
                         "sim.simulate()\n" +
                         code);
}

// How often the C++ sources an AOTInductor package carries name Vectorized
// (at::vec, its SIMD kernels): none for one exported with cpp.simdlen=1.
inline int64_t vectorized_mentions(const std::string& package) {
  return std::stoll(
      python("import zipfile\nwith zipfile.ZipFile('" + package +
             "') as z:\n"
             "    print(sum(z.read(n).count(b'Vectorized') for n in z.namelist() if n.endswith('.cpp')))\n"));
}

// The numbers of one line printed by Python (repr of floats; "nan" allowed).
inline std::vector<double> parse_numbers(const std::string& line) {
  std::istringstream in(line);
  std::vector<double> v;
  std::string tok;
  while (in >> tok) v.push_back(tok == "nan" ? std::nan("") : std::stod(tok));
  return v;
}

// The output of python(), one entry per line.
inline std::vector<std::string> lines(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) out.push_back(line);
  return out;
}

// LibTorch sees a CUDA device.
inline bool has_cuda() { return torch::cuda::is_available(); }

// perf can use one: LibTorch sees a device and perf was built with CUDA
// (false in a PERF_WITH_CUDA=0 build on a GPU machine).
inline bool perf_has_cuda() { return perf::detail::cuda_device_count() > 0; }

// A test package or its reference, by file name (test_packages()).
inline std::string package(const std::string& name) { return test_packages() + "/" + name; }

inline double max_diff(const at::Tensor& a, const at::Tensor& b) {
  EXPECT_EQ(a.sizes(), b.sizes());
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

// A module's parameters, flattened into one CPU tensor.
inline at::Tensor cat_params(torch::nn::Module& m) {
  std::vector<at::Tensor> v;
  for (auto& p : m.parameters()) v.push_back(p.detach().cpu().flatten());
  return at::cat(v);
}

}  // namespace test_util

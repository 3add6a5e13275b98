// perf/detail/cpu.h — what the CPU offers for bfloat16, as ATen detects it.
// bf16 autocast pays off on the CPU only with native bf16 arithmetic
// (AVX-512-BF16 or AMX-BF16); elsewhere ATen emulates it and fp32 is faster.
// Also the cores, and how many processes of a distributed job share them.
#pragma once

#include <ATen/cpu/Utils.h>
#include <c10/util/Exception.h>
#include <perf/config.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace perf {
namespace detail {

struct CpuBf16 {
  bool avx512_bf16 = false;
  bool amx_bf16 = false;
  bool native() const noexcept { return avx512_bf16 || amx_bf16; }
  /// e.g. "avx512_bf16=yes amx_bf16=no"
  std::string features() const {
    return std::string("avx512_bf16=") + (avx512_bf16 ? "yes" : "no") + " amx_bf16=" + (amx_bf16 ? "yes" : "no");
  }
  /// The CPU autocast default and why, e.g. "off (fp32): avx512_bf16=no amx_bf16=no".
  std::string autocast_choice() const { return std::string(native() ? "bf16" : "off (fp32)") + ": " + features(); }
};

inline bool cpu_flag(const std::unordered_map<std::string, c10::IValue>& caps, const char* name) {
  const auto it = caps.find(name);
  return it != caps.end() && it->second.isBool() && it->second.toBool();
}

// Read once: cpuinfo's answer does not change while the process runs. Mutable
// only so that tests can play the other kind of CPU.
inline CpuBf16& cpu_bf16() {
  static CpuBf16 caps = [] {
    CpuBf16 c;
    const auto all = at::cpu::get_cpu_capabilities();
    c.avx512_bf16 = cpu_flag(all, "avx512_bf16");
    c.amx_bf16 = cpu_flag(all, "amx_bf16");
    return c;
  }();
  return caps;
}

// The words of an ISA list (AOTI_CPU_ISA's "AVX512 AVX512_VNNI AMX_TILE", "AVX2")
// this CPU lacks, space-separated; "" when it has them all. A CPU package's
// AVX-512 code dies of SIGILL without them; oneDNN picks its kernels by them.
inline std::string missing_cpu_isa(const std::string& isa) {
  const auto caps = at::cpu::get_cpu_capabilities();
  auto has = [&](const char* name) { return cpu_flag(caps, name); };
  std::istringstream in(isa);
  std::string word, missing;
  while (in >> word) {
    bool ok = true;
    if (word == "AVX2") ok = has("avx2") && has("fma3");
    if (word == "AVX512") ok = has("avx512_f") && has("avx512_bw") && has("avx512_vl") && has("avx512_dq");
    if (word == "AVX512_VNNI") ok = has("avx512_vnni");
    if (word == "AMX_TILE") ok = has("amx_tile");
    if (!ok) missing += (missing.empty() ? "" : " ") + word;
  }
  return missing;
}

// The machine's physical cores as ATen's cpuinfo counts them (0: unknown).
inline int64_t physical_cores() {
  static const int64_t cores = [] {
    const auto all = at::cpu::get_cpu_capabilities();
    const auto it = all.find("num_physical_cores");
    return it != all.end() && it->second.isInt() ? it->second.toInt() : int64_t{0};
  }();
  return cores;
}

// How many processes of this program's distributed job run on this machine and
// share its cores: counted by perf::init_process_group, 1 without a job.
inline std::atomic<int>& job_processes_here() {
  static std::atomic<int> n{1};
  return n;
}

// The variables of this process's environment that set its CPU threads, as
// (name, value): OMP_NUM_THREADS and MKL_NUM_THREADS choose LibTorch's intra-op
// threads, OMP_WAIT_POLICY how OpenMP's idle threads wait (spinning, libgomp's
// default, costs cores that other processes need). Unset or empty: left out.
inline std::vector<std::pair<std::string, std::string>> thread_variables() {
  std::vector<std::pair<std::string, std::string>> set;
  for (const char* name : {"OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY"}) {
    const char* value = std::getenv(name);
    if (value != nullptr && *value != '\0') set.emplace_back(name, value);
  }
  return set;
}

// Whether the environment chose the intra-op thread count (OMP_NUM_THREADS or
// MKL_NUM_THREADS set), which perf then leaves as it is.
inline bool thread_count_set_by_environment() {
  for (const auto& [name, value] : thread_variables())
    if (name != "OMP_WAIT_POLICY") return true;
  return false;
}

}  // namespace detail
}  // namespace perf

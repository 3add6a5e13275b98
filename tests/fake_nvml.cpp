// A stand-in for libnvidia-ml.so.1 with scripted readings, so that
// perf::GpuMonitor's loading, sampling and summaries are tested on machines
// without a GPU. Device i: SM utilisation alternates 20%/80%, memory 80 GiB
// total and (i+1) GiB used, SM clock 1980 MHz, power 300.5 W, 40+i degrees.
#include <cstdint>
#include <cstdio>
#include <cstdlib>

extern "C" {

typedef struct {
  unsigned gpu, memory;
} fake_utilization;
typedef struct {
  unsigned long long total, free, used;
} fake_memory;

static unsigned fake_calls[16];

static unsigned index_of(void* d) { return static_cast<unsigned>(reinterpret_cast<uintptr_t>(d) - 1); }

int nvmlInit_v2(void) { return 0; }
int nvmlDeviceGetCount_v2(unsigned* n) {
  const char* c = getenv("FAKE_NVML_COUNT");
  *n = c ? static_cast<unsigned>(std::atoi(c)) : 2u;
  return 0;
}
int nvmlDeviceGetHandleByIndex_v2(unsigned i, void** d) {
  *d = reinterpret_cast<void*>(static_cast<uintptr_t>(i + 1));
  return 0;
}
int nvmlDeviceGetName(void* d, char* buf, unsigned len) {
  std::snprintf(buf, len, "Fake GPU %u", index_of(d));
  return 0;
}
int nvmlDeviceGetUtilizationRates(void* d, fake_utilization* u) {
  unsigned k = __atomic_fetch_add(&fake_calls[index_of(d) % 16], 1u, __ATOMIC_RELAXED);
  u->gpu = k % 2 ? 80u : 20u;
  u->memory = 10u;
  return 0;
}
int nvmlDeviceGetMemoryInfo(void* d, fake_memory* m) {
  m->total = 80ull << 30;
  m->used = static_cast<unsigned long long>(index_of(d) + 1) << 30;
  m->free = m->total - m->used;
  return 0;
}
int nvmlDeviceGetClockInfo(void* d, int type, unsigned* mhz) {
  (void)d;
  *mhz = type == 1 ? 1980u : 0u;
  return 0;
}
int nvmlDeviceGetPowerUsage(void* d, unsigned* mw) {
  (void)d;
  *mw = 300500u;
  return 0;
}
int nvmlDeviceGetTemperature(void* d, int sensor, unsigned* c) {
  *c = sensor == 0 ? 40u + index_of(d) : 0u;
  return 0;
}
}  // extern "C"

// perf/monitor.h — see where a training loop's time goes: perf::Progress
// (perf/progress.h), perf::GpuMonitor (perf/gpu_monitor.h) and perf::advise
// (perf/advise.h), one header each; this one includes the three.
#pragma once

#include <perf/advise.h>
#include <perf/gpu_monitor.h>
#include <perf/progress.h>

// perf — everything: include this, call perf::setup() first.
#pragma once

#include <perf/amp.h>
#include <perf/attention.h>
#include <perf/bench.h>
#include <perf/compiled.h>
#include <perf/config.h>
#include <perf/cuda_graph.h>
#include <perf/data.h>
#include <perf/distributed.h>
#include <perf/environment.h>
#include <perf/lr_scheduler.h>
#include <perf/memory.h>
#include <perf/memory_format.h>
#include <perf/model.h>
#include <perf/module.h>
#include <perf/monitor.h>
#include <perf/muon.h>
#include <perf/optim.h>
#include <perf/profile.h>
#include <perf/setup.h>
#include <perf/state_dict.h>
#include <perf/swa_utils.h>

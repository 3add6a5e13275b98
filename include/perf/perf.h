// perf — everything: include this, call perf::setup() first.
#pragma once

#include <perf/bench.h>
#include <perf/config.h>
#include <perf/memory.h>
#include <perf/optim.h>
#include <perf/profile.h>
#include <perf/setup.h>

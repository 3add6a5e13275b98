// perf/data.h — data loading: tuned DataLoader options, a pinned asynchronous
// device prefetcher, and a worker-count autotuner.
//
//   auto loader = torch::data::make_data_loader(dataset.map(torch::data::transforms::Stack<>()),
//                                               perf::loader_options(64));
//   for (auto& batch : perf::prefetch(*loader, torch::kCUDA,
//                                     perf::PrefetchOptions().channels_last(true).dtype(torch::kHalf)
//                                         .mean({123.7, 116.3, 103.5}).std({58.4, 57.1, 57.4}))) {
//     auto loss = model->forward(batch.data) ...;   // already on the GPU, NHWC, normalised
//   }
//   size_t w = perf::tune_workers([&](size_t n) { return make_my_loader(n); }, {1, 2, 4, 8});
#pragma once

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <c10/util/Exception.h>
#include <perf/config.h>
#include <perf/detail/check.h>
#include <torch/arg.h>
#include <torch/data/dataloader_options.h>
#include <torch/data/example.h>

#if PERF_WITH_CUDA
#include <c10/cuda/CUDAEvent.h>  // at::cuda::CUDAEvent without ATen's cuBLAS/cuSOLVER includes
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <iomanip>
#include <iostream>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace perf {

// --------------------------------------------------------------------------- loader options

/// Choices behind perf::loader_options; every one can be overridden.
struct LoaderTuning {
  /// Worker threads. Unset: half the hardware threads, at least 1, at most 8.
  TORCH_ARG(std::optional<size_t>, workers);
  /// Batches each worker may have in flight (max_jobs = workers x prefetch_factor).
  TORCH_ARG(size_t, prefetch_factor) = 2;
  /// Drop the last incomplete batch. Off, as in PyTorch and LibTorch, so an
  /// epoch sees every sample; turn it on for static shapes (cuDNN benchmark,
  /// CUDA graphs), or let perf::TrainStep run that last batch eagerly.
  TORCH_ARG(bool, drop_last) = false;
  /// Deliver batches in sampler order (LibTorch's default).
  TORCH_ARG(bool, enforce_ordering) = true;
  TORCH_ARG(std::optional<std::chrono::milliseconds>, timeout);
};

/// DataLoaderOptions with perf's defaults for `batch_size`.
torch::data::DataLoaderOptions loader_options(size_t batch_size, const LoaderTuning& tuning = LoaderTuning());

/// The program's own options, tuned where they are at LibTorch's defaults:
/// workers(0) gets perf's worker count, an unset max_jobs gets workers x
/// prefetch_factor; batch size, drop_last, enforce_ordering, timeout and every
/// non-default value are kept. describe(tuned, existing) says what changed.
/// Values set in `tuning` win over both.
torch::data::DataLoaderOptions loader_options(const torch::data::DataLoaderOptions& existing,
                                              const LoaderTuning& tuning = LoaderTuning());

/// "batch_size=64 workers=4 max_jobs=8 drop_last=false enforce_ordering=true timeout=none".
std::string describe(const torch::data::DataLoaderOptions& options);
/// What differs from `before`: "workers 0 -> 4, max_jobs default -> 8" ("unchanged" if nothing).
std::string describe(const torch::data::DataLoaderOptions& options, const torch::data::DataLoaderOptions& before);

// --------------------------------------------------------------------------- prefetch

struct PrefetchOptions {
  /// Copy from pinned host memory (a CUDA target). Unset: on. For a CPU
  /// target batches are never pinned; pin(true) there warns.
  TORCH_ARG(std::optional<bool>, pin);
  /// Batches staged ahead of the one in use.
  TORCH_ARG(size_t, depth) = 2;
  /// Convert 4-D / 5-D inputs to channels-last.
  TORCH_ARG(bool, channels_last) = false;
  /// Convert inputs to this dtype on the device (e.g. uint8 images -> half).
  TORCH_ARG(std::optional<c10::ScalarType>, dtype);
  /// Per-channel normalisation on the device, (x - mean) / std, in the units of
  /// the data (e.g. 0-255 for uint8 images). Channel dim: 0 for 3-D, else 1.
  /// Computed in float32 (float64 for double) and rounded once to the output
  /// dtype: `dtype`, else the input's if floating, else float32.
  TORCH_ARG(std::vector<double>, mean);
  TORCH_ARG(std::vector<double>, std);
};

/// Customisation point: how to apply a function to every tensor of a batch.
/// `f(tensor, is_input)` returns the new tensor; inputs (data) get the
/// conversions, other tensors (targets) only move. Specialise it for your own
/// batch type:
///
///   template <> struct perf::BatchTraits<MyBatch> {
///     template <typename F> static MyBatch map(MyBatch b, F&& f) {
///       b.image = f(b.image, true); b.label = f(b.label, false); return b;
///     }
///   };
template <typename Batch, typename Enable = void>
struct BatchTraits;

template <>
struct BatchTraits<at::Tensor> {
  template <typename F>
  static at::Tensor map(at::Tensor b, F&& f) {
    return f(b, true);
  }
};

template <>
struct BatchTraits<torch::data::Example<at::Tensor, at::Tensor>> {
  // By value, as the customisation point above takes a batch: its callers move the batch in.
  template <typename F>
  static torch::data::Example<at::Tensor, at::Tensor> map(
      torch::data::Example<at::Tensor, at::Tensor> b,  // NOLINT(performance-unnecessary-value-param)
      F&& f) {
    return {f(b.data, true), f(b.target, false)};
  }
};

template <>
struct BatchTraits<torch::data::Example<at::Tensor, torch::data::example::NoTarget>> {
  using E = torch::data::Example<at::Tensor, torch::data::example::NoTarget>;
  template <typename F>
  static E map(E b, F&& f) {
    return E(f(b.data, true));
  }
};

template <typename T>
struct BatchTraits<std::vector<T>> {
  template <typename F>
  static std::vector<T> map(std::vector<T> b, F&& f) {
    for (auto& x : b) x = BatchTraits<T>::map(std::move(x), f);
    return b;
  }
};

/// An iterable over `loader`'s batches, each already on the target device.
/// CUDA: a background thread pins each batch, copies it with non_blocking on a
/// dedicated stream and applies the conversions there, `depth` batches ahead;
/// the consumer's stream waits on an event (no host sync) and the tensors are
/// record_stream'ed so their memory is not reused early. Elsewhere it is a
/// pass-through applying the same conversions. Exceptions from the dataset
/// reach the consumer unchanged. Like LibTorch's loader, a new epoch (begin())
/// needs the previous one iterated to its end.
template <typename Loader>
class Prefetcher {
 public:
  using Batch = typename Loader::BatchType;
  class iterator;

  Prefetcher(Loader& loader, c10::Device device, PrefetchOptions options);
  ~Prefetcher() { stop(); }
  Prefetcher(const Prefetcher&) = delete;
  Prefetcher& operator=(const Prefetcher&) = delete;

  iterator begin();
  iterator end() { return iterator(this, true); }
  c10::Device device() const noexcept { return device_; }
  /// True when batches are staged asynchronously (a CUDA target).
  bool asynchronous() const noexcept { return async_; }

  class iterator {
   public:
    using iterator_category = std::input_iterator_tag;
    using value_type = Batch;
    using difference_type = std::ptrdiff_t;
    using pointer = Batch*;
    using reference = Batch&;

    Batch& operator*() { return *current_; }
    Batch* operator->() { return &*current_; }
    iterator& operator++() {
      current_ = owner_->next();
      done_ = !current_.has_value();
      return *this;
    }
    bool operator==(const iterator& o) const { return done_ && o.done_; }
    bool operator!=(const iterator& o) const { return !(*this == o); }

   private:
    friend class Prefetcher;
    iterator(Prefetcher* owner, bool done) : owner_(owner), done_(done) {}
    Prefetcher* owner_;
    bool done_;
    std::optional<Batch> current_;
  };

 private:
  struct Slot {
    std::optional<Batch> batch;
    std::exception_ptr error;
#if PERF_WITH_CUDA
    std::unique_ptr<at::cuda::CUDAEvent> ready;
#endif
  };

  at::Tensor convert(const at::Tensor& t, bool is_input, bool non_blocking);
  Batch stage(Batch batch, bool non_blocking) {
    return BatchTraits<Batch>::map(
        std::move(batch), [&](const at::Tensor& t, bool is_input) { return convert(t, is_input, non_blocking); });
  }
  std::optional<Batch> next();
  void produce();
  void stop();

  Loader& loader_;
  c10::Device device_;
  PrefetchOptions options_;
  bool pin_ = false, async_ = false;
  at::Tensor mean_, std_, mean64_, std64_;  // float32 and float64 copies on the device
  // Synchronous mode: the loader's own iterator.
  std::optional<decltype(std::declval<Loader&>().begin())> sync_it_;
  // Asynchronous mode: producer thread and a bounded queue of staged batches.
  std::thread producer_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Slot>> queue_;
  bool stop_ = false, producer_done_ = false;
#if PERF_WITH_CUDA
  // Events recorded after each staged batch, reused once the consumer's stream
  // has been made to wait on them (a wait captures the event's state then).
  std::vector<std::unique_ptr<at::cuda::CUDAEvent>> free_events_;
  size_t events_created_ = 0;
#endif

 public:
  /// CUDA events created so far (a small pool, reused across batches).
  size_t events_created() const noexcept {
#if PERF_WITH_CUDA
    return events_created_;
#else
    return 0;
#endif
  }
};

template <typename Loader>
Prefetcher<Loader> prefetch(Loader& loader, c10::Device device, const PrefetchOptions& options = PrefetchOptions()) {
  return Prefetcher<Loader>(loader, device, options);
}

// --------------------------------------------------------------------------- worker autotuner

/// Measures batches/s of `make_loader(workers)` for each candidate on the real
/// dataset (after one warm-up batch), prints a progress line per candidate and a
/// result table to `log`, and returns the fastest. The budget is shared by all
/// candidates; candidates it leaves no time for are skipped (and reported).
/// Candidates empty: 0, 1, 2, 4, ... up to the hardware threads.
template <typename MakeLoader>
size_t tune_workers(MakeLoader make_loader, std::vector<size_t> candidates = {},
                    std::chrono::duration<double> budget = std::chrono::seconds(20), OstreamPtr log = &std::cerr);

// ---------------------------------------------------------------------------
namespace detail {

PERF_INLINE size_t default_workers();

}  // namespace detail

PERF_INLINE std::string describe(const torch::data::DataLoaderOptions& o, const torch::data::DataLoaderOptions& before);

PERF_INLINE std::string describe(const torch::data::DataLoaderOptions& o);

template <typename Loader>
Prefetcher<Loader>::Prefetcher(Loader& loader, c10::Device device, PrefetchOptions options)
    : loader_(loader), device_(device), options_(std::move(options)) {
  detail::check_count(options_.depth(), 1, "perf::PrefetchOptions::depth");
  TORCH_CHECK(options_.mean().size() == options_.std().size(), "perf::PrefetchOptions: mean has ",
              options_.mean().size(), " values but std has ", options_.std().size());
  for (double s : options_.std()) TORCH_CHECK(s > 0, "perf::PrefetchOptions::std: values must be > 0, got ", s);
  if (options_.dtype()) {
    TORCH_CHECK(at::isFloatingType(*options_.dtype()), "perf::PrefetchOptions::dtype: must be a floating type, got ",
                *options_.dtype());
  }
  TORCH_CHECK(device_.is_cpu() || device_.is_cuda(), "perf::prefetch: device must be cpu or cuda, got ", device_);
#if PERF_WITH_CUDA
  if (device_.is_cuda()) {
    TORCH_CHECK(c10::cuda::device_count() > 0, "perf::prefetch: ", device_,
                " requested but no CUDA device is available");
    if (!device_.has_index()) device_ = c10::Device(c10::kCUDA, c10::cuda::current_device());
    TORCH_CHECK(device_.index() < c10::cuda::device_count(), "perf::prefetch: ", device_,
                ": no such CUDA device (this process sees ", static_cast<int>(c10::cuda::device_count()),
                "; valid: cuda:0 to cuda:", static_cast<int>(c10::cuda::device_count()) - 1, ")");
    async_ = true;
  }
#else
  TORCH_CHECK(!device_.is_cuda(), "perf::prefetch: ", device_, " requested but perf was built without CUDA");
#endif
  // As Python's DataLoader without an accelerator: pin(true) for a CPU target
  // is a warning and no pinning (pinning needs CUDA and only speeds up copies to it).
  if (options_.pin().value_or(false) && !async_) {
    TORCH_WARN("perf::PrefetchOptions::pin(true) has no effect for a ", device_,
               " target (pinned memory speeds up copies to a CUDA device): batches are not pinned");
  }
  pin_ = async_ && options_.pin().value_or(true);
  if (!options_.mean().empty()) {
    mean64_ = at::tensor(options_.mean(), at::kDouble).to(device_);
    std64_ = at::tensor(options_.std(), at::kDouble).to(device_);
    mean_ = mean64_.to(at::kFloat);
    std_ = std64_.to(at::kFloat);
  }
}

template <typename Loader>
at::Tensor Prefetcher<Loader>::convert(const at::Tensor& t, bool is_input, bool non_blocking) {
  if (!t.defined()) return t;
  at::Tensor x = t;
  if (pin_ && x.is_cpu() && !x.is_pinned()) x = x.pin_memory();
  x = x.to(device_, non_blocking);
  if (!is_input) return x;
  if (!mean_.defined()) {
    if (options_.dtype()) x = x.to(*options_.dtype());
  } else {
    // (x - mean) / std in float32 (float64 for double), rounded once to the
    // output dtype: computed in bf16 it rounds three times (2.6x the error).
    const auto out = options_.dtype().value_or(at::isFloatingType(x.scalar_type()) ? x.scalar_type() : at::kFloat);
    const bool wide = out == at::kDouble || x.scalar_type() == at::kDouble;
    const int64_t cdim = x.dim() == 3 ? 0 : 1;
    TORCH_CHECK(x.dim() >= 2 && x.size(cdim) == mean_.numel(), "perf::PrefetchOptions: mean/std have ", mean_.numel(),
                " channels but the input of shape ", x.sizes(), " has ", x.dim() >= 2 ? x.size(cdim) : 0, " at dim ",
                cdim);
    std::vector<int64_t> shape(static_cast<size_t>(x.dim()), 1);
    shape[static_cast<size_t>(cdim)] = mean_.numel();
    x = x.to(wide ? at::kDouble : at::kFloat);
    x = (x - (wide ? mean64_ : mean_).view(shape)).div_((wide ? std64_ : std_).view(shape)).to(out);
  }
  if (options_.channels_last() && (x.dim() == 4 || x.dim() == 5)) {
    x = x.contiguous(x.dim() == 4 ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::ChannelsLast3d);
  }
  return x;
}

template <typename Loader>
typename Prefetcher<Loader>::iterator Prefetcher<Loader>::begin() {
  stop();
  if (async_) {
    stop_ = false;
    producer_done_ = false;
    queue_.clear();
    producer_ = std::thread([this] { produce(); });
  } else {
    sync_it_.emplace(loader_.begin());
  }
  iterator it(this, false);
  ++it;
  return it;
}

template <typename Loader>
void Prefetcher<Loader>::produce() {
  auto push = [&](std::shared_ptr<Slot> slot) {
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [&] { return stop_ || queue_.size() < options_.depth(); });
    if (stop_) return false;
    queue_.push_back(std::move(slot));
    cv_.notify_all();
    return true;
  };
  // Everything in the thread, its CUDA setup included, reports errors to the
  // consumer: an exception escaping a std::thread would call std::terminate.
  try {
#if PERF_WITH_CUDA
    c10::cuda::CUDAGuard device_guard(device_.index());
    const auto copy_stream = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device_.index());
    c10::cuda::CUDAStreamGuard stream_guard(copy_stream);
#endif
    for (auto it = loader_.begin(); it != loader_.end(); ++it) {
      auto slot = std::make_shared<Slot>();
      slot->batch = stage(std::move(*it), /*non_blocking=*/true);
#if PERF_WITH_CUDA
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (!free_events_.empty()) {
          slot->ready = std::move(free_events_.back());
          free_events_.pop_back();
        } else {
          ++events_created_;
        }
      }
      if (!slot->ready) slot->ready = std::make_unique<at::cuda::CUDAEvent>();
      slot->ready->record(copy_stream);
#endif
      if (!push(std::move(slot))) return;
    }
  } catch (...) {
    auto slot = std::make_shared<Slot>();
    slot->error = std::current_exception();
    if (!push(std::move(slot))) return;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  producer_done_ = true;
  cv_.notify_all();
}

template <typename Loader>
std::optional<typename Prefetcher<Loader>::Batch> Prefetcher<Loader>::next() {
  // A user scope, so that perf::advise and the profiler see time spent waiting for data.
  RECORD_USER_SCOPE("perf::prefetch::next");
  if (!async_) {
    if (!sync_it_ || *sync_it_ == loader_.end()) return std::nullopt;
    auto& it = *sync_it_;
    Batch b = stage(std::move(*it), /*non_blocking=*/false);
    ++it;
    return b;
  }
  std::shared_ptr<Slot> slot;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [&] { return !queue_.empty() || producer_done_; });
    if (queue_.empty()) return std::nullopt;
    slot = std::move(queue_.front());
    queue_.pop_front();
    cv_.notify_all();
  }
  if (slot->error) std::rethrow_exception(slot->error);
#if PERF_WITH_CUDA
  const auto consumer = c10::cuda::getCurrentCUDAStream(device_.index());
  slot->ready->block(consumer);  // the consumer's stream waits for the copy; the host does not
  {
    std::lock_guard<std::mutex> lock(mutex_);
    free_events_.push_back(std::move(slot->ready));
  }
  return BatchTraits<Batch>::map(std::move(*slot->batch), [&](const at::Tensor& t, bool) {
    if (t.defined() && t.is_cuda()) t.record_stream(consumer);
    return t;
  });
#else
  return std::move(slot->batch);
#endif
}

template <typename Loader>
void Prefetcher<Loader>::stop() {
  if (producer_.joinable()) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
      cv_.notify_all();
    }
    producer_.join();
  }
  queue_.clear();
  sync_it_.reset();
}

template <typename MakeLoader>
size_t tune_workers(MakeLoader make_loader, std::vector<size_t> candidates, std::chrono::duration<double> budget,
                    OstreamPtr log) {
  using clock = std::chrono::steady_clock;
  if (candidates.empty()) {
    const size_t hw = std::max(1u, std::thread::hardware_concurrency());
    candidates.push_back(0);
    for (size_t w = 1; w <= hw; w *= 2) candidates.push_back(w);
  }
  TORCH_CHECK(budget.count() > 0, "perf::tune_workers: budget must be > 0 seconds");
  const auto deadline = clock::now() + std::chrono::duration_cast<clock::duration>(budget);
  const auto per_candidate = budget / static_cast<double>(candidates.size());
  std::vector<std::pair<size_t, double>> rates;  // workers, batches/s
  for (size_t i = 0; i < candidates.size(); ++i) {
    const size_t w = candidates[i];
    if (clock::now() >= deadline) {
      if (log) *log << "tune_workers: budget spent, skipping workers=" << w << "\n";
      continue;
    }
    auto loader = make_loader(w);
    auto& l = *loader;
    int64_t batches = 0;
    clock::time_point t0;
    bool warm = false;
    const auto stop_at = std::min(deadline, clock::now() + std::chrono::duration_cast<clock::duration>(per_candidate));
    while (clock::now() < stop_at) {
      int64_t in_epoch = 0;
      for (auto it = l.begin(); it != l.end(); ++it) {
        ++in_epoch;
        if (!warm) {  // first batch: worker start-up, not throughput
          warm = true;
          t0 = clock::now();
          continue;
        }
        ++batches;
        if (clock::now() >= stop_at) break;
      }
      if (in_epoch == 0) break;  // empty dataset
      if (clock::now() >= stop_at) break;
    }
    const double secs = warm ? std::chrono::duration<double>(clock::now() - t0).count() : 0;
    const double rate = secs > 0 ? static_cast<double>(batches) / secs : 0;
    rates.emplace_back(w, rate);
    if (log) {
      *log << "tune_workers: [" << (i + 1) << "/" << candidates.size() << "] workers=" << w << ": " << std::fixed
           << std::setprecision(1) << rate << " batches/s (" << batches << " batches in " << std::setprecision(2)
           << secs << " s)" << std::endl;
    }
  }
  TORCH_CHECK(!rates.empty(), "perf::tune_workers: the budget allowed no candidate to run");
  const auto best =
      std::max_element(rates.begin(), rates.end(), [](const auto& a, const auto& b) { return a.second < b.second; });
  if (log) {
    *log << "tune_workers: result\n  workers   batches/s\n";
    for (const auto& [w, r] : rates) {
      *log << "  " << std::setw(7) << w << "   " << std::setw(9) << std::fixed << std::setprecision(1) << r
           << (w == best->first ? "   <- best" : "") << "\n";
    }
    log->flush();
  }
  return best->first;
}

}  // namespace perf

#ifdef PERF_HEADER_ONLY
#include <perf/impl/data-inl.h>
#endif

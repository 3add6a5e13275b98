// README.md's C++ examples, verbatim, each inside the context it assumes (a
// model `Net`, a `dataset`, a `loader`, ...). Compiled, not run, under the
// strict flags but for unused variables (examples declare what a real program
// would go on to use); tests/readme_snippets.py checks that every ```cpp block
// of README.md appears here line for line, so an example that no longer
// compiles, or one edited in the README alone, fails CI. The examples stand as
// the README prints them (clang-format off around each).
//
// The first include is also perf/compiled.h's header check (tests/CMakeLists.txt):
// it comes first, and the flags are the header checks' own until the pragmas below.
// clang-format off
#include <perf/compiled.h>
#include <perf/attention.h>
#include <perf/lr_scheduler.h>
#include <perf/muon.h>
#include <perf/perf.h>  // or the one header you need
#include <perf/state_dict.h>
#include <perf/swa_utils.h>
#include <torch/torch.h>
// clang-format on

#include <fstream>
#include <functional>
#include <iostream>
#include <optional>

#pragma GCC diagnostic ignored "-Wunused-variable"
#pragma GCC diagnostic ignored "-Wunused-but-set-variable"
// The stricter set's warnings on the examples' own lines (a lambda's x beside the
// context's x, a size given as a streamsize or a double): the reader's code, short
// on purpose; perf's lines above and the templates they instantiate keep them.
#pragma GCC diagnostic ignored "-Wshadow"
#pragma GCC diagnostic ignored "-Wconversion"
#pragma GCC diagnostic ignored "-Wsign-conversion"

struct NetImpl : torch::nn::Module {
  NetImpl() {
    conv = register_module("conv", torch::nn::Conv2d(3, 8, 3));
    fc = register_module("fc", torch::nn::Linear(8, 10));
  }
  torch::Tensor forward(torch::Tensor x) { return fc(torch::adaptive_avg_pool2d(conv(x), 1).flatten(1)); }
  torch::nn::Conv2d conv{nullptr};
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Net);
namespace readme_snippets {
auto mnist() { return torch::data::datasets::MNIST("data").map(torch::data::transforms::Stack<>()); }
torch::Tensor loss_fn(const torch::Tensor& a, const torch::Tensor& b) {
  return torch::nn::functional::cross_entropy(a, b);
}

void block1() {
  auto dataset = mnist();
  // clang-format off
std::cout << perf::setup();                                // fast defaults, reported
auto model = perf::optimize(Net(), perf::ModelOptions().device(torch::kCUDA));  // NHWC + autocast
perf::optim::AdamW opt(model->parameters(), perf::optim::AdamWOptions(1e-3));  // fused kernels
perf::GradScaler scaler;
auto loader = torch::data::make_data_loader(dataset, perf::loader_options(64));
for (auto& b : perf::prefetch(*loader, torch::kCUDA)) {    // pinned, async, already on the GPU
  opt.zero_grad();
  scaler.scale(loss_fn(model(b.data), b.target)).backward();
  scaler.step(opt);
  scaler.update();
}

  // clang-format on
}
void train_step(const torch::Tensor&, const torch::Tensor&) {}
void block2() {
  auto dataset = torch::data::datasets::MNIST("data");
  // clang-format off
auto loader = torch::data::make_data_loader(
    dataset.map(torch::data::transforms::Stack<>()), perf::loader_options(64));
for (auto& batch : perf::prefetch(*loader, torch::kCUDA,
                                  perf::PrefetchOptions().channels_last(true).dtype(torch::kHalf)
                                      .mean({123.7, 116.3, 103.5}).std({58.4, 57.1, 57.4}))) {
  train_step(batch.data, batch.target);           // already on the GPU, NHWC, normalised
}

  // clang-format on
}
void block3() {
  Net model;
  torch::optim::SGD opt(model->parameters(), 0.1);
  auto loader = torch::data::make_data_loader(mnist(), 64);
  // clang-format off
// C++ with perf
perf::GradScaler scaler;                                   // init_scale 65536, growth 2, backoff 0.5, interval 2000
for (auto& batch : *loader) {
  opt.zero_grad();
  torch::Tensor loss;
  {
    perf::Autocast ac(torch::kCUDA, torch::kHalf);         // RAII `with torch.autocast(...)`
    loss = loss_fn(model->forward(batch.data), batch.target);
  }
  scaler.scale(loss).backward();
  scaler.unscale_(opt);
  torch::nn::utils::clip_grad_norm_(model->parameters(), 1.0);
  scaler.step(opt);                                        // skipped when a gradient is inf/NaN
  scaler.update();
}

  // clang-format on
}
void block4(torch::Tensor x) {
  // clang-format off
  auto model = perf::optimize(Net(), perf::ModelOptions().device(torch::kCPU).example(x));
  std::cout << model.choice();
  // perf::optimize: channels-last fp32 (fastest of 2 measured on [1, 3, 64, 64] Float on cpu)
  //     NCHW fp32                                      14.418 ms   1.00x
  //   * channels-last fp32                             13.384 ms   1.08x
  //   decided in 1.28 s (first calls 0.05 s, measured calls 1.22 s)
  auto pinned = perf::optimize(Net(), perf::ModelOptions().recipe(model.recipe()));  // reproducible runs

  // clang-format on
}
void block5(torch::Tensor x_example, torch::Tensor x) {
  Net model;
  perf::optim::AdamW optimizer(model->parameters(), perf::optim::AdamWOptions(1e-3));
  torch::optim::StepLR scheduler(optimizer, 1, 0.5);
  auto loader = torch::data::make_data_loader(mnist(), 64);
  // clang-format off
model->eval();
auto g = perf::graph(model, x_example, perf::GraphOptions().batch_sizes({1, 2, 4, 8, 16, 32}));
torch::Tensor y = g(x);                    // copy in, replay, output (yours; .clone_outputs(false): a view)

std::optional<perf::TrainStep> step;
for (auto& batch : perf::prefetch(*loader, torch::kCUDA)) {
  if (!step) step.emplace(model, [&](const torch::Tensor& x, const torch::Tensor& t) {
    return torch::nn::functional::cross_entropy(model->forward(x), t);
  }, optimizer, batch);                    // built from the first batch; optimizer: perf::optim::*
  torch::Tensor loss = step->step(batch);  // forward + backward + update in one replay, no host sync;
                                           // the loss is yours (a 0-dim device copy): keep one per step
  scheduler.step();                        // takes effect at the next replay
}

  // clang-format on
}
void block6(std::vector<torch::Tensor> params) {
  Net model;
  // clang-format off
perf::optim::AdamW opt(model->parameters(), perf::optim::AdamWOptions(1e-3).weight_decay(0.01));
perf::optim::Adam  adam(params, perf::optim::AdamOptions(1e-3).amsgrad(true));
perf::optim::SGD   sgd(params, perf::optim::SGDOptions(0.1).momentum(0.9).nesterov(true));

  // clang-format on
}
void block7() {
  Net model;
  // clang-format off
perf::optim::AdamW opt(model->parameters(), perf::optim::AdamWOptions(1e-3).flat(true));  // likewise Adam, SGD
opt.kernels();  // {"cuda:0 Float: fused, flat (1 tensor for 161 parameters)"}

  // clang-format on
}
void block8(torch::Tensor x, torch::Tensor y, torch::Tensor x2, torch::Tensor y2) {
  Net model;
  perf::optim::AdamW opt(model->parameters(), perf::optim::AdamWOptions(1e-3));
  // clang-format off
auto pg = perf::init_process_group();            // torchrun's RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (LOCAL_RANK: the GPU)
perf::DistributedDataParallel ddp(model, pg);    // rank 0's parameters and buffers broadcast to every rank
auto loss = loss_fn(ddp(x), y);                  // ddp(args...) calls model->forward(args...)
loss.backward();                                 // gradients averaged across ranks in buckets while backward runs
opt.step();                                      // perf::optim, torch::optim, perf::GradScaler: unchanged
{ auto guard = ddp.no_sync(); loss_fn(ddp(x2), y2).backward(); }  // accumulate locally, no communication

  // clang-format on
}
void block_data_parallel(const torch::data::Example<>& first_batch) {
  Net model;
  perf::optim::AdamW opt(model->parameters(), perf::optim::AdamWOptions(1e-3));
  const auto loss_fn = [&](const torch::Tensor& x, const torch::Tensor& y) {
    return torch::nn::functional::cross_entropy(model->forward(x), y);
  };
  // clang-format off
auto pg = perf::init_process_group();
perf::TrainStep step(model, loss_fn, opt, first_batch,                  // this rank's share of each batch
                     perf::TrainStepOptions().data_parallel(pg));       // perf::DataParallelOptions() 2nd
perf::CompiledTrainStep compiled("net_train.pt2", model, opt,
                                 perf::CompiledTrainOptions().data_parallel(pg));

  // clang-format on
}
void block9(torch::Tensor x, torch::Tensor tokens, torch::Tensor feats) {
  // clang-format off
perf::CompiledModel model("resnet.pt2");             // perf::CompiledOptions(): model_name, device_index, runners,
                                                     // single_threaded, check_inputs
at::Tensor y = model(x);                             // one input, one output
std::vector<at::Tensor> outs = model.run({tokens, feats});   // any number of inputs and outputs
std::cout << model;
// perf::CompiledModel 'resnet.pt2' on cpu, exported with torch 2.11.0+cu130, CPU ISA AVX512 AVX512_VNNI,
//   single-threaded (capturable)
//   input 0: Float [batch, 3, 64, 64] batch 1..64
//   outputs: 1

  // clang-format on
}
void block_attention(torch::Tensor x, torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor tokens) {
  // clang-format off
auto layer_options = torch::nn::TransformerEncoderLayerOptions(512, 8).dim_feedforward(2048);
perf::TransformerEncoder encoder(torch::nn::TransformerEncoderOptions(
    torch::nn::TransformerEncoderLayer(layer_options), 6));  // LibTorch's options, perf's layers
auto causal = torch::nn::TransformerImpl::generate_square_subsequent_mask(x.size(0));
auto y = encoder(x, causal);                                    // (L, N, E): causal detected, as in Python

perf::MultiheadAttention mha(torch::nn::MultiheadAttentionOptions(512, 8));
auto [out, no_weights] = mha(q, k, v, torch::Tensor(), /*need_weights=*/false);

// a pre-LayerNorm (GPT-style) stack on (N, L, E) batches: Python's norm_first and batch_first
perf::TransformerEncoder gpt(torch::nn::TransformerEncoderOptions(layer_options, 6),
                             perf::TransformerLayerOptions().norm_first(true).batch_first(true));
auto h = gpt(tokens, torch::nn::TransformerImpl::generate_square_subsequent_mask(tokens.size(1)));  // (N, L, E)

  // clang-format on
}
void block10() {
  Net model;
  // clang-format off
perf::save(perf::state_dict(model), "weights.pt");   // perf/state_dict.h, above

  // clang-format on
}
void block_optimizer_state_dict() {
  Net model;
  perf::optim::AdamW opt(model->parameters(), perf::optim::AdamWOptions(1e-3));
  // clang-format off
// Python: torch.save({"model": m.state_dict(), "optim": opt.state_dict()}, "run.pt")
auto run = perf::load("run.pt").toGenericDict();
perf::load_state_dict(model, run.at("model"));
opt.load_state_dict(run.at("optim"));              // the run goes on in C++ ...
auto back = perf::dict();
back.insert("model", perf::state_dict(model));
back.insert("optim", opt.state_dict());
perf::save(back, "run.pt");                        // ... and back in Python, with load_state_dict

  // clang-format on
}
void block_lr_scheduler() {
  Net model;
  // clang-format off
perf::optim::AdamW opt(model->parameters(), perf::optim::AdamWOptions(1e-3).weight_decay(0.05));
// Python: SequentialLR(opt, [LinearLR(opt, 0.01, 1.0, 500), CosineAnnealingLR(opt, 9500, 1e-5)], [500])
auto warmup = std::make_shared<perf::optim::LinearLR>(opt, /*start_factor=*/0.01, /*end_factor=*/1.0, /*total_iters=*/500);
auto decay = std::make_shared<perf::optim::CosineAnnealingLR>(opt, /*T_max=*/9500, /*eta_min=*/1e-5);
perf::optim::SequentialLR scheduler(opt, {warmup, decay}, /*milestones=*/{500});
for (int64_t step = 0; step < 10000; ++step) {
  // forward, backward
  opt.step();
  scheduler.step();                                 // after the optimizer's step, as in Python
}
double last = scheduler.get_last_lr()[0];
auto ckpt = perf::dict();
ckpt.insert("optim", opt.state_dict());
ckpt.insert("sched", scheduler.state_dict());       // Python: scheduler.load_state_dict(ckpt["sched"])
perf::save(ckpt, "ckpt.pt");
// the 1cycle policy, rate and momentum (Adam's first beta), stepped once per batch
perf::optim::OneCycleLR one_cycle(opt, perf::optim::OneCycleLROptions(/*max_lr=*/1e-2, /*total_steps=*/10000).pct_start(0.25));
  // clang-format on
  (void)last;
}
void block_muon() {
  Net model;
  auto loader = torch::data::make_data_loader(mnist(), perf::loader_options(64));
  // clang-format off
std::vector<torch::Tensor> matrices, others;        // Muon: the hidden layers' 2-D weights; AdamW: the rest
for (const auto& item : model->named_parameters())
  (item.value().dim() == 2 && item.key() != "fc.weight" ? matrices : others).push_back(item.value());
perf::optim::Muon muon(matrices, perf::optim::MuonOptions(0.02));     // Python: torch.optim.Muon(matrices, lr=0.02)
perf::optim::AdamW adamw(others, perf::optim::AdamWOptions(3e-4));
perf::optim::CosineAnnealingLR schedule(muon, /*T_max=*/1000);
for (auto& b : perf::prefetch(*loader, torch::kCUDA)) {
  // forward, backward
  muon.step();
  adamw.step();
  muon.zero_grad();
  adamw.zero_grad();
  schedule.step();
}
perf::save(muon.state_dict(), "muon.pt");           // Python: muon.load_state_dict(torch.load("muon.pt"))

  // clang-format on
}
void block_muon_train_step() {
  Net model;
  auto loader = torch::data::make_data_loader(mnist(), perf::loader_options(64));
  std::vector<torch::Tensor> matrices, others;  // as in block_muon
  for (const auto& item : model->named_parameters())
    (item.value().dim() == 2 && item.key() != "fc.weight" ? matrices : others).push_back(item.value());
  perf::optim::Muon muon(matrices, perf::optim::MuonOptions(0.02));
  perf::optim::AdamW adamw(others, perf::optim::AdamWOptions(3e-4));
  perf::optim::CosineAnnealingLR schedule(muon, /*T_max=*/1000);
  const auto loss_fn = [&](const torch::Tensor& x, const torch::Tensor& y) {  // forward and loss
    return torch::nn::functional::cross_entropy(model->forward(x), y);
  };
  auto first_batch = *loader->begin();
  // clang-format off
perf::TrainStep step(model, loss_fn, {&muon, &adamw}, first_batch, perf::TrainStepOptions().max_grad_norm(1.0));
for (auto& b : perf::prefetch(*loader, torch::kCUDA)) {
  step.step(b);                                     // one CUDA graph: forward, backward, clipping, Muon and AdamW
  schedule.step();
}
  // clang-format on
}
void block_swa_utils() {
  Net model;
  auto loader = torch::data::make_data_loader(mnist(), perf::loader_options(64));
  const auto x = torch::randn({1, 3, 8, 8});
  // clang-format off
perf::optim::AdamW opt(model->parameters(), perf::optim::AdamWOptions(1e-3).flat(true));
// Python: AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.999), use_buffers=True)
perf::optim::AveragedModel ema(model, Net(),       // Net(): a second instance, for a Net that is not Cloneable
                               perf::optim::AveragedModelOptions()
                                   .multi_avg_fn(perf::optim::get_ema_multi_avg_fn(0.999))
                                   .use_buffers(true));
for (auto& b : perf::prefetch(*loader, torch::kCUDA)) {
  // forward, backward
  opt.step();
  ema->update_parameters(model);                   // one lerp over the flat buffer, no host sync
}
torch::Tensor y = ema->forward(x);                 // or ema->module(): the averaged Net
perf::save(perf::state_dict(ema), "ema.pt");       // Python: AveragedModel(model, ...).load_state_dict(torch.load("ema.pt"))

// SWA: the equal-weight average of the epochs after 160, at SWALR's annealed rate; then BatchNorm statistics
perf::optim::AveragedModel swa(model, Net());
perf::optim::SWALR swa_scheduler(opt, /*swa_lr=*/0.05);
for (int epoch = 0; epoch < 300; ++epoch) {
  // an epoch of steps
  if (epoch > 160) {
    swa->update_parameters(model);
    swa_scheduler.step();
  }
}
perf::optim::update_bn(*loader, swa);
  // clang-format on
}
void block10_state_dict() {
  Net model;
  int64_t epoch = 0;
  // clang-format off
// trained or downloaded in Python: torch.save(model.state_dict(), "pretrained.pt")
perf::load_state_dict(model, perf::load("pretrained.pt"));
// and back: in Python, twin.load_state_dict(torch.load("trained.pt"))
perf::save(perf::state_dict(model), "trained.pt");

// a checkpoint of several things, read by Python's torch.load as a dict
auto ckpt = perf::dict();                      // string -> any value
ckpt.insert("model", perf::state_dict(model));
ckpt.insert("epoch", epoch);
perf::save(ckpt, "ckpt.pt");
auto loaded = perf::load("ckpt.pt").toGenericDict();
perf::load_state_dict(model, loaded.at("model"));
epoch = loaded.at("epoch").toInt();

  // clang-format on
}
void block10_safetensors() {
  Net model;
  // clang-format off
// in Python: save_file(model.state_dict(), "model.safetensors"), or from the Hub
perf::load_state_dict(model, perf::load_safetensors("model.safetensors"));
perf::save_safetensors(perf::state_dict(model), "tuned.safetensors", {{"format", "pt"}});
// a sharded checkpoint, through its index, and one written in shards of at most 2 GB
auto weights = perf::load_safetensors("model.safetensors.index.json", torch::kCUDA);
perf::save_safetensors_sharded(perf::state_dict(model), "checkpoint/", 2000000000);
// one tensor at a time, as Python's safe_open: the shards mapped, read where touched
perf::SafetensorsFile file("model.safetensors.index.json", torch::kCUDA);
for (const auto& name : file.keys()) std::cout << name << " " << file.get_tensor(name).sizes() << "\n";
auto rows = file.get_slice("embed.weight", {torch::indexing::Slice(0, 1000)});  // rows 0-999 only

  // clang-format on
}
void block11(torch::Device device) {
  Net model;
  auto loader = torch::data::make_data_loader(mnist(), 64);
  // clang-format off
perf::optim::AdamW opt(model->parameters(), perf::optim::AdamWOptions(1e-3).weight_decay(0.01));
perf::CompiledTrainStep step("net_train.pt2", model, opt);   // perf::CompiledTrainOptions()...
for (auto& b : perf::prefetch(*loader, device)) {
  torch::Tensor loss = step.step(b.data, b.target);          // yours: keep one per step if you like
}
std::cout << step;   // perf::CompiledTrainStep 'net_train.pt2' on cpu, autocast bf16, eager steps

  // clang-format on
}
void block12(int64_t total_images, torch::Device device) {
  auto loader = torch::data::make_data_loader(mnist(), 64);
  torch::Tensor loss;
  // clang-format off
perf::Progress bar(total_images, perf::ProgressOptions().unit("img").description("epoch 0"));
for (auto& b : perf::prefetch(*loader, device)) {
  bar.update(b.data.size(0), {{"loss", loss.detach()}});   // the loss is read only when a line is drawn
}

  // clang-format on
}
void train() {}
void block13() {
  // clang-format off
perf::GpuMonitor mon(perf::GpuMonitorOptions().interval(std::chrono::milliseconds(100)));
train();
std::cout << mon.summary();   // per GPU: SM util mean/max, memory util, memory max of total, SM clock, power, temperature

  // clang-format on
}
template <typename Batch>
void train_step(const Batch&) {}
void block_profile_schedule() {
  auto loader = torch::data::make_data_loader(mnist(), 64);
  // clang-format off
perf::Profile p("trace.json", perf::ProfileOptions().schedule(
                                  perf::ProfileSchedule().skip_first(10).wait(1).warmup(1).active(3).repeat(2)));
for (auto& batch : *loader) { train_step(batch); p.step(); }  // trace-1.json: steps 12-14, trace-2.json: 17-19

  // clang-format on
}
void train_step() {}
void block14() {
  // clang-format off
std::cout << perf::advise([&] { train_step(); }, perf::AdviseOptions().steps(20));

  // clang-format on
}
void block15(torch::Tensor x) {
  Net model;
  // clang-format off
// Wrong: times the kernel launches (microseconds), not the matmuls.
auto t0 = std::chrono::steady_clock::now();
auto y = model->forward(x);                       // returns at once on CUDA
auto ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();

  // clang-format on
}
void block16(torch::Tensor x, std::function<void()> f, std::function<void()> g) {
  Net model;
  // clang-format off
// Right: CUDA events on the stream, warm-up first, statistics over many calls.
perf::Timer t(torch::kCUDA);                      // events; no host sync until read
t.start(); auto y = model->forward(x); t.stop();
double ms = t.elapsed_ms();                       // waits for the stop event only
perf::Stats s = perf::benchmark([&] { model->forward(x); },
    perf::BenchOptions().warmup(10).iters(100).min_time(1.0).items_per_call(x.size(0)));
std::cout << perf::Stats::header() << s;          // min, median, mean, p90, max, items/s

auto c = perf::compare("eager", f, "graphed", g); // A B A B ... alternately
std::cout << c;                                   // both rows + ratio of medians

  // clang-format on
}
}  // namespace readme_snippets

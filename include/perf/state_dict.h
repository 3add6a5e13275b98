// perf/state_dict.h — model weights to and from Python's torch.save files.
//
//   // weights trained in Python (torch.save(model.state_dict(), "resnet.pt")) into the C++ model
//   perf::load_state_dict(model, perf::load("resnet.pt"));
//   // and back: in Python, model.load_state_dict(torch.load("trained.pt"))
//   perf::save(perf::state_dict(model), "trained.pt");
//   // a whole checkpoint, torch.save({"model": model.state_dict(), "epoch": 3}, "ckpt.pt")
//   auto ckpt = perf::load("ckpt.pt").toGenericDict();
//   perf::load_state_dict(model, ckpt.at("model"));
//   // and its optimizer and scaler, as Python's: opt.load_state_dict(ckpt.at("optim")) (perf/optim.h, amp.h)
//   // Hugging Face's .safetensors files, as Python's safetensors.torch.load_file / save_file
//   perf::load_state_dict(model, perf::load_safetensors("model.safetensors"));
//   perf::save_safetensors(perf::state_dict(model), "trained.safetensors", {{"format", "pt"}});
//   // a sharded checkpoint (transformers' model.safetensors.index.json and its shards), read and written
//   auto weights = perf::load_safetensors("llama/model.safetensors.index.json");
//   perf::save_safetensors_sharded(perf::state_dict(model), "checkpoint/", /*max_shard_bytes=*/2000000000);
//   // one tensor at a time, as Python's safe_open: the file mapped into memory, read where touched
//   perf::SafetensorsFile file("model.safetensors", torch::kCUDA);
//   at::Tensor rows = file.get_slice("embed.weight", {torch::indexing::Slice(0, 1000)});
//
// LibTorch's own torch::save/torch::load write and read a TorchScript archive
// that Python's torch.load does not read, and LibTorch's torch::pickle_load
// fails on a Python state_dict (an OrderedDict: pytorch/pytorch#100741). These
// read and write the file torch.save writes, with the names of Python's
// state_dict(): LibTorch's modules name their parameters and buffers as
// PyTorch's do, so a C++ model and its Python twin share one file.
#pragma once

#include <ATen/TensorIndexing.h>
#include <ATen/core/Dict.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/core/Device.h>
#include <c10/util/Exception.h>
#include <perf/config.h>
#include <perf/module.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <iosfwd>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace perf {

/// Python's `module.state_dict()`: every parameter and buffer by its dotted
/// name, in Python's order (a module's own parameters, then its own buffers,
/// then each child's, depth first), detached; a tensor registered under two
/// names (tied weights) is there under both, as in Python.
c10::Dict<std::string, at::Tensor> state_dict(ModuleRef module);

/// What `load_state_dict(..., /*strict=*/false)` left out (Python's
/// `_IncompatibleKeys`): names the module has and the state lacks, and the
/// other way round.
struct IncompatibleKeys {
  std::vector<std::string> missing_keys;
  std::vector<std::string> unexpected_keys;
};
std::ostream& operator<<(std::ostream& os, const IncompatibleKeys& keys);

/// Python's `module.load_state_dict(state, strict)`: `state` is a dict of name
/// -> tensor (what perf::load returns for a saved state_dict, or
/// perf::state_dict of another module). Each tensor is copied into the
/// module's tensor of that name, which keeps its own dtype and device (as
/// Python's `copy_`). Everything is checked before anything is copied: a
/// shape that differs, or a value that is not a tensor, is refused naming it
/// (with or without `strict`); with `strict`, so is a missing or unexpected
/// name. Python copies what it can before it raises; here a refused state
/// leaves the module as it was.
IncompatibleKeys load_state_dict(ModuleRef module, const c10::IValue& state, bool strict = true);

/// An empty dict of any key and value (Python's `{}`), for a checkpoint of
/// several things: `auto ckpt = perf::dict(); ckpt.insert("epoch", 3);`.
/// c10::Dict<std::string, c10::IValue> cannot be built empty by its
/// default constructor.
c10::impl::GenericDict dict();

/// Writes `value` as Python's `torch.save(value, path)` does: a zip archive
/// whose pickle Python's `torch.load(path)` reads with its default
/// `weights_only=True`. Tensors (any device; a storage shared by several is
/// written once, as Python does, so views and tied weights stay shared), dicts
/// (c10::Dict, GenericDict: Python dicts), lists, tuples, int, double, complex,
/// bool, string (a Python str where it is UTF-8 text, Python bytes where it is
/// not), None. The file is written beside `path` and renamed over it at the
/// end, so an earlier checkpoint at `path` survives a failed save.
void save(const c10::IValue& value, const std::string& path);

/// Reads a file written by Python's `torch.save` (or perf::save), as Python's
/// `torch.load(path, map_location="cpu")` with its default `weights_only=True`
/// does: dicts (OrderedDict too) as GenericDict in their order, lists, tuples,
/// tensors (on the CPU, in their saved dtype; storages shared in the file stay
/// shared), parameters as tensors, numbers (complex too), strings, bytes and
/// bytearray (a string of the bytes), bool, None, torch.Size (a tuple), sets
/// (a list of the items), Counter (a dict), torch.device and dtypes. A Python
/// object of any other class (an argparse.Namespace, a numpy array) is refused
/// naming its class, as Python's default refuses it; so are quantized, sparse
/// and nested tensors (Python reads them; perf reads dense tensors). Files of
/// the format before PyTorch 1.6 (not a zip archive: torchvision's older
/// weights) are read too, as Python reads them. So is a .safetensors file
/// (which Python's torch.load does not read): a dict as load_safetensors's.
c10::IValue load(const std::string& path);

/// Python's `safetensors.torch.load_file(path, device)`: the tensors of a
/// .safetensors file (Hugging Face's weight format: a JSON header, then each
/// tensor's bytes) by name, in the file's order, on `device`. On the CPU, as
/// Python's, they are the file's bytes mapped into memory, copy-on-write
/// (SafetensorsFile, below, says what that means); on another device each is
/// copied there from the mapping. Every dtype Python's safetensors reads for
/// torch (float8s, unsigned ints and packed float4 too). The header is checked
/// whole before a byte of data is read, as the format's own reader checks it:
/// the tensors must cover the data exactly, without gaps or overlaps, each the
/// size its dtype and shape say; a file that fails is refused naming what is
/// wrong.
/// A path ending in .json is a sharded checkpoint's index (transformers'
/// model.safetensors.index.json, whose "weight_map" names each tensor's
/// shard): every shard is opened, and each must hold exactly the names the
/// index gives it.
c10::Dict<std::string, at::Tensor> load_safetensors(const std::string& path, c10::Device device = c10::kCPU);

/// Python's `safe_open(path, "pt").metadata()`: the text the header's
/// `__metadata__` holds (`{"format": "pt"}` in files written by
/// transformers), empty when there is none. Reads the header only.
std::map<std::string, std::string> safetensors_metadata(const std::string& path);

/// Python's `safetensors.torch.save_file(tensors, path, metadata)`: `tensors`
/// is a dict of name -> tensor (perf::state_dict, or load_safetensors's
/// result), on any device. Where Python refuses, perf writes what the file
/// can hold: a non-contiguous tensor (a view, a transpose) as its values, and
/// tensors that share memory (tied weights) each under its name (so the file
/// loads back into the model with load_state_dict). A dtype the format has no
/// name for (complex128, quantized) or a sparse tensor is refused before
/// anything is written; the file is written beside `path` and renamed over it
/// at the end, so an earlier file at `path` survives a failed save.
void save_safetensors(const c10::IValue& tensors, const std::string& path,
                      const std::map<std::string, std::string>& metadata = {});

/// huggingface_hub's `save_torch_state_dict(tensors, directory,
/// max_shard_size)`: the tensors in shards of at most `max_shard_bytes` each,
/// filled in the dict's order (a larger tensor alone in its own shard; tensors
/// sharing a storage, as tied weights, in the first one's, counted once), named
/// `model-00001-of-00003.safetensors` and so on, with the index
/// `model.safetensors.index.json` (`total_size` and the `weight_map`) that
/// transformers and perf::load_safetensors read them through; one shard is
/// written as `model.safetensors` without an index. Each shard's metadata is
/// `{"format": "pt"}` and `metadata`. Returns the paths written, the index
/// last. Everything is checked before the first file is written.
std::vector<std::string> save_safetensors_sharded(const c10::IValue& tensors, const std::string& directory,
                                                  int64_t max_shard_bytes = 5000000000,
                                                  const std::map<std::string, std::string>& metadata = {});

namespace detail {
struct SafetensorsFileState;
}

/// Python's `safetensors.safe_open(path, framework="pt", device)`: a
/// .safetensors file opened once, its header checked whole (as
/// load_safetensors checks it), its tensors read one at a time, by name. A
/// path ending in .json opens a sharded checkpoint through its index, every
/// shard at once, each checked to hold exactly the names the index gives it.
///
/// The file is mapped into memory, as Python's is. On the CPU a tensor is the
/// file's bytes themselves: nothing is read until it is touched, and each
/// call for a name gives the same memory. Writing to a tensor writes a private
/// copy of its pages, never the file. Tensors keep the mapping alive after
/// the SafetensorsFile is gone. (A tensor whose bytes do not start at a
/// multiple of its element size, which Python's writer and perf's never
/// produce, is copied instead.) On another device each tensor is copied there
/// straight from the mapping, and get_slice copies only the slice. As with
/// Python's, a file cut short while mapped (rewritten in place) makes a read
/// of its lost pages crash the process (SIGBUS); perf::save_safetensors
/// writes a new file and renames it over the old one, which leaves a mapping
/// of the old file whole.
class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path, c10::Device device = c10::kCPU);

  /// The tensors' names, sorted (Python's `keys()`).
  std::vector<std::string> keys() const;
  /// The names in the order of the file's data (Python's `offset_keys()`);
  /// through an index, shard by shard in the order the index first names them.
  std::vector<std::string> offset_keys() const;
  bool contains(const std::string& name) const;
  /// A tensor's dtype and shape, from the header, without reading it (Python's
  /// `get_slice(name).get_dtype()` and `get_shape()`).
  c10::ScalarType dtype(const std::string& name) const;
  std::vector<int64_t> shape(const std::string& name) const;

  /// Python's `get_tensor(name)`, on the file's device.
  at::Tensor get_tensor(const std::string& name) const;
  /// Python's `get_slice(name)[indices]`: `file.get_slice("embed.weight",
  /// {Slice(0, 1000), Slice()})` with `using namespace torch::indexing`,
  /// contiguous, on the file's device; only the slice is copied (on the CPU,
  /// nothing where the slice is contiguous in the file).
  at::Tensor get_slice(const std::string& name, at::ArrayRef<at::indexing::TensorIndex> indices) const;
  /// Python's `get_tensors()`: every tensor, in offset_keys()'s order.
  c10::Dict<std::string, at::Tensor> get_tensors() const;

  /// Python's `metadata()`: the header's `__metadata__`. Through an index,
  /// the index's "metadata" (transformers': `total_size`), numbers as text.
  const std::map<std::string, std::string>& metadata() const;
  c10::Device device() const;
  const std::string& path() const;

 private:
  std::shared_ptr<const detail::SafetensorsFileState> state_;
};

}  // namespace perf

#ifdef PERF_HEADER_ONLY
#include <perf/impl/state_dict-inl.h>
#endif

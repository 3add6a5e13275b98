// perf/impl/state_dict-inl.h — the out-of-line definitions of perf/state_dict.h.
// Included by perf/state_dict.h (header-only, the default), or compiled once into
// perf::perf_static (PERF_SEPARATE_COMPILATION; src/perf.cpp).
#pragma once

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/core/ScalarType.h>
#include <c10/util/irange.h>
#include <caffe2/serialize/inline_container.h>
#include <fcntl.h>
#include <perf/state_dict.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <ostream>
#include <sstream>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <utility>

namespace perf {

namespace detail {

// Python's pickle opcodes that torch.save writes (protocol 2, its default) and a few of protocol 4's.
namespace op {
constexpr uint8_t kProto = 0x80, kFrame = 0x95, kStop = '.', kMark = '(', kPop = '0', kPopMark = '1', kDup = '2',
                  kNone = 'N', kTrue = 0x88, kFalse = 0x89, kBinInt = 'J', kBinInt1 = 'K', kBinInt2 = 'M',
                  kLong1 = 0x8a, kLong4 = 0x8b, kBinFloat = 'G', kBinUnicode = 'X', kShortBinUnicode = 0x8c,
                  kBinUnicode8 = 0x8d, kEmptyList = ']', kAppend = 'a', kAppends = 'e', kEmptyDict = '}',
                  kSetItem = 's', kSetItems = 'u', kEmptyTuple = ')', kTuple = 't', kTuple1 = 0x85, kTuple2 = 0x86,
                  kTuple3 = 0x87, kBinPut = 'q', kLongBinPut = 'r', kMemoize = 0x94, kBinGet = 'h', kLongBinGet = 'j',
                  kGlobal = 'c', kStackGlobal = 0x93, kReduce = 'R', kBuild = 'b', kNewObj = 0x81, kBinPersId = 'Q',
                  kShortBinBytes = 'C', kBinBytes = 'B', kBinBytes8 = 0x8e, kEmptySet = 0x8f, kAddItems = 0x90;
}  // namespace op

// Whether Python's torch.load can read `s` as a str: UTF-8, surrogates allowed (it decodes with
// "surrogatepass"). Other bytes are written as Python bytes.
PERF_INLINE bool python_str(const std::string& s) {
  const auto* b = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  const auto cont = [&](size_t i, unsigned lo = 0x80, unsigned hi = 0xbf) { return i < n && b[i] >= lo && b[i] <= hi; };
  for (size_t i = 0; i < n;) {
    const unsigned c = b[i];
    if (c < 0x80) {
      i += 1;
    } else if (c >= 0xc2 && c <= 0xdf && cont(i + 1)) {
      i += 2;
    } else if (c >= 0xe0 && c <= 0xef && cont(i + 1, c == 0xe0 ? 0xa0 : 0x80) && cont(i + 2)) {
      i += 3;
    } else if (c >= 0xf0 && c <= 0xf4 && cont(i + 1, c == 0xf0 ? 0x90 : 0x80, c == 0xf4 ? 0x8f : 0xbf) && cont(i + 2) &&
               cont(i + 3)) {
      i += 4;
    } else {
      return false;
    }
  }
  return true;
}

// The legacy storage class torch.save names for a dtype ("FloatStorage"), as torch/storage.py's
// _dtype_to_storage_type_map; dtypes without one are written as an UntypedStorage and the dtype
// (_rebuild_tensor_v3), as Python writes them.
PERF_INLINE std::string legacy_storage_name(c10::ScalarType t) {
  switch (t) {
    case c10::kDouble:
      return "DoubleStorage";
    case c10::kFloat:
      return "FloatStorage";
    case c10::kHalf:
      return "HalfStorage";
    case c10::kLong:
      return "LongStorage";
    case c10::kInt:
      return "IntStorage";
    case c10::kShort:
      return "ShortStorage";
    case c10::kChar:
      return "CharStorage";
    case c10::kByte:
      return "ByteStorage";
    case c10::kBool:
      return "BoolStorage";
    case c10::kBFloat16:
      return "BFloat16Storage";
    case c10::kComplexDouble:
      return "ComplexDoubleStorage";
    case c10::kComplexFloat:
      return "ComplexFloatStorage";
    default:
      return "";
  }
}

PERF_INLINE std::optional<c10::ScalarType> dtype_of_python_name(const std::string& name) {
  const auto& names = c10::getStringToDtypeMap();
  auto it = names.find(name);
  if (it != names.end()) return it->second;
  return std::nullopt;
}

// A pickle of a value, the way Python's pickler writes it at protocol 2, and the storages its tensors need.
class PickleWriter {
 public:
  std::string bytes;
  // Each distinct (storage, dtype): its key in the archive and the tensor whose storage it is.
  std::vector<std::pair<std::string, at::Tensor>> storages;

  void value(const c10::IValue& v, const std::string& where) {
    if (v.isNone()) {
      put(op::kNone);
    } else if (v.isBool()) {
      put(v.toBool() ? op::kTrue : op::kFalse);
    } else if (v.isInt()) {
      integer(v.toInt());
    } else if (v.isDouble()) {
      binfloat(v.toDouble());
    } else if (v.isComplexDouble()) {
      const auto z = v.toComplexDouble();
      global("__builtin__", "complex");  // as Python's pickler names builtins at protocol 2
      binfloat(z.real());
      binfloat(z.imag());
      put(op::kTuple2);
      put(op::kReduce);
    } else if (v.isString()) {
      text_or_bytes(v.toStringRef());
    } else if (v.isTensor()) {
      tensor(v.toTensor(), where);
    } else if (v.isDevice()) {
      global("torch", "device");
      put(op::kMark);
      string(v.toDevice().str());
      put(op::kTuple);
      put(op::kReduce);
    } else if (v.isGenericDict()) {
      put(op::kEmptyDict);
      const auto dict = v.toGenericDict();
      if (dict.empty()) return;
      put(op::kMark);
      for (const auto& kv : dict) {
        value(kv.key(), where);
        value(kv.value(), where.empty() ? key_str(kv.key()) : where + "." + key_str(kv.key()));
      }
      put(op::kSetItems);
    } else if (v.isList()) {
      put(op::kEmptyList);
      const auto list = v.toListRef();
      if (list.empty()) return;
      put(op::kMark);
      for (const auto i : c10::irange(list.size())) value(list[i], where + "[" + std::to_string(i) + "]");
      put(op::kAppends);
    } else if (v.isTuple()) {
      const auto& elems = v.toTupleRef().elements();
      if (elems.empty()) {
        put(op::kEmptyTuple);
        return;
      }
      put(op::kMark);
      for (const auto i : c10::irange(elems.size())) value(elems[i], where + "[" + std::to_string(i) + "]");
      put(op::kTuple);
    } else {
      TORCH_CHECK(false, "perf::save: ", where.empty() ? std::string("the value") : "'" + where + "'", " is a ",
                  v.tagKind(),
                  "; a file Python's torch.load reads holds tensors, dicts, lists, tuples, int, double, complex, "
                  "bool, string, None and devices");
    }
  }

 private:
  std::map<std::pair<const void*, c10::ScalarType>, std::string> keys_;  // (storage, dtype) -> its record's key

  void put(uint8_t b) { bytes.push_back(static_cast<char>(b)); }
  void put_le(uint64_t v, int n) {
    for (int i = 0; i < n; ++i) put(static_cast<uint8_t>(v >> (8 * i)));
  }
  static std::string key_str(const c10::IValue& k) { return k.isString() ? k.toStringRef() : c10::str(k); }
  void integer(int64_t i) {
    if (i >= 0 && i < 256) {
      put(op::kBinInt1);
      put(static_cast<uint8_t>(i));
    } else if (i >= 0 && i < 65536) {
      put(op::kBinInt2);
      put_le(static_cast<uint64_t>(i), 2);
    } else if (i >= INT32_MIN && i <= INT32_MAX) {
      put(op::kBinInt);
      put_le(static_cast<uint64_t>(i), 4);
    } else {
      put(op::kLong1);
      put(8);
      put_le(static_cast<uint64_t>(i), 8);  // two's complement, little-endian
    }
  }
  void binfloat(double d) {
    put(op::kBinFloat);
    uint64_t u = 0;
    std::memcpy(&u, &d, sizeof u);
    for (int i = 7; i >= 0; --i) put(static_cast<uint8_t>(u >> (8 * i)));  // big-endian, as pickle's
  }
  void string(const std::string& s) {
    put(op::kBinUnicode);
    put_le(s.size(), 4);
    bytes += s;
  }
  // A C++ string is bytes; Python's str is text. Text (UTF-8) is written as a str, anything else as bytes,
  // the way Python's pickler writes bytes at protocol 2: _codecs.encode(<the bytes as latin-1 text>, 'latin1').
  void text_or_bytes(const std::string& s) {
    if (python_str(s)) return string(s);
    std::string latin1;
    for (const char ch : s) {
      const auto c = static_cast<unsigned char>(ch);
      if (c < 0x80) {
        latin1 += ch;
      } else {
        latin1 += static_cast<char>(0xc0 | (c >> 6));
        latin1 += static_cast<char>(0x80 | (c & 0x3f));
      }
    }
    global("_codecs", "encode");
    string(latin1);
    string("latin1");
    put(op::kTuple2);
    put(op::kReduce);
  }
  void global(const char* module, const char* name) {
    put(op::kGlobal);
    bytes += module;
    bytes += '\n';
    bytes += name;
    bytes += '\n';
  }
  void tensor(const at::Tensor& t, const std::string& where) {
    TORCH_CHECK(t.defined(), "perf::save: '", where, "' is an undefined tensor");
    TORCH_CHECK(t.layout() == c10::kStrided && !t.is_quantized(), "perf::save: '", where, "' is a ", t.layout(),
                t.is_quantized() ? " quantized" : "", " tensor; perf writes dense (strided) tensors");
    TORCH_CHECK(t.has_storage(), "perf::save: '", where, "' has no storage (", t.device(), ")");
    if (t.is_conj() || t.is_neg()) return tensor(t.resolve_conj().resolve_neg(), where);  // the values, not the bits
    const std::string legacy = legacy_storage_name(t.scalar_type());
    const std::string dtype_name(c10::getDtypeNames(t.scalar_type()).first);  // a string_view since 2.15
    TORCH_CHECK(!legacy.empty() || dtype_of_python_name(dtype_name), "perf::save: '", where, "' has dtype ",
                t.scalar_type(), ", which perf cannot name for Python");
    // One record per storage and dtype, as Python (which refuses one storage under two dtypes).
    const auto [found, added] =
        keys_.try_emplace({t.storage().unsafeGetStorageImpl(), t.scalar_type()}, std::to_string(storages.size()));
    const std::string key = found->second;
    if (added) storages.emplace_back(key, t);
    const int64_t itemsize = static_cast<int64_t>(c10::elementSize(t.scalar_type()));
    const int64_t nbytes = static_cast<int64_t>(t.storage().nbytes());
    const bool v3 = legacy.empty();
    global("torch._utils", v3 ? "_rebuild_tensor_v3" : "_rebuild_tensor_v2");
    put(op::kMark);
    // persistent id ('storage', storage class, key, location, numel): the bytes are the record data/<key>
    put(op::kMark);
    string("storage");
    global(v3 ? "torch.storage" : "torch", v3 ? "UntypedStorage" : legacy.c_str());
    string(key);
    string(t.device().is_cpu() ? "cpu" : t.device().str());
    integer(v3 ? nbytes : nbytes / itemsize);
    put(op::kTuple);
    put(op::kBinPersId);
    integer(t.storage_offset());
    put(op::kMark);
    for (const auto s : t.sizes()) integer(s);
    put(op::kTuple);
    put(op::kMark);
    for (const auto s : t.strides()) integer(s);
    put(op::kTuple);
    put(t.requires_grad() ? op::kTrue : op::kFalse);
    global("collections", "OrderedDict");  // backward hooks: always empty, as Python writes them
    put(op::kEmptyTuple);
    put(op::kReduce);
    if (v3) global("torch", dtype_name.c_str());
    put(op::kTuple);
    put(op::kReduce);
  }
};

// One entry of the unpickler's stack: a value, or a Python callable named by GLOBAL (only ever called).
struct PickleItem {
  c10::IValue value;
  std::string callable;  // "module.name"; empty for a value
  // A tuple holding callables (the arguments of torch._tensor._rebuild_from_type_v2, a tensor with Python
  // attributes): each item's callable, "" for a value; `value` holds None in a callable's place.
  std::vector<std::string> item_callables;
};

// An unpickler for what torch.save writes and Python's weights_only loader accepts. LibTorch's own
// (torch::jit::Unpickler) turns every OrderedDict into None, and a state_dict is one.
class PickleReader {
 public:
  // A zip archive's data.pkl, whose storages are the archive's records data/<key>.
  PickleReader(caffe2::serialize::PyTorchStreamReader& archive, std::string path)
      : archive_(&archive), path_(std::move(path)) {}
  // A file of the format before PyTorch 1.6: pickles, then the storages' bytes (fill_storages).
  explicit PickleReader(std::string path) : path_(std::move(path)) {}

  c10::IValue run(const std::string& pickle) {
    size_t pos = 0;
    return run(pickle, pos);
  }
  // One pickle of `data` from `pos` on, leaving `pos` after its STOP; a fresh stack and memo, as each
  // pickle.load of Python's.
  c10::IValue run(const std::string& data, size_t& pos) {
    data_ = &data;
    pos_ = pos;
    stack_.clear();
    memo_.clear();
    marks_.clear();
    c10::IValue result = read();
    pos = pos_;
    return result;
  }

  // The old format's storage bytes, after its pickles: for each key the pickle of keys lists, the element
  // count (8 bytes, little-endian) and the elements (torch/serialization.py's _legacy_load).
  void fill_storages(const c10::IValue& keys, const std::string& data, size_t& pos) {
    data_ = &data;
    pos_ = pos;
    check(keys.isList(), "lists its storages in something not a list");
    std::unordered_set<std::string> filled;
    for (const auto& k : keys.toListRef()) {
      check(k.isString(), "lists a storage key that is not a string");
      auto it = storages_.find(k.toStringRef());
      check(it != storages_.end(), "lists storage ", k.toStringRef(), ", which no tensor uses");
      at::Tensor& t = it->second;
      const auto numel = static_cast<int64_t>(le(8));
      check(numel == t.numel(), "says storage ", k.toStringRef(), " holds ", t.numel(), " elements, but its data ",
            numel);
      const size_t nbytes = t.storage().nbytes();
      check(nbytes <= data_->size() - pos_, "ends early (truncated?)");
      if (nbytes > 0) std::memcpy(t.storage().mutable_data(), data_->data() + pos_, nbytes);  // an empty one has none
      pos_ += nbytes;
      filled.insert(k.toStringRef());
    }
    for (const auto& kv : storages_) check(filled.count(kv.first) != 0, "has no data for storage ", kv.first);
    pos = pos_;
  }

 private:
  c10::IValue read() {
    while (true) {
      const uint8_t code = u8();
      switch (code) {
        case op::kProto:
          u8();
          break;
        case op::kFrame:
          le(8);
          break;
        case op::kStop:
          check(stack_.size() == 1 && marks_.empty(), "ends with ", stack_.size(), " values on its stack");
          return value_of(pop(), "the result");
        case op::kMark:
          marks_.push_back(stack_.size());
          break;
        case op::kPop:
          pop();
          break;
        case op::kPopMark:
          stack_.resize(mark());
          break;
        case op::kDup:
          check(!stack_.empty(), "DUP on an empty stack");
          stack_.push_back(stack_.back());
          break;
        case op::kNone:
          push(c10::IValue());
          break;
        case op::kTrue:
          push(true);
          break;
        case op::kFalse:
          push(false);
          break;
        case op::kBinInt:
          push(static_cast<int64_t>(static_cast<int32_t>(le(4))));
          break;
        case op::kBinInt1:
          push(static_cast<int64_t>(u8()));
          break;
        case op::kBinInt2:
          push(static_cast<int64_t>(le(2)));
          break;
        case op::kLong1:
          push(long_int(u8()));
          break;
        case op::kLong4:
          push(long_int(le(4)));
          break;
        case op::kBinFloat: {
          uint64_t u = 0;
          for (int i = 0; i < 8; ++i) u = (u << 8) | u8();
          double d = 0;
          std::memcpy(&d, &u, sizeof d);
          push(d);
          break;
        }
        case op::kBinUnicode:
          push(bytes(le(4)));
          break;
        case op::kShortBinUnicode:
          push(bytes(u8()));
          break;
        case op::kBinUnicode8:
          push(bytes(le(8)));
          break;
        case op::kShortBinBytes:  // bytes, at protocol 3 and above: a C++ string of them
          push(bytes(u8()));
          break;
        case op::kBinBytes:
          push(bytes(le(4)));
          break;
        case op::kBinBytes8:
          push(bytes(le(8)));
          break;
        case op::kEmptyList:
        case op::kEmptySet:  // a set is a list of its items (IValue has no set)
          push(c10::impl::GenericList(c10::AnyType::get()));
          break;
        case op::kAppend: {
          auto v = value_of(pop(), "a list's item");
          list_at(stack_.size() - 1).push_back(std::move(v));
          break;
        }
        case op::kAppends:
        case op::kAddItems: {
          const size_t m = mark();
          check(m > 0, "APPENDS without a list");
          auto list = list_at(m - 1);
          for (size_t i = m; i < stack_.size(); ++i) list.push_back(value_of(stack_[i], "a list's item"));
          stack_.resize(m);
          break;
        }
        case op::kEmptyDict:
          push(perf::dict());
          break;
        case op::kSetItem: {
          auto v = value_of(pop(), "a dict's value");
          auto k = value_of(pop(), "a dict's key");
          dict_at(stack_.size() - 1).insert_or_assign(std::move(k), std::move(v));
          break;
        }
        case op::kSetItems: {
          const size_t m = mark();
          check(m > 0 && (stack_.size() - m) % 2 == 0, "SETITEMS without a dict or with an odd count");
          auto dict = dict_at(m - 1);
          for (size_t i = m; i < stack_.size(); i += 2) {
            dict.insert_or_assign(value_of(stack_[i], "a dict's key"), value_of(stack_[i + 1], "a dict's value"));
          }
          stack_.resize(m);
          break;
        }
        case op::kEmptyTuple:
          push(c10::ivalue::Tuple::create({}));
          break;
        case op::kTuple: {
          const size_t m = mark();
          push_tuple(m);
          break;
        }
        case op::kTuple1:
        case op::kTuple2:
        case op::kTuple3: {
          const size_t n = code - op::kTuple1 + 1;
          check(stack_.size() >= n, "TUPLE", n, " on a stack of ", stack_.size());
          push_tuple(stack_.size() - n);
          break;
        }
        case op::kBinPut:
          memo(u8());
          break;
        case op::kLongBinPut:
          memo(le(4));
          break;
        case op::kMemoize:
          memo(memo_.size());
          break;
        case op::kBinGet:
          recall(u8());
          break;
        case op::kLongBinGet:
          recall(le(4));
          break;
        case op::kGlobal: {
          std::string module = line();
          std::string name = line();
          global(module, name);
          break;
        }
        case op::kStackGlobal: {
          auto name = value_of(pop(), "a global's name");
          auto module = value_of(pop(), "a global's module");
          check(name.isString() && module.isString(), "STACK_GLOBAL without strings");
          global(module.toStringRef(), name.toStringRef());
          break;
        }
        case op::kReduce:
        case op::kNewObj: {
          PickleItem args = pop();
          auto fn = pop();
          if (fn.callable == "torch._tensor._rebuild_from_type_v2") {
            push(rebuild_from_type(args));
            break;
          }
          check(value_of(args, "arguments").isTuple(), "calls ", fn.callable, " without an argument tuple");
          push(call(fn, args.value.toTupleRef().elements()));
          break;
        }
        case op::kBuild: {
          auto state = pop();
          check(!stack_.empty(), "BUILD on an empty stack");
          // An OrderedDict's attributes (a state_dict's _metadata: each module's version) and a
          // Parameter's Python attributes: nothing a C++ tensor or dict holds. Anything else is an object.
          const auto& target = stack_.back().value;
          check(stack_.back().callable.empty() && (target.isGenericDict() || target.isTensor()),
                "sets the state of something that is not a dict or a tensor");
          break;
        }
        case op::kBinPersId:
          push(storage(value_of(pop(), "a persistent id")));
          break;
        default: {
          std::ostringstream os;
          os << "0x" << std::hex << static_cast<int>(code);
          check(false, "has pickle opcode ", os.str(), " at byte ", pos_ - 1,
                ", which torch.save does not write (a file of pickle protocol 2 to 4 from torch.save is expected)");
        }
      }
    }
  }

  template <typename... Args>
  void check(bool ok, const Args&... what) const {
    TORCH_CHECK(ok, "perf::load: ", path_, ": the pickle (data.pkl) ", what...);
  }

  uint8_t u8() {
    check(pos_ < data_->size(), "ends early (truncated?)");
    return static_cast<uint8_t>((*data_)[pos_++]);
  }
  uint64_t le(int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; ++i) v |= static_cast<uint64_t>(u8()) << (8 * i);
    return v;
  }
  std::string bytes(uint64_t n) {
    check(n <= data_->size() - pos_, "ends early (truncated?)");
    std::string s = data_->substr(pos_, n);
    pos_ += n;
    return s;
  }
  std::string line() {
    const size_t end = data_->find('\n', pos_);
    check(end != std::string::npos, "ends early in a GLOBAL");
    std::string s = data_->substr(pos_, end - pos_);
    pos_ = end + 1;
    return s;
  }
  int64_t long_int(uint64_t n) {
    check(n <= 8, "holds an integer of ", n, " bytes (more than 64 bits)");
    if (n == 0) return 0;
    uint64_t v = le(static_cast<int>(n));
    if (n < 8 && (v >> (8 * n - 1)) & 1) v |= ~uint64_t{0} << (8 * n);  // sign-extend
    return static_cast<int64_t>(v);
  }

  void push(c10::IValue v) { stack_.push_back(PickleItem{std::move(v), {}, {}}); }
  PickleItem pop() {
    check(!stack_.empty() && (marks_.empty() || stack_.size() > marks_.back()), "pops an empty stack");
    PickleItem it = std::move(stack_.back());
    stack_.pop_back();
    return it;
  }
  size_t mark() {
    check(!marks_.empty(), "has no MARK where one is needed");
    const size_t m = marks_.back();
    marks_.pop_back();
    return m;
  }
  c10::IValue value_of(const PickleItem& it, const char* what) const {
    check(it.callable.empty(), "holds the Python callable ", it.callable, " as ", what,
          ", which only Python can rebuild");
    for (const auto& c : it.item_callables) {
      check(c.empty(), "holds the Python callable ", c, " in a tuple, which only Python can rebuild");
    }
    return it.value;
  }
  // The bytes of a str whose characters are all below 256 (Python's bytes at protocol 2), from its UTF-8.
  std::string latin1(const std::string& text) const {
    std::string out;
    for (size_t i = 0; i < text.size(); ++i) {
      const auto c = static_cast<unsigned char>(text[i]);
      if (c < 0x80) {
        out += text[i];
        continue;
      }
      const bool two =
          (c == 0xc2 || c == 0xc3) && i + 1 < text.size() && (static_cast<unsigned char>(text[i + 1]) & 0xc0) == 0x80;
      check(two, "encodes a character above 255 as latin1 bytes");
      out += static_cast<char>(((c & 0x1f) << 6) | (static_cast<unsigned char>(text[++i]) & 0x3f));
    }
    return out;
  }
  void push_tuple(size_t from) {
    std::vector<c10::IValue> elems;
    std::vector<std::string> callables;  // empty unless an item is a callable
    for (size_t i = from; i < stack_.size(); ++i) {
      const bool callable = !stack_[i].callable.empty();
      if (callable && callables.empty()) callables.resize(stack_.size() - from);
      if (callable) callables[i - from] = stack_[i].callable;
      elems.push_back(callable ? c10::IValue() : value_of(stack_[i], "a tuple's item"));
    }
    stack_.resize(from);
    stack_.push_back(PickleItem{c10::ivalue::Tuple::create(std::move(elems)), {}, std::move(callables)});
  }
  c10::impl::GenericList list_at(size_t i) {
    check(i < stack_.size() && stack_[i].callable.empty() && stack_[i].value.isList(), "appends to a non-list");
    return stack_[i].value.toList();
  }
  c10::impl::GenericDict dict_at(size_t i) {
    check(i < stack_.size() && stack_[i].callable.empty() && stack_[i].value.isGenericDict(),
          "sets an item of a non-dict");
    return stack_[i].value.toGenericDict();
  }

  void memo(uint64_t i) {
    check(!stack_.empty(), "memoizes an empty stack");
    check(i <= memo_.size() + (uint64_t{1} << 20), "memoizes at index ", i);
    if (i >= memo_.size()) memo_.resize(i + 1);
    memo_[i] = stack_.back();
  }
  void recall(uint64_t i) {
    check(i < memo_.size(), "recalls memo ", i, ", never stored");
    stack_.push_back(memo_[i]);
  }

  // GLOBAL: what Python's weights_only loader allows, and nothing more.
  void global(const std::string& pickled_module, const std::string& name) {
    // Python's pickler names builtins "__builtin__" at protocol 2 (Python 2's name); its loader maps it back.
    const std::string module = pickled_module == "__builtin__" ? "builtins" : pickled_module;
    const std::string full = module + "." + name;
    if (full == "torch.storage.UntypedStorage" || full == "torch.UntypedStorage") {
      return push(static_cast<int64_t>(c10::kByte));
    }
    if (module == "torch") {
      // a storage class of the persistent id ("FloatStorage"), or a dtype (torch.float32)
      for (int i = 0; i < static_cast<int>(c10::ScalarType::NumOptions); ++i) {
        if (name == legacy_storage_name(static_cast<c10::ScalarType>(i))) return push(static_cast<int64_t>(i));
      }
      if (auto t = dtype_of_python_name(name)) return push(*t);
      if (name == "Size" || name == "device") return stack_.push_back(PickleItem{{}, full, {}});
    }
    if (full == "collections.OrderedDict" || full == "torch._utils._rebuild_tensor_v2" ||
        full == "torch._utils._rebuild_tensor" || full == "torch._utils._rebuild_tensor_v3" ||
        full == "torch._utils._rebuild_parameter" || full == "torch._utils._rebuild_parameter_with_state" ||
        full == "collections.Counter" || full == "builtins.set" || full == "builtins.complex" ||
        full == "builtins.bytearray" || full == "_codecs.encode") {
      return stack_.push_back(PickleItem{{}, full, {}});
    }
    // A tensor with Python attributes (t.tag = 1; an nn.Buffer saved as such): _rebuild_from_type_v2 with its
    // type, which Python's weights_only loader allows for these two.
    if (full == "torch._tensor._rebuild_from_type_v2" || full == "torch.Tensor" ||
        full == "torch.nn.parameter.Parameter") {
      return stack_.push_back(PickleItem{{}, full, {}});
    }
    check(module.rfind("__torch__", 0) != 0, "holds TorchScript's class ", full,
          ": this is an archive of LibTorch's torch::save or Python's torch.jit.save, which torch::load (C++) "
          "and torch.jit.load (Python) read");
    // What Python's default loader also accepts and perf does not rebuild: tensors other than dense ones
    // (quantized, sparse, nested, meta), their layouts and schemes, and the legacy tensor classes.
    const bool python_reads =
        module == "torch._utils" || full == "torch.serialization._get_layout" ||
        (module == "torch" &&
         (name.rfind("per_", 0) == 0 || (name.size() >= 6 && name.compare(name.size() - 6, 6, "Tensor") == 0)));
    check(!python_reads, "holds ", full,
          ": a quantized, sparse, nested or meta tensor, which Python's torch.load reads and perf::load does not "
          "(it reads dense tensors); save such tensors as dense ones (t.dequantize(), t.to_dense()) or as plain "
          "tensors");
    check(false, "holds a Python object of class ", full,
          ", which only Python can rebuild (Python's torch.load refuses it too unless weights_only=False). Save "
          "tensors, numbers, strings and dicts, lists or tuples of them, such as model.state_dict()");
  }

  c10::IValue call(const PickleItem& fn, const std::vector<c10::IValue>& args) {
    const std::string& f = fn.callable;
    check(!f.empty(), "calls a value that is not a Python callable");
    check(f != "torch.Tensor" && f != "torch.nn.parameter.Parameter" && f != "torch._tensor._rebuild_from_type_v2",
          "calls ", f, " in a way torch.save does not write");
    if (f == "collections.OrderedDict") {
      auto dict = perf::dict();
      if (!args.empty()) {  // OrderedDict([(k, v), ...])
        check(args.size() == 1 && args[0].isList(), "builds an OrderedDict from something not a list of pairs");
        for (const auto& kv : args[0].toListRef()) {
          check(kv.isTuple() && kv.toTupleRef().elements().size() == 2, "builds an OrderedDict from a non-pair");
          dict.insert_or_assign(kv.toTupleRef().elements()[0], kv.toTupleRef().elements()[1]);
        }
      }
      return dict;
    }
    if (f == "collections.Counter") {  // Counter({...}): a dict
      check(args.size() <= 1 && (args.empty() || args[0].isGenericDict()), "builds a Counter from a non-dict");
      auto dict = perf::dict();
      if (!args.empty()) {
        for (const auto& kv : args[0].toGenericDict()) dict.insert_or_assign(kv.key(), kv.value());
      }
      return dict;
    }
    if (f == "builtins.set") {  // set([...]): a list of the items
      check(args.size() <= 1 && (args.empty() || args[0].isList()), "builds a set from a non-list");
      return args.empty() ? c10::IValue(c10::impl::GenericList(c10::AnyType::get())) : args[0];
    }
    if (f == "builtins.complex") {
      check(args.size() <= 2 &&
                std::all_of(args.begin(), args.end(), [](const c10::IValue& a) { return a.isDouble() || a.isInt(); }),
            "builds a complex number from other than two numbers");
      const auto part = [&](size_t i) { return i < args.size() ? args[i].toScalar().to<double>() : 0.0; };
      return c10::complex<double>(part(0), part(1));
    }
    if (f == "_codecs.encode" || f == "builtins.bytearray") {  // bytes and bytearray: a C++ string of the bytes
      if (f == "builtins.bytearray" && args.size() <= 1) {
        check(args.empty() || args[0].isString(), "builds a bytearray from other than bytes");
        return args.empty() ? std::string() : args[0].toStringRef();
      }
      check(args.size() == 2 && args[0].isString() && args[1].isString() &&
                (args[1].toStringRef() == "latin1" || args[1].toStringRef() == "latin-1"),
            "calls ", f, " with other arguments than Python's pickler writes (text and 'latin1')");
      return latin1(args[0].toStringRef());
    }
    if (f == "torch.Size") {
      check(args.size() == 1 && (args[0].isTuple() || args[0].isList()), "builds a torch.Size from a non-tuple");
      return args[0];
    }
    if (f == "torch.device") {
      check(!args.empty() && args[0].isString(), "builds a torch.device without a string");
      std::string s = args[0].toStringRef();
      if (args.size() > 1 && args[1].isInt()) s += ":" + std::to_string(args[1].toInt());
      return c10::Device(s);
    }
    if (f == "torch._utils._rebuild_parameter" || f == "torch._utils._rebuild_parameter_with_state") {
      check(args.size() >= 2 && args[0].isTensor() && args[1].isBool(), "calls ", f, " with other arguments");
      auto t = args[0].toTensor();
      if (args[1].toBool()) t.requires_grad_(true);
      return t;
    }
    // _rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks[, metadata]);
    // _rebuild_tensor_v3(..., hooks, dtype[, metadata])
    // and PyTorch 0.3's _rebuild_tensor(storage, offset, size, stride)
    const bool v3 = f == "torch._utils._rebuild_tensor_v3", v1 = f == "torch._utils._rebuild_tensor";
    check(args.size() >= (v1   ? 4u
                          : v3 ? 7u
                               : 6u) &&
              args[0].isTensor() && args[1].isInt() && (args[2].isTuple() || args[2].isList()) &&
              (args[3].isTuple() || args[3].isList()) && (v1 || args[4].isBool()),
          "calls ", f, " with other arguments than torch.save writes");
    const bool requires_grad = !v1 && args[4].toBool();
    const auto ints = [&](const c10::IValue& v, const char* what) {
      std::vector<int64_t> out;
      const std::vector<c10::IValue> elems = v.isTuple() ? v.toTupleRef().elements().vec() : v.toListRef().vec();
      for (const auto& e : elems) {
        check(e.isInt() && e.toInt() >= 0, "gives a tensor a ", what, " that is not a non-negative integer");
        out.push_back(e.toInt());
      }
      return out;
    };
    at::Tensor storage = args[0].toTensor();
    c10::ScalarType dtype = storage.scalar_type();
    if (v3) {
      dtype = scalar_type(args[6], "_rebuild_tensor_v3's dtype");
    }
    const int64_t offset = args[1].toInt();
    const auto size = ints(args[2], "size");
    const auto stride = ints(args[3], "stride");
    check(size.size() == stride.size() && offset >= 0, "gives a tensor ", size.size(), " sizes and ", stride.size(),
          " strides, offset ", offset);
    // The last element the view reaches must lie in its storage: a damaged file fails here, not in memory.
    const int64_t itemsize = static_cast<int64_t>(c10::elementSize(dtype));
    const int64_t available = static_cast<int64_t>(storage.storage().nbytes()) / itemsize;
    bool empty = false, overflow = false;
    int64_t last = offset;
    for (const auto i : c10::irange(size.size())) {
      if (size[i] == 0) empty = true;
      int64_t reach = 0;
      overflow |= __builtin_mul_overflow(size[i] > 0 ? size[i] - 1 : 0, stride[i], &reach);
      overflow |= __builtin_add_overflow(last, reach, &last);
    }
    check(empty || !overflow, "gives a tensor sizes and strides beyond 64-bit indexing");
    check(empty || last < available, "gives a tensor a view past the end of its storage (element ", last, " of ",
          available, ")");
    check(!requires_grad || c10::isFloatingType(dtype) || c10::isComplexType(dtype), "asks for gradients of a ", dtype,
          " tensor");
    at::Tensor t = at::empty({0}, at::TensorOptions().dtype(dtype));
    t.set_(storage.storage(), offset, size, stride);
    if (requires_grad) t.requires_grad_(true);
    return t;
  }

  // torch._tensor._rebuild_from_type_v2(func, new_type, args, state): the tensor func(*args), whose Python
  // attributes (`state`: {"tag": 1}; nn.Buffer's {"_is_buffer": True, "persistent": ...}) Python sets on it and a
  // C++ tensor has no room for: they are dropped. Python's weights_only loader takes torch.Tensor and
  // nn.Parameter as the type; a subclass is refused at its GLOBAL, as Python refuses it.
  c10::IValue rebuild_from_type(const PickleItem& args) {
    const char* f = "torch._tensor._rebuild_from_type_v2";
    const auto& c = args.item_callables;  // only a tuple has them, one per item
    check(c.size() == 4 && c[0].rfind("torch._utils._rebuild_", 0) == 0 && c[2].empty() && c[3].empty(), "calls ", f,
          " with other arguments than torch.save writes");
    check(c[1] == "torch.Tensor" || c[1] == "torch.nn.parameter.Parameter", "calls ", f, " to make a ",
          c[1].empty() ? std::string("value that is not a class") : c[1], ", not a torch.Tensor or nn.Parameter");
    const auto& e = args.value.toTupleRef().elements();
    check(e[2].isTuple(), "calls ", f, " without an argument tuple for ", c[0]);
    c10::IValue t = call(PickleItem{{}, c[0], {}}, e[2].toTupleRef().elements().vec());
    check(t.isTensor(), "calls ", f, " on ", c[0], ", which does not make a tensor");
    return t;
  }

  c10::ScalarType scalar_type(const c10::IValue& v, const char* what) const {
    check(v.isInt() && v.toInt() >= 0 && v.toInt() < static_cast<int64_t>(c10::ScalarType::NumOptions), "has ", what,
          " that is not a dtype");
    return static_cast<c10::ScalarType>(v.toInt());
  }

  // BINPERSID ('storage', storage class or dtype, key, location, numel): the record data/<key>, read once.
  // The old format adds a view of the storage (None since PyTorch 0.4) and has no records: its storages
  // are made empty here and filled from the file's end (fill_storages).
  c10::IValue storage(const c10::IValue& id) {
    if (archive_ == nullptr) return legacy_storage(id);
    check(id.isTuple() && id.toTupleRef().elements().size() == 5, "has a persistent id torch.save does not write");
    const std::vector<c10::IValue> e = id.toTupleRef().elements().vec();
    check(e[0].isString() && e[0].toStringRef() == "storage" && e[1].isInt() && e[2].isString() && e[4].isInt(),
          "has a persistent id torch.save does not write");
    const auto dtype = scalar_type(e[1], "a storage's class");
    const std::string& key = e[2].toStringRef();
    auto it = storages_.find(key);
    if (it == storages_.end()) {
      const std::string record = "data/" + key;
      check(archive_->hasRecord(record), "names a storage ", record, " that the archive does not hold");
      auto [ptr, nbytes] = archive_->getRecord(record);
      const size_t itemsize = c10::elementSize(dtype);
      check(e[4].toInt() >= 0 && static_cast<size_t>(e[4].toInt()) <= nbytes &&
                nbytes == static_cast<size_t>(e[4].toInt()) * itemsize,
            "says storage ", key, " holds ", e[4].toInt(), " elements of ", dtype, ", but its record has ", nbytes,
            " bytes");
      c10::Storage s(c10::Storage::use_byte_size_t(), nbytes, std::move(ptr), /*allocator=*/nullptr,
                     /*resizable=*/false);
      at::Tensor t = at::empty({0}, at::TensorOptions().dtype(dtype));
      t.set_(s, 0, {static_cast<int64_t>(nbytes / itemsize)}, {1});
      it = storages_.emplace(key, t).first;
    }
    return it->second;
  }

  c10::IValue legacy_storage(const c10::IValue& id) {
    check(id.isTuple() && id.toTupleRef().elements().size() == 6, "has a persistent id torch.save does not write");
    const std::vector<c10::IValue> e = id.toTupleRef().elements().vec();
    check(e[0].isString() && e[0].toStringRef() == "storage" && e[1].isInt() && e[2].isString() && e[4].isInt(),
          "has a persistent id torch.save does not write");
    check(e[5].isNone(), "holds a view of a storage (a file of PyTorch before 0.4), which perf::load does not read");
    const auto dtype = scalar_type(e[1], "a storage's class");
    const std::string& key = e[2].toStringRef();
    const int64_t numel = e[4].toInt();
    auto it = storages_.find(key);
    if (it == storages_.end()) {
      // The bytes must follow in the file: a count larger than the file is damage, not an allocation to try.
      check(numel >= 0 && static_cast<uint64_t>(numel) <= data_->size() / c10::elementSize(dtype), "says storage ", key,
            " holds ", numel, " elements of ", dtype, ", more than the file has");
      it = storages_.emplace(key, at::empty({numel}, at::TensorOptions().dtype(dtype))).first;
    }
    check(it->second.scalar_type() == dtype && it->second.numel() == numel, "gives storage ", key,
          " two dtypes or sizes");
    return it->second;
  }

  caffe2::serialize::PyTorchStreamReader* archive_ = nullptr;
  std::string path_;
  const std::string* data_ = nullptr;
  size_t pos_ = 0;
  std::vector<PickleItem> stack_, memo_;
  std::vector<size_t> marks_;
  std::unordered_map<std::string, at::Tensor> storages_;
};

PERF_INLINE void state_dict_into(torch::nn::Module& module, const std::string& prefix,
                                 c10::Dict<std::string, at::Tensor>& out) {
  for (const auto& p : module.named_parameters(/*recurse=*/false)) {
    if (p.value().defined()) out.insert_or_assign(prefix + p.key(), p.value().detach());
  }
  for (const auto& b : module.named_buffers(/*recurse=*/false)) {
    if (b.value().defined()) out.insert_or_assign(prefix + b.key(), b.value().detach());
  }
  for (const auto& c : module.named_children()) state_dict_into(*c.value(), prefix + c.key() + ".", out);
}

PERF_INLINE std::string quoted_list(const std::vector<std::string>& names) {
  std::string s;
  for (const auto& n : names) s += (s.empty() ? "\"" : ", \"") + n + "\"";
  return s;
}

// A file of torch.save before PyTorch 1.6 (or _use_new_zipfile_serialization=False): five pickles (a magic
// number, the format's version, the writer's byte order and sizes, the value, its storages' keys), then each
// storage's elements. Python's torch.load still reads it (torchvision's older weights are such files).
PERF_INLINE c10::IValue load_legacy(const std::string& path) {
  std::string data;
  {
    std::ifstream f(path, std::ios::binary);
    data.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
    TORCH_CHECK(!f.bad(), "perf::load: could not read '", path, "'");
  }
  // The magic number 0x1950a86a20f9469cfc6c, pickled (LONG1 of 10 bytes) at any protocol from 2 on.
  static const std::string magic("\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19.", 13);
  size_t pos = 0;
  if (data.size() >= 2 && static_cast<uint8_t>(data[0]) == op::kProto) pos = 2;
  if (data.size() >= pos + 9 && static_cast<uint8_t>(data[pos]) == op::kFrame) pos += 9;
  TORCH_CHECK(data.compare(pos, magic.size(), magic) == 0, "perf::load: '", path,
              "' is not a torch.save file (neither the zip archive torch.save writes since PyTorch 1.6 nor the "
              "format before it)");
  pos += magic.size();
  try {
    PickleReader reader(path);
    const auto version = reader.run(data, pos);
    TORCH_CHECK(version.isInt() && version.toInt() == 1001, "perf::load: ", path, ": the format's version is ", version,
                "; perf reads version 1001 (torch.save from PyTorch 0.4 to 1.5)");
    const auto info = reader.run(data, pos);
    TORCH_CHECK(info.isGenericDict() && info.toGenericDict().contains("little_endian"), "perf::load: ", path,
                ": the writer's system information is not a dict with little_endian");
    TORCH_CHECK(info.toGenericDict().at("little_endian").toBool(), "perf::load: '", path,
                "' was written on a big-endian machine; perf reads little-endian files");
    c10::IValue result = reader.run(data, pos);
    const auto keys = reader.run(data, pos);
    reader.fill_storages(keys, data, pos);
    return result;
  } catch (const c10::Error& e) {
    const std::string what = e.what_without_backtrace();
    TORCH_CHECK(what.rfind("perf::load: ", 0) == 0, "perf::load: ", path, ": ", what);
    throw;
  }
}

// ---- .safetensors (github.com/huggingface/safetensors): an 8-byte little-endian header length, the header (a JSON
// object: "__metadata__" -> {text: text}, and name -> {"dtype", "shape", "data_offsets": [begin, end)} with offsets
// into the data after it), then the data.

// The format's dtype names, as Python's safetensors maps them to torch's; F4 holds two float4 values a byte, and the
// header counts them (torch's float4_e2m1fn_x2 counts bytes), so its last dimension is twice torch's.
PERF_INLINE const std::vector<std::pair<std::string, c10::ScalarType>>& safetensors_dtypes() {
  static const std::vector<std::pair<std::string, c10::ScalarType>> names = {
      {"F64", c10::kDouble},
      {"F32", c10::kFloat},
      {"F16", c10::kHalf},
      {"BF16", c10::kBFloat16},
      {"I64", c10::kLong},
      {"I32", c10::kInt},
      {"I16", c10::kShort},
      {"I8", c10::kChar},
      {"U64", c10::kUInt64},
      {"U32", c10::kUInt32},
      {"U16", c10::kUInt16},
      {"U8", c10::kByte},
      {"BOOL", c10::kBool},
      {"C64", c10::kComplexFloat},
      {"F8_E4M3", c10::kFloat8_e4m3fn},
      {"F8_E4M3FNUZ", c10::kFloat8_e4m3fnuz},
      {"F8_E5M2", c10::kFloat8_e5m2},
      {"F8_E5M2FNUZ", c10::kFloat8_e5m2fnuz},
      {"F8_E8M0", c10::kFloat8_e8m0fnu},
      {"F4", c10::kFloat4_e2m1fn_x2},
  };
  return names;
}

PERF_INLINE std::string safetensors_dtype_list() {
  std::string s;
  for (const auto& d : safetensors_dtypes()) s += (s.empty() ? "" : ", ") + d.first;
  return s;
}

// A JSON value: what a header holds. Numbers keep their text (offsets and sizes are read from it exactly).
struct JsonValue {
  enum class Kind { Null, Bool, Number, String, Array, Object } kind = Kind::Null;
  std::string text;               // a string's value (UTF-8), a number's text, "true"/"false"
  std::vector<JsonValue> items;   // an array's, or an object's values
  std::vector<std::string> keys;  // an object's, in the header's order
};

// RFC 8259 JSON, strict (no comments, no trailing commas), nested at most 64 deep: a header is data from a file.
// `what` names the text in errors, `at` is its first byte's offset in the file.
class JsonParser {
 public:
  JsonParser(const std::string& text, std::string who, std::string what = "its header", size_t at = 8)
      : s_(text), who_(std::move(who)), what_(std::move(what)), at_(at) {}
  JsonValue document() {
    space();
    JsonValue v = value(0);
    space();
    if (i_ != s_.size()) fail("text after the JSON value");
    return v;
  }

 private:
  [[noreturn]] void fail(const std::string& why) const {
    TORCH_CHECK(false, who_, ": ", what_, " is not valid JSON: ", why, " at byte ", i_ + at_, " of the file");
  }
  void space() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\t' || s_[i_] == '\n' || s_[i_] == '\r')) ++i_;
  }
  bool eat(char c) {
    space();
    if (i_ < s_.size() && s_[i_] == c) return ++i_, true;
    return false;
  }
  void expect(char c) {
    if (!eat(c)) fail(std::string("'") + c + "' expected");
  }
  JsonValue value(int depth) {
    if (depth > 64) fail("nested more than 64 deep");
    space();
    if (i_ >= s_.size()) fail("the header ends early");
    JsonValue v;
    const char c = s_[i_];
    if (c == '{') {
      v.kind = JsonValue::Kind::Object;
      ++i_;
      if (eat('}')) return v;
      do {
        space();
        v.keys.push_back(string());
        expect(':');
        v.items.push_back(value(depth + 1));
      } while (eat(','));
      expect('}');
    } else if (c == '[') {
      v.kind = JsonValue::Kind::Array;
      ++i_;
      if (eat(']')) return v;
      do v.items.push_back(value(depth + 1));
      while (eat(','));
      expect(']');
    } else if (c == '"') {
      v.kind = JsonValue::Kind::String;
      v.text = string();
    } else if (c == '-' || (c >= '0' && c <= '9')) {
      v.kind = JsonValue::Kind::Number;
      v.text = number();
    } else {
      for (const char* word : {"true", "false", "null"}) {
        if (s_.compare(i_, std::strlen(word), word) == 0) {
          i_ += std::strlen(word);
          v.kind = word[0] == 'n' ? JsonValue::Kind::Null : JsonValue::Kind::Bool;
          v.text = word;
          return v;
        }
      }
      fail("a value expected");
    }
    return v;
  }
  std::string number() {
    const size_t start = i_;
    const auto digits = [&] {
      const size_t from = i_;
      while (i_ < s_.size() && s_[i_] >= '0' && s_[i_] <= '9') ++i_;
      if (i_ == from) fail("a digit expected");
    };
    if (s_[i_] == '-') ++i_;
    if (i_ < s_.size() && s_[i_] == '0') {
      ++i_;
    } else {
      digits();
    }
    if (i_ < s_.size() && s_[i_] == '.') ++i_, digits();
    if (i_ < s_.size() && (s_[i_] == 'e' || s_[i_] == 'E')) {
      ++i_;
      if (i_ < s_.size() && (s_[i_] == '+' || s_[i_] == '-')) ++i_;
      digits();
    }
    return s_.substr(start, i_ - start);
  }
  unsigned hex4() {
    unsigned u = 0;
    for (int k = 0; k < 4; ++k, ++i_) {
      if (i_ >= s_.size() || !std::isxdigit(static_cast<unsigned char>(s_[i_])))
        fail("a \\u escape needs 4 hex digits");
      const char h = s_[i_];
      u = u * 16 + static_cast<unsigned>(h <= '9' ? h - '0' : (h | 0x20) - 'a' + 10);
    }
    return u;
  }
  std::string string() {
    if (i_ >= s_.size() || s_[i_] != '"') fail("a string expected");
    ++i_;
    std::string out;
    while (true) {
      if (i_ >= s_.size()) fail("a string is not closed");
      const char c = s_[i_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) fail("a control character in a string");
      if (c != '\\') {
        out += c;
        continue;
      }
      if (i_ >= s_.size()) fail("a string is not closed");
      const char e = s_[i_++];
      switch (e) {
        case '"':
        case '\\':
        case '/':
          out += e;
          break;
        case 'b':
          out += '\b';
          break;
        case 'f':
          out += '\f';
          break;
        case 'n':
          out += '\n';
          break;
        case 'r':
          out += '\r';
          break;
        case 't':
          out += '\t';
          break;
        case 'u': {
          unsigned cp = hex4();
          if (cp >= 0xd800 && cp <= 0xdbff) {  // a surrogate pair: one code point
            if (s_.compare(i_, 2, "\\u") != 0) fail("a lone surrogate in a \\u escape");
            i_ += 2;
            const unsigned lo = hex4();
            if (lo < 0xdc00 || lo > 0xdfff) fail("a lone surrogate in a \\u escape");
            cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
          } else if (cp >= 0xdc00 && cp <= 0xdfff) {
            fail("a lone surrogate in a \\u escape");
          }
          if (cp < 0x80) {
            out += static_cast<char>(cp);
          } else if (cp < 0x800) {
            out += static_cast<char>(0xc0 | (cp >> 6));
            out += static_cast<char>(0x80 | (cp & 0x3f));
          } else if (cp < 0x10000) {
            out += static_cast<char>(0xe0 | (cp >> 12));
            out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
            out += static_cast<char>(0x80 | (cp & 0x3f));
          } else {
            out += static_cast<char>(0xf0 | (cp >> 18));
            out += static_cast<char>(0x80 | ((cp >> 12) & 0x3f));
            out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
            out += static_cast<char>(0x80 | (cp & 0x3f));
          }
          break;
        }
        default:
          fail(std::string("an unknown escape \\") + e);
      }
    }
  }

  const std::string& s_;
  std::string who_, what_;
  size_t at_, i_ = 0;
};

PERF_INLINE void json_string(std::string& out, const std::string& s) {
  out += '"';
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (ch == '"' || ch == '\\') {
      out += '\\';
      out += ch;
    } else if (c < 0x20) {
      static const char hex[] = "0123456789abcdef";
      out += "\\u00";
      out += hex[c >> 4];
      out += hex[c & 15];
    } else {
      out += ch;
    }
  }
  out += '"';
}

// The format's own limit on the header (safetensors' MAX_HEADER_SIZE): past it, a damaged or foreign file.
constexpr uint64_t kSafetensorsMaxHeader = 100000000;

// The header's length: the file's first 8 bytes, little-endian.
PERF_INLINE uint64_t safetensors_header_length(const unsigned char* b) {
  uint64_t n = 0;
  for (int k = 7; k >= 0; --k) n = (n << 8) | b[k];
  return n;
}

struct SafetensorsEntry {
  std::string name;
  c10::ScalarType dtype;
  std::vector<int64_t> shape;  // torch's (F4's last dimension halved)
  uint64_t begin, end;         // into the data
};

struct SafetensorsHeader {
  std::vector<SafetensorsEntry> entries;  // in the data's order
  std::map<std::string, std::string> metadata;
  uint64_t data_start = 0;  // 8 + the header's length
};

// The header, checked whole as the format's reader (safetensors' Metadata::validate) checks it.
PERF_INLINE SafetensorsHeader read_safetensors_header(std::ifstream& f, const std::string& who) {
  const auto file_size = static_cast<uint64_t>(f.seekg(0, std::ios::end).tellg());
  f.seekg(0);
  unsigned char len[8] = {};
  f.read(reinterpret_cast<char*>(len), 8);
  TORCH_CHECK(f.gcount() == 8, who, ": the file is shorter than the 8 bytes of a .safetensors header's length");
  const uint64_t n = safetensors_header_length(len);
  TORCH_CHECK(n <= kSafetensorsMaxHeader, who, ": the header's length, ", n, " bytes, is over the format's limit of ",
              kSafetensorsMaxHeader, " (not a .safetensors file, or a damaged one)");
  TORCH_CHECK(8 + n <= file_size, who, ": the header's length, ", n, " bytes, runs past the end of the file (",
              file_size, " bytes): a truncated file");
  std::string text(n, '\0');
  f.read(text.data(), static_cast<std::streamsize>(n));
  TORCH_CHECK(static_cast<uint64_t>(f.gcount()) == n, who, ": could not read the header");
  TORCH_CHECK(!text.empty() && text[0] == '{', who, ": the header does not start with '{' (not a .safetensors file)");
  TORCH_CHECK(python_str(text), who, ": the header is not UTF-8 text");
  const JsonValue doc = JsonParser(text, who).document();
  TORCH_CHECK(doc.kind == JsonValue::Kind::Object, who, ": the header is not a JSON object");

  using Kind = JsonValue::Kind;
  const auto integer = [&](const JsonValue& v, const std::string& what) {
    TORCH_CHECK(
        v.kind == Kind::Number && v.text.find_first_not_of("0123456789") == std::string::npos && v.text.size() <= 19,
        who, ": ", what, " is ", v.kind == Kind::Number ? v.text : "not a number",
        "; a non-negative integer is expected");
    return static_cast<uint64_t>(std::stoull(v.text));
  };
  SafetensorsHeader h;
  h.data_start = 8 + n;
  std::unordered_set<std::string> names;
  for (size_t m = 0; m < doc.keys.size(); ++m) {
    const std::string& name = doc.keys[m];
    const JsonValue& info = doc.items[m];
    TORCH_CHECK(names.insert(name).second, who, ": the header names \"", name, "\" twice");
    if (name == "__metadata__") {
      if (info.kind == Kind::Null) continue;
      TORCH_CHECK(info.kind == Kind::Object, who, ": the header's __metadata__ is not an object of text -> text");
      for (size_t k = 0; k < info.keys.size(); ++k) {
        TORCH_CHECK(info.items[k].kind == Kind::String, who, ": the header's __metadata__ holds \"", info.keys[k],
                    "\" as a value that is not text (the format's metadata is text -> text)");
        h.metadata[info.keys[k]] = info.items[k].text;
      }
      continue;
    }
    TORCH_CHECK(info.kind == Kind::Object, who, ": \"", name, "\" is not an object in the header");
    const JsonValue *dtype = nullptr, *shape = nullptr, *offsets = nullptr;
    for (size_t k = 0; k < info.keys.size(); ++k) {
      if (info.keys[k] == "dtype") dtype = &info.items[k];
      if (info.keys[k] == "shape") shape = &info.items[k];
      if (info.keys[k] == "data_offsets") offsets = &info.items[k];
    }
    TORCH_CHECK(dtype && shape && offsets, who, ": \"", name,
                "\" lacks one of dtype, shape and data_offsets in the header");
    TORCH_CHECK(dtype->kind == Kind::String, who, ": \"", name, "\"'s dtype is not text");
    const auto& table = safetensors_dtypes();
    const auto it = std::find_if(table.begin(), table.end(), [&](const auto& d) { return d.first == dtype->text; });
    TORCH_CHECK(it != table.end(), who, ": \"", name, "\" has dtype ", dtype->text,
                ", which perf does not read; it reads ", safetensors_dtype_list());
    TORCH_CHECK(shape->kind == Kind::Array && offsets->kind == Kind::Array && offsets->items.size() == 2, who, ": \"",
                name, "\"'s shape is not a list, or its data_offsets not a [begin, end] pair");
    SafetensorsEntry e{name,
                       it->second,
                       {},
                       integer(offsets->items[0], "\"" + name + "\"'s data_offsets[0]"),
                       integer(offsets->items[1], "\"" + name + "\"'s data_offsets[1]")};
    // Counted in bits: F4 is half a byte; every product is checked against 2^63 before it is formed.
    uint64_t bits = it->second == c10::kFloat4_e2m1fn_x2 ? 4 : 8 * c10::elementSize(it->second);
    for (const auto& d : shape->items) {
      const uint64_t size = integer(d, "a dimension of \"" + name + "\"");
      TORCH_CHECK(size <= static_cast<uint64_t>(INT64_MAX) && (size == 0 || bits <= (uint64_t{1} << 63) / size), who,
                  ": \"", name, "\"'s shape is too large for its dtype");
      bits *= size;
      e.shape.push_back(static_cast<int64_t>(size));
    }
    TORCH_CHECK(bits % 8 == 0, who, ": \"", name, "\" holds an odd number of F4 values, not whole bytes");
    if (it->second == c10::kFloat4_e2m1fn_x2) {
      TORCH_CHECK(!e.shape.empty() && e.shape.back() % 2 == 0, who, ": \"", name,
                  "\" is F4 with an odd last dimension (or none): torch packs two F4 values a byte along it");
      e.shape.back() /= 2;
    }
    TORCH_CHECK(e.begin <= e.end && e.end - e.begin == bits / 8, who, ": \"", name, "\" has data_offsets [", e.begin,
                ", ", e.end, "], but its dtype and shape take ", bits / 8, " bytes");
    h.entries.push_back(std::move(e));
  }
  std::stable_sort(h.entries.begin(), h.entries.end(),
                   [](const auto& a, const auto& b) { return std::tie(a.begin, a.end) < std::tie(b.begin, b.end); });
  uint64_t at = 0;
  for (const auto& e : h.entries) {
    TORCH_CHECK(e.begin == at, who, ": \"", e.name, "\" starts at byte ", e.begin, " of the data, where ",
                e.begin < at ? "an earlier tensor's bytes are (they overlap)" : "a gap follows the tensor before it",
                "; the format's tensors lie end to end from byte 0");
    at = e.end;
  }
  TORCH_CHECK(at == file_size - h.data_start, who, ": the tensors take ", at, " bytes of data and the file holds ",
              file_size - h.data_start, " after its header (",
              at < file_size - h.data_start ? "bytes left over" : "a truncated file", ")");
  return h;
}

// One .safetensors file mapped into memory, private and writable (copy-on-write: a write never reaches the file), as
// Python's safetensors maps it. Tensors on the CPU point into it and hold it alive.
struct SafetensorsMapping {
  SafetensorsHeader header;
  char* base = nullptr;
  size_t size = 0;
  SafetensorsMapping() = default;
  SafetensorsMapping(const SafetensorsMapping&) = delete;
  SafetensorsMapping& operator=(const SafetensorsMapping&) = delete;
  ~SafetensorsMapping() {
    if (base) ::munmap(base, size);
  }
};

PERF_INLINE std::shared_ptr<SafetensorsMapping> map_safetensors(const std::string& path, const std::string& who) {
  TORCH_CHECK(std::filesystem::is_regular_file(path), who, ": not a file");
  auto m = std::make_shared<SafetensorsMapping>();
  {
    std::ifstream f(path, std::ios::binary);
    TORCH_CHECK(f, who, ": could not open the file");
    m->header = read_safetensors_header(f, who);
  }
  const uint64_t expected = m->header.data_start + (m->header.entries.empty() ? 0 : m->header.entries.back().end);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TORCH_CHECK(fd >= 0, who, ": could not open the file: ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_size) != expected) {
    ::close(fd);
    TORCH_CHECK(false, who, ": the file changed while it was opened (", expected, " bytes by its header, ", st.st_size,
                " now)");
  }
  void* p = ::mmap(nullptr, expected, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
  const int err = errno;
  ::close(fd);
  TORCH_CHECK(p != MAP_FAILED, who, ": could not map the file into memory: ", std::strerror(err));
  m->base = static_cast<char*>(p);
  m->size = expected;
  return m;
}

// A tensor over its bytes in the mapping (a copy where they do not start aligned to its element size).
PERF_INLINE at::Tensor mapped_tensor(const std::shared_ptr<SafetensorsMapping>& m, const SafetensorsEntry& e) {
  const auto options = at::TensorOptions().dtype(e.dtype);
  const uint64_t nbytes = e.end - e.begin;
  if (nbytes == 0) return at::empty(e.shape, options);
  char* bytes = m->base + m->header.data_start + e.begin;
  if (reinterpret_cast<uintptr_t>(bytes) % c10::elementSize(e.dtype) != 0) {
    at::Tensor t = at::empty(e.shape, options);
    std::memcpy(t.data_ptr(), bytes, nbytes);
    return t;
  }
  return at::from_blob(
      bytes, e.shape, [keep = m](void*) {}, options);
}

// transformers' sharded checkpoint: an index (model.safetensors.index.json: {"metadata": {...}, "weight_map": {name:
// shard file}}) beside the shards it names.
struct SafetensorsIndex {
  std::vector<std::string> shards;                        // in the order the map first names them
  std::unordered_map<std::string, std::string> shard_of;  // name -> shard file
  std::vector<std::string> names;                         // the map's, in its order
  std::map<std::string, std::string> metadata;            // text and numbers, as text
};

PERF_INLINE SafetensorsIndex read_safetensors_index(const std::string& path, const std::string& who) {
  TORCH_CHECK(std::filesystem::is_regular_file(path), who, ": not a file");
  std::string text;
  {
    std::ifstream f(path, std::ios::binary);
    TORCH_CHECK(f, who, ": could not open the file");
    text.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  }
  TORCH_CHECK(python_str(text), who, ": the index is not UTF-8 text");
  const JsonValue doc = JsonParser(text, who, "the index", 0).document();
  const JsonValue *map = nullptr, *metadata = nullptr;
  for (size_t k = 0; doc.kind == JsonValue::Kind::Object && k < doc.keys.size(); ++k) {
    if (doc.keys[k] == "weight_map") map = &doc.items[k];
    if (doc.keys[k] == "metadata") metadata = &doc.items[k];
  }
  TORCH_CHECK(map && map->kind == JsonValue::Kind::Object, who,
              ": the index has no \"weight_map\" object of name -> shard file (transformers' "
              "model.safetensors.index.json)");
  SafetensorsIndex index;
  for (size_t k = 0; k < map->keys.size(); ++k) {
    TORCH_CHECK(map->items[k].kind == JsonValue::Kind::String, who, ": the weight_map gives \"", map->keys[k],
                "\" a shard that is not a file name");
    const std::string& shard = map->items[k].text;
    if (std::find(index.shards.begin(), index.shards.end(), shard) == index.shards.end()) index.shards.push_back(shard);
    index.shard_of[map->keys[k]] = shard;
    index.names.push_back(map->keys[k]);
  }
  for (size_t k = 0; metadata && metadata->kind == JsonValue::Kind::Object && k < metadata->keys.size(); ++k) {
    const auto kind = metadata->items[k].kind;
    if (kind == JsonValue::Kind::String || kind == JsonValue::Kind::Number) {
      index.metadata[metadata->keys[k]] = metadata->items[k].text;
    }
  }
  return index;
}

struct SafetensorsFileState {
  std::string path;
  c10::Device device = c10::kCPU;
  std::vector<std::shared_ptr<SafetensorsMapping>> files;            // one, or an index's shards
  std::unordered_map<std::string, std::pair<size_t, size_t>> where;  // name -> (file, entry)
  std::map<std::string, std::string> metadata;
};

// Opens `path` (a .safetensors file, or a .json index of shards), checks every header (and the index against its
// shards) and maps the files: nothing of the data is read.
PERF_INLINE std::shared_ptr<SafetensorsFileState> open_safetensors(const std::string& path, c10::Device device,
                                                                   const std::string& reader) {
  const std::string who = reader + ": " + path;
  auto state = std::make_shared<SafetensorsFileState>();
  state->path = path;
  state->device = device;
  const bool is_index = path.size() >= 5 && path.compare(path.size() - 5, 5, ".json") == 0;
  if (!is_index) {
    state->files.push_back(map_safetensors(path, who));
    state->metadata = state->files[0]->header.metadata;
  } else {
    const SafetensorsIndex index = read_safetensors_index(path, who);
    const std::filesystem::path dir = std::filesystem::path(path).parent_path();
    for (const auto& shard : index.shards) {
      const std::string file = (dir / shard).string();
      state->files.push_back(map_safetensors(file, reader + ": " + file));
      std::unordered_set<std::string> held;
      for (const auto& e : state->files.back()->header.entries) {
        const auto it = index.shard_of.find(e.name);
        TORCH_CHECK(it != index.shard_of.end() && it->second == shard, who, ": shard ", shard, " holds \"", e.name,
                    "\", which the index ",
                    it == index.shard_of.end() ? "does not name" : "puts in shard " + it->second);
        held.insert(e.name);
      }
      for (const auto& name : index.names) {
        TORCH_CHECK(index.shard_of.at(name) != shard || held.count(name), who, ": the index puts \"", name,
                    "\" in shard ", shard, ", which does not hold it");
      }
    }
    state->metadata = index.metadata;
  }
  for (size_t f = 0; f < state->files.size(); ++f) {
    const auto& entries = state->files[f]->header.entries;
    for (size_t e = 0; e < entries.size(); ++e) state->where.emplace(entries[e].name, std::make_pair(f, e));
  }
  if (!device.is_cpu()) {  // a device this process lacks is refused before anything is read
    try {
      at::empty({0}, at::TensorOptions().device(device));
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, who, ": cannot put tensors on ", device, ": ", e.what_without_backtrace());
    }
  }
  return state;
}

// `name`'s file and header entry, or an error naming what the file holds.
PERF_INLINE std::pair<const std::shared_ptr<SafetensorsMapping>*, const SafetensorsEntry*> safetensors_find(
    const SafetensorsFileState& state, const std::string& name, const char* method) {
  const auto it = state.where.find(name);
  if (it == state.where.end()) {
    std::vector<std::string> names;
    for (const auto& kv : state.where) names.push_back(kv.first);
    std::sort(names.begin(), names.end());
    std::string some;
    for (size_t k = 0; k < names.size() && k < 5; ++k) some += (k ? ", \"" : "\"") + names[k] + "\"";
    TORCH_CHECK(false, "perf::SafetensorsFile::", method, ": ", state.path, " holds no tensor \"", name,
                "\" (it holds ", names.size(), names.empty() ? "" : ": ", some, names.size() > 5 ? ", ..." : "", ")");
  }
  const auto& file = state.files[it->second.first];
  return {&file, &file->header.entries[it->second.second]};
}

// Every tensor, in the files' order, on `state.device`.
PERF_INLINE std::vector<std::pair<std::string, at::Tensor>> safetensors_tensors(const SafetensorsFileState& state) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  out.reserve(state.where.size());
  for (const auto& file : state.files) {
    for (const auto& e : file->header.entries) {
      at::Tensor t = mapped_tensor(file, e);
      out.emplace_back(e.name, state.device.is_cpu() ? std::move(t) : t.to(state.device));
    }
  }
  return out;
}

// What perf::load takes for a .safetensors file: its 8 first bytes a header length that fits the file, and the
// header an object. A torch.save file starts with "PK" (a zip) or pickle's 0x80 0x02.
PERF_INLINE bool looks_like_safetensors(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  unsigned char b[9] = {};
  f.read(reinterpret_cast<char*>(b), 9);
  if (f.gcount() != 9 || b[8] != '{') return false;
  const uint64_t n = safetensors_header_length(b);
  std::error_code ec;
  const auto size = std::filesystem::file_size(path, ec);
  return !ec && n <= kSafetensorsMaxHeader && 8 + n <= size;
}

// What save_safetensors writes, each tensor with its dtype's name in the format; everything the format cannot hold
// is refused here, before a file is opened.
struct SafetensorsItem {
  std::string name;
  at::Tensor t;
  std::string dtype;
};

PERF_INLINE std::vector<SafetensorsItem> safetensors_items(const c10::IValue& tensors,
                                                           const std::map<std::string, std::string>& metadata,
                                                           const std::string& who) {
  TORCH_CHECK(tensors.isGenericDict(), who, ": the tensors are a ", tensors.tagKind(),
              ", not a dict of name -> tensor (perf::state_dict, or perf::load_safetensors)");
  std::vector<SafetensorsItem> items;
  for (const auto& kv : tensors.toGenericDict()) {
    TORCH_CHECK(kv.key().isString(), who, ": a key is not a string: ", kv.key());
    const std::string& name = kv.key().toStringRef();
    TORCH_CHECK(name != "__metadata__", who, ": \"__metadata__\" is the header's metadata, not a tensor's name");
    TORCH_CHECK(python_str(name), who, ": the name \"", name, "\" is not UTF-8 text (the header is JSON)");
    TORCH_CHECK(kv.value().isTensor() && kv.value().toTensor().defined(), who, ": \"", name, "\" is a ",
                kv.value().tagKind(), ", not a tensor");
    const at::Tensor& t = kv.value().toTensor();
    TORCH_CHECK(t.layout() == c10::kStrided && !t.is_quantized(), who, ": \"", name, "\" is a ", t.layout(),
                t.is_quantized() ? " quantized" : "", " tensor; the format holds dense ones (.to_dense() it first)");
    const auto& table = safetensors_dtypes();
    const auto it =
        std::find_if(table.begin(), table.end(), [&](const auto& d) { return d.second == t.scalar_type(); });
    TORCH_CHECK(it != table.end(), who, ": \"", name, "\" is ", t.scalar_type(),
                ", which the format has no name for; it holds ", safetensors_dtype_list());
    TORCH_CHECK(it->first != "F4" || t.dim() > 0, who, ": \"", name,
                "\" is a 0-dim float4_e2m1fn_x2; the format counts F4 values along the last dimension");
    items.push_back({name, t, it->first});
  }
  for (const auto& [k, v] : metadata) {
    TORCH_CHECK(python_str(k) && python_str(v), who, ": the metadata \"", k,
                "\" is not UTF-8 text (the header is JSON)");
  }
  return items;
}

// Writes a file beside `path`, then renames it over `path`: an earlier file there survives a failed write.
template <class Write>
void write_then_rename(const std::string& path, const std::string& who, Write&& write) {
  namespace fs = std::filesystem;
  const fs::path target(path);
  TORCH_CHECK(!target.filename().empty(), who, ": '", path, "' names no file");
  const fs::path dir = target.parent_path().empty() ? fs::path(".") : target.parent_path();
  TORCH_CHECK(fs::is_directory(dir), who, ": the directory of '", path, "' does not exist");
  const fs::path tmp = dir / (target.filename().string() + ".perf-tmp");
  try {
    write(tmp.string());
  } catch (...) {
    std::error_code ec;
    fs::remove(tmp, ec);
    throw;
  }
  std::error_code ec;
  fs::rename(tmp, target, ec);
  TORCH_CHECK(!ec, who, ": could not move the written file over '", path, "': ", ec.message());
}

}  // namespace detail

PERF_INLINE c10::Dict<std::string, at::Tensor> state_dict(ModuleRef module) {
  c10::Dict<std::string, at::Tensor> out;
  detail::state_dict_into(*module, "", out);
  return out;
}

PERF_INLINE std::ostream& operator<<(std::ostream& os, const IncompatibleKeys& keys) {
  return os << "missing keys: [" << detail::quoted_list(keys.missing_keys) << "], unexpected keys: ["
            << detail::quoted_list(keys.unexpected_keys) << "]";
}

PERF_INLINE IncompatibleKeys load_state_dict(ModuleRef module, const c10::IValue& state, bool strict) {
  const std::string who = "perf::load_state_dict(" + module->name() + ")";
  TORCH_CHECK(state.isGenericDict(), who, ": the state is a ", state.tagKind(),
              ", not a dict of name -> tensor (perf::load of a saved state_dict, or perf::state_dict)");
  const auto dict = state.toGenericDict();
  const auto own = state_dict(module);
  IncompatibleKeys keys;
  std::vector<std::string> errors;
  std::vector<std::pair<at::Tensor, at::Tensor>> copies;  // (module's tensor, state's tensor)
  std::unordered_set<std::string> seen;
  for (const auto& kv : dict) {
    TORCH_CHECK(kv.key().isString(), who, ": the state has a key that is not a string: ", kv.key());
    const std::string& name = kv.key().toStringRef();
    seen.insert(name);
    auto it = own.find(name);
    if (it == own.end()) {
      keys.unexpected_keys.push_back(name);
      continue;
    }
    if (!kv.value().isTensor() || !kv.value().toTensor().defined()) {
      errors.push_back("\"" + name + "\" is a " + kv.value().tagKind() + " in the state, not a tensor");
      continue;
    }
    const at::Tensor& src = kv.value().toTensor();
    const at::Tensor& dst = it->value();
    if (!src.sizes().equals(dst.sizes())) {
      errors.push_back(c10::str("size mismatch for ", name, ": copying a param with shape ", src.sizes(),
                                " from checkpoint, the shape in current model is ", dst.sizes()));
      continue;
    }
    if (src.is_complex() != dst.is_complex()) {
      errors.push_back("\"" + name + "\" is " + c10::toString(src.scalar_type()) + " in the state and " +
                       c10::toString(dst.scalar_type()) + " in the module");
      continue;
    }
    copies.emplace_back(dst, src);
  }
  for (const auto& kv : own) {
    if (!seen.count(kv.key())) keys.missing_keys.push_back(kv.key());
  }
  if (strict && !keys.unexpected_keys.empty()) {
    errors.insert(errors.begin(), "Unexpected key(s) in state_dict: " + detail::quoted_list(keys.unexpected_keys));
  }
  if (strict && !keys.missing_keys.empty()) {
    errors.insert(errors.begin(), "Missing key(s) in state_dict: " + detail::quoted_list(keys.missing_keys));
  }
  if (!errors.empty()) {
    std::string msg = who + ": error(s) in loading the state, nothing loaded:";
    for (const auto& e : errors) msg += "\n\t" + e;
    if (strict && (!keys.missing_keys.empty() || !keys.unexpected_keys.empty())) {
      msg += "\n(strict=false loads the names both have and returns the others)";
    }
    TORCH_CHECK(false, msg);
  }
  torch::NoGradGuard no_grad;
  for (auto& c : copies) c.first.copy_(c.second);
  return keys;
}

PERF_INLINE c10::impl::GenericDict dict() { return c10::impl::GenericDict(c10::AnyType::get(), c10::AnyType::get()); }

PERF_INLINE void save(const c10::IValue& value, const std::string& path) {
  detail::PickleWriter w;
  w.bytes.push_back(static_cast<char>(detail::op::kProto));
  w.bytes.push_back(2);
  w.value(value, "");
  w.bytes.push_back(static_cast<char>(detail::op::kStop));
  // Python names the archive's folder after the file; written beside it under another name, then renamed.
  detail::write_then_rename(path, "perf::save", [&](const std::string& tmp) {
    caffe2::serialize::PyTorchStreamWriter writer(tmp);
    writer.writeRecord("data.pkl", w.bytes.data(), w.bytes.size());
    writer.writeRecord("byteorder", "little", 6);  // no .format_version: Python then reads offsets from the zip
    for (const auto& [key, t] : w.storages) {
      const auto nbytes = static_cast<int64_t>(t.storage().nbytes());
      at::Tensor bytes = at::empty({0}, t.options().dtype(c10::kByte));
      bytes.set_(t.storage(), 0, {nbytes}, {1});
      bytes = bytes.cpu();
      writer.writeRecord("data/" + key, bytes.data_ptr(), static_cast<size_t>(nbytes));
    }
    writer.writeEndOfFile();
  });
}

PERF_INLINE c10::IValue load(const std::string& path) {
  TORCH_CHECK(std::filesystem::is_regular_file(path), "perf::load: '", path, "' is not a file");
  {
    std::ifstream f(path, std::ios::binary);
    char magic[4] = {};
    f.read(magic, sizeof magic);
    if (std::string(magic, static_cast<size_t>(f.gcount())) != std::string("PK\x03\x04", 4)) {
      if (!detail::looks_like_safetensors(path)) return detail::load_legacy(path);
      c10::impl::GenericDict out(c10::StringType::get(), c10::TensorType::get());
      const auto state = detail::open_safetensors(path, c10::kCPU, "perf::load");
      for (auto& [name, t] : detail::safetensors_tensors(*state)) out.insert(name, t);
      return out;
    }
  }
  std::unique_ptr<caffe2::serialize::PyTorchStreamReader> archive;
  try {
    archive = std::make_unique<caffe2::serialize::PyTorchStreamReader>(path);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "perf::load: '", path, "' is a damaged zip archive: ", e.what_without_backtrace());
  }
  TORCH_CHECK(archive->hasRecord("data.pkl"), "perf::load: '", path,
              "' holds no data.pkl: not a torch.save file (a TorchScript module or torch::save archive is read "
              "by torch::load)");
  if (archive->hasRecord("byteorder")) {
    auto [ptr, n] = archive->getRecord("byteorder");
    const std::string order(static_cast<const char*>(ptr.get()), n);
    TORCH_CHECK(order == "little", "perf::load: '", path, "' was written on a ", order,
                "-endian machine; perf reads little-endian files");
  }
  auto [ptr, n] = archive->getRecord("data.pkl");
  const std::string pickle(static_cast<const char*>(ptr.get()), n);
  try {
    return detail::PickleReader(*archive, path).run(pickle);
  } catch (const c10::Error& e) {
    // LibTorch's own refusals (a dtype it cannot make, a damaged zip record) get the file named too.
    const std::string what = e.what_without_backtrace();
    TORCH_CHECK(what.rfind("perf::load: ", 0) == 0, "perf::load: ", path, ": ", what);
    throw;
  }
}

PERF_INLINE c10::Dict<std::string, at::Tensor> load_safetensors(const std::string& path, c10::Device device) {
  const auto state = detail::open_safetensors(path, device, "perf::load_safetensors");
  c10::Dict<std::string, at::Tensor> out;
  for (auto& [name, t] : detail::safetensors_tensors(*state)) out.insert(name, std::move(t));
  return out;
}

PERF_INLINE std::map<std::string, std::string> safetensors_metadata(const std::string& path) {
  const std::string who = "perf::safetensors_metadata: " + path;
  TORCH_CHECK(std::filesystem::is_regular_file(path), who, ": not a file");
  std::ifstream f(path, std::ios::binary);
  TORCH_CHECK(f, who, ": could not open the file");
  return detail::read_safetensors_header(f, who).metadata;
}

PERF_INLINE void save_safetensors(const c10::IValue& tensors, const std::string& path,
                                  const std::map<std::string, std::string>& metadata) {
  const std::string who = "perf::save_safetensors";
  auto items = detail::safetensors_items(tensors, metadata, who);
  // As Python's writer orders them: the widest elements first (each tensor then starts aligned), then by name.
  std::stable_sort(items.begin(), items.end(), [](const auto& a, const auto& b) {
    const auto wa = a.t.element_size(), wb = b.t.element_size();
    return wa != wb ? wa > wb : a.name < b.name;
  });
  std::string header = "{";
  if (!metadata.empty()) {
    header += "\"__metadata__\":{";
    for (const auto& [k, v] : metadata) {
      if (header.back() != '{') header += ',';
      detail::json_string(header, k);
      header += ':';
      detail::json_string(header, v);
    }
    header += '}';
  }
  uint64_t at = 0;
  for (const auto& item : items) {
    if (header.size() > 1) header += ',';
    detail::json_string(header, item.name);
    header += ":{\"dtype\":\"" + item.dtype + "\",\"shape\":[";
    const auto sizes = item.t.sizes();
    for (size_t d = 0; d < sizes.size(); ++d) {
      // The header counts F4 values, two a byte of torch's float4_e2m1fn_x2.
      const int64_t size = item.dtype == "F4" && d + 1 == sizes.size() ? 2 * sizes[d] : sizes[d];
      if (d) header += ',';
      header += std::to_string(size);  // not `"," + to_string()`: GCC 12's -Wrestrict misfires on it in C++20
    }
    const auto nbytes = static_cast<uint64_t>(item.t.numel() * item.t.element_size());
    header += "],\"data_offsets\":[" + std::to_string(at) + "," + std::to_string(at + nbytes) + "]}";
    at += nbytes;
  }
  header += '}';
  header.append((8 - header.size() % 8) % 8, ' ');  // the data starts 8-byte aligned, as Python's writer pads it
  detail::write_then_rename(path, who, [&](const std::string& tmp) {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    TORCH_CHECK(f, who, ": could not open '", tmp, "' to write");
    char len[8];
    for (int k = 0; k < 8; ++k) len[k] = static_cast<char>((header.size() >> (8 * k)) & 0xff);
    f.write(len, 8);
    f.write(header.data(), static_cast<std::streamsize>(header.size()));
    for (const auto& item : items) {
      // One tensor at a time on the host, as its values: a view, a transpose, a conjugate resolved.
      const at::Tensor host = item.t.detach().resolve_conj().resolve_neg().to(c10::kCPU).contiguous();
      f.write(static_cast<const char*>(host.data_ptr()), static_cast<std::streamsize>(host.nbytes()));
    }
    f.flush();
    TORCH_CHECK(f.good(), who, ": could not write '", tmp, "'");
  });
}

PERF_INLINE std::vector<std::string> save_safetensors_sharded(const c10::IValue& tensors, const std::string& directory,
                                                              int64_t max_shard_bytes,
                                                              const std::map<std::string, std::string>& metadata) {
  const std::string who = "perf::save_safetensors_sharded";
  TORCH_CHECK(max_shard_bytes > 0, who, ": max_shard_bytes is ", max_shard_bytes, "; it must be positive");
  TORCH_CHECK(std::filesystem::is_directory(directory), who, ": '", directory, "' is not a directory");
  detail::safetensors_items(tensors, metadata, who);  // all refused before the first shard is written
  // huggingface_hub's split (split_state_dict_into_shards_factory): in the dict's order, a new shard where the next
  // tensor would pass the limit, a tensor over the limit alone in a shard of its own, each tensor counted by its
  // storage's size, and tensors that share a storage (tied weights, views) in the shard of the first, counted once.
  using Shard = c10::impl::GenericDict;
  const auto new_shard = [] { return Shard(c10::StringType::get(), c10::TensorType::get()); };
  std::vector<Shard> shards;
  Shard current = new_shard();
  int64_t current_bytes = 0, total = 0;
  std::vector<std::pair<const c10::StorageImpl*, std::vector<c10::IValue>>> shared;  // storage -> its tensors' names
  for (const auto& kv : tensors.toGenericDict()) {
    const at::Tensor& t = kv.value().toTensor();  // a tensor: checked above
    const auto* storage = t.storage().unsafeGetStorageImpl();
    auto it = std::find_if(shared.begin(), shared.end(), [&](const auto& s) { return s.first == storage; });
    if (it != shared.end()) {
      it->second.push_back(kv.key());  // placed with the first below
      continue;
    }
    shared.push_back({storage, {kv.key()}});
    const auto bytes = static_cast<int64_t>(t.storage().nbytes());
    total += bytes;
    if (bytes > max_shard_bytes) {
      shards.push_back(new_shard());
      shards.back().insert(kv.key(), kv.value());
      continue;
    }
    if (current_bytes + bytes > max_shard_bytes) {
      shards.push_back(current);
      current = new_shard();
      current_bytes = 0;
    }
    current.insert(kv.key(), kv.value());
    current_bytes += bytes;
  }
  if (!current.empty() || shards.empty()) shards.push_back(current);
  const auto all = tensors.toGenericDict();
  for (const auto& [storage, names] : shared) {
    for (auto& shard : shards) {
      if (!shard.contains(names.front())) continue;
      for (size_t k = 1; k < names.size(); ++k) shard.insert(names[k], all.at(names[k]));
      break;
    }
  }
  auto shard_metadata = metadata;
  shard_metadata.emplace("format", "pt");
  const size_t n = shards.size();
  const auto name = [&](size_t i) {
    if (n == 1) return std::string("model.safetensors");
    char suffix[48];  // room for two 20-digit numbers
    std::snprintf(suffix, sizeof suffix, "-%05zu-of-%05zu", i + 1, n);
    return "model" + std::string(suffix) + ".safetensors";
  };
  const std::filesystem::path dir(directory);
  std::vector<std::string> written;
  std::string map;
  for (size_t i = 0; i < n; ++i) {
    const std::string file = (dir / name(i)).string();
    save_safetensors(shards[i], file, shard_metadata);
    written.push_back(file);
    for (const auto& kv : shards[i]) {
      map += map.empty() ? "\n    " : ",\n    ";
      detail::json_string(map, kv.key().toStringRef());
      map += ": ";
      detail::json_string(map, name(i));
    }
  }
  if (n == 1) return written;
  // The index's metadata: total_size, then the caller's (whose own total_size wins, as huggingface_hub merges them).
  std::string index = "{\n  \"metadata\": {";
  if (!metadata.count("total_size")) index += "\n    \"total_size\": " + std::to_string(total);
  for (const auto& [k, v] : metadata) {
    index += index.back() == '{' ? "\n    " : ",\n    ";
    detail::json_string(index, k);
    index += ": ";
    detail::json_string(index, v);
  }
  index += "\n  },\n  \"weight_map\": {" + map + "\n  }\n}\n";
  const std::string index_path = (dir / "model.safetensors.index.json").string();
  detail::write_then_rename(index_path, who, [&](const std::string& tmp) {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    f << index;
    f.flush();
    TORCH_CHECK(f.good(), who, ": could not write '", tmp, "'");
  });
  written.push_back(index_path);
  return written;
}

PERF_INLINE SafetensorsFile::SafetensorsFile(const std::string& path, c10::Device device)
    : state_(detail::open_safetensors(path, device, "perf::SafetensorsFile")) {}

PERF_INLINE std::vector<std::string> SafetensorsFile::keys() const {
  std::vector<std::string> names = offset_keys();
  std::sort(names.begin(), names.end());
  return names;
}

PERF_INLINE std::vector<std::string> SafetensorsFile::offset_keys() const {
  std::vector<std::string> names;
  names.reserve(state_->where.size());
  for (const auto& file : state_->files) {
    for (const auto& e : file->header.entries) names.push_back(e.name);
  }
  return names;
}

PERF_INLINE bool SafetensorsFile::contains(const std::string& name) const { return state_->where.count(name) > 0; }

PERF_INLINE c10::ScalarType SafetensorsFile::dtype(const std::string& name) const {
  return detail::safetensors_find(*state_, name, "dtype").second->dtype;
}

PERF_INLINE std::vector<int64_t> SafetensorsFile::shape(const std::string& name) const {
  return detail::safetensors_find(*state_, name, "shape").second->shape;
}

PERF_INLINE at::Tensor SafetensorsFile::get_tensor(const std::string& name) const {
  const auto [file, entry] = detail::safetensors_find(*state_, name, "get_tensor");
  at::Tensor t = detail::mapped_tensor(*file, *entry);
  return state_->device.is_cpu() ? t : t.to(state_->device);
}

PERF_INLINE at::Tensor SafetensorsFile::get_slice(const std::string& name,
                                                  at::ArrayRef<at::indexing::TensorIndex> indices) const {
  const auto [file, entry] = detail::safetensors_find(*state_, name, "get_slice");
  at::Tensor slice;
  try {
    slice = detail::mapped_tensor(*file, *entry).index(indices);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "perf::SafetensorsFile::get_slice: \"", name, "\" (shape ", c10::IntArrayRef(entry->shape),
                "): ", e.what_without_backtrace());
  }
  return state_->device.is_cpu() ? slice.contiguous()
                                 : slice.to(state_->device, /*non_blocking=*/false,
                                            /*copy=*/false, c10::MemoryFormat::Contiguous);
}

PERF_INLINE c10::Dict<std::string, at::Tensor> SafetensorsFile::get_tensors() const {
  c10::Dict<std::string, at::Tensor> out;
  for (auto& [name, t] : detail::safetensors_tensors(*state_)) out.insert(name, std::move(t));
  return out;
}

PERF_INLINE const std::map<std::string, std::string>& SafetensorsFile::metadata() const { return state_->metadata; }
PERF_INLINE c10::Device SafetensorsFile::device() const { return state_->device; }
PERF_INLINE const std::string& SafetensorsFile::path() const { return state_->path; }

}  // namespace perf

// The GPU step (device_step.h).
#include "device_step.h"

#include <unistd.h>

#include <chrono>
#include <cstring>
#include <utility>

#include "channel.h"
#include "device_path.h"
#include "kernels_ptx.h"
#include "reduce.h"
#include "wire.h"

namespace smddp {

namespace {

constexpr std::uint32_t kCardMagic = 0x53445043;  // "SDPC"
constexpr std::uint32_t kCardVersion = 2;  // 2: an out_ready flag per slot
// The flags, by their line in the header: out_ready is one per slot (lines 2 and 3), piece q's
// at kOutReady + q % kSlots.
constexpr int kInReady = 0, kDone = 1, kOutReady = 2;
constexpr unsigned kThreads = 256;
constexpr std::uint64_t kMaxBlocks = 4096;

struct Card {
  std::uint32_t magic;
  std::uint32_t version;
  std::uint32_t local_rank;
  std::uint32_t local_size;
  std::int32_t device;
  std::int32_t pid;
  std::uint64_t slot_bytes;
  std::uint32_t slots;
  std::uint32_t reserved;
  cuda::IpcMemHandle handle;
};
static_assert(sizeof(Card) <= DeviceStep::kCardBytes, "a card fits its bytes");

// The fold kernel of each wire dtype (kernels.cu).
const char* kernel_name(std::uint8_t dtype) {
  switch (static_cast<DType>(dtype)) {
    case DType::kUint8: return "smddp_fold_uint8";
    case DType::kInt32: return "smddp_fold_int32";
    case DType::kInt64: return "smddp_fold_int64";
    case DType::kFloat16: return "smddp_fold_float16";
    case DType::kBfloat16: return "smddp_fold_bfloat16";
    case DType::kFloat32: return "smddp_fold_float32";
    case DType::kFloat64: return "smddp_fold_float64";
  }
  return nullptr;
}

std::string num(std::uint64_t v) { return std::to_string(v); }

}  // namespace

// ------------------------------------------------------------------------------------- StepWork

StepWork::StepWork(std::shared_ptr<cuda::Driver> driver, int device, cuda::Event done)
    : driver_(std::move(driver)), device_(device), done_(done) {}

StepWork::~StepWork() { destroy_event(*driver_, device_, done_); }

cuda::Result StepWork::order(std::uintptr_t stream) {
  cuda::Bound bound(*driver_, device_);
  if (bound.result() != cuda::kSuccess) return bound.result();
  return driver_->api().stream_wait_event(cuda::stream_of(stream), done_, 0);
}

cuda::Result StepWork::query() { return driver_->api().event_query(done_); }

cuda::Result StepWork::wait(std::int64_t timeout_ns, std::int64_t spin_ns) {
  return poll_event(*driver_, done_, timeout_ns, spin_ns);
}

// ----------------------------------------------------------------------------------- DeviceStep

std::unique_ptr<DeviceStep> DeviceStep::create(std::shared_ptr<cuda::Driver> driver, int device,
                                               std::uint32_t local_rank, std::uint32_t local_size,
                                               std::uint64_t slot_bytes, std::string* why) {
  if (!driver->step_missing().empty()) {
    *why = "the CUDA driver lacks " + driver->step_missing();
    return nullptr;
  }
  if (local_size < 1 || local_size > kMaxRanks || local_rank >= local_size) {
    *why = "the GPU step takes 1 to " + num(kMaxRanks) + " ranks a node (this node has " + num(local_size) + ")";
    return nullptr;
  }
  if (slot_bytes < 4096 || slot_bytes % 512 != 0) {
    *why = "the GPU step's slots are a multiple of 512 bytes, at least 4096";
    return nullptr;
  }
  std::unique_ptr<DeviceStep> s(new DeviceStep());
  s->driver_ = std::move(driver);
  s->device_ = device;
  s->rank_ = local_rank;
  s->size_ = local_size;
  s->slot_bytes_ = slot_bytes;
  cuda::Driver& d = *s->driver_;
  const cuda::StepApi& step = d.step();
  cuda::Bound bound(d, device);
  const std::string where = "cuda:" + std::to_string(device) + ": ";
  if (bound.result() != cuda::kSuccess) {
    *why = where + d.describe(bound.result(), "cuCtxSetCurrent");
    return nullptr;
  }
  cuda::Result r = step.module_load_data(&s->module_, kKernelsPtx);
  if (r != cuda::kSuccess) {
    s->module_ = nullptr;
    *why = where + "the GPU step's kernels (PTX 9.0, CUDA 13) were refused: " + d.describe(r, "cuModuleLoadData");
    return nullptr;
  }
  for (std::uint8_t code = 0; code < 8; code++) {
    const char* name = kernel_name(code);
    if (name == nullptr) continue;
    r = step.module_get_function(&s->fold_[code], s->module_, name);
    if (r != cuda::kSuccess) {
      *why = where + std::string(name) + ": " + d.describe(r, "cuModuleGetFunction");
      return nullptr;
    }
  }
  const char* call = "cuStreamCreate";
  r = d.api().stream_create(&s->in_lane_, cuda::kStreamNonBlocking);
  if (r == cuda::kSuccess) r = d.api().stream_create(&s->gather_lane_, cuda::kStreamNonBlocking);
  if (r == cuda::kSuccess) r = d.api().stream_create(&s->back_lane_, cuda::kStreamNonBlocking);
  if (r == cuda::kSuccess) {
    call = "cuMemAlloc";
    r = step.mem_alloc(&s->stage_, kHeader + kSlots * slot_bytes);
  }
  if (r != cuda::kSuccess) {
    s->stage_ = 0;
    *why = where + d.describe(r, call);
    return nullptr;
  }
  // The flags start at 0 (no piece): zeroed before the card can be given (the lane synchronised).
  call = "cuMemsetD32Async";
  r = step.memset_d32(s->stage_, 0, kHeader / 4, s->in_lane_);
  if (r == cuda::kSuccess) {
    call = "cuStreamSynchronize";
    r = d.api().stream_synchronize(s->in_lane_);
  }
  if (r != cuda::kSuccess) {
    *why = where + d.describe(r, call);
    return nullptr;
  }
  s->stages_.assign(local_size, 0);
  s->opened_.assign(local_size, false);
  s->stages_[local_rank] = s->stage_;
  return s;
}

DeviceStep::~DeviceStep() { (void)close(0); }

bool DeviceStep::close(std::int64_t timeout_ns) {
  if (closed_) return true;
  cuda::Driver& d = *driver_;
  const cuda::Api& api = d.api();
  cuda::Bound bound(d, device_);
  if (bound.result() != cuda::kSuccess) return false;
  if (in_lane_ != nullptr && gather_lane_ != nullptr && back_lane_ != nullptr) {
    // The last point of each lane, the in lane's after every rank's done has reached this rank's
    // last piece (so no peer still reads its slots); polled, never synchronised on (a lane whose
    // peer is gone never ends).
    cuda::Result r = cuda::kSuccess;
    const std::uint64_t last = next_piece_ - 1;
    for (std::uint32_t j = 0; r == cuda::kSuccess && joined_ && last > 0 && j < size_; j++)
      r = d.step().wait_value32(in_lane_, flag(j, kDone), static_cast<std::uint32_t>(last), cuda::kWaitValueGeq);
    cuda::Event ends[3] = {nullptr, nullptr, nullptr};
    const cuda::Stream lanes[3] = {in_lane_, gather_lane_, back_lane_};
    for (int i = 0; r == cuda::kSuccess && i < 3; i++) {
      r = api.event_create(&ends[i], cuda::kEventDisableTiming);
      if (r == cuda::kSuccess) r = api.event_record(ends[i], lanes[i]);
    }
    const auto t0 = std::chrono::steady_clock::now();
    const auto deadline = t0 + std::chrono::nanoseconds(timeout_ns);
    bool idle = r == cuda::kSuccess;
    for (int i = 0; idle && i < 3; i++) {
      // (reached, or failed: either way nothing more runs there)
      while (api.event_query(ends[i]) == cuda::kNotReady && (idle = std::chrono::steady_clock::now() < deadline))
        stream_pause(t0, 0);
    }
    for (cuda::Event e : ends)
      if (e != nullptr) (void)api.event_destroy(e);
    if (!idle) return false;
  }
  release();
  closed_ = true;
  return true;
}

void DeviceStep::release() {
  cuda::Driver& d = *driver_;
  if (in_lane_ != nullptr) (void)d.api().stream_destroy(in_lane_);
  if (gather_lane_ != nullptr) (void)d.api().stream_destroy(gather_lane_);
  if (back_lane_ != nullptr) (void)d.api().stream_destroy(back_lane_);
  in_lane_ = gather_lane_ = back_lane_ = nullptr;
  for (std::size_t j = 0; j < stages_.size(); j++)
    if (opened_[j]) (void)d.step().ipc_close_mem_handle(stages_[j]);
  opened_.assign(opened_.size(), false);
  if (stage_ != 0) (void)d.step().mem_free(stage_);
  stage_ = 0;
  if (module_ != nullptr) (void)d.step().module_unload(module_);
  module_ = nullptr;
}

std::string DeviceStep::card() const {
  Card c{};
  c.magic = kCardMagic;
  c.version = kCardVersion;
  c.local_rank = rank_;
  c.local_size = size_;
  c.device = device_;
  c.pid = static_cast<std::int32_t>(getpid());
  c.slot_bytes = slot_bytes_;
  c.slots = kSlots;
  {
    cuda::Bound bound(*driver_, device_);
    if (bound.result() != cuda::kSuccess ||
        driver_->step().ipc_get_mem_handle(&c.handle, stage_) != cuda::kSuccess)
      return std::string();  // (join() refuses an empty card, naming it)
  }
  std::string out(kCardBytes, '\0');
  std::memcpy(out.data(), &c, sizeof c);
  return out;
}

bool DeviceStep::join(const std::vector<std::string>& cards, std::string* why) {
  if (joined_) {
    *why = "the GPU step has joined its node already";
    return false;
  }
  if (cards.size() != size_) {
    *why = "the GPU step was given " + num(cards.size()) + " cards for a node of " + num(size_) + " ranks";
    return false;
  }
  cuda::Driver& d = *driver_;
  cuda::Bound bound(d, device_);
  if (bound.result() != cuda::kSuccess) {
    *why = d.describe(bound.result(), "cuCtxSetCurrent");
    return false;
  }
  for (std::uint32_t j = 0; j < size_; j++) {
    Card c{};
    if (cards[j].size() != kCardBytes) {
      *why = "local rank " + num(j) + "'s GPU step card is not one (" + num(cards[j].size()) + " bytes)";
      return false;
    }
    std::memcpy(&c, cards[j].data(), sizeof c);
    if (c.magic != kCardMagic || c.version != kCardVersion || c.local_rank != j || c.local_size != size_ ||
        c.slot_bytes != slot_bytes_ || c.slots != kSlots) {
      *why = "local rank " + num(j) + "'s GPU step card does not match this rank's (another layout, or out of place)";
      return false;
    }
    if (j == rank_) continue;
    if (c.device != device_) {
      int can = 0;
      const cuda::Result r = d.step().can_access_peer(&can, device_, c.device);
      if (r != cuda::kSuccess || can == 0) {
        *why = "cuda:" + std::to_string(device_) + " cannot reach local rank " + num(j) + "'s cuda:" +
               std::to_string(c.device) + " (no peer access)";
        return false;
      }
    }
    cuda::DevicePtr p = 0;
    const cuda::Result r = d.step().ipc_open_mem_handle(&p, c.handle, cuda::kIpcLazyPeerAccess);
    if (r != cuda::kSuccess) {
      *why = "local rank " + num(j) + "'s staging memory (pid " + std::to_string(c.pid) + ", cuda:" +
             std::to_string(c.device) + ") could not be opened: " + d.describe(r, "cuIpcOpenMemHandle");
      return false;
    }
    stages_[j] = p;
    opened_[j] = true;
  }
  joined_ = true;
  return true;
}

cuda::DevicePtr DeviceStep::slot(std::uint32_t rank, std::uint64_t piece) const {
  return stages_[rank] + kHeader + (piece % kSlots) * slot_bytes_;
}

cuda::DevicePtr DeviceStep::flag(std::uint32_t rank, int which) const {
  return stages_[rank] + static_cast<std::uint64_t>(which) * 128;
}

cuda::Result DeviceStep::copy_rows(cuda::DevicePtr dst, std::uint64_t dst_pitch, cuda::DevicePtr src,
                                   std::uint64_t src_pitch, std::uint64_t width, std::uint64_t height,
                                   cuda::Stream lane) const {
  if (width == 0 || height == 0) return cuda::kSuccess;
  const cuda::StepApi& step = driver_->step();
  if (height > 1 && dst_pitch <= cuda::kMaxPitch && src_pitch <= cuda::kMaxPitch) {
    cuda::Memcpy2D c;
    c.src_type = c.dst_type = cuda::kMemoryTypeDevice;
    c.src_device = src;
    c.src_pitch = src_pitch;
    c.dst_device = dst;
    c.dst_pitch = dst_pitch;
    c.width = width;
    c.height = height;
    return step.memcpy_2d(&c, lane);
  }
  cuda::Result r = cuda::kSuccess;
  for (std::uint64_t row = 0; r == cuda::kSuccess && row < height; row++)
    r = step.memcpy_d2d(dst + row * dst_pitch, src + row * src_pitch, width, lane);
  return r;
}

cuda::DevicePtr DeviceStep::out_ready(std::uint32_t rank, std::uint64_t piece) const {
  return flag(rank, kOutReady + static_cast<int>(piece % kSlots));
}

bool DeviceStep::broken(std::string* why) {
  if (failure_.empty()) return false;
  *why = failure_;
  return true;
}

void DeviceStep::fail(std::string why) {
  if (failure_.empty()) failure_ = "the GPU step is broken by an earlier failure: " + why;
}

std::vector<std::uint64_t> DeviceStep::piece_counts(std::uint64_t n, std::size_t itemsize) const {
  std::vector<std::uint64_t> out;
  const std::uint64_t per = itemsize == 0 ? 0 : slot_bytes_ / itemsize;
  if (per == 0) return out;
  for (std::uint64_t start = 0; start < n || (n == 0 && out.empty()); start += per) {
    out.push_back(n - start < per ? n - start : per);
    if (n == 0) break;
  }
  return out;
}

DeviceStep::Call DeviceStep::call_of(Kind kind, cuda::DevicePtr in, cuda::DevicePtr out, std::uint64_t n,
                                     std::uint8_t dtype, std::uint8_t op) {
  static const char* const kWhat[] = {"all-reduce", "reduce-scatter", "all-gather", "broadcast"};
  Call c;
  c.kind = kind;
  c.what = kWhat[static_cast<int>(kind)];
  c.in = in;
  c.out = out;
  c.n = n;
  c.dtype = dtype;
  c.op = op;
  return c;
}

bool DeviceStep::whole_nodes(std::uint32_t world, std::uint32_t rank, const char* what, std::string* why) const {
  if (world != 0 && world % size_ == 0 && rank < world) return true;
  *why = std::string("the GPU step's ") + what + ": rank " + num(rank) + " of a job of " + num(world) +
         " ranks is not one of whole nodes of " + num(size_);
  return false;
}

std::shared_ptr<StepWork> DeviceStep::allreduce(cuda::DevicePtr buf, std::uint64_t n, std::uint8_t dtype,
                                                std::uint8_t op, std::uint64_t divisor, bool after,
                                                std::uintptr_t stream, std::string* why) {
  Call c = call_of(Kind::kAllreduce, buf, buf, n, dtype, op);
  c.divisor = divisor;
  return enqueue(c, after, stream, nullptr, nullptr, why);
}

std::shared_ptr<StepWork> DeviceStep::reduce_scatter(cuda::DevicePtr in, cuda::DevicePtr out, std::uint64_t part,
                                                     std::uint8_t dtype, std::uint8_t op, std::uint64_t divisor,
                                                     bool after, std::uintptr_t stream, std::string* why) {
  Call c = call_of(Kind::kReduceScatter, in, out, part, dtype, op);
  c.divisor = divisor;
  return enqueue(c, after, stream, nullptr, nullptr, why);
}

std::shared_ptr<StepWork> DeviceStep::allgather(cuda::DevicePtr in, cuda::DevicePtr out, std::uint64_t n,
                                                std::uint8_t dtype, bool after, std::uintptr_t stream,
                                                std::string* why) {
  return enqueue(call_of(Kind::kAllgather, in, out, n, dtype, 0), after, stream, nullptr, nullptr, why);
}

std::shared_ptr<StepWork> DeviceStep::broadcast(cuda::DevicePtr buf, std::uint64_t n, std::uint8_t dtype,
                                                std::uint32_t root, bool after, std::uintptr_t stream,
                                                std::string* why) {
  if (root >= size_) {
    *why = "the GPU step's broadcast: root " + num(root) + " is not one of the node's " + num(size_) + " ranks";
    return nullptr;
  }
  Call c = call_of(Kind::kBroadcast, buf, buf, n, dtype, 0);
  c.root = root;
  return enqueue(c, after, stream, nullptr, nullptr, why);
}

std::shared_ptr<StepWork> DeviceStep::allreduce_across(cuda::DevicePtr buf, std::uint64_t n, std::uint8_t dtype,
                                                       std::uint8_t op, bool after, std::uintptr_t stream,
                                                       const Send& send, std::vector<Piece>* pieces,
                                                       std::string* why) {
  return enqueue(call_of(Kind::kAllreduce, buf, buf, n, dtype, op), after, stream, &send, pieces, why);
}

std::shared_ptr<StepWork> DeviceStep::allgather_across(cuda::DevicePtr in, cuda::DevicePtr out, std::uint64_t n,
                                                       std::uint8_t dtype, std::uint32_t world, bool after,
                                                       std::uintptr_t stream, const Send& send,
                                                       std::vector<Piece>* pieces, std::string* why) {
  if (!whole_nodes(world, 0, "all-gather", why)) return nullptr;
  Call c = call_of(Kind::kAllgather, in, out, n, dtype, 0);
  c.rows = world / size_;
  return enqueue(c, after, stream, &send, pieces, why);
}

std::shared_ptr<StepWork> DeviceStep::reduce_scatter_across(cuda::DevicePtr in, cuda::DevicePtr out,
                                                            std::uint64_t part, std::uint8_t dtype, std::uint8_t op,
                                                            std::uint32_t world, std::uint32_t rank, bool after,
                                                            std::uintptr_t stream, const Send& send,
                                                            std::vector<Piece>* pieces, std::string* why) {
  if (!whole_nodes(world, rank, "reduce-scatter", why)) return nullptr;
  Call c = call_of(Kind::kReduceScatter, in, out, part, dtype, op);
  c.rows = world / size_;
  c.rank = rank;
  return enqueue(c, after, stream, &send, pieces, why);
}

std::shared_ptr<StepWork> DeviceStep::broadcast_across(cuda::DevicePtr buf, std::uint64_t n, std::uint8_t dtype,
                                                       bool root, bool after, std::uintptr_t stream,
                                                       const Send& send, std::vector<Piece>* pieces,
                                                       std::string* why) {
  Call c = call_of(Kind::kBroadcast, buf, buf, n, dtype, 0);
  c.is_root = root;
  return enqueue(c, after, stream, &send, pieces, why);
}

std::shared_ptr<StepWork> DeviceStep::enqueue(const Call& c, bool after, std::uintptr_t stream, const Send* send,
                                              std::vector<Piece>* pieces, std::string* why) {
  if (broken(why)) return nullptr;
  if (closed_) {
    *why = "the GPU step is closed";
    return nullptr;
  }
  if (!joined_) {
    *why = "the GPU step has not joined its node";
    return nullptr;
  }
  const bool folds = c.kind == Kind::kAllreduce || c.kind == Kind::kReduceScatter;
  const std::uint8_t dtype = c.dtype, op = c.op;
  const std::size_t isz = dtype_size(dtype);
  if (dtype >= 8 || fold_[dtype] == nullptr || isz == 0) {
    *why = "the GPU step has no kernel for dtype " + num(dtype);
    return nullptr;
  }
  if (folds && (op < static_cast<std::uint8_t>(ReduceOp::kSum) || op > static_cast<std::uint8_t>(ReduceOp::kMax))) {
    *why = "the GPU step has no reduction op " + num(op);
    return nullptr;
  }
  cuda::Driver& d = *driver_;
  const cuda::Api& api = d.api();
  const cuda::StepApi& step = d.step();
  cuda::Bound bound(d, device_);
  if (bound.result() != cuda::kSuccess) {
    *why = d.describe(bound.result(), "cuCtxSetCurrent");
    return nullptr;
  }
  const std::uint32_t g = size_, me = rank_;
  // Both lanes after the caller's work so far (the buffers' producer): an event of our own on its
  // stream, let go of once the waits are enqueued (the driver keeps what they wait for).
  const char* call = "cuEventCreate";
  cuda::Result r = cuda::kSuccess;
  if (after) {
    cuda::Event before = nullptr;
    r = record_new_event(api, cuda::stream_of(stream), &before, &call);
    if (r == cuda::kSuccess) {
      call = "cuStreamWaitEvent";
      r = api.stream_wait_event(in_lane_, before, 0);
      if (r == cuda::kSuccess) r = api.stream_wait_event(gather_lane_, before, 0);
      (void)api.event_destroy(before);
    }
  }
  const bool across = send != nullptr;
  // A reduce-scatter's piece is [a, b) of every block: its slot holds the world's blocks' (so
  // G x rows x m); an all-gather's across nodes, its rows of the piece's result (rows x m).
  const std::uint64_t blocks = c.kind == Kind::kReduceScatter ? std::uint64_t{g} * c.rows : 1;
  const std::size_t unit = c.kind == Kind::kReduceScatter ? isz * blocks : isz * c.rows;
  // Anything enqueued so far is harmless to leave if this fails (no flag written); once a flag is
  // written, a failure leaves the node's flags out of step for good: fail() breaks the step.
  bool wrote = false;
  std::uint64_t start = 0;
  for (const std::uint64_t m : piece_counts(c.n, unit)) {  // (the cut the caller's slots were made for)
    if (r != cuda::kSuccess) break;
    const std::uint64_t q = next_piece_;
    const auto q32 = static_cast<std::uint32_t>(q);
    const std::uint64_t filled = m * blocks;  // the slot's elements
    if (q > kSlots) {
      call = "cuStreamWaitValue32";
      for (std::uint32_t j = 0; r == cuda::kSuccess && j < g; j++)
        r = step.wait_value32(in_lane_, flag(j, kDone), static_cast<std::uint32_t>(q - kSlots), cuda::kWaitValueGeq);
    }
    // This rank's slot: its input's piece (a reduce-scatter's, from each block; a broadcast's, the
    // root's alone); across nodes, a gather's comes back from the host instead.
    const bool fills = c.kind == Kind::kBroadcast ? !across && me == c.root : !across || folds;
    const std::uint64_t lo = filled * me / g, hi = filled * (me + 1) / g;
    // Across nodes, the broadcast's root has its slice already: into its slot from its buffer here,
    // and no way back from the host (its out_ready is the in lane's, below).
    const bool own_slice = across && c.kind == Kind::kBroadcast && c.is_root;
    if (r == cuda::kSuccess && own_slice && hi > lo) {
      call = "cuMemcpyDtoDAsync";
      r = step.memcpy_d2d(slot(me, q) + lo * isz, c.in + (start + lo) * isz, (hi - lo) * isz, in_lane_);
    }
    if (r == cuda::kSuccess && m > 0 && fills) {
      call = "cuMemcpyDtoDAsync";
      if (c.kind == Kind::kReduceScatter) {  // (one 2-D copy: a row of m from each block)
        call = "cuMemcpy2DAsync";
        r = copy_rows(slot(me, q), m * isz, c.in + start * isz, c.n * isz, m * isz, blocks, in_lane_);
      } else {
        r = step.memcpy_d2d(slot(me, q), c.in + start * isz, m * isz, in_lane_);
      }
    }
    if (r == cuda::kSuccess) {
      call = "cuStreamWriteValue32";
      wrote = true;
      r = step.write_value32(in_lane_, flag(me, kInReady), q32, cuda::kWriteValueDefault);
    }
    if (folds) {
      for (std::uint32_t j = 0; r == cuda::kSuccess && j < g; j++) {
        if (j == me) continue;
        call = "cuStreamWaitValue32";
        r = step.wait_value32(in_lane_, flag(j, kInReady), q32, cuda::kWaitValueGeq);
      }
      if (r == cuda::kSuccess && hi > lo) {
        FoldArgs a{};
        a.dst = slot(me, q) + lo * isz;
        a.n = hi - lo;
        for (std::uint32_t j = 0; j < g; j++) a.src[j] = slot(j, q) + lo * isz;
        a.k = g;
        a.op = op;
        a.divisor = op == static_cast<std::uint8_t>(ReduceOp::kAvg) && send == nullptr ? c.divisor : 0;
        const std::uint64_t grid64 = (a.n + kThreads - 1) / kThreads;
        const auto grid = static_cast<unsigned>(grid64 < kMaxBlocks ? grid64 : kMaxBlocks);
        void* params[] = {&a};
        call = "cuLaunchKernel";
        r = step.launch_kernel(fold_[dtype], grid, 1, 1, kThreads, 1, 1, 0, in_lane_, params, nullptr);
      }
    }
    if (r == cuda::kSuccess && !across) {
      call = "cuStreamWriteValue32";
      r = step.write_value32(in_lane_, out_ready(me, q), q32, cuda::kWriteValueDefault);
    } else if (r == cuda::kSuccess) {
      // Across nodes: what this rank sends (its slice of the node's partial; a gather's input piece)
      // goes to the host from here, in lane order; its slice of the result comes back on the back
      // lane, then out_ready (the caller's).
      Piece p;
      p.number = q;
      p.count = m;
      p.out_ready = out_ready(me, q);
      if (c.kind == Kind::kAllgather) {
        p.send = c.in + start * isz;
        p.send_bytes = m * isz;
        p.back = slot(me, q);
        p.back_offset = std::uint64_t{me} * c.rows * m * isz;
        p.back_bytes = std::uint64_t{c.rows} * m * isz;
      } else if (c.kind == Kind::kReduceScatter) {
        p.send = slot(me, q) + lo * isz;  // (the node's partial of blocks [me x rows, (me+1) x rows))
        p.send_bytes = (hi - lo) * isz;
        p.back = c.out + start * isz;  // (its own block's [a, b): straight into place)
        p.back_offset = std::uint64_t{c.rank} * m * isz;
        p.back_bytes = m * isz;
      } else {
        if (c.kind == Kind::kAllreduce) {
          p.send = slot(me, q) + lo * isz;
          p.send_bytes = (hi - lo) * isz;
        } else if (c.is_root) {
          p.send = c.in + start * isz;
          p.send_bytes = m * isz;
        }
        if (!own_slice) {
          p.back = slot(me, q) + lo * isz;
          p.back_offset = lo * isz;
          p.back_bytes = (hi - lo) * isz;
        } else {
          p.out_ready = 0;  // (nothing comes back: the caller delivers nothing and writes no flag)
        }
      }
      std::string w;
      if (!(*send)(p, in_lane_, &w)) {
        *why = "cuda:" + std::to_string(device_) + ": the GPU step's piece " + num(q) + " could not go: " + w;
        fail(*why);
        return nullptr;
      }
      if (pieces != nullptr) pieces->push_back(p);
      if (own_slice) {
        call = "cuStreamWriteValue32";
        r = step.write_value32(in_lane_, out_ready(me, q), q32, cuda::kWriteValueDefault);
      }
    }
    // The gather lane: once the slots it reads are ready, the piece's result into place.
    if (r == cuda::kSuccess) call = "cuStreamWaitValue32";
    switch (c.kind) {
      case Kind::kAllreduce:
        for (std::uint32_t j = 0; r == cuda::kSuccess && j < g; j++)
          r = step.wait_value32(gather_lane_, out_ready(j, q), q32, cuda::kWaitValueGeq);
        for (std::uint32_t j = 0; r == cuda::kSuccess && j < g; j++) {
          const std::uint64_t jlo = m * j / g, jhi = m * (j + 1) / g;
          if (jhi == jlo) continue;
          call = "cuMemcpyDtoDAsync";
          r = step.memcpy_d2d(c.out + (start + jlo) * isz, slot(j, q) + jlo * isz, (jhi - jlo) * isz, gather_lane_);
        }
        break;
      case Kind::kReduceScatter:  // (its own slice: the fold read the others' before out_ready)
        if (r == cuda::kSuccess)
          r = step.wait_value32(gather_lane_, out_ready(me, q), q32, cuda::kWaitValueGeq);
        if (r == cuda::kSuccess && m > 0 && !across) {  // (across nodes its block came back in place)
          call = "cuMemcpyDtoDAsync";
          r = step.memcpy_d2d(c.out + start * isz, slot(me, q) + lo * isz, m * isz, gather_lane_);
        }
        break;
      case Kind::kAllgather:  // (local rank j's slot: rows j x rows ... of the piece's result)
        for (std::uint32_t j = 0; r == cuda::kSuccess && j < g; j++)
          r = step.wait_value32(gather_lane_, out_ready(j, q), q32, cuda::kWaitValueGeq);
        for (std::uint32_t j = 0; r == cuda::kSuccess && j < g && m > 0; j++) {
          call = "cuMemcpy2DAsync";  // (its rows, n apart in the output: one 2-D copy a slot)
          const std::uint64_t row = std::uint64_t{j} * c.rows;
          r = copy_rows(c.out + (row * c.n + start) * isz, c.n * isz, slot(j, q), m * isz, m * isz, c.rows,
                        gather_lane_);
        }
        break;
      case Kind::kBroadcast:
        if (across) {  // (every rank's slice of it came back into its slot; the root has them all)
          for (std::uint32_t j = 0; r == cuda::kSuccess && j < g; j++)
            r = step.wait_value32(gather_lane_, out_ready(j, q), q32, cuda::kWaitValueGeq);
          for (std::uint32_t j = 0; r == cuda::kSuccess && j < g && !c.is_root; j++) {
            const std::uint64_t jlo = m * j / g, jhi = m * (j + 1) / g;
            if (jhi == jlo) continue;
            call = "cuMemcpyDtoDAsync";
            r = step.memcpy_d2d(c.out + (start + jlo) * isz, slot(j, q) + jlo * isz, (jhi - jlo) * isz,
                                gather_lane_);
          }
          break;
        }
        // (the root's own: its copy out of the caller's buffer, so that the end says the buffer is
        // no longer read; the others copy the root's slot)
        if (r == cuda::kSuccess)
          r = step.wait_value32(gather_lane_, out_ready(c.root, q), q32, cuda::kWaitValueGeq);
        if (r == cuda::kSuccess && m > 0 && me != c.root) {
          call = "cuMemcpyDtoDAsync";
          r = step.memcpy_d2d(c.out + start * isz, slot(c.root, q), m * isz, gather_lane_);
        }
        break;
    }
    if (r == cuda::kSuccess) {
      call = "cuStreamWriteValue32";
      r = step.write_value32(gather_lane_, flag(me, kDone), q32, cuda::kWriteValueDefault);
    }
    next_piece_++;
    start += m;
  }
  cuda::Event done = nullptr;
  if (r == cuda::kSuccess) r = record_new_event(api, gather_lane_, &done, &call);
  if (r != cuda::kSuccess) {
    *why = "cuda:" + std::to_string(device_) + ": the GPU step's " + c.what + " could not be enqueued: " + d.describe(r, call);
    if (wrote) fail(*why);
    return nullptr;
  }
  return std::make_shared<StepWork>(driver_, device_, done);
}

}  // namespace smddp

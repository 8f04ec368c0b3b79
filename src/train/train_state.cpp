// A run's state in and out: the weights into their tiers at the start (init or load), a pending
// update applied on its own (flush), the HF save, training checkpoints and their restore.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "kernels/cpu/parallel.h"
#include "io/crc32c.h"
#include "kernels/dtype.h"
#include "src/checkpoint/hf.h"
#include "src/checkpoint/train_checkpoint.h"
#include "src/train/faults.h"
#include "src/train/trainer_impl.h"

namespace strata {
namespace fs = std::filesystem;

namespace {

// Elements of p's whole HF tensor (under tensor parallelism more than this rank's part).
int64_t hf_numel(const ParamInfo& p) {
  int64_t n = 1;
  for (int64_t x : p.full_shape) n *= x;
  return n;
}

// dst (n, dtype) = src (n, fp32), round to nearest even, on the host.
void cast_on_host(const float* src, void* dst, int64_t n, DType dt) {
  if (dt == DType::f32) {
    std::memcpy(dst, src, static_cast<size_t>(n) * 4);
    return;
  }
  auto* d = static_cast<uint16_t*>(dst);
  kernels::cpu::parallel_for(0, n, 1 << 16, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) d[i] = dt == DType::bf16 ? kernels::f32_to_bf16(src[i]) : kernels::f32_to_f16(src[i]);
  });
}

}  // namespace

// Applies a pending optimizer step on its own (the run is over, or a checkpoint or save needs
// the updated weights): an aside of the memory manager, outside the step's program.
void Trainer::Impl::flush() {
  if (!pending) return;
  mem->begin_step(TieredMemory::Schedule::update);
  driver->optimizer(pending->st, pending->apply);
  mem->end_step();
  if (placement.speculate) mem->flip();  // the update wrote the second copies (TieredMemory::flip)
  stream->synchronize();
  opt_stream().synchronize();
  pending.reset();
}

// Every unit's master weights (random init or the checkpoint), its working weights and zeroed
// AdamW state, written unit by unit straight to the tiers they live in. Each block's write home
// starts as soon as it is filled (write_back), so the writes overlap the next units' work; the
// moments of a fresh start are zeroed without writing them (on NVMe: a range the swap file
// records as zeros). Returns once every byte is home.
void Trainer::Impl::init_weights(bool load_weights, bool base_weights) {
  std::unique_ptr<HfCheckpoint> ckpt, optim, base_owned;
  if (!resumed_from.empty()) {
    ckpt = HfCheckpoint::open(resumed_from);
    optim = HfCheckpoint::open_file(resumed_from / "optimizer.safetensors");
  } else if (load_weights) {
    ckpt = HfCheckpoint::open(o.model);
  }
  // LoRA: the frozen base from --model (a resume's checkpoint holds only the adapters), and the
  // adapters of a fresh start from their init (A Kaiming-uniform, B zero), not from --model.
  // --adapter: a fresh start's adapters from a PEFT adapter (its names behind "base_model.model.").
  const HfCheckpoint* base = nullptr;
  const HfCheckpoint* adapters = ckpt.get();
  std::unique_ptr<HfCheckpoint> peft;
  std::string adapter_prefix;
  if (model->lora() && base_weights)
    base = resumed_from.empty() ? ckpt.get() : (base_owned = HfCheckpoint::open(o.model)).get();
  if (model->lora() && resumed_from.empty()) {
    if (!o.adapter.empty()) peft = HfCheckpoint::open_file(fs::path(o.adapter) / "adapter_model.safetensors");
    adapters = peft.get();  // null: their init
    adapter_prefix = "base_model.model.";
  }
  base_crc = 0;
  this->base_weights = base_weights;
  const bool aliased = mem->master_is_weights();
  // Sharded (stage >= 1): each unit is built whole in `full`, and this rank keeps its shard. A
  // frozen unit (LoRA's base) has no master: it is built in `full` and cast to its weights.
  const bool sharded = sh.sharded_optimizer();
  // A frozen unit (LoRA's base, read from --model or a random init) that is not stored
  // otherwise is read and cast in pieces of this many elements, its crc taken on the way (the
  // 8B model's embedding would stage 2 GiB whole); at stage 3 only the pieces' overlap with this
  // rank's shard is kept.
  constexpr int64_t kPiece = int64_t{1} << 24;
  const auto in_pieces = [&](const Unit& unit, int u) {
    return !unit.trainable && !model->stored_unit(u) && !tp().on();
  };
  // A trainable unit (without tensor parallelism) is read or initialised in this rank's range
  // only (init_range draws every element from a counter of its own; load_range reads a range of
  // each tensor): straight into the master block (the whole unit, or this rank's shard), and
  // where the weights block is whole beside a sharded master (stages 1-2) in pieces through
  // `full`. Building each unit whole first made the stage-3 peak a whole embedding above the
  // pools (147 MiB of gpt2's; 2 GiB of llama-8b's), on every rank, at every start and resume.
  const auto ranged = [&](const Unit& unit) { return unit.trainable && !tp().on(); };
  std::vector<float> full;
  if (sharded || model->lora()) {
    int64_t most = 0;
    for (size_t ui = 0; ui < model->units().size(); ++ui) {
      const Unit& unit = model->units()[ui];
      const int u = static_cast<int>(ui);
      if (ranged(unit))
        most = std::max(most, !sharded || aliased || sh.sharded_weights() ? 0 : std::min(kPiece, unit.numel));
      else if (sharded || !unit.trainable)
        most = std::max(most, in_pieces(unit, u) ? kPiece : unit.numel);
    }
    full.resize(static_cast<size_t>(most));
  }
  mem->begin_step(TieredMemory::Schedule::aside);
  if (!optim)  // first, while no write is in flight (TieredMemory::zero)
    for (size_t u = 0; u < model->units().size(); ++u)
      if (model->units()[u].trainable && model->units()[u].held) mem->zero(Role::adam, static_cast<int>(u));
  for (size_t ui = 0; ui < model->units().size(); ++ui) {
    const int u = static_cast<int>(ui);
    const Unit& unit = model->units()[ui];
    if (!unit.held) continue;  // another pipeline stage's
    const int64_t n = sharded ? sh.shard(unit.numel) : unit.numel, lo = sharded ? sh.rank * n : 0;
    if (in_pieces(unit, u)) {
      char* w = static_cast<char*>(mem->acquire(Role::params, u, offload::Mode::write, Side::host));
      const size_t esz = kernels::dtype_size(dtype);
      // The weights block: [lo, lo + n) of the unit (stage 3: this rank's shard), else all of it.
      const int64_t w_lo = sh.sharded_weights() ? lo : 0, w_hi = sh.sharded_weights() ? lo + n : unit.numel;
      for (int64_t at = 0; at < unit.numel; at += kPiece) {
        const int64_t n_piece = std::min(kPiece, unit.numel - at);
        if (base)
          model->load_range(u, *base, at, at + n_piece, full.data());
        else
          model->init_range(u, o.seed, at, at + n_piece, full.data());
        // (the unit's tensors lie back to back from its start: its first n_real values are
        // the whole tensors' in order, as load_unit's per-tensor crc takes them)
        if (at < unit.n_real)
          base_crc = io::crc32c(full.data(), static_cast<size_t>(std::min(n_piece, unit.n_real - at)) * 4, base_crc);
        const int64_t a = std::max(at, w_lo), b = std::min(at + n_piece, w_hi);
        if (b > a) cast_on_host(full.data() + (a - at), w + static_cast<size_t>(a - w_lo) * esz, b - a, dtype);
      }
      mem->release(Role::params, u);
      mem->write_back(Role::params, u);
      continue;
    }
    if (!unit.trainable) {
      // The crc of the whole tensors' values in order (the unit's n_real values, or under tensor
      // parallelism the whole tensors the load reads anyway): the same base's on any grid.
      const auto crc_of = [&](const ParamInfo& p, const float* values) {
        const int64_t numel = hf_numel(p);
        base_crc = io::crc32c(values, static_cast<size_t>(numel) * 4, base_crc);
      };
      if (base) {
        model->load_unit(u, *base, full.data(), "", crc_of);
      } else {
        model->init_unit(u, o.seed, full.data());
        // (a random base under tensor parallelism: its parts gathered to tp rank 0, the crc sent back)
        for (int pi : unit.params) {
          const ParamInfo& p = model->params()[static_cast<size_t>(pi)];
          const std::vector<float> whole = whole_tensor(p, full.data());
          if (!whole.empty()) crc_of(p, whole.data());
        }
        if (tp().on()) tp().comm->host_broadcast(&base_crc, sizeof base_crc, 0);
      }
      void* w = mem->acquire(Role::params, u, offload::Mode::write, Side::host);
      if (model->stored_unit(u))  // --base-dtype: quantized (or cast) as stored
        model->store_unit(u, full.data(), w);
      else if (sh.sharded_weights())
        cast_on_host(full.data() + lo, w, n, dtype);
      else
        cast_on_host(full.data(), w, unit.numel, dtype);
      mem->release(Role::params, u);
      mem->write_back(Role::params, u);
      continue;
    }
    float* master = static_cast<float*>(mem->acquire(Role::master, u, offload::Mode::write, Side::host));
    if (ranged(unit)) {
      // The unit's [a, b) into out, every element written (the padding after the tensors zero).
      const auto fill_range = [&](int64_t a, int64_t b, float* out) {
        if (adapters)
          model->load_range(u, *adapters, a, b, out, adapter_prefix);
        else
          model->init_range(u, o.seed, a, b, out);
      };
      fill_range(lo, lo + n, master);
      if (!aliased) {
        char* w = static_cast<char*>(mem->acquire(Role::params, u, offload::Mode::write, Side::host));
        if (!sharded || sh.sharded_weights()) {  // the weights block is the master's range
          cast_on_host(master, w, n, dtype);
        } else {  // stages 1-2: the whole unit's weights, a piece at a time
          const size_t esz = kernels::dtype_size(dtype);
          for (int64_t at = 0; at < unit.numel; at += kPiece) {
            const int64_t n_piece = std::min(kPiece, unit.numel - at);
            fill_range(at, at + n_piece, full.data());
            cast_on_host(full.data(), w + static_cast<size_t>(at) * esz, n_piece, dtype);
          }
        }
        mem->release(Role::params, u);
        mem->write_back(Role::params, u);
      }
    } else {
      float* src = sharded ? full.data() : master;
      if (adapters)
        model->load_unit(u, *adapters, src, adapter_prefix);
      else
        model->init_unit(u, o.seed, src);
      if (!aliased) {  // stage 3: the weights block is this rank's shard
        void* w = mem->acquire(Role::params, u, offload::Mode::write, Side::host);
        if (sh.sharded_weights())
          cast_on_host(src + lo, w, n, dtype);
        else
          cast_on_host(src, w, unit.numel, dtype);
        mem->release(Role::params, u);
        mem->write_back(Role::params, u);
      }
      if (sharded) std::memcpy(master, src + lo, static_cast<size_t>(n) * 4);
    }
    mem->release(Role::master, u);
    mem->write_back(Role::master, u);
    if (!optim) continue;
    // m and v as the unit table lays them out, each over the unit's padded length (sharded:
    // this rank's part of it).
    const AdamLayout al = mem->units()[u].adam_layout();
    void* adam = mem->acquire(Role::adam, u, offload::Mode::write, Side::host);
    std::memset(adam, 0, static_cast<size_t>(al.length()) * 4);
    for (int half = 0; half < 2; ++half) {
      float* dst = static_cast<float*>(adam) + (half == 0 ? al.m_offset() : al.v_offset());
      if (ranged(unit)) {  // each tensor's elements inside this rank's range
        for (int pi : unit.params) {
          const ParamInfo& p = model->params()[static_cast<size_t>(pi)];
          const int64_t a = std::max<int64_t>(0, lo - p.unit_offset), b = std::min(p.numel, lo + n - p.unit_offset);
          if (b > a)
            optim->read_range(half == 0 ? exp_avg_name(p.name) : exp_avg_sq_name(p.name), p.shape, a, b,
                              dst + (p.unit_offset + a - lo), DType::f32);
        }
        continue;
      }
      float* whole = sharded ? full.data() : dst;
      if (sharded) std::fill(full.begin(), full.begin() + unit.numel, 0.f);
      for (int pi : unit.params) {
        const ParamInfo& p = model->params()[static_cast<size_t>(pi)];
        model->read_param(*optim, half == 0 ? exp_avg_name(p.name) : exp_avg_sq_name(p.name), p,
                          whole + p.unit_offset);
      }
      if (sharded) std::memcpy(dst, full.data() + lo, static_cast<size_t>(n) * 4);
    }
    mem->release(Role::adam, u);
    mem->write_back(Role::adam, u);
  }
  mem->end_step();
  mem->drain();  // the start-up includes the writes: the weights are in their tiers
}


// What a checkpoint records besides tensors: enough to continue bit for bit.
nlohmann::json Trainer::Impl::state_json() const {
  nlohmann::json j;
  j["trainer"] = {{"steps_done", steps_done}, {"skipped_steps", skipped_steps}, {"tokens", tokens_done},
                  {"trained_tokens", trained_done}};
  j["loss_scaler"] = {{"enabled", scaler.enabled()}, {"scale", scaler.scale()}, {"good_steps", scaler.good_steps()}};
  j["data"] = data->position();
  j["n_params"] = model->n_model_params();
  j["flags"] = options_json(o);
  j["run_id"] = run_id;
  // LoRA: the checkpoint holds only the adapters; the base is --model again, checked by value.
  if (model->lora()) j["lora_base"] = {{"model", o.model}, {"crc32c", base_crc}};
  return j;
}

void Trainer::Impl::restore_state(const nlohmann::json& man) {
  const std::string where = (resumed_from / "trainer.json").string();
  try {
    const auto& t = man.at("trainer");
    steps_done = t.at("steps_done").get<int64_t>();
    skipped_steps = t.at("skipped_steps").get<int64_t>();
    tokens_done = t.at("tokens").get<int64_t>();
    trained_done = t.value("trained_tokens", int64_t{0});
    if (steps_done < 0 || skipped_steps < 0 || skipped_steps > steps_done || tokens_done < 0)
      throw std::runtime_error("inconsistent step counts");
    const auto& ls = man.at("loss_scaler");
    // The scaler's own invariants: a power of two in [1, 2^99], a non-negative count.
    const double scale = ls.at("scale").get<double>();
    const int64_t good = ls.at("good_steps").get<int64_t>();
    if (!(scale >= 1 && scale <= 0x1p99 && std::exp2(std::round(std::log2(scale))) == scale))
      throw std::runtime_error(fmt::format("loss_scaler.scale {}: must be a power of 2 in [1, 2^99]", scale));
    if (good < 0 || good > INT32_MAX) throw std::runtime_error(fmt::format("loss_scaler.good_steps {}: out of range", good));
    if (ls.at("enabled").get<bool>() == scaler.enabled()) scaler.restore(static_cast<float>(scale), static_cast<int>(good));
    if (man.at("n_params").get<int64_t>() != model->n_model_params()) throw std::runtime_error("parameter count differs");
    data->restore(man, o.data);
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error(where + ": malformed trainer state: " + e.what());
  } catch (const std::exception& e) {
    throw std::runtime_error(where + ": " + e.what());
  }
  if (steps_done >= o.steps)
    throw std::invalid_argument("--resume " + resumed_from.string() + ": the checkpoint is at step " +
                                std::to_string(steps_done) + " and --steps is " + std::to_string(o.steps) +
                                ": nothing left to train (raise --steps)");
  last_checkpoint_step = steps_done;
  if (model->lora()) {
    const auto& b = man.contains("lora_base") ? man["lora_base"] : nlohmann::json();
    if (!b.is_object() || !b.contains("crc32c"))
      throw std::invalid_argument("--resume " + resumed_from.string() +
                                  ": the checkpoint holds no LoRA adapters (a full fine-tuning run); resume it "
                                  "without --lora-rank");
    if (b["crc32c"].get<uint32_t>() != base_crc)
      throw std::invalid_argument(fmt::format(
          "--resume {}: the base model differs from the one the adapters were trained on (crc32c of its weights "
          "{:08x}, the checkpoint's {:08x}; it was --model {}): resume with that base",
          resumed_from.string(), base_crc, b["crc32c"].get<uint32_t>(), b.value("model", std::string("(none)"))));
  } else if (man.contains("lora_base")) {
    throw std::invalid_argument("--resume " + resumed_from.string() +
                                ": the checkpoint holds LoRA adapters; resume with the same --lora-* flags and --model");
  }
  // What the user changed since the checkpoint's run (allowed; shown in the header).
  const nlohmann::json now = options_json(o);
  if (man.contains("flags") && man["flags"].is_object())
    for (const auto& [k, v] : man["flags"].items())
      if (now.contains(k) && now[k] != v) {
        std::string flag = k;
        std::replace(flag.begin(), flag.end(), '_', '-');
        resume_changes.push_back(fmt::format("--{} {} (was {})", flag, now[k].dump(), v.dump()));
      }
}

void Trainer::Impl::gather_range(Role role, int u, int64_t offset, int64_t e0, int64_t e1, float* dst) {
  const int64_t n = sh.shard(model->units()[static_cast<size_t>(u)].numel);
  // To rank 0 alone (an all-gather would stage the whole unit on every rank), stream-ordered
  // like the step's collectives, so a rank that dies fails the others' waits instead of
  // leaving them blocked in a host call. Rank r holds the unit's [r n, (r + 1) n).
  Communicator& dp = groups->dp();
  const float* src = static_cast<const float*>(mem->acquire(role, u, offload::Mode::read, Side::host));
  try {
    for (int r = 0; r < sh.world; ++r) {
      const int64_t lo = std::max(e0, r * n), hi = std::min(e1, (r + 1) * n);
      if (lo >= hi) continue;
      const auto count = static_cast<size_t>(hi - lo);
      if (sh.rank == 0 && r == 0)
        std::memcpy(dst + (lo - e0), src + offset + lo, count * 4);
      else if (sh.rank == 0)
        dp.recv(dst + (lo - e0), count, DType::f32, r, *stream);
      else if (sh.rank == r)
        dp.send(src + offset + (lo - r * n), count, DType::f32, 0, *stream);
    }
    stream->synchronize();
  } catch (...) {
    mem->release(role, u);
    throw;
  }
  mem->release(role, u);
}

std::vector<float> Trainer::Impl::gather_unit(Role role, int u, int64_t offset) {
  const int64_t numel = model->units()[static_cast<size_t>(u)].numel;
  std::vector<float> whole(sh.rank == 0 ? static_cast<size_t>(numel) : 0);
  gather_range(role, u, offset, 0, numel, whole.data());
  return whole;
}

// The whole HF values of every trainable tensor of one role's block, produced in parameter order
// one unit at a time on the job's rank 0: each held unit's parts (element offsets into its block:
// the master's 0, AdamW's m and v) gathered from the ZeRO shards over the data-parallel ranks,
// each tensor then from its tp group's parts on the group's rank 0, and (pipeline parallel) sent
// to stage 0 by the first stage that holds it. Rank 0 stages one unit's parts where it used to
// stage the whole model's (a checkpoint's master, m and v: 12 bytes a parameter, 16 GB of
// llama-1.5b's 1.36B, beyond the pools). Collective, in the same order on every rank: rank 0 pulls
// the tensors as its writer asks for them (get), and every rank ends with finish(), which produces
// what no one asked for (the other ranks' whole share). A failed write on rank 0 takes the job
// down (report_fatal_error), the other ranks' gathers with it. Inside an aside (TieredMemory::begin_step)
// on every rank. Made for pieces (a save's writer, TensorToSave::fill_range) on a grid of ZeRO
// shards alone (no tp, no pp), it stages nothing at all: each kSavePieceBytes piece of a tensor
// goes from the shards that hold it into the writer's buffer (fill).
class Trainer::Impl::TensorStream {
 public:
  using Offset = std::function<int64_t(int)>;
  // before: a stream of the same save whose tensors are written first; it finishes before this
  // one produces anything (were a writer to ask out of that order, get throws instead of the
  // ranks running different collectives).
  // in_pieces: the writer takes the tensors through fill() (TensorToSave::fill_range), not get();
  // on a grid of data-parallel shards alone (pieces()) nothing whole is then staged.
  TensorStream(Impl& m, Role role, std::vector<Offset> parts, TensorStream* before = nullptr, bool in_pieces = false)
      : m_(m), role_(role), parts_(std::move(parts)), before_(before), in_pieces_(in_pieces), unit_parts_(parts_.size()),
        tensor_(parts_.size()), current_(parts_.size(), nullptr) {
    const std::vector<ParamInfo>& ps = m_.model->params();
    for (size_t pi = 0; pi < ps.size(); ++pi)
      if (m_.model->units()[static_cast<size_t>(ps[pi].unit)].trainable) order_.push_back(pi);
    // Pipeline parallel: each tensor's sender, the first stage holding it (over the pipeline
    // group of data-parallel and tensor-parallel rank 0, the one with the job's rank 0).
    if (sends()) {
      Communicator& g = m_.groups->pp();
      std::vector<uint8_t> mine(ps.size()), all(ps.size() * static_cast<size_t>(g.world()));
      for (size_t pi = 0; pi < ps.size(); ++pi) mine[pi] = m_.model->holds(ps[pi]) && held(ps[pi].unit);
      g.host_all_gather(mine.data(), all.data(), mine.size());
      owner_.assign(ps.size(), -1);
      for (size_t pi = 0; pi < ps.size(); ++pi)
        for (int r = 0; r < g.world() && owner_[pi] < 0; ++r)
          if (all[static_cast<size_t>(r) * ps.size() + pi]) owner_[pi] = r;
    }
  }
  // Rank 0: part k of parameter pi's whole values (pi trainable; pi no smaller than the last
  // call's), valid until the next call.
  const float* get(size_t pi, size_t k) {
    if (before_) before_->finish();
    while (produced_ == 0 || order_[produced_ - 1] < pi) {
      if (produced_ == order_.size()) throw std::logic_error("TensorStream: no trainable parameter " + std::to_string(pi));
      produce(order_[produced_++]);
    }
    if (order_[produced_ - 1] != pi)
      throw std::logic_error("TensorStream: parameter " + std::to_string(pi) + " asked for after a later one");
    return current_.at(k);
  }
  // Rank 0: bytes [at, at + n) of part k of parameter pi's whole values into dst, where the
  // writer stages a tensor kSavePieceBytes at a time (the pieces in order, parameter by
  // parameter and part by part within one: a checkpoint's optimizer file has each tensor's m,
  // then its v). On pieces() grids each piece is gathered from the shards that hold it straight
  // into dst (what the other ranks' finish() sends, in the same order), else copied from get().
  void fill(void* dst, size_t pi, size_t k, uint64_t at, uint64_t n) {
    if (!in_pieces_) throw std::logic_error("TensorStream::fill on a stream made for get()");
    if (!pieces()) {
      std::memcpy(dst, get(pi, k) + at / 4, n);
      return;
    }
    if (before_) before_->finish();
    if (!next_piece() || order_[next_.oi] != pi || next_.k != k || next_.at != at || piece_bytes(next_) != n)
      throw std::logic_error("TensorStream: piece [" + std::to_string(at) + ", +" + std::to_string(n) + ") of parameter " +
                             std::to_string(pi) + " part " + std::to_string(k) + " asked for out of order");
    gather_piece(next_, static_cast<float*>(dst));
    advance();
  }
  void finish() {
    if (before_) before_->finish();
    if (pieces()) {
      std::vector<float> drop;  // (rank 0: pieces its writer did not ask for)
      while (next_piece()) {
        if (m_.sh.rank == 0) drop.resize(piece_bytes(next_) / 4);
        gather_piece(next_, m_.sh.rank == 0 ? drop.data() : nullptr);
        advance();
      }
      return;
    }
    while (produced_ < order_.size()) produce(order_[produced_++]);
    for (auto& v : unit_parts_) std::vector<float>().swap(v);
    for (auto& v : tensor_) std::vector<float>().swap(v);
  }

 private:
  bool held(int u) const {
    const Unit& unit = m_.model->units()[static_cast<size_t>(u)];
    return unit.trainable && unit.held;
  }
  bool sends() const { return m_.pp().on() && m_.sh.rank == 0 && m_.tp().rank == 0; }
  bool pieces() const { return in_pieces_ && m_.sh.sharded_optimizer() && !m_.tp().on() && !m_.pp().on(); }
  // The pieces' sequence: parameter order_[oi], part k, bytes from `at`.
  struct Piece {
    size_t oi = 0, k = 0;
    uint64_t at = 0;
  };
  uint64_t tensor_bytes(size_t pi) const { return static_cast<uint64_t>(hf_numel(m_.model->params()[pi])) * 4; }
  uint64_t piece_bytes(const Piece& c) const { return std::min(kSavePieceBytes, tensor_bytes(order_[c.oi]) - c.at); }
  // Whether a piece is left; next_ set to it (skipping empty tensors).
  bool next_piece() {
    while (next_.oi < order_.size()) {
      if (next_.at < tensor_bytes(order_[next_.oi])) return true;
      next_.at = 0;
      if (++next_.k == parts_.size()) next_.k = 0, ++next_.oi;
    }
    return false;
  }
  void advance() { next_.at += kSavePieceBytes; }
  // A piece from the data-parallel shards that hold it (gather_range), into dst on rank 0.
  void gather_piece(const Piece& c, float* dst) {
    const ParamInfo& p = m_.model->params()[order_[c.oi]];
    const int64_t e0 = p.unit_offset + static_cast<int64_t>(c.at / 4), e1 = e0 + static_cast<int64_t>(piece_bytes(c) / 4);
    m_.gather_range(role_, p.unit, parts_[c.k](p.unit), e0, e1, dst);
  }
  void produce(size_t pi) {
    const ParamInfo& p = m_.model->params()[pi];
    const int u = p.unit;
    if (held(u)) {
      if (u != unit_) {  // this rank's part of the unit, whole over the data-parallel ranks (on their rank 0)
        for (size_t k = 0; k < parts_.size(); ++k) {
          std::vector<float>().swap(unit_parts_[k]);  // (one unit staged at a time)
          const int64_t at = parts_[k](u);
          if (m_.sh.sharded_optimizer()) {
            unit_parts_[k] = m_.gather_unit(role_, u, at);
          } else if (m_.sh.rank == 0) {  // (the other data-parallel ranks hold the same)
            const int64_t numel = m_.model->units()[static_cast<size_t>(u)].numel;
            const float* src = static_cast<const float*>(m_.mem->acquire(role_, u, offload::Mode::read, Side::host));
            unit_parts_[k].assign(src + at, src + at + numel);
            m_.mem->release(role_, u);
          }
        }
        unit_ = u;
      }
      if (m_.sh.rank == 0)  // the tp groups of data-parallel rank 0 assemble the tensor
        for (size_t k = 0; k < parts_.size(); ++k) {
          if (m_.tp().on()) {
            tensor_[k] = m_.whole_tensor(p, unit_parts_[k].data());
            current_[k] = tensor_[k].data();
          } else {
            current_[k] = unit_parts_[k].data() + p.unit_offset;
          }
        }
    }
    if (!sends()) return;
    const int owner = owner_[pi];
    if (owner <= 0) return;  // stage 0's own
    Communicator& g = m_.groups->pp();
    const int64_t numel = hf_numel(p);
    for (size_t k = 0; k < parts_.size(); ++k) {
      if (g.rank() == owner) g.send(current_[k], static_cast<size_t>(numel), DType::f32, 0, *m_.stream);
      if (g.rank() == 0) {
        tensor_[k].resize(static_cast<size_t>(numel));
        g.recv(tensor_[k].data(), static_cast<size_t>(numel), DType::f32, owner, *m_.stream);
        current_[k] = tensor_[k].data();
      }
      m_.stream->synchronize();
    }
  }

  Impl& m_;
  Role role_;
  std::vector<Offset> parts_;
  TensorStream* before_;
  bool in_pieces_;
  Piece next_;                 // pieces(): the next piece to gather
  std::vector<size_t> order_;  // the trainable parameters, in parameter order
  size_t produced_ = 0;        // order_[0, produced_) have been produced
  int unit_ = -1;              // the unit in unit_parts_
  std::vector<std::vector<float>> unit_parts_, tensor_;  // [part]: the gathered unit; a tp- or pp-assembled tensor
  std::vector<const float*> current_;                    // [part]: the last produced tensor's values (rank 0)
  std::vector<int> owner_;                               // pipeline parallel: per parameter, its sender
};

std::vector<std::vector<float>> Trainer::Impl::gather_tensors(Role role, const std::function<int64_t(int)>& offset) {
  std::vector<std::vector<float>> out(model->params().size());
  mem->begin_step(TieredMemory::Schedule::aside);
  try {
    TensorStream s(*this, role, {offset});
    if (rank0())
      for (size_t pi = 0; pi < out.size(); ++pi) {
        const ParamInfo& p = model->params()[pi];
        if (!model->units()[static_cast<size_t>(p.unit)].trainable) continue;
        const int64_t numel = hf_numel(p);
        const float* v = s.get(pi, 0);
        out[pi].assign(v, v + numel);
      }
    s.finish();
  } catch (...) {
    mem->end_step();
    throw;
  }
  mem->end_step();
  return out;
}

std::vector<float> Trainer::Impl::whole_tensor(const ParamInfo& p, const float* unit_part) const {
  const TensorParallel& t = tp();
  if (!t.on()) return {unit_part + p.unit_offset, unit_part + p.unit_offset + p.numel};
  // Every rank's part padded to the largest (the vocabulary's last part may be shorter).
  int64_t most = 0;
  for (int r = 0; r < t.size; ++r) most = std::max(most, tp_numel(p, r, t.size));
  std::vector<float> mine(static_cast<size_t>(most)), all(t.rank == 0 ? static_cast<size_t>(most * t.size) : 0);
  std::copy_n(unit_part + p.unit_offset, p.numel, mine.begin());
  t.comm->host_gather(mine.data(), all.empty() ? nullptr : all.data(), static_cast<size_t>(most) * sizeof(float), 0);
  if (t.rank != 0) return {};
  const int64_t numel = hf_numel(p);
  std::vector<float> whole(static_cast<size_t>(numel));
  for (int r = 0; r < t.size; ++r)
    tp_runs(p, r, t.size, [&](int64_t local, int64_t full, int64_t n) {
      std::copy_n(all.begin() + r * most + local, n, whole.begin() + full);
    });
  return whole;
}

namespace {

// A tensor's fp32 bytes (a piece of them: TensorToSave::fill_range, `first` its first
// element) checked finite on their way to a save: a last update can overflow (a diverging run
// whose loss was still finite), and such weights never become a save or a checkpoint.
void check_finite(const void* dst, size_t bytes, const std::string& what, uint64_t first) {
  const float* f = static_cast<const float*>(dst);
  for (size_t i = 0; i < bytes / 4; ++i)
    if (!std::isfinite(f[i])) throw std::runtime_error(what + " (element " + std::to_string(first + i) + ")");
}
// (STRATA_FAULT=save-fill:N, tests only: the N-th tensor a save produces fails, at its first piece)
void save_fill_fault(uint64_t first) {
  static int64_t fills = 0;
  if (first == 0 && ++fills == faults().save_fill_nth)
    throw std::runtime_error("STRATA_FAULT=save-fill:" + std::to_string(fills) + ": this tensor failed on purpose");
}
void copy_finite(void* dst, const float* src, size_t bytes, const std::string& what, uint64_t first) {
  save_fill_fault(first);
  std::memcpy(dst, src, bytes);
  check_finite(dst, bytes, what, first);
}

using FillRange = std::function<void(void*, uint64_t, uint64_t)>;

// A save callback for one fp32 tensor: its bytes [at, at + n) from element `offset` of a unit's
// `role` block, acquired on the host side of an aside for the copy only, non-finite values
// refused (`what`).
FillRange fill_from_block(TieredMemory* mem, Role role, int unit, int64_t offset, std::string what) {
  return [mem, role, unit, offset, what = std::move(what)](void* dst, uint64_t at, uint64_t n) {
    const float* src = static_cast<const float*>(mem->acquire(role, unit, offload::Mode::read, Side::host));
    try {
      copy_finite(dst, src + offset + at / 4, n, what, at / 4);
    } catch (...) {
      mem->release(role, unit);
      throw;
    }
    mem->release(role, unit);
  };
}

}  // namespace

// A save callback for part k of parameter pi, from a TensorStream made for pieces.
std::function<void(void*, uint64_t, uint64_t)> Trainer::Impl::streamed(TensorStream* s, size_t pi, size_t k, std::string what) {
  return [s, pi, k, what = std::move(what)](void* dst, uint64_t at, uint64_t n) {
    save_fill_fault(at / 4);
    s->fill(dst, pi, k, at, n);
    check_finite(dst, n, what, at / 4);
  };
}

// The master weights, unit by unit from wherever they live, through the save's per-tensor
// callbacks, kSavePieceBytes of a tensor at a time; sharded, tensor-parallel or pipelined
// (saves_gathered) through a TensorStream (ZeRO shards alone: a piece at a time too, gathered
// into the writer's buffer; with tp or pp one unit gathered whole on rank 0). Collective: every
// rank calls it; rank 0 alone writes.
void Trainer::save(const std::string& out_dir) const {
  Impl& m = *impl_;
  ModelConfig c = m.cfg;
  c.torch_dtype = "float32";
  m.flush();  // a pending update belongs to the weights being saved
  m.stream->synchronize();
  m.opt_stream().synchronize();
  const bool gathered = m.saves_gathered();
  if (m.o.merge_adapter) {  // every tensor whole on rank 0 first: the merge needs base and adapters together
    std::vector<std::vector<float>> whole;  // [param] (gathered, rank 0)
    if (gathered) whole = m.gather_tensors(Role::master, [](int) { return int64_t{0}; });
    if (m.tp().on()) m.gather_base(whole);
    if (m.rank0()) m.save_merged(out_dir, gathered ? &whole : nullptr);
    return;
  }
  const std::string diverged = "the weights are not finite: the run diverged; nothing was saved";
  const bool lora = m.model->lora();  // a PEFT adapter: the trained adapters, in PEFT's names
  TieredMemory* mem = m.mem.get();
  m.mem->begin_step(TieredMemory::Schedule::aside);
  try {
    std::unique_ptr<Impl::TensorStream> stream;
    if (gathered)
      stream = std::make_unique<Impl::TensorStream>(
          m, Role::master, std::vector<Impl::TensorStream::Offset>{[](int) { return int64_t{0}; }}, nullptr, true);
    if (m.rank0()) {
      std::vector<TensorToSave> tensors;
      for (const ParamInfo& p : m.model->params()) {
        if (lora && !m.model->units()[static_cast<size_t>(p.unit)].trainable) continue;
        const auto pi = static_cast<size_t>(&p - m.model->params().data());
        tensors.push_back({.name = lora ? "base_model.model." + p.name : p.name,
                           .shape = p.full_shape,
                           .dtype = DType::f32,
                           .fill = {},
                           .fill_range = gathered ? Impl::streamed(stream.get(), pi, 0, diverged)
                                                  : fill_from_block(mem, Role::master, p.unit, p.unit_offset, diverged)});
      }
      // The tokenizer of --model goes along: `strata generate` and `strata data` read the saved
      // directory as they read the one it was trained from. (Read before the save replaces
      // anything, so --out may be --model with --overwrite-model.)
      std::vector<fs::path> tokenizer;
      if (!m.o.model.empty())
        for (const char* name : kTokenizerFiles)
          if (fs::is_regular_file(fs::path(m.o.model) / name)) tokenizer.push_back(fs::path(m.o.model) / name);
      if (lora)
        save_peft_adapter(out_dir, m.peft_config(), tensors, tokenizer);
      else
        save_hf_model(out_dir, c, tensors, 5ull << 30, tokenizer);
    }
    if (stream) stream->finish();
  } catch (...) {
    m.mem->end_step();  // every fill releases what it acquired
    throw;
  }
  m.mem->end_step();
}

int64_t Trainer::steps_done() const { return impl_->steps_done; }

// The whole training state after the last step (its pending update applied first), each
// tensor streamed from wherever its unit lives, kSavePieceBytes at a time. Sharded (stage >= 1),
// tensor-parallel or pipelined: master, m and v gathered to rank 0 (TensorStream: a piece at a
// time, or with tp or pp a unit at a time), which writes them unsharded by name, so a checkpoint does not
// depend on the grid it was written on. Collective: every rank calls it; rank 0 alone writes
// (the others return "").
std::string Trainer::save_checkpoint() {
  Impl& m = *impl_;
  if (m.o.checkpoint_dir.empty()) throw std::logic_error("save_checkpoint without --checkpoint-dir");
  m.flush();
  const bool gathered = m.saves_gathered();
  TieredMemory* mem = m.mem.get();
  fs::path path;
  m.mem->begin_step(TieredMemory::Schedule::aside);
  try {
    // The model file (masters) is written before the optimizer file (m and v, by parameter):
    // the streams follow that order, the moments' finishing the masters' first.
    std::unique_ptr<Impl::TensorStream> masters, moments;
    if (gathered) {
      const auto adam_at = [&m](bool v) {
        return [&m, v](int u) {
          const AdamLayout al = m.mem->units()[u].adam_layout();
          return v ? al.v_offset() : al.m_offset();
        };
      };
      masters = std::make_unique<Impl::TensorStream>(
          m, Role::master, std::vector<Impl::TensorStream::Offset>{[](int) { return int64_t{0}; }}, nullptr, true);
      moments = std::make_unique<Impl::TensorStream>(
          m, Role::adam, std::vector<Impl::TensorStream::Offset>{adam_at(false), adam_at(true)}, masters.get(), true);
    }
    if (m.rank0()) {
      TrainCheckpointContent c;
      c.cfg = m.cfg;
      c.cfg.torch_dtype = "float32";
      c.state = m.state_json();
      for (const ParamInfo& p : m.model->params()) {
        if (!m.model->units()[static_cast<size_t>(p.unit)].trainable) continue;  // LoRA: the adapters only
        const AdamLayout al = m.mem->units()[p.unit].adam_layout();
        // A last update that overflowed never becomes a checkpoint (rotation would then drop the
        // good ones): the run stops instead, the previous checkpoint kept.
        const std::string diverged =
            "'" + p.name + "' is not finite: the run diverged; no checkpoint written, the previous one is kept";
        const auto pi = static_cast<size_t>(&p - m.model->params().data());
        auto from = [&](Role role, int64_t offset, Impl::TensorStream* s, size_t part) -> FillRange {
          if (!gathered) return fill_from_block(mem, role, p.unit, offset, diverged);
          return Impl::streamed(s, pi, part, diverged);
        };
        const auto tensor = [&](std::string name, FillRange fill) {
          return TensorToSave{.name = std::move(name), .shape = p.full_shape, .dtype = DType::f32, .fill = {},
                              .fill_range = std::move(fill)};
        };
        c.model.push_back(tensor(p.name, from(Role::master, p.unit_offset, masters.get(), 0)));
        c.optimizer.push_back(tensor(exp_avg_name(p.name), from(Role::adam, al.m_offset() + p.unit_offset, moments.get(), 0)));
        c.optimizer.push_back(
            tensor(exp_avg_sq_name(p.name), from(Role::adam, al.v_offset() + p.unit_offset, moments.get(), 1)));
      }
      path = write_train_checkpoint(m.o.checkpoint_dir, m.steps_done, c,
                                    static_cast<int>(std::min<int64_t>(m.o.keep, 1 << 30)));
    }
    if (moments) moments->finish();
  } catch (...) {
    m.mem->end_step();
    throw;
  }
  m.mem->end_step();
  m.last_checkpoint_step = m.steps_done;
  return m.rank0() ? path.string() : "";
}

}  // namespace strata

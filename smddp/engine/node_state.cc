// The daemon's table of collectives and the job-wide rules around it, without I/O.
#include "node_state.h"

#include <utility>

namespace smddp {
namespace {

const char* dtype_label(std::uint8_t code) {
  const DTypeInfo* d = dtype_info(code);
  return d != nullptr ? d->label : nullptr;
}

std::string label_or_code(const char* label, std::uint8_t code) {
  return label != nullptr ? std::string(label) : "code " + std::to_string(code);
}

Verdict fail(Fault f, std::string why) { return {f, std::move(why)}; }

}  // namespace

std::string describe(const Spec& s) {
  std::string extra;
  if (s.has_op) extra = ", op=" + label_or_code(reduce_op_label(s.op), s.op);
  if (s.kind == static_cast<std::uint8_t>(Kind::kBroadcast)) {
    extra = ", root=" + std::to_string(s.root);
  } else if (s.kind == static_cast<std::uint8_t>(Kind::kAllreduce) && s.root != 0) {
    extra += ", one of " + std::to_string(s.root) + " pieces";  // a large buffer pipelined as `root` all-reduces
  }
  return label_or_code(kind_label(s.kind), s.kind) + "(" + label_or_code(dtype_label(s.dtype), s.dtype) +
         ", count=" + std::to_string(s.count) + extra + ")";
}

NodeState::NodeState(const Topology& topo, std::vector<std::string> node_names, std::vector<std::string> rank_names)
    : topo_(topo), node_names_(std::move(node_names)), rank_names_(std::move(rank_names)) {
  node_names_.resize(topo.nnodes);
  rank_names_.resize(topo.local_size);
  senders_ = rank_names_;
  next_seq_.assign(topo.local_size, 1);  // sequence numbers start at 1 (docs/protocol.md)
  ahead_.assign(topo.local_size, {});
  said_bye_.assign(topo.local_size, false);
  left_early_.assign(topo.local_size, std::string());
  peer_bye_.assign(topo.nnodes, false);
}

void NodeState::name_rank(std::uint32_t local, const std::string& name) {
  if (local < senders_.size()) senders_[local] = name;
}

std::string NodeState::left_message(const std::string& who, std::uint64_t seq, const std::string& what) const {
  return who + " shut down while collective #" + std::to_string(seq) + " " + what +
         " still needed it: every rank must issue the same collectives in the same order (one rank called "
         "shutdown() early, or skipped a call)";
}

Verdict NodeState::op_for(const Spec& spec, const std::string& who, std::shared_ptr<Collective>* out,
                          bool* created) {
  *created = false;
  out->reset();
  const auto it = ops_.find(spec.seq);
  if (it != ops_.end()) {
    if (!it->second.c->same_fingerprint(spec))
      return fail(Fault::kMismatch, "collective #" + std::to_string(spec.seq) + " mismatch: " + it->second.origin +
                                        " called " + describe(it->second.c->spec()) + " but " + who + " called " +
                                        describe(spec));
    *out = it->second.c;
    return {};
  }
  // First sight: the collective's own checks (a reduce op where one belongs, the root, the size).
  const std::string why = Collective::check(spec, topo_);
  if (!why.empty()) return fail(Fault::kProtocol, who + ": " + why);
  for (std::uint32_t i = 0; i < topo_.local_size; i++)
    if (!left_early_[i].empty())
      return fail(Fault::kPeerLost, left_early_[i] + ", but collective #" + std::to_string(spec.seq) + " " +
                                        describe(spec) + " needs it");
  for (std::uint32_t i = 0; i < topo_.local_size; i++)
    if (said_bye_[i]) return fail(Fault::kMismatch, left_message(rank_names_[i], spec.seq, describe(spec)));
  for (std::uint32_t j = 0; j < topo_.nnodes; j++)
    if (peer_bye_[j])
      return fail(Fault::kMismatch, left_message("every rank of " + node_names_[j], spec.seq, describe(spec)));
  auto c = std::make_shared<Collective>(spec, topo_);
  ops_.emplace(spec.seq, Op{c, who});
  *out = std::move(c);
  *created = true;
  return {};
}

Verdict NodeState::submit(std::uint32_t local, const Spec& spec, std::shared_ptr<Collective>* out, bool* created,
                          bool* all_in) {
  *created = false;
  *all_in = false;
  out->reset();
  if (local >= topo_.local_size) return fail(Fault::kProtocol, "local rank " + std::to_string(local) + " out of range");
  const std::string& who = senders_[local];
  if (said_bye_[local]) return fail(Fault::kProtocol, who + " submitted collective #" + std::to_string(spec.seq) + " after BYE");
  const std::uint64_t next = next_seq_[local];
  if (spec.seq < next || ahead_[local].count(spec.seq))
    return fail(Fault::kProtocol, who + " submitted collective #" + std::to_string(spec.seq) + " twice");
  if (spec.seq - next >= kSubmitWindow)
    return fail(Fault::kProtocol, who + " submitted collective #" + std::to_string(spec.seq) + ", expected #" +
                                      std::to_string(next) + " to #" + std::to_string(next + kSubmitWindow - 1));
  // Taken; the lowest not submitted moves up past every number now in.
  std::set<std::uint64_t>& ahead = ahead_[local];
  ahead.insert(spec.seq);
  while (!ahead.empty() && *ahead.begin() == next_seq_[local]) {
    ahead.erase(ahead.begin());
    next_seq_[local]++;
  }
  if (spec.node_summed && ((spec.kind != static_cast<std::uint8_t>(Kind::kAllreduce) &&
                            spec.kind != static_cast<std::uint8_t>(Kind::kReduceScatter)) ||
                           topo_.nnodes < 2))
    return fail(Fault::kProtocol, who + " submitted collective #" + std::to_string(spec.seq) +
                                      " as summed on the node's GPUs, which only an all-reduce or a reduce-scatter "
                                      "of a job of several nodes may be");
  std::shared_ptr<Collective> c;
  Verdict v = op_for(spec, who, &c, created);
  if (!v.ok()) return v;
  // (The first local SUBMIT of a collective says it for all: only a later one can disagree, so a
  // collective just created is never refused here.)
  if (!c->note_node_summed(spec.node_summed))
    return fail(Fault::kMismatch, "collective #" + std::to_string(spec.seq) + " mismatch: " + who +
                                      (spec.node_summed ? " summed it on the node's GPUs, other ranks of its node did not"
                                                        : " did not sum it on the node's GPUs, other ranks of its node did"));
  const std::string why = c->submit(local, who, all_in);
  if (!why.empty()) return fail(Fault::kProtocol, why);
  *out = std::move(c);
  return {};
}

Verdict NodeState::release(std::uint32_t local, std::uint64_t seq, bool* retire) {
  *retire = false;
  if (local >= topo_.local_size) return fail(Fault::kProtocol, "local rank " + std::to_string(local) + " out of range");
  const auto it = ops_.find(seq);
  if (it == ops_.end())
    return fail(Fault::kProtocol, senders_[local] + " released collective #" + std::to_string(seq) +
                                      ", which it does not hold");
  const std::string why = it->second.c->release(local, senders_[local], retire);
  if (!why.empty()) return fail(Fault::kProtocol, why);
  if (*retire) ops_.erase(it);
  return {};
}

bool NodeState::send_finished(std::uint64_t seq) {
  const auto it = ops_.find(seq);
  if (it == ops_.end() || !it->second.c->send_finished()) return false;
  ops_.erase(it);
  return true;
}

Verdict NodeState::rank_said_bye(std::uint32_t local) {
  if (local >= topo_.local_size) return fail(Fault::kProtocol, "local rank " + std::to_string(local) + " out of range");
  said_bye_[local] = true;
  if (!ahead_[local].empty())
    return fail(Fault::kProtocol, senders_[local] + " said BYE without submitting collective #" +
                                      std::to_string(next_seq_[local]) + ", though it submitted #" +
                                      std::to_string(*ahead_[local].rbegin()));
  // The lowest sequence number first: the collective the rank skipped or stopped before.
  for (const auto& [seq, op] : ops_)
    if (!op.c->done() && !op.c->submitted_by(local))
      return fail(Fault::kMismatch, left_message(rank_names_[local], seq, describe(op.c->spec())));
  return {};
}

Verdict NodeState::peer_said_bye(std::uint32_t j) {
  if (j >= topo_.nnodes || j == topo_.node) return fail(Fault::kProtocol, "BYE from node " + std::to_string(j) + ", not a peer");
  peer_bye_[j] = true;
  // Its BYE follows all its frames: a collective not done here never gets what it lacks from it.
  for (const auto& [seq, op] : ops_)
    if (!op.c->done() && op.c->lacks_from(j))
      return fail(Fault::kMismatch, left_message("every rank of " + node_names_[j], seq, describe(op.c->spec())));
  return {};
}

Verdict NodeState::rank_left_early(std::uint32_t local, bool joined, const std::string& reason, bool* recorded) {
  *recorded = false;
  if (local >= topo_.local_size) return fail(Fault::kProtocol, "local rank " + std::to_string(local) + " out of range");
  if (joined || !left_early_[local].empty()) return {};
  left_early_[local] = reason.empty() ? rank_names_[local] + " is gone" : reason;
  *recorded = true;
  for (const auto& [seq, op] : ops_)
    if (!op.c->done())
      return fail(Fault::kPeerLost, left_early_[local] + ", while collective #" + std::to_string(seq) + " " +
                                        describe(op.c->spec()) + " waits for it");
  return {};
}

bool NodeState::all_ranks_gone() const {
  for (std::uint32_t i = 0; i < topo_.local_size; i++)
    if (!rank_gone(i)) return false;
  return true;
}

std::shared_ptr<Collective> NodeState::find(std::uint64_t seq) const {
  const auto it = ops_.find(seq);
  return it == ops_.end() ? nullptr : it->second.c;
}

}  // namespace smddp

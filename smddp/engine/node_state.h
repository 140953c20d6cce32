// What one daemon knows across its collectives, without I/O: the table of collectives in flight and
// the job-wide rules around them (docs/engine.md, "State without I/O").
//
// A collective is created at its first sight, from a local rank's SUBMIT or a peer's frame; every
// later sight must carry the same fingerprint (kind, dtype, count, reduce op, root), or the job has
// a mismatch, named with who called what. Each local rank submits every sequence number once, each
// less than kSubmitWindow past the lowest it has not submitted yet (a device collective's SUBMIT goes
// when its copy lands, and later ones need not wait for it), and none missing at its BYE. A rank or node
// that said BYE, or a rank whose process ended without joining, fails every collective that still
// needs it, at once, instead of leaving the others to wait for their timeout. Verdicts name the
// fault and say why in the words every rank then prints; the driver turns them into smddp.errors.
// Owns the Collective objects (shared with whoever holds one while the table drops it). No I/O, no
// locks: one driver at a time (the data plane, LocalPlane, under its lock).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "collective.h"

namespace smddp {

// What went wrong, as smddp.errors classes it.
enum class Fault : std::uint8_t { kNone = 0, kProtocol = 1, kMismatch = 2, kPeerLost = 3 };

struct Verdict {
  Fault fault = Fault::kNone;
  std::string why;
  bool ok() const { return fault == Fault::kNone; }
};

// How a collective's fingerprint reads in a message: "allreduce(float32, count=8, op=sum)".
std::string describe(const Spec& spec);

class NodeState {
 public:
  // node_names[j]: how node j is named in messages; rank_names[i]: local rank i (before it connects).
  NodeState(const Topology& topo, std::vector<std::string> node_names, std::vector<std::string> rank_names);

  // Local rank `local` connected: how its own frames name it from now on (with its pid). Messages
  // about a rank that left name it as rank_names did.
  void name_rank(std::uint32_t local, const std::string& name);

  // The collective `spec` names, seen from `who`: found (same fingerprint), or created (*created).
  Verdict op_for(const Spec& spec, const std::string& who, std::shared_ptr<Collective>* out, bool* created);
  // Local rank `local` submitted `spec`: a number it has not submitted, within its window (above),
  // then op_for and the collective's submit.
  Verdict submit(std::uint32_t local, const Spec& spec, std::shared_ptr<Collective>* out, bool* created,
                 bool* all_in);
  // Local rank `local` copied the result of `seq` out; *retire: it left the table (free its memory).
  Verdict release(std::uint32_t local, std::uint64_t seq, bool* retire);
  // A frame of `seq` left for a peer; returns whether it left the table (free its memory).
  bool send_finished(std::uint64_t seq);

  // Local rank `local` said BYE: a number it skipped is a protocol error; a collective still waiting
  // for its input fails (a mismatch).
  Verdict rank_said_bye(std::uint32_t local);
  // Every rank of peer node `j` said BYE (its daemon's BYE): a collective still waiting for a frame
  // from it fails (a mismatch).
  Verdict peer_said_bye(std::uint32_t j);
  // Local rank `local`'s process ended without joining, as `reason` says; *recorded is false when the
  // rank had joined or was already known gone (nothing changes then). A collective in flight, which
  // can never complete without it, fails (the rank is lost).
  Verdict rank_left_early(std::uint32_t local, bool joined, const std::string& reason, bool* recorded);
  // Every local rank said BYE or left early.
  bool all_ranks_gone() const;
  bool rank_gone(std::uint32_t local) const { return said_bye_.at(local) || !left_early_.at(local).empty(); }
  bool left_early(std::uint32_t local) const { return !left_early_.at(local).empty(); }

  std::shared_ptr<Collective> find(std::uint64_t seq) const;
  std::size_t size() const { return ops_.size(); }
  std::size_t rank_count() const { return rank_names_.size(); }

 private:
  struct Op {
    std::shared_ptr<Collective> c;
    std::string origin;  // who created it, for mismatch messages
  };
  std::string left_message(const std::string& who, std::uint64_t seq, const std::string& what) const;

  Topology topo_;
  std::vector<std::string> node_names_;
  std::vector<std::string> rank_names_;
  std::vector<std::string> senders_;  // local rank i as its frames name it (name_rank)
  std::vector<std::uint64_t> next_seq_;  // the lowest number local rank i has not submitted
  std::vector<std::set<std::uint64_t>> ahead_;  // those above it that it has (fewer than kSubmitWindow)
  std::vector<bool> said_bye_;
  std::vector<std::string> left_early_;  // why local rank i is gone without joining ("" if not)
  std::vector<bool> peer_bye_;
  std::map<std::uint64_t, Op> ops_;
};

}  // namespace smddp

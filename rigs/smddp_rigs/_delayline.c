/* The simulated cluster's delay line: a learning Ethernet switch that holds every frame for a fixed time.
 *
 * This kernel has no netem (nor fq/etf), so SimCluster(ClusterConfig(delay_ms=...)) replaces its
 * bridge with this forwarder, run in the switch namespace by smddp_rigs.delayline. One AF_PACKET
 * SOCK_RAW socket per port (a veth whose peer is a node's eth0, or the uplink):
 *
 * - every frame read from a port is stamped with its arrival time and queued in one FIFO; it is sent
 *   when arrival + delay has passed. The delay is the same for every frame, so due order is arrival
 *   order and one FIFO keeps every flow's order;
 * - the destination is that of a learning switch: the port a unicast MAC was last seen on, else every
 *   other port (broadcast, multicast, not yet learned);
 * - PACKET_VNET_HDR on both sides: a TSO/GSO super-frame (up to 64 KiB) crosses as one read and one
 *   write with its segmentation and checksum-offload metadata, instead of 45 reads of 1500 bytes;
 * - PACKET_IGNORE_OUTGOING: a port's socket does not read back the frames this process sends on it;
 * - the loop sleeps in ppoll() until the head frame is due or a port is readable, with a small timer
 *   slack (the default 50 us would add up to 50 us of jitter to a 500 us delay). It never spins: the
 *   benchmark machine has 2 cores shared with 8 or more busy processes.
 *
 * Sends are blocking with a bounded SO_SNDTIMEO (the socket's send buffer fills only while the peer
 * node's stack has not yet taken earlier frames), so a slow receiver delays the line like a switch's
 * output queue would rather than losing frames; a send that still times out drops that frame.
 * When the queue is full the ports are not read, and the kernel drops what overflows their receive
 * buffers, as a switch drops on a full buffer.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <arpa/inet.h>
#include <errno.h>
#include <linux/if_ether.h>
#include <linux/if_packet.h>
#include <linux/virtio_net.h>
#include <net/if.h>
#include <poll.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define MAX_PORTS 256
#define VNET_LEN ((Py_ssize_t)sizeof(struct virtio_net_hdr))
/* A GSO frame is at most 64 KiB of IP packet plus its link header; anything larger is dropped. */
#define FRAME_MAX (VNET_LEN + 65536 + 64)
#define MAC_SLOTS 4096 /* learned addresses: open addressing, power of two */
#define RECV_BATCH 64  /* frames read per wake-up before due frames are sent again */
#define SOCK_BUF (4 << 20)
#define SEND_TIMEOUT_MS 200
#define DEFAULT_QUEUE_BYTES (64LL << 20)
#define MAX_DELAY_NS (10LL * 1000 * 1000 * 1000)

typedef struct {
    int64_t due_ns;
    int64_t off; /* in the byte ring */
    int32_t len; /* virtio_net_hdr + frame */
    int32_t port;
} rec_t;

typedef struct {
    uint8_t mac[6];
    int16_t port; /* -1: empty */
} mac_entry_t;

typedef struct {
    /* counters handed back to Python */
    unsigned long long rx_frames, rx_bytes, tx_frames, tx_bytes, flooded, same_port, oversize, send_errors,
        queue_full_waits, max_queue_frames, max_queue_bytes, late_count, late_sum_ns, late_max_ns;
} counters_t;

typedef struct {
    int nports;
    int fds[MAX_PORTS];
    int64_t delay_ns;
    /* byte ring: frames are stored contiguously at off..off+len; head_off is the oldest frame's */
    uint8_t *ring;
    int64_t ring_cap, head_off, tail_off;
    /* descriptor ring */
    rec_t *recs;
    int64_t rec_cap, rec_head, rec_count;
    int64_t queued_bytes;
    mac_entry_t macs[MAC_SLOTS];
    counters_t c;
} line_t;

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static unsigned mac_hash(const uint8_t *m) {
    uint32_t h = 2166136261u;
    for (int i = 0; i < 6; i++) h = (h ^ m[i]) * 16777619u;
    return h & (MAC_SLOTS - 1);
}

static int mac_lookup(const line_t *L, const uint8_t *m) {
    for (unsigned i = mac_hash(m), n = 0; n < MAC_SLOTS; i = (i + 1) & (MAC_SLOTS - 1), n++) {
        if (L->macs[i].port < 0) return -1;
        if (memcmp(L->macs[i].mac, m, 6) == 0) return L->macs[i].port;
    }
    return -1;
}

/* A full table stops learning: unknown addresses are flooded, which is still correct. */
static void mac_learn(line_t *L, const uint8_t *m, int port) {
    for (unsigned i = mac_hash(m), n = 0; n < MAC_SLOTS; i = (i + 1) & (MAC_SLOTS - 1), n++) {
        if (L->macs[i].port < 0) {
            memcpy(L->macs[i].mac, m, 6);
            L->macs[i].port = (int16_t)port;
            return;
        }
        if (memcmp(L->macs[i].mac, m, 6) == 0) {
            L->macs[i].port = (int16_t)port; /* a host that moved */
            return;
        }
    }
}

/* Where the next frame (at most FRAME_MAX bytes) goes in the byte ring, or -1 when it is full. The
 * stored frames always form one run head_off..tail_off, or two: head_off..end and 0..tail_off. */
static int64_t ring_alloc(const line_t *L) {
    if (L->rec_count == L->rec_cap) return -1;
    if (L->rec_count == 0) return 0;
    if (L->tail_off > L->head_off) { /* one run: room after it, else wrap to the start */
        if (L->ring_cap - L->tail_off >= FRAME_MAX) return L->tail_off;
        return L->head_off > FRAME_MAX ? 0 : -1;
    }
    /* two runs: the gap between them; strictly larger, so tail never meets head */
    return L->head_off - L->tail_off > FRAME_MAX ? L->tail_off : -1;
}

static void send_one(line_t *L, int port, const uint8_t *buf, int32_t len) {
    for (;;) {
        ssize_t n = send(L->fds[port], buf, (size_t)len, 0);
        if (n >= 0) {
            L->c.tx_frames++;
            L->c.tx_bytes += (unsigned long long)(len - VNET_LEN);
            return;
        }
        if (errno != EINTR) break;
    }
    /* EAGAIN: SO_SNDTIMEO ran out; ENOBUFS: the peer's backlog dropped it. Either way the frame is lost,
     * as on a real link, and TCP recovers. */
    L->c.send_errors++;
}

static void forward_head(line_t *L, int64_t now) {
    const rec_t *r = &L->recs[L->rec_head];
    const uint8_t *buf = L->ring + r->off;
    const uint8_t *eth = buf + VNET_LEN;
    int64_t late = now - r->due_ns;
    L->c.late_count++;
    L->c.late_sum_ns += (unsigned long long)late;
    if ((unsigned long long)late > L->c.late_max_ns) L->c.late_max_ns = (unsigned long long)late;
    int dst = (eth[0] & 1) ? -1 : mac_lookup(L, eth);
    if (dst == r->port) {
        L->c.same_port++; /* a switch never sends a frame back out of the port it came in on */
    } else if (dst >= 0) {
        send_one(L, dst, buf, r->len);
    } else {
        L->c.flooded++;
        for (int p = 0; p < L->nports; p++)
            if (p != r->port) send_one(L, p, buf, r->len);
    }
    L->queued_bytes -= r->len;
    L->rec_head = (L->rec_head + 1) % L->rec_cap;
    if (--L->rec_count == 0)
        L->head_off = L->tail_off = 0;
    else
        L->head_off = L->recs[L->rec_head].off;
}

/* Reads one frame from `port` into the queue: 1 read, 0 nothing to read, -1 error (errno set). */
static int read_one(line_t *L, int port, int64_t off) {
    uint8_t *buf = L->ring + off;
    struct iovec iov = {.iov_base = buf, .iov_len = FRAME_MAX};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};
    ssize_t n;
    do {
        n = recvmsg(L->fds[port], &msg, MSG_DONTWAIT | MSG_TRUNC);
    } while (n < 0 && errno == EINTR);
    if (n < 0) return (errno == EAGAIN || errno == EWOULDBLOCK) ? 0 : -1;
    if (n > FRAME_MAX || (msg.msg_flags & MSG_TRUNC)) {
        L->c.oversize++;
        return 1;
    }
    if (n < VNET_LEN + ETH_HLEN) return 1; /* a runt: nothing to forward */
    int64_t now = now_ns();
    const uint8_t *eth = buf + VNET_LEN;
    if (!(eth[6] & 1)) mac_learn(L, eth + 6, port);
    int64_t slot = (L->rec_head + L->rec_count) % L->rec_cap;
    L->recs[slot] = (rec_t){.due_ns = now + L->delay_ns, .off = off, .len = (int32_t)n, .port = port};
    if (L->rec_count == 0) L->head_off = off;
    L->rec_count++;
    L->tail_off = off + ((n + 7) & ~7);
    L->queued_bytes += n;
    L->c.rx_frames++;
    L->c.rx_bytes += (unsigned long long)(n - VNET_LEN);
    if ((unsigned long long)L->rec_count > L->c.max_queue_frames) L->c.max_queue_frames = L->rec_count;
    if ((unsigned long long)L->queued_bytes > L->c.max_queue_bytes) L->c.max_queue_bytes = L->queued_bytes;
    return 1;
}

static int open_port(const char *name, char *err, size_t errlen) {
    unsigned idx = if_nametoindex(name);
    if (idx == 0) {
        snprintf(err, errlen, "no interface %s here: %s", name, strerror(errno));
        return -1;
    }
    int fd = socket(AF_PACKET, SOCK_RAW | SOCK_CLOEXEC, htons(ETH_P_ALL));
    if (fd < 0) {
        snprintf(err, errlen, "AF_PACKET socket: %s (needs CAP_NET_RAW)", strerror(errno));
        return -1;
    }
    int one = 1, buf = SOCK_BUF;
    struct timeval tv = {.tv_sec = 0, .tv_usec = SEND_TIMEOUT_MS * 1000};
    struct sockaddr_ll sll = {.sll_family = AF_PACKET, .sll_protocol = htons(ETH_P_ALL), .sll_ifindex = (int)idx};
    struct packet_mreq mr = {.mr_ifindex = (int)idx, .mr_type = PACKET_MR_PROMISC};
    const char *what = NULL;
    /* Options before bind: vnet headers cannot be switched on once the socket is bound to a ring. */
    if (setsockopt(fd, SOL_PACKET, PACKET_VNET_HDR, &one, sizeof one) < 0)
        what = "PACKET_VNET_HDR";
    else if (setsockopt(fd, SOL_PACKET, PACKET_IGNORE_OUTGOING, &one, sizeof one) < 0)
        what = "PACKET_IGNORE_OUTGOING";
    /* FORCE variants (root) go past net.core.[rw]mem_max: a 0.5 ms line at several Gbit/s holds MBs. */
    else if (setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &buf, sizeof buf) < 0 &&
             setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buf, sizeof buf) < 0)
        what = "SO_RCVBUF";
    else if (setsockopt(fd, SOL_SOCKET, SO_SNDBUFFORCE, &buf, sizeof buf) < 0 &&
             setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buf, sizeof buf) < 0)
        what = "SO_SNDBUF";
    else if (setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv) < 0)
        what = "SO_SNDTIMEO";
    else if (bind(fd, (struct sockaddr *)&sll, sizeof sll) < 0)
        what = "bind";
    /* A veth hands every frame up anyway; promiscuous mode says so for any other kind of port. */
    else if (setsockopt(fd, SOL_PACKET, PACKET_ADD_MEMBERSHIP, &mr, sizeof mr) < 0)
        what = "PACKET_MR_PROMISC";
    if (what) {
        snprintf(err, errlen, "port %s: %s: %s", name, what, strerror(errno));
        close(fd);
        return -1;
    }
    return fd;
}

/* The switch until stop_fd is readable. Returns 0, or -1 with err filled (errno-style failure), or
 * -2 when a signal handler raised (checked with the GIL held). */
static int run_loop(line_t *L, int stop_fd, char *err, size_t errlen, PyThreadState **ts) {
    struct pollfd pfd[MAX_PORTS + 1];
    int next_port = 0; /* round-robin start, so one busy port cannot starve the others */
    for (;;) {
        int64_t now = now_ns();
        while (L->rec_count && L->recs[L->rec_head].due_ns <= now) {
            forward_head(L, now);
            now = now_ns();
        }
        int can_read = ring_alloc(L) >= 0;
        if (!can_read) L->c.queue_full_waits++;
        pfd[0] = (struct pollfd){.fd = stop_fd, .events = POLLIN};
        for (int p = 0; p < L->nports; p++)
            pfd[p + 1] = (struct pollfd){.fd = L->fds[p], .events = can_read ? POLLIN : 0};
        struct timespec tmo, *tp = NULL;
        if (L->rec_count) {
            int64_t wait = L->recs[L->rec_head].due_ns - now;
            if (wait < 0) wait = 0;
            tmo.tv_sec = wait / 1000000000LL;
            tmo.tv_nsec = wait % 1000000000LL;
            tp = &tmo;
        }
        int n = ppoll(pfd, (nfds_t)L->nports + 1, tp, NULL);
        if (n < 0) {
            if (errno != EINTR) {
                snprintf(err, errlen, "ppoll: %s", strerror(errno));
                return -1;
            }
            /* A signal: let Python's handler run (SIGINT's raises KeyboardInterrupt). */
            PyEval_RestoreThread(*ts);
            int bad = PyErr_CheckSignals();
            *ts = PyEval_SaveThread();
            if (bad < 0) return -2;
            continue;
        }
        if (n == 0) continue;
        if (pfd[0].revents) return 0;
        for (int p = 0; p < L->nports; p++) {
            if (pfd[p + 1].revents & (POLLERR | POLLHUP | POLLNVAL)) {
                int e = 0;
                socklen_t el = sizeof e;
                getsockopt(L->fds[p], SOL_SOCKET, SO_ERROR, &e, &el);
                snprintf(err, errlen, "port %d failed: %s", p, e ? strerror(e) : "hang-up");
                return -1;
            }
        }
        /* Read what is there, one frame per readable port in turn, at most RECV_BATCH frames before
         * the due frames are looked at again. */
        int busy[MAX_PORTS], nbusy = 0;
        for (int k = 0; k < L->nports; k++) {
            int p = (next_port + k) % L->nports;
            if (pfd[p + 1].revents & POLLIN) busy[nbusy++] = p;
        }
        next_port = (next_port + 1) % L->nports;
        for (int got = 0; nbusy && got < RECV_BATCH;) {
            for (int k = 0; k < nbusy && got < RECV_BATCH;) {
                int64_t off = ring_alloc(L);
                if (off < 0) {
                    nbusy = 0;
                    break;
                }
                int r = read_one(L, busy[k], off);
                if (r < 0) {
                    snprintf(err, errlen, "recv on port %d: %s", busy[k], strerror(errno));
                    return -1;
                }
                if (r == 0) {
                    busy[k] = busy[--nbusy]; /* drained */
                } else {
                    got++;
                    k++;
                }
            }
        }
    }
}

#define COUNTER(name) {#name, offsetof(counters_t, name)}
static const struct {
    const char *name;
    size_t off;
} COUNTERS[] = {
    COUNTER(rx_frames),     COUNTER(rx_bytes),         COUNTER(tx_frames),        COUNTER(tx_bytes),
    COUNTER(flooded),       COUNTER(same_port),        COUNTER(oversize),         COUNTER(send_errors),
    COUNTER(queue_full_waits), COUNTER(max_queue_frames), COUNTER(max_queue_bytes), COUNTER(late_count),
    COUNTER(late_sum_ns),   COUNTER(late_max_ns),
};

static PyObject *counters_dict(const counters_t *c) {
    PyObject *d = PyDict_New();
    if (d == NULL) return NULL;
    for (size_t i = 0; i < sizeof COUNTERS / sizeof COUNTERS[0]; i++) {
        unsigned long long v = *(const unsigned long long *)((const char *)c + COUNTERS[i].off);
        PyObject *o = PyLong_FromUnsignedLongLong(v);
        if (o == NULL || PyDict_SetItemString(d, COUNTERS[i].name, o) < 0) {
            Py_XDECREF(o);
            Py_DECREF(d);
            return NULL;
        }
        Py_DECREF(o);
    }
    return d;
}

static void line_free(line_t *L) {
    for (int p = 0; p < L->nports; p++)
        if (L->fds[p] >= 0) close(L->fds[p]);
    if (L->ring) munmap(L->ring, (size_t)L->ring_cap);
    if (L->recs) munmap(L->recs, (size_t)L->rec_cap * sizeof(rec_t));
    PyMem_Free(L);
}

static PyObject *run(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kwlist[] = {"ifnames", "delay_ns", "stop_fd", "ready_fd", "queue_bytes", NULL};
    PyObject *names;
    long long delay_ns, queue_bytes = DEFAULT_QUEUE_BYTES;
    int stop_fd, ready_fd = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OLi|iL", kwlist, &names, &delay_ns, &stop_fd, &ready_fd,
                                     &queue_bytes))
        return NULL;
    PyObject *seq = PySequence_Fast(names, "ifnames must be a sequence of interface names");
    if (seq == NULL) return NULL;
    Py_ssize_t np = PySequence_Fast_GET_SIZE(seq);
    if (np < 2 || np > MAX_PORTS) {
        Py_DECREF(seq);
        return PyErr_Format(PyExc_ValueError, "ifnames: 2..%d ports, not %zd", MAX_PORTS, np);
    }
    if (delay_ns < 0 || delay_ns > MAX_DELAY_NS) {
        Py_DECREF(seq);
        return PyErr_Format(PyExc_ValueError, "delay_ns must be 0..%lld, not %lld", MAX_DELAY_NS, delay_ns);
    }
    if (queue_bytes < 4 * FRAME_MAX || queue_bytes > (1LL << 34)) {
        Py_DECREF(seq);
        return PyErr_Format(PyExc_ValueError, "queue_bytes %lld out of range", queue_bytes);
    }
    line_t *L = PyMem_Calloc(1, sizeof *L);
    if (L == NULL) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    L->delay_ns = delay_ns;
    for (int i = 0; i < MAC_SLOTS; i++) L->macs[i].port = -1;
    for (int p = 0; p < MAX_PORTS; p++) L->fds[p] = -1;
    char err[256] = "";
    for (Py_ssize_t i = 0; i < np; i++) {
        const char *name = PyUnicode_AsUTF8(PySequence_Fast_GET_ITEM(seq, i));
        if (name == NULL) {
            Py_DECREF(seq);
            line_free(L);
            return NULL;
        }
        int fd = open_port(name, err, sizeof err);
        if (fd < 0) {
            Py_DECREF(seq);
            line_free(L);
            return PyErr_Format(PyExc_OSError, "delay line: %s", err);
        }
        L->fds[L->nports++] = fd;
    }
    Py_DECREF(seq);
    /* Anonymous mappings: pages are touched only as far as the queue ever grows. */
    L->ring_cap = queue_bytes;
    L->rec_cap = queue_bytes / 64 + 16; /* more than enough descriptors: a frame takes >= 60 bytes */
    void *ring = mmap(NULL, (size_t)L->ring_cap, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    void *recs = mmap(NULL, (size_t)L->rec_cap * sizeof(rec_t), PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    L->ring = ring == MAP_FAILED ? NULL : ring;
    L->recs = recs == MAP_FAILED ? NULL : recs;
    if (L->ring == NULL || L->recs == NULL) {
        line_free(L);
        return PyErr_NoMemory();
    }
    /* Precise wake-ups: the default 50 us slack is a tenth of the delay being emulated. */
    prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
    if (ready_fd >= 0) {
        static const char ready[] = "ready\n";
        if (write(ready_fd, ready, sizeof ready - 1) < 0) {
            line_free(L);
            return PyErr_SetFromErrno(PyExc_OSError);
        }
    }
    PyThreadState *ts = PyEval_SaveThread();
    int rc = run_loop(L, stop_fd, err, sizeof err, &ts);
    PyEval_RestoreThread(ts);
    if (rc == -2) {
        line_free(L);
        return NULL; /* the signal handler's exception */
    }
    if (rc == -1) {
        line_free(L);
        return PyErr_Format(PyExc_OSError, "delay line: %s", err);
    }
    PyObject *d = counters_dict(&L->c);
    line_free(L);
    return d;
}

static PyMethodDef methods[] = {
    {"run", (PyCFunction)(void (*)(void))run, METH_VARARGS | METH_KEYWORDS,
     "run(ifnames, delay_ns, stop_fd, ready_fd=-1, queue_bytes=64 MiB) -> counters\n\n"
     "Switch frames between the named interfaces, each held delay_ns, until stop_fd is readable.\n"
     "Writes \"ready\\n\" to ready_fd once every port is open. Releases the GIL while it runs."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_delayline", "Compiled delay line of the simulated cluster.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__delayline(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddIntConstant(m, "MAX_PORTS", MAX_PORTS) < 0 ||
        PyModule_AddIntConstant(m, "FRAME_MAX", (long)FRAME_MAX) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

/* The software GPU's shared state: devices and contexts, memory with a happens-before race
 * detector, streams run by worker threads, and the violation report. The driver entry points
 * (driver.cpp), the kernels (kernels.cpp) and NCCL (nccl.cpp) are built on it. */
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace sim {

/* Reports a misuse of the programming model (a race, an access outside a live allocation, a
 * wrong launch, a hang) on stderr and aborts the process: a test can never pass over one. */
[[noreturn]] void violation(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* Settings read once from the environment (docs/cuda.md lists them). */
struct Config {
    int devices = 2;
    int sms = 2;
    int cc_major = 8, cc_minor = 0;
    bool memory_pools = true;
    unsigned delay_us = 0; /* max random delay before each stream operation */
    unsigned timeout_s = 60; /* a wait longer than this is reported as a hang */
    int driver_version = 12080; /* what cuDriverGetVersion reports: 13000 runs NVRTC 13's CUBINs */
    bool reset_refuses_push = false; /* a reset primary context cannot be pushed until retained again */
};
const Config &config();

struct Stream;
struct Context;

struct Device {
    int ordinal;
    Context *primary;
    /* Devices granted access to this device's default memory pool (always itself). */
    std::vector<bool> pool_access;
};

struct Context {
    Device *device;
    Stream *legacy; /* the NULL stream */
    std::vector<Stream *> streams; /* blocking streams created in it, for the legacy stream's rule */
    bool reset = false; /* reset and not retained since */
};

Device &device(int ordinal);
Context *current_context();

/* A vector clock over streams: entry s is the last operation of stream s that happened before. */
using Clock = std::map<uint32_t, uint64_t>;
void join(Clock &into, const Clock &other);

/* What an operation touches; checked and recorded when it runs. */
class Footprint {
public:
    Footprint(int device, std::string what, uint32_t stream, uint64_t seq, const Clock *clock)
        : device_(device), what_(std::move(what)), stream_(stream), seq_(seq), clock_(clock) {}
    /* Declares a read or write of `bytes` at device address `ptr` (null with 0 bytes is allowed):
     * it must lie inside one live allocation this device may access, and must not race with an
     * access of another stream that is not ordered before this operation. */
    void read(const void *ptr, uint64_t bytes) { access((uint64_t)(uintptr_t)ptr, bytes, false); }
    void write(const void *ptr, uint64_t bytes) { access((uint64_t)(uintptr_t)ptr, bytes, true); }
    void access(uint64_t ptr, uint64_t bytes, bool write);
    /* Checks as `access`, on behalf of `device` (a peer reading this rank's buffer in a collective). */
    void peer_access(uint64_t ptr, uint64_t bytes, int device);
    const std::string &what() const { return what_; }

private:
    int device_;
    std::string what_;
    uint32_t stream_;
    uint64_t seq_;
    const Clock *clock_;
};

struct Op {
    std::string what;
    std::function<void(Footprint &)> footprint; /* may be empty */
    std::function<void()> run;                  /* may be empty */
    /* A graph node that acts when the graph is launched (an external event record or wait):
     * called with the launch's stream instead of enqueuing this op. */
    std::function<void(Stream *)> at_launch;
};

/* Stream handle resolution: NULL/0x1 = the context's legacy stream, 0x2 = this thread's
 * per-thread stream, else a created stream that must belong to `ctx`. Null when invalid. */
Stream *resolve_stream(void *handle, Context *ctx);
/* Enqueues `op` after the stream's earlier work (and the legacy stream's rule); returns its
 * sequence number on the stream. */
uint64_t enqueue(Stream *s, Op op);
/* Makes `s` wait for operation `seq` of `other` (an event), joining its clock. */
void enqueue_wait(Stream *s, Stream *other, uint64_t seq, const Clock &clock);
/* CUDA graph capture on a stream: operations enqueued while capturing are recorded, not run;
 * a launch of the graph enqueues copies of them. A capture an operation could not join (a
 * pageable copy, a synchronisation) is invalidated, as on hardware. */
using Graph = std::vector<Op>;
bool begin_capture(Stream *s);                  /* false when already capturing */
std::unique_ptr<Graph> end_capture(Stream *s);  /* null when invalidated or not capturing */
int capture_status(Stream *s);                  /* 0 none, 1 active, 2 invalidated */
uint64_t capture_id(Stream *s);                 /* the active capture's number, unique; 0 none */
void invalidate_capture(Stream *s);
/* Host waits: for operation `seq` of `s` (0 = everything enqueued so far). */
void host_wait(Stream *s, uint64_t seq = 0);
bool done(Stream *s, uint64_t seq);
uint64_t last_enqueued(Stream *s);
Clock clock_of(Stream *s);
Stream *create_stream(Context *ctx, bool blocking);
void destroy_stream(Stream *s);
/* Every stream of `device` drained (cuMemFree's implicit synchronisation). */
void device_synchronize(int device);

/* Memory. */
uint64_t allocate(int device, uint64_t bytes, bool pool);
/* The live allocation holding [ptr, ptr + bytes) on `device` (any device when -1); 0 when none,
 * with the reason in `why`. */
uint64_t find_live(uint64_t ptr, uint64_t bytes, int device, std::string *why);
bool mark_free_enqueued(uint64_t base);
/* The process-unique id of the live allocation holding `ptr` (CU_POINTER_ATTRIBUTE_BUFFER_ID), 0
 * when none. */
uint64_t buffer_id(uint64_t ptr);
/* Whether `ptr` is inside an allocation a primary context reset freed: using it is an error the
 * driver returns, not a violation. */
bool freed_by_reset(uint64_t ptr);
/* cuDevicePrimaryCtxReset: every live allocation of `device` freed, every stream created in `ctx`
 * gone (after draining it), and the device's pool grants withdrawn. */
void reset_context(Context *ctx);
uint64_t allocation_bytes(uint64_t base);
void release(uint64_t base); /* the free, as it executes: poison and quarantine */

/* Blocks run their threads as fibers, with real barriers (fiber.cpp). */
struct Dim3 {
    unsigned x = 1, y = 1, z = 1;
};
void run_block(Dim3 grid, Dim3 block, Dim3 block_dim, const std::function<void()> &body);
Dim3 thread_idx();
Dim3 block_idx();
Dim3 block_dim();
Dim3 grid_dim();
int barrier(int predicate); /* __syncthreads_or */
uint64_t shuffle_down(uint64_t bits, unsigned mask, unsigned delta, int width);

} // namespace sim

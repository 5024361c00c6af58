/* The CUDA driver entry points the project calls, and nothing else: any other symbol is missing,
 * so a caller that needs one fails loudly. Each call checks its arguments as the real driver does
 * (a current context, streams of that context, live allocations) and returns its status codes;
 * misuse the hardware would not report at once (races, stale pointers) is a violation. */
#include <cstdio>
#include <cstring>
#include <mutex>
#include <map>
#include <set>

#include "image.h"
#include "kernels.h"
#include "sim.h"

#define EXPORT extern "C" __attribute__((visibility("default")))

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef sim::Context *CUcontext;
typedef void *CUstream;
typedef struct Event *CUevent;
typedef struct Module *CUmodule;
typedef struct Function *CUfunction;
typedef sim::Device *CUmemoryPool;

enum : CUresult {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_IMAGE = 200,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_NO_BINARY_FOR_GPU = 209,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_NOT_FOUND = 500,
    CUDA_ERROR_NOT_READY = 600,
    CUDA_ERROR_CONTEXT_IS_DESTROYED = 709,
    CUDA_ERROR_NOT_SUPPORTED = 801,
    CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900,
    CUDA_ERROR_STREAM_CAPTURE_INVALIDATED = 901,
    CUDA_ERROR_STREAM_CAPTURE_MERGE = 902,
    CUDA_ERROR_STREAM_CAPTURE_ISOLATION = 905,
};

struct Event {
    sim::Context *ctx;
    sim::Stream *stream = nullptr; /* of the last record */
    uint64_t seq = 0;
    sim::Clock clock;
    uint64_t capture = 0; /* the capture the last record was made in (a capture-internal record), or 0 */
};

struct Module {
    sim::Image image;
    sim::Context *ctx = nullptr;
};

struct Function {
    const sim::KernelInfo *kernel;
    sim::ImageKernel image;
    sim::Context *ctx;
};

namespace {

bool initialised = false;
thread_local std::vector<sim::Context *> context_stack;

/* The current context, or the status a call without one returns. */
CUresult need_context(sim::Context **ctx) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    *ctx = sim::current_context();
    return *ctx ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}

/* The current context and `handle` resolved in it. */
CUresult need_stream(CUstream handle, sim::Context **ctx, sim::Stream **stream) {
    if (CUresult r = need_context(ctx)) return r;
    *stream = sim::resolve_stream(handle, *ctx);
    return *stream ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

/* A call a capture cannot record (pageable copies, host waits): it invalidates the capture. */
CUresult refuse_if_capturing(sim::Stream *stream) {
    if (sim::capture_status(stream) == 0) return CUDA_SUCCESS;
    sim::invalidate_capture(stream);
    return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
}

/* The checks of a call on device `device` writing through `out`. */
CUresult need_device(const void *out, int device) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    if (!out) return CUDA_ERROR_INVALID_VALUE;
    return device < 0 || device >= sim::config().devices ? CUDA_ERROR_INVALID_DEVICE : CUDA_SUCCESS;
}

int current_device() { return sim::current_context()->device->ordinal; }

/* A device range the host names in a copy or fill: must be live now (a violation otherwise), but
 * memory a primary context reset freed is an error the driver returns. */
CUresult check_device_range(const char *call, CUdeviceptr ptr, size_t bytes) {
    std::string why;
    if (!bytes || sim::find_live(ptr, bytes, -1, &why)) return CUDA_SUCCESS;
    if (sim::freed_by_reset(ptr)) return CUDA_ERROR_INVALID_VALUE;
    sim::violation("%s: %s", call, why.c_str());
}

/* Modules, functions and events alive now: a primary context reset destroys its context's, and
 * their handles are then invalid (CUDA_ERROR_INVALID_HANDLE), not dangling. */
std::mutex &handles_mutex = *new std::mutex;
std::map<const void *, sim::Context *> &live_handles = *new std::map<const void *, sim::Context *>;

void handle_created(const void *h, sim::Context *ctx) {
    std::lock_guard<std::mutex> lock(handles_mutex);
    live_handles[h] = ctx;
}

bool handle_live(const void *h) {
    std::lock_guard<std::mutex> lock(handles_mutex);
    return live_handles.count(h) != 0;
}

bool handle_destroyed(const void *h) {
    std::lock_guard<std::mutex> lock(handles_mutex);
    return live_handles.erase(h) != 0;
}

} // namespace

sim::Context *sim::current_context() { return context_stack.empty() ? nullptr : context_stack.back(); }

EXPORT CUresult cuInit(unsigned flags) {
    if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
    sim::device(0);
    initialised = true;
    return CUDA_SUCCESS;
}

/* NVRTC opens libcuda.so.1 and asks for an internal table: there is none here. */
EXPORT CUresult cuGetExportTable(const void **table, const void *id) {
    if (table) *table = nullptr;
    return CUDA_ERROR_NOT_SUPPORTED;
}

EXPORT CUresult cuDriverGetVersion(int *version) {
    if (!version) return CUDA_ERROR_INVALID_VALUE;
    *version = sim::config().driver_version;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuGetErrorString(CUresult error, const char **text) {
    if (!text) return CUDA_ERROR_INVALID_VALUE;
    switch (error) {
    case CUDA_SUCCESS: *text = "no error"; break;
    case CUDA_ERROR_INVALID_VALUE: *text = "invalid argument"; break;
    case CUDA_ERROR_OUT_OF_MEMORY: *text = "out of memory"; break;
    case CUDA_ERROR_NOT_INITIALIZED: *text = "initialization error"; break;
    case CUDA_ERROR_INVALID_DEVICE: *text = "invalid device ordinal"; break;
    case CUDA_ERROR_INVALID_IMAGE: *text = "device kernel image is invalid"; break;
    case CUDA_ERROR_INVALID_CONTEXT: *text = "invalid device context"; break;
    case CUDA_ERROR_NO_BINARY_FOR_GPU: *text = "no kernel image is available for execution on the device"; break;
    case CUDA_ERROR_INVALID_HANDLE: *text = "invalid resource handle"; break;
    case CUDA_ERROR_CONTEXT_IS_DESTROYED: *text = "context is destroyed"; break;
    case CUDA_ERROR_NOT_FOUND: *text = "named symbol not found"; break;
    case CUDA_ERROR_NOT_READY: *text = "device not ready"; break;
    case CUDA_ERROR_NOT_SUPPORTED: *text = "operation not supported"; break;
    case CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED: *text = "operation not permitted when stream is capturing"; break;
    case CUDA_ERROR_STREAM_CAPTURE_INVALIDATED: *text = "operation failed due to a previous error during capture"; break;
    case CUDA_ERROR_STREAM_CAPTURE_MERGE: *text = "operation would result in a merge of separate capture sequences"; break;
    case CUDA_ERROR_STREAM_CAPTURE_ISOLATION: *text = "dependency created on uncaptured work in another stream"; break;
    default: *text = nullptr; return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetCount(int *count) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    if (!count) return CUDA_ERROR_INVALID_VALUE;
    *count = sim::config().devices;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGet(CUdevice *device, int ordinal) {
    if (CUresult r = need_device(device, ordinal)) return r;
    *device = ordinal;
    return CUDA_SUCCESS;
}

/* CUdevice_attribute values the project asks for. */
enum { ATTR_MULTIPROCESSOR_COUNT = 16, ATTR_CC_MAJOR = 75, ATTR_CC_MINOR = 76, ATTR_MEMORY_POOLS_SUPPORTED = 115 };

EXPORT CUresult cuDeviceGetAttribute(int *value, int attribute, CUdevice device) {
    if (CUresult r = need_device(value, device)) return r;
    const auto &c = sim::config();
    switch (attribute) {
    case ATTR_MULTIPROCESSOR_COUNT: *value = c.sms; break;
    case ATTR_CC_MAJOR: *value = c.cc_major; break;
    case ATTR_CC_MINOR: *value = c.cc_minor; break;
    case ATTR_MEMORY_POOLS_SUPPORTED: *value = c.memory_pools; break;
    default: sim::violation("cuDeviceGetAttribute(%d): an attribute the software GPU does not model", attribute);
    }
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice device) {
    if (CUresult r = need_device(ctx, device)) return r;
    *ctx = sim::device(device).primary;
    (*ctx)->reset = false;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice device) {
    return need_device(&device, device);
}

/* cudaDeviceReset's driver call: the primary context stays (its handle and retains too), but
 * everything made in it is destroyed: memory, streams, events, modules and their functions. */
EXPORT CUresult cuDevicePrimaryCtxReset_v2(CUdevice device) {
    if (CUresult r = need_device(&device, device)) return r;
    sim::Context *ctx = sim::device(device).primary;
    sim::reset_context(ctx);
    ctx->reset = true;
    std::lock_guard<std::mutex> lock(handles_mutex);
    for (auto it = live_handles.begin(); it != live_handles.end();) it = it->second == ctx ? live_handles.erase(it) : std::next(it);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxPushCurrent_v2(CUcontext ctx) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    if (!ctx) return CUDA_ERROR_INVALID_CONTEXT;
    if (ctx->reset && sim::config().reset_refuses_push) return CUDA_ERROR_CONTEXT_IS_DESTROYED;
    context_stack.push_back(ctx);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxPopCurrent_v2(CUcontext *ctx) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    if (context_stack.empty()) return CUDA_ERROR_INVALID_CONTEXT;
    if (ctx) *ctx = context_stack.back();
    context_stack.pop_back();
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxGetCurrent(CUcontext *ctx) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    if (!ctx) return CUDA_ERROR_INVALID_VALUE;
    *ctx = sim::current_context();
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxSetCurrent(CUcontext ctx) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    if (!context_stack.empty()) context_stack.pop_back();
    if (ctx) context_stack.push_back(ctx);
    return CUDA_SUCCESS;
}

/* ---- Memory ---- */

EXPORT CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool, CUdevice device) {
    if (CUresult r = need_device(pool, device)) return r;
    if (!sim::config().memory_pools) return CUDA_ERROR_NOT_SUPPORTED;
    *pool = &sim::device(device);
    return CUDA_SUCCESS;
}

/* CUmemAccessDesc: {CUmemLocation {int type; int id;}, int flags}. */
struct MemAccessDesc {
    int location_type;
    int location_id;
    int flags;
};
enum { LOCATION_DEVICE = 1, ACCESS_NONE = 0, ACCESS_READWRITE = 3 };

EXPORT CUresult cuMemPoolSetAccess(CUmemoryPool pool, const MemAccessDesc *map, size_t count) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    if (!pool || (!map && count)) return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < count; ++i) {
        const auto &d = map[i];
        if (d.location_type != LOCATION_DEVICE || d.location_id < 0 || d.location_id >= sim::config().devices) return CUDA_ERROR_INVALID_VALUE;
        if (d.flags != ACCESS_NONE && d.flags != ACCESS_READWRITE) return CUDA_ERROR_INVALID_VALUE;
        if (d.location_id == pool->ordinal) {
            if (d.flags != ACCESS_READWRITE) return CUDA_ERROR_INVALID_DEVICE; /* the owner keeps its access */
            continue;
        }
        pool->pool_access[d.location_id] = d.flags == ACCESS_READWRITE;
    }
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemAllocAsync(CUdeviceptr *ptr, size_t bytes, CUstream handle) {
    sim::Context *ctx;
    sim::Stream *stream;
    if (CUresult r = need_stream(handle, &ctx, &stream)) return r;
    if (sim::capture_status(stream)) sim::violation("%s during a capture: graph memory nodes are not modelled", __func__);
    if (!ptr || bytes == 0) return CUDA_ERROR_INVALID_VALUE;
    if (!sim::config().memory_pools) return CUDA_ERROR_NOT_SUPPORTED;
    uint64_t p = sim::allocate(ctx->device->ordinal, bytes, true);
    if (!p) return CUDA_ERROR_OUT_OF_MEMORY;
    /* Usable in stream order from here: another stream must wait for this point. */
    sim::enqueue(stream, sim::Op{"cuMemAllocAsync", [p, bytes](sim::Footprint &f) { f.access(p, bytes, true); }, nullptr});
    *ptr = p;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemFreeAsync(CUdeviceptr ptr, CUstream handle) {
    sim::Context *ctx;
    sim::Stream *stream;
    if (CUresult r = need_stream(handle, &ctx, &stream)) return r;
    if (sim::capture_status(stream)) sim::violation("%s during a capture: graph memory nodes are not modelled", __func__);
    if (sim::freed_by_reset(ptr)) return CUDA_ERROR_INVALID_VALUE;
    std::string why;
    uint64_t base = sim::find_live(ptr, 0, -1, &why);
    if (base != ptr || !sim::mark_free_enqueued(ptr)) sim::violation("cuMemFreeAsync(%#llx): %s", ptr, base ? "not the start of an allocation" : why.c_str());
    uint64_t bytes = sim::allocation_bytes(ptr);
    sim::enqueue(stream, sim::Op{"cuMemFreeAsync", [ptr, bytes](sim::Footprint &f) { f.access(ptr, bytes, true); },
                                 [ptr] { sim::release(ptr); }});
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *ptr, size_t bytes) {
    sim::Context *ctx;
    if (CUresult r = need_context(&ctx)) return r;
    if (!ptr || bytes == 0) return CUDA_ERROR_INVALID_VALUE;
    uint64_t p = sim::allocate(ctx->device->ordinal, bytes, false);
    if (!p) return CUDA_ERROR_OUT_OF_MEMORY;
    *ptr = p;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemFree_v2(CUdeviceptr ptr) {
    sim::Context *ctx;
    if (CUresult r = need_context(&ctx)) return r;
    if (sim::freed_by_reset(ptr)) return CUDA_ERROR_INVALID_VALUE;
    std::string why;
    uint64_t base = sim::find_live(ptr, 0, -1, &why);
    if (base != ptr || !sim::mark_free_enqueued(ptr)) sim::violation("cuMemFree(%#llx): %s", ptr, base ? "not the start of an allocation" : why.c_str());
    /* cuMemFree synchronises: every stream of the device has finished with the memory. */
    for (int d = 0; d < sim::config().devices; ++d) sim::device_synchronize(d);
    sim::release(ptr);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemsetD8Async(CUdeviceptr ptr, unsigned char value, size_t count, CUstream handle) {
    sim::Context *ctx;
    sim::Stream *stream;
    if (CUresult r = need_stream(handle, &ctx, &stream)) return r;
    if (CUresult r = check_device_range("cuMemsetD8Async", ptr, count)) return r;
    sim::enqueue(stream, sim::Op{"cuMemsetD8Async", [=](sim::Footprint &f) { f.access(ptr, count, true); },
                                 [=] { memset((void *)(uintptr_t)ptr, value, count); }});
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemsetD32Async(CUdeviceptr ptr, unsigned value, size_t count, CUstream handle) {
    sim::Context *ctx;
    sim::Stream *stream;
    if (CUresult r = need_stream(handle, &ctx, &stream)) return r;
    if (ptr % 4) return CUDA_ERROR_INVALID_VALUE;
    if (CUresult r = check_device_range("cuMemsetD32Async", ptr, count * 4)) return r;
    sim::enqueue(stream, sim::Op{"cuMemsetD32Async", [=](sim::Footprint &f) { f.access(ptr, count * 4, true); }, [=] {
                                     auto *p = (unsigned *)(uintptr_t)ptr;
                                     for (size_t i = 0; i < count; ++i) p[i] = value;
                                 }});
    return CUDA_SUCCESS;
}

/* Host memory is pageable: the source of a host-to-device copy is staged before the call returns. */
EXPORT CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t bytes, CUstream handle) {
    sim::Context *ctx;
    sim::Stream *stream;
    if (CUresult r = need_stream(handle, &ctx, &stream)) return r;
    if (CUresult r = refuse_if_capturing(stream)) return r;
    if (!src && bytes) return CUDA_ERROR_INVALID_VALUE;
    if (CUresult r = check_device_range("cuMemcpyHtoDAsync", dst, bytes)) return r;
    auto staged = std::make_shared<std::vector<uint8_t>>((const uint8_t *)src, (const uint8_t *)src + bytes);
    sim::enqueue(stream, sim::Op{"cuMemcpyHtoDAsync", [=](sim::Footprint &f) { f.access(dst, bytes, true); },
                                 [=] { memcpy((void *)(uintptr_t)dst, staged->data(), bytes); }});
    return CUDA_SUCCESS;
}

/* To pageable host memory: returns once the copy is done. */
EXPORT CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t bytes, CUstream handle) {
    sim::Context *ctx;
    sim::Stream *stream;
    if (CUresult r = need_stream(handle, &ctx, &stream)) return r;
    if (CUresult r = refuse_if_capturing(stream)) return r;
    if (!dst && bytes) return CUDA_ERROR_INVALID_VALUE;
    if (CUresult r = check_device_range("cuMemcpyDtoHAsync", src, bytes)) return r;
    uint64_t seq = sim::enqueue(stream, sim::Op{"cuMemcpyDtoHAsync", [=](sim::Footprint &f) { f.access(src, bytes, false); },
                                                [=] { memcpy(dst, (const void *)(uintptr_t)src, bytes); }});
    sim::host_wait(stream, seq);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream handle) {
    sim::Context *ctx;
    sim::Stream *stream;
    if (CUresult r = need_stream(handle, &ctx, &stream)) return r;
    if (CUresult r = check_device_range("cuMemcpyDtoDAsync", src, bytes)) return r;
    if (CUresult r = check_device_range("cuMemcpyDtoDAsync", dst, bytes)) return r;
    sim::enqueue(stream, sim::Op{"cuMemcpyDtoDAsync",
                                 [=](sim::Footprint &f) {
                                     f.access(src, bytes, false);
                                     f.access(dst, bytes, true);
                                 },
                                 [=] { memmove((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, bytes); }});
    return CUDA_SUCCESS;
}

enum { POINTER_ATTRIBUTE_BUFFER_ID = 7 };

/* Only CU_POINTER_ATTRIBUTE_BUFFER_ID: a process-unique id of the allocation holding `ptr`. */
EXPORT CUresult cuPointerGetAttribute(void *data, int attribute, CUdeviceptr ptr) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    if (!data) return CUDA_ERROR_INVALID_VALUE;
    if (attribute != POINTER_ATTRIBUTE_BUFFER_ID) sim::violation("cuPointerGetAttribute(%d): an attribute the software GPU does not model", attribute);
    uint64_t id = sim::buffer_id(ptr);
    if (!id) return CUDA_ERROR_INVALID_VALUE;
    *(unsigned long long *)data = id;
    return CUDA_SUCCESS;
}

/* ---- Streams and events ---- */

enum { STREAM_NON_BLOCKING = 1 };

EXPORT CUresult cuStreamCreate(CUstream *stream, unsigned flags) {
    sim::Context *ctx;
    if (CUresult r = need_context(&ctx)) return r;
    if (!stream || flags > STREAM_NON_BLOCKING) return CUDA_ERROR_INVALID_VALUE;
    *stream = sim::create_stream(ctx, !(flags & STREAM_NON_BLOCKING));
    return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamDestroy_v2(CUstream handle) {
    sim::Context *ctx;
    sim::Stream *stream;
    if ((uintptr_t)handle <= 2) return CUDA_ERROR_INVALID_HANDLE;
    if (CUresult r = need_stream(handle, &ctx, &stream)) return r;
    sim::destroy_stream(stream);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamSynchronize(CUstream handle) {
    sim::Context *ctx;
    sim::Stream *stream;
    if (CUresult r = need_stream(handle, &ctx, &stream)) return r;
    if (CUresult r = refuse_if_capturing(stream)) return r;
    sim::host_wait(stream);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamQuery(CUstream handle) {
    sim::Context *ctx;
    sim::Stream *stream;
    if (CUresult r = need_stream(handle, &ctx, &stream)) return r;
    if (CUresult r = refuse_if_capturing(stream)) return r;
    uint64_t last = sim::last_enqueued(stream);
    if (!sim::done(stream, last)) return CUDA_ERROR_NOT_READY;
    sim::host_wait(stream, last);
    return CUDA_SUCCESS;
}

enum { EVENT_DISABLE_TIMING = 2 };
/* CU_EVENT_RECORD_EXTERNAL and CU_EVENT_WAIT_EXTERNAL: during a capture, a graph node. */
enum { EVENT_EXTERNAL = 1 };

namespace {

/* A graph node that names a destroyed event is a violation when it runs. */
void check_live(Event *event, const char *node) {
    if (!handle_live(event)) sim::violation("a graph's %s node names an event that was destroyed", node);
}

void record_now(Event *event, sim::Stream *stream) {
    event->stream = stream;
    event->seq = sim::last_enqueued(stream);
    event->clock = sim::clock_of(stream);
    event->capture = 0;
}

} // namespace

EXPORT CUresult cuEventCreate(CUevent *event, unsigned flags) {
    sim::Context *ctx;
    if (CUresult r = need_context(&ctx)) return r;
    if (!event || (flags & ~3u)) return CUDA_ERROR_INVALID_VALUE;
    *event = new Event{ctx};
    handle_created(*event, ctx);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuEventDestroy_v2(CUevent event) {
    sim::Context *ctx;
    if (CUresult r = need_context(&ctx)) return r;
    if (!event || !handle_destroyed(event)) return CUDA_ERROR_INVALID_HANDLE;
    delete event;
    return CUDA_SUCCESS;
}

/* In a capture, a plain record marks the event as the capture's own (a wait on it in the same
 * capture is ordered already); an external one becomes a node that records at every replay. */
EXPORT CUresult cuEventRecordWithFlags(CUevent event, CUstream handle, unsigned flags) {
    sim::Context *ctx;
    sim::Stream *stream;
    if (CUresult r = need_stream(handle, &ctx, &stream)) return r;
    if (!event || !handle_live(event)) return CUDA_ERROR_INVALID_HANDLE;
    if (event->ctx != ctx) return CUDA_ERROR_INVALID_CONTEXT;
    if (flags & ~(unsigned)EVENT_EXTERNAL) return CUDA_ERROR_INVALID_VALUE;
    int capture = sim::capture_status(stream);
    if (capture == 2) return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
    if (!capture) {
        record_now(event, stream);
    } else if (flags & EVENT_EXTERNAL) {
        sim::Op node{"event record node", nullptr, nullptr, [event](sim::Stream *s) {
                         check_live(event, "event record");
                         record_now(event, s);
                     }};
        sim::enqueue(stream, std::move(node));
    } else {
        event->stream = stream;
        event->capture = sim::capture_id(stream);
    }
    return CUDA_SUCCESS;
}

EXPORT CUresult cuEventRecord(CUevent event, CUstream handle) { return cuEventRecordWithFlags(event, handle, 0); }

/* A wait during a capture as the driver treats it: on the capture's own record, already in order;
 * with CU_EVENT_WAIT_EXTERNAL, a node that waits at every replay for the event's last record
 * before the launch; on work recorded outside the capture, refused with
 * CUDA_ERROR_STREAM_CAPTURE_ISOLATION (another capture's: MERGE), invalidating the capture. */
EXPORT CUresult cuStreamWaitEvent(CUstream handle, CUevent event, unsigned flags) {
    sim::Context *ctx;
    sim::Stream *stream;
    if (CUresult r = need_stream(handle, &ctx, &stream)) return r;
    if (!event || !handle_live(event)) return CUDA_ERROR_INVALID_HANDLE;
    if (flags & ~(unsigned)EVENT_EXTERNAL) return CUDA_ERROR_INVALID_VALUE;
    int capture = sim::capture_status(stream);
    if (!capture) {
        if (flags & EVENT_EXTERNAL) return CUDA_ERROR_INVALID_VALUE; /* invalid outside a capture */
        if (event->capture)
            sim::violation("cuStreamWaitEvent outside a capture on an event last recorded inside one: joining a stream into a capture "
                           "(or using such an event after it) is not modelled; record it with CU_EVENT_RECORD_EXTERNAL");
        if (event->stream) sim::enqueue_wait(stream, event->stream, event->seq, event->clock);
        return CUDA_SUCCESS;
    }
    if (capture == 2) return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
    if (flags & EVENT_EXTERNAL) {
        sim::Op node{"event wait node", nullptr, nullptr, [event](sim::Stream *s) {
                         check_live(event, "event wait");
                         if (event->capture) sim::violation("a graph's event wait node names an event last recorded inside a capture");
                         if (event->stream) sim::enqueue_wait(s, event->stream, event->seq, event->clock);
                     }};
        sim::enqueue(stream, std::move(node));
        return CUDA_SUCCESS;
    }
    if (event->capture == sim::capture_id(stream) || (!event->capture && !event->stream)) return CUDA_SUCCESS;
    sim::invalidate_capture(stream);
    return event->capture ? CUDA_ERROR_STREAM_CAPTURE_MERGE : CUDA_ERROR_STREAM_CAPTURE_ISOLATION;
}

EXPORT CUresult cuEventSynchronize(CUevent event) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    if (!event) return CUDA_ERROR_INVALID_HANDLE;
    if (event->stream) sim::host_wait(event->stream, event->seq ? event->seq : 1);
    return CUDA_SUCCESS;
}

/* ---- Modules and launches ---- */

EXPORT CUresult cuModuleLoadData(CUmodule *module, const void *data) {
    sim::Context *ctx;
    if (CUresult r = need_context(&ctx)) return r;
    if (!module || !data) return CUDA_ERROR_INVALID_VALUE;
    auto m = std::make_unique<Module>();
    std::string why;
    if (!sim::parse_image(data, &m->image, &why)) {
        fprintf(stderr, "simgpu: cuModuleLoadData: %s\n", why.c_str());
        return CUDA_ERROR_INVALID_IMAGE;
    }
    int device = sim::config().cc_major * 10 + sim::config().cc_minor, arch = m->image.arch;
    bool runs = m->image.cubin ? arch / 10 == device / 10 && arch <= device : arch <= device;
    if (!runs) return CUDA_ERROR_NO_BINARY_FOR_GPU;
    m->ctx = ctx;
    *module = m.release();
    handle_created(*module, ctx);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuModuleUnload(CUmodule module) {
    if (!module || !handle_destroyed(module)) return CUDA_ERROR_INVALID_HANDLE;
    delete module;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuModuleGetFunction(CUfunction *function, CUmodule module, const char *name) {
    sim::Context *ctx;
    if (CUresult r = need_context(&ctx)) return r;
    if (!function || !module || !name) return CUDA_ERROR_INVALID_VALUE;
    if (!handle_live(module)) return CUDA_ERROR_INVALID_HANDLE;
    auto in_image = module->image.kernels.find(name);
    if (in_image == module->image.kernels.end()) return CUDA_ERROR_NOT_FOUND;
    const sim::KernelInfo *kernel = sim::find_kernel(name);
    if (!kernel) sim::violation("cuModuleGetFunction(%s): the image has it but the software GPU has no host build of it", name);
    if (kernel->param_sizes != in_image->second.param_sizes) {
        std::string host, device;
        for (size_t s : kernel->param_sizes) host += " " + std::to_string(s);
        for (size_t s : in_image->second.param_sizes) device += " " + std::to_string(s);
        sim::violation("%s: parameter sizes differ between the image (%s ) and the host build (%s )", name, device.c_str(), host.c_str());
    }
    *function = new Function{kernel, in_image->second, module->ctx};
    handle_created(*function, module->ctx);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned shared_bytes,
                               CUstream handle, void **params, void **extra) {
    sim::Context *ctx;
    sim::Stream *stream;
    if (CUresult r = need_stream(handle, &ctx, &stream)) return r;
    if (!f || !handle_live(f)) return CUDA_ERROR_INVALID_HANDLE;
    if (extra) sim::violation("cuLaunchKernel(%s): `extra` arguments are not modelled", f->kernel->name.c_str());
    if (!gx || !gy || !gz || !bx || !by || !bz || shared_bytes) return CUDA_ERROR_INVALID_VALUE;
    if ((uint64_t)bx * by * bz > f->image.max_threads) return CUDA_ERROR_INVALID_VALUE;
    if (!params && !f->kernel->param_sizes.empty()) return CUDA_ERROR_INVALID_VALUE;
    sim::BoundKernel bound = f->kernel->bind(params, current_device());
    sim::Dim3 grid{gx, gy, gz}, block{bx, by, bz};
    auto body = std::make_shared<std::function<void()>>(bound.body);
    char what[160];
    snprintf(what, sizeof what, "%s<<<%u, %u>>>", f->kernel->name.c_str(), gx * gy * gz, bx * by * bz);
    sim::enqueue(stream, sim::Op{what, bound.footprint, [grid, block, body] {
                                     for (unsigned z = 0; z < grid.z; ++z)
                                         for (unsigned y = 0; y < grid.y; ++y)
                                             for (unsigned x = 0; x < grid.x; ++x) sim::run_block(grid, sim::Dim3{x, y, z}, block, *body);
                                 }});
    return CUDA_SUCCESS;
}

/* ---- CUDA graphs, as far as stream capture needs them ---- */

typedef struct Graph *CUgraph;
typedef struct Graph *CUgraphExec;
struct Graph {
    sim::Graph ops;
};

enum { CAPTURE_MODE_GLOBAL = 0, CAPTURE_MODE_THREAD_LOCAL = 1, CAPTURE_MODE_RELAXED = 2 };

EXPORT CUresult cuStreamBeginCapture_v2(CUstream handle, int mode) {
    sim::Context *ctx;
    sim::Stream *stream;
    if (CUresult r = need_stream(handle, &ctx, &stream)) return r;
    if ((uintptr_t)handle <= 1) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED; /* the legacy stream cannot be captured */
    if (mode < CAPTURE_MODE_GLOBAL || mode > CAPTURE_MODE_RELAXED) return CUDA_ERROR_INVALID_VALUE;
    return sim::begin_capture(stream) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuStreamIsCapturing(CUstream handle, int *status) {
    sim::Context *ctx;
    sim::Stream *stream;
    if (CUresult r = need_stream(handle, &ctx, &stream)) return r;
    if (!status) return CUDA_ERROR_INVALID_VALUE;
    *status = sim::capture_status(stream);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamEndCapture(CUstream handle, CUgraph *graph) {
    sim::Context *ctx;
    sim::Stream *stream;
    if (CUresult r = need_stream(handle, &ctx, &stream)) return r;
    if (!graph) return CUDA_ERROR_INVALID_VALUE;
    if (sim::capture_status(stream) == 0) return CUDA_ERROR_INVALID_VALUE;
    std::unique_ptr<sim::Graph> ops = sim::end_capture(stream);
    *graph = nullptr;
    if (!ops) return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
    *graph = new Graph{std::move(*ops)};
    return CUDA_SUCCESS;
}

EXPORT CUresult cuGraphInstantiateWithFlags(CUgraphExec *exec, CUgraph graph, unsigned long long flags) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    if (!exec || !graph || flags) return CUDA_ERROR_INVALID_VALUE;
    *exec = new Graph{graph->ops};
    return CUDA_SUCCESS;
}

EXPORT CUresult cuGraphLaunch(CUgraphExec exec, CUstream handle) {
    sim::Context *ctx;
    sim::Stream *stream;
    if (CUresult r = need_stream(handle, &ctx, &stream)) return r;
    if (!exec) return CUDA_ERROR_INVALID_VALUE;
    for (const sim::Op &op : exec->ops) {
        if (op.at_launch)
            op.at_launch(stream);
        else
            sim::enqueue(stream, op);
    }
    return CUDA_SUCCESS;
}

EXPORT CUresult cuGraphDestroy(CUgraph graph) {
    if (!graph) return CUDA_ERROR_INVALID_VALUE;
    delete graph;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuGraphExecDestroy(CUgraphExec exec) {
    if (!exec) return CUDA_ERROR_INVALID_VALUE;
    delete exec;
    return CUDA_SUCCESS;
}

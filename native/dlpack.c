/* dlpack.c -- device allocations as DLPack tensors.
 *
 * A framework that imports a DLPack tensor calls its deleter when the last reference to
 * the memory dies. Here the deleter frees the device allocation (and with it its layout
 * record), so tensor lifetimes and device memory agree without the framework knowing
 * anything about the card. The layout of the structures below is the DLPack ABI (v0.8,
 * unversioned DLManagedTensor). A wrap makes its host structures before it takes the
 * device lock, so that under the lock it can only succeed or leave nothing behind. */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

typedef struct {
    int32_t device_type;
    int32_t device_id;
} dl_device;

typedef struct {
    uint8_t code;
    uint8_t bits;
    uint16_t lanes;
} dl_dtype;

typedef struct {
    void *data;
    dl_device device;
    int32_t ndim;
    dl_dtype dtype;
    int64_t *shape;
    int64_t *strides;
    uint64_t byte_offset;
} dl_tensor;

typedef struct dl_managed {
    dl_tensor tensor;
    void *manager_ctx;
    void (*deleter)(struct dl_managed *self);
} dl_managed;

typedef struct wrap_ctx {
    spy_device *dev;  /* borrowed: the device outlives its wrapped tensors */
    uint64_t addr;
    uint64_t epoch;   /* the device's reset epoch at the wrap */
    int64_t dims[];   /* shape, then strides */
} wrap_ctx;

#define MAX_NDIM 64

static void deleter(dl_managed *m)
{
    wrap_ctx *ctx = m->manager_ctx;
    spy_device *d = ctx->dev;
    spy_lock(d);
    /* After a device reset the address may belong to a new allocation: leave it alone. */
    if (ctx->epoch == d->epoch)
        (void)spy_alloc_put(&d->mem, ctx->addr);
    d->dlpack_live--;
    spy_unlock(d);
    free(ctx);
    free(m);
}

static spy_status check_tensor(uint32_t i, const spy_dlpack_tensor *t)
{
    if (t->ndim < 0 || t->ndim > MAX_NDIM || (t->ndim && (!t->shape || !t->strides)) || t->code > 255 ||
        t->bits == 0 || t->bits > 255)
        return spy_fail(SPY_E_INVALID_ARG, -1, "DLPack tensor %u: bad ndim %d, shape, strides or dtype "
                        "(code %u, %u bits)", i, t->ndim, t->code, t->bits);
    return SPY_OK;
}

/* The DLManagedTensor of t, with its device fields still unset. */
static dl_managed *make_managed(spy_device *d, const spy_dlpack_tensor *t, int32_t device_type)
{
    size_t ndim = (size_t)t->ndim;
    dl_managed *m = calloc(1, sizeof *m);
    wrap_ctx *ctx = malloc(sizeof *ctx + 2 * (ndim ? ndim : 1) * sizeof(int64_t));
    if (!m || !ctx) {
        free(m);
        free(ctx);
        return NULL;
    }
    ctx->dev = d;
    if (ndim) {
        memcpy(ctx->dims, t->shape, ndim * sizeof(int64_t));
        memcpy(ctx->dims + ndim, t->strides, ndim * sizeof(int64_t));
    }
    m->tensor.device.device_type = device_type;
    m->tensor.device.device_id = (int32_t)d->ordinal;
    m->tensor.ndim = t->ndim;
    m->tensor.dtype.code = (uint8_t)t->code;
    m->tensor.dtype.bits = (uint8_t)t->bits;
    m->tensor.dtype.lanes = 1;
    m->tensor.shape = ctx->dims;
    m->tensor.strides = ctx->dims + ndim;
    m->manager_ctx = ctx;
    m->deleter = deleter;
    return m;
}

static void discard(dl_managed **m, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++) {
        if (m[i])
            free(m[i]->manager_ctx);
        free(m[i]);
    }
    free(m);
}

/* The start of a wrap: check the arguments and make the host structures of n wraps (*out,
 * an array settle() hands out or drops), then lock the device. */
static spy_status prepare(spy_device *d, bool args_ok, uint32_t n, const spy_dlpack_tensor *tensors,
                          int32_t device_type, dl_managed ***out)
{
    spy_clear_error();
    if (!d || !args_ok)
        return spy_fail(SPY_E_INVALID_ARG, -1, "bad DLPack arguments: a null device or array");
    for (uint32_t i = 0; i < n; i++) {
        spy_status s = check_tensor(i, &tensors[i]);
        if (s != SPY_OK)
            return s;
    }
    dl_managed **m = calloc(n ? n : 1, sizeof *m);
    for (uint32_t i = 0; m && i < n; i++) {
        m[i] = make_managed(d, &tensors[i], device_type);
        if (!m[i]) {
            discard(m, n);
            m = NULL;
        }
    }
    if (!m)
        return spy_fail(SPY_E_HOST_NOMEM, -1, "host memory exhausted");
    *out = m;
    spy_lock(d);
    return SPY_OK;
}

/* The end of a wrap, called with the device locked; releases it: when s is SPY_OK, tie m[i] to the allocation
 * at addrs[i] and hand it out (the device now owes n deleters); otherwise drop m. */
static spy_status settle(spy_device *d, spy_status s, dl_managed **m, uint32_t n, const uint64_t *addrs,
                         void **out)
{
    if (s == SPY_OK) {
        for (uint32_t i = 0; i < n; i++) {
            wrap_ctx *ctx = m[i]->manager_ctx;
            ctx->addr = addrs[i];
            ctx->epoch = d->epoch;
            m[i]->tensor.data = (void *)(uintptr_t)addrs[i];
            out[i] = m[i];
        }
        d->dlpack_live += n;
    }
    spy_unlock(d);
    if (s == SPY_OK)
        free(m);
    else
        discard(m, n);
    return s;
}

spy_status spy_dlpack_wrap_many(spy_device *d, uint32_t n, const uint64_t *addrs,
                                const spy_dlpack_tensor *tensors, int32_t device_type, void **out)
{
    dl_managed **m;
    spy_status s = prepare(d, !n || (addrs && tensors && out), n, tensors, device_type, &m);
    if (s != SPY_OK)
        return s;
    for (uint32_t i = 0; i < n && s == SPY_OK; i++) {
        spy_block *b = spy_alloc_find(&d->mem, addrs[i], 1);
        if (!b || b->addr != addrs[i])
            s = spy_fail(SPY_E_BAD_ADDRESS, -1, "0x%llx is not a live allocation",
                         (unsigned long long)addrs[i]);
    }
    return settle(d, s, m, n, addrs, out);
}

spy_status spy_dlpack_wrap(spy_device *d, uint64_t addr, int32_t ndim, const int64_t *shape,
                           const int64_t *strides, uint32_t code, uint32_t bits, int32_t device_type,
                           void **out)
{
    spy_dlpack_tensor t = {shape, strides, ndim, code, bits, 0};
    return spy_dlpack_wrap_many(d, 1, &addr, &t, device_type, out);
}

spy_status spy_dlpack_new_many(spy_device *d, uint32_t n, const spy_layout *layouts,
                               const spy_dlpack_tensor *tensors, int32_t device_type, uint64_t *addrs,
                               void **out)
{
    dl_managed **m;
    spy_status s = prepare(d, !n || (layouts && tensors && addrs && out), n, tensors, device_type, &m);
    if (s != SPY_OK)
        return s;
    d->counters.native_calls++;
    s = d->lost ? spy_fail(SPY_E_DEVICE_LOST, -1, "device %u is lost; reset it", d->ordinal)
                : spy_mem_alloc_many_locked(d, n, NULL, layouts, addrs);
    return settle(d, s, m, n, addrs, out);
}

void spy_dlpack_release(void *managed)
{
    if (managed)
        deleter(managed);
}

uint64_t spy_dlpack_live(spy_device *d)
{
    uint64_t n = 0;
    if (d)
        spy_read_locked(d, &n, &d->dlpack_live, sizeof n);
    return n;
}

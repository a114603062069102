/* dlpack.c -- device allocations as DLPack tensors.
 *
 * A framework that imports a DLPack tensor calls its deleter when the last reference to
 * the memory dies. Here the deleter frees the device allocation, so tensor lifetimes and
 * device memory agree without the framework knowing anything about the card. The layout
 * of the structures below is the DLPack ABI (v0.8, unversioned DLManagedTensor). */
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
    spy_device *dev;
    uint64_t addr;
    uint64_t epoch;
    int64_t dims[];
} wrap_ctx;

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

spy_status spy_dlpack_wrap(spy_device *d, uint64_t addr, int32_t ndim, const int64_t *shape,
                           const int64_t *strides, uint32_t code, uint32_t bits, int32_t device_type,
                           void **out)
{
    spy_clear_error();
    if (!d || !out || ndim < 0 || ndim > 64 || (ndim && (!shape || !strides)))
        return spy_fail(SPY_E_INVALID_ARG, -1, "bad DLPack wrap arguments");
    dl_managed *m = calloc(1, sizeof *m);
    wrap_ctx *ctx = malloc(sizeof *ctx + 2 * (size_t)(ndim ? ndim : 1) * sizeof(int64_t));
    if (!m || !ctx) {
        free(m);
        free(ctx);
        return spy_fail(SPY_E_HOST_NOMEM, -1, "host memory exhausted");
    }
    spy_lock(d);
    spy_block *b = spy_alloc_find(&d->mem, addr, 1);
    bool ok = b && b->addr == addr;
    if (ok)
        d->dlpack_live++;
    ctx->epoch = d->epoch;
    spy_unlock(d);
    if (!ok) {
        free(m);
        free(ctx);
        return spy_fail(SPY_E_BAD_ADDRESS, -1, "0x%llx is not a live allocation",
                        (unsigned long long)addr);
    }
    ctx->dev = d;
    ctx->addr = addr;
    if (ndim) {
        memcpy(ctx->dims, shape, (size_t)ndim * sizeof(int64_t));
        memcpy(ctx->dims + ndim, strides, (size_t)ndim * sizeof(int64_t));
    }
    m->tensor.data = (void *)(uintptr_t)addr;
    m->tensor.device.device_type = device_type;
    m->tensor.device.device_id = (int32_t)d->ordinal;
    m->tensor.ndim = ndim;
    m->tensor.dtype.code = (uint8_t)code;
    m->tensor.dtype.bits = (uint8_t)bits;
    m->tensor.dtype.lanes = 1;
    m->tensor.shape = ctx->dims;
    m->tensor.strides = ctx->dims + ndim;
    m->manager_ctx = ctx;
    m->deleter = deleter;
    *out = m;
    return SPY_OK;
}

/* For a wrapped tensor that was never handed to a framework. */
void spy_dlpack_release(void *managed)
{
    if (managed)
        deleter(managed);
}

uint64_t spy_dlpack_live(spy_device *d)
{
    spy_lock(d);
    uint64_t n = d->dlpack_live;
    spy_unlock(d);
    return n;
}

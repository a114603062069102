/* memory.c -- the device's memory API: allocation and free (epoch-aware), statistics, the
 * free-block cache, and direct reads and writes of backed memory. The address space
 * itself is alloc.c's; this file is its locked, checked entry points. */
#include <string.h>

#include "internal.h"

spy_status spy_malloc(spy_device *d, uint64_t nbytes, uint32_t kind, uint64_t *addr)
{
    SPY_ENTER(d);
    SPY_REFUSE_IF_LOST(d);
    if (!addr || kind > SPY_MEM_CONTROL)
        SPY_LEAVE(d, spy_fail(SPY_E_INVALID_ARG, -1, "bad output pointer or memory kind %u", kind));
    bool backed = kind == SPY_MEM_CONTROL || d->mode == SPY_MODE_FUNCTIONAL;
    SPY_LEAVE(d, spy_alloc_get(&d->mem, nbytes, kind, backed, addr));
}

static spy_status free_locked(spy_device *d, uint64_t addr)
{
    spy_block *b = spy_alloc_find(&d->mem, addr, 1);
    if (b && b->addr == addr && b->plan_owned)
        return spy_fail(SPY_E_BAD_ADDRESS, -1, "0x%llx belongs to a graph plan", (unsigned long long)addr);
    return spy_alloc_put(&d->mem, addr);
}

spy_status spy_free(spy_device *d, uint64_t addr)
{
    SPY_ENTER(d);
    SPY_LEAVE(d, free_locked(d, addr));
}

spy_status spy_free_epoch(spy_device *d, uint64_t addr, uint64_t epoch)
{
    SPY_ENTER(d);
    if (epoch != d->epoch)
        SPY_LEAVE(d, SPY_OK); /* a reset dropped it already */
    SPY_LEAVE(d, free_locked(d, addr));
}

spy_status spy_empty_cache(spy_device *d)
{
    SPY_ENTER(d);
    spy_alloc_release_cache(&d->mem);
    SPY_LEAVE(d, SPY_OK);
}

spy_status spy_mem_stats_get(spy_device *d, spy_mem_stats *out)
{
    SPY_ENTER(d);
    if (!out)
        SPY_LEAVE(d, spy_fail(SPY_E_INVALID_ARG, -1, "null output"));
    spy_alloc_stats(&d->mem, out);
    SPY_LEAVE(d, SPY_OK);
}

spy_status spy_mem_reset_peak(spy_device *d)
{
    SPY_ENTER(d);
    d->mem.peak = d->mem.allocated;
    d->mem.data_peak = d->mem.allocated - d->mem.control;
    SPY_LEAVE(d, SPY_OK);
}

/* The backed block holding [addr, addr+len). */
static spy_status mem_access(spy_device *d, uint64_t addr, uint64_t len, spy_block **out)
{
    spy_block *b = spy_alloc_find(&d->mem, addr, len);
    if (!b)
        return spy_fail(SPY_E_BAD_ADDRESS, -1,
                        "[0x%llx, +%llu) is not inside a live allocation",
                        (unsigned long long)addr, (unsigned long long)len);
    if (!b->backing)
        return spy_fail(SPY_E_BAD_ADDRESS, -1,
                        "0x%llx holds no data: timing-mode tensor memory is not backed",
                        (unsigned long long)addr);
    *out = b;
    return SPY_OK;
}

spy_status spy_mem_read(spy_device *d, uint64_t addr, void *dst, uint64_t len)
{
    SPY_ENTER(d);
    SPY_REFUSE_IF_LOST(d);
    if (len && !dst)
        SPY_LEAVE(d, spy_fail(SPY_E_INVALID_ARG, -1, "null destination"));
    spy_block *b;
    spy_status s = mem_access(d, addr, len, &b);
    if (s == SPY_OK && len)
        memcpy(dst, b->backing + (addr - b->addr), len);
    SPY_LEAVE(d, s);
}

spy_status spy_mem_write(spy_device *d, uint64_t addr, const void *src, uint64_t len)
{
    SPY_ENTER(d);
    SPY_REFUSE_IF_LOST(d);
    if (len && !src)
        SPY_LEAVE(d, spy_fail(SPY_E_INVALID_ARG, -1, "null source"));
    spy_block *b;
    spy_status s = mem_access(d, addr, len, &b);
    if (s == SPY_OK && b->plan_owned)
        s = spy_fail(SPY_E_BAD_ADDRESS, -1, "0x%llx belongs to a graph plan", (unsigned long long)addr);
    if (s == SPY_OK) {
        if (len)
            memcpy(b->backing + (addr - b->addr), src, len);
        spy_block_uncommit(b);
    }
    SPY_LEAVE(d, s);
}

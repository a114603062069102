/* memory.c -- the device's memory API: allocation (one, several at once, with a stick
 * layout recorded) and free (epoch-aware), layouts, statistics, the free-block cache, and
 * direct reads and writes of backed memory. The address space itself is alloc.c's; this
 * file is its locked, checked entry points. */
#include <string.h>

#include "internal.h"

spy_status spy_layout_bytes(const spy_layout *l, uint64_t *nbytes)
{
    if (!l || !nbytes)
        return spy_fail(SPY_E_INVALID_ARG, -1, "null layout or output");
    uint32_t es = l->itemsize, sb = l->stick_bytes;
    if ((es != 1 && es != 2 && es != 4 && es != 8) || sb < es || (sb & (sb - 1)) || l->row_len == 0)
        return spy_fail(SPY_E_INVALID_ARG, -1, "layout of %llu rows of %llu elements of %u bytes "
                        "in %u-byte sticks is malformed", (unsigned long long)l->rows,
                        (unsigned long long)l->row_len, es, sb);
    uint64_t per_stick = sb / es;
    uint64_t sticks = l->row_len / per_stick + (l->row_len % per_stick != 0);
    uint64_t row_bytes, bytes;
    if (!spy_mul_ok(sticks, sb, &row_bytes) || !spy_mul_ok(row_bytes, l->rows ? l->rows : 1, &bytes))
        return spy_fail(SPY_E_INVALID_ARG, -1, "layout of %llu x %llu elements is larger than 2^64 bytes",
                        (unsigned long long)l->rows, (unsigned long long)l->row_len);
    *nbytes = bytes;
    return SPY_OK;
}

spy_status spy_layout_check(const spy_device *d, const spy_layout *l, uint64_t nbytes)
{
    uint64_t need;
    spy_status s = spy_layout_bytes(l, &need);
    if (s != SPY_OK)
        return s;
    if (l->stick_bytes != d->prof.stick_bytes)
        return spy_fail(SPY_E_INVALID_ARG, -1, "layout in %u-byte sticks on a device of %u-byte sticks",
                        l->stick_bytes, d->prof.stick_bytes);
    if (need > nbytes)
        return spy_fail(SPY_E_INVALID_ARG, -1, "layout of %llu bytes does not fit an allocation of %llu",
                        (unsigned long long)need, (unsigned long long)nbytes);
    return SPY_OK;
}

static spy_status malloc_locked(spy_device *d, uint64_t nbytes, uint32_t kind, const spy_layout *layout,
                                uint64_t *addr)
{
    if (!addr || kind > SPY_MEM_CONTROL)
        return spy_fail(SPY_E_INVALID_ARG, -1, "bad output pointer or memory kind %u", kind);
    if (layout && kind != SPY_MEM_DATA)
        return spy_fail(SPY_E_INVALID_ARG, -1, "a layout is recorded for DATA allocations only");
    spy_status s = layout ? spy_layout_check(d, layout, nbytes) : SPY_OK;
    if (s != SPY_OK)
        return s;
    bool backed = kind == SPY_MEM_CONTROL || d->mode == SPY_MODE_FUNCTIONAL;
    return spy_alloc_get(&d->mem, nbytes, kind, backed, layout, addr);
}

spy_status spy_malloc_layout(spy_device *d, uint64_t nbytes, uint32_t kind, const spy_layout *layout,
                             uint64_t *addr)
{
    SPY_ENTER(d);
    SPY_REFUSE_IF_LOST(d);
    SPY_LEAVE(d, malloc_locked(d, nbytes, kind, layout, addr));
}

spy_status spy_malloc(spy_device *d, uint64_t nbytes, uint32_t kind, uint64_t *addr)
{
    return spy_malloc_layout(d, nbytes, kind, NULL, addr);
}

spy_status spy_mem_alloc_many_locked(spy_device *d, uint32_t n, const uint64_t *nbytes,
                                     const spy_layout *layouts, uint64_t *addrs)
{
    if (n && (!addrs || (!nbytes && !layouts)))
        return spy_fail(SPY_E_INVALID_ARG, -1, "null addresses, or neither sizes nor layouts");
    /* Every argument first, so that a malformed one fails before anything is allocated. */
    for (uint32_t i = 0; i < n; i++) {
        uint64_t size = nbytes ? nbytes[i] : 0;
        spy_status s = nbytes ? SPY_OK : spy_layout_bytes(&layouts[i], &size);
        if (s == SPY_OK && layouts)
            s = spy_layout_check(d, &layouts[i], size);
        if (s != SPY_OK)
            return spy_fail(s, -1, "allocation %u of %u: %s", i, n, spy_last_error());
    }
    /* A failed call leaves the statistics as they were, but for the out-of-memory count. */
    uint64_t peak = d->mem.peak, data_peak = d->mem.data_peak, reserved_peak = d->mem.reserved_peak;
    uint64_t total_allocs = d->mem.total_allocs, total_frees = d->mem.total_frees;
    for (uint32_t i = 0; i < n; i++) {
        uint64_t size = nbytes ? nbytes[i] : 0;
        if (!nbytes)
            (void)spy_layout_bytes(&layouts[i], &size); /* checked above */
        bool backed = d->mode == SPY_MODE_FUNCTIONAL;
        spy_status s = spy_alloc_get(&d->mem, size, SPY_MEM_DATA, backed, layouts ? &layouts[i] : NULL,
                                     &addrs[i]);
        if (s != SPY_OK) {
            s = spy_fail(s, -1, "allocation %u of %u: %s", i, n, spy_last_error());
            for (uint32_t k = 0; k < i; k++)
                (void)spy_alloc_put(&d->mem, addrs[k]);
            d->mem.peak = peak;
            d->mem.data_peak = data_peak;
            d->mem.reserved_peak = reserved_peak;
            d->mem.total_allocs = total_allocs;
            d->mem.total_frees = total_frees;
            return s;
        }
    }
    return SPY_OK;
}

spy_status spy_malloc_many(spy_device *d, uint32_t n, const uint64_t *nbytes, const spy_layout *layouts,
                           uint64_t *addrs)
{
    SPY_ENTER(d);
    SPY_REFUSE_IF_LOST(d);
    SPY_LEAVE(d, spy_mem_alloc_many_locked(d, n, nbytes, layouts, addrs));
}

spy_status spy_layout_of(spy_device *d, uint64_t addr, spy_layout *out)
{
    SPY_ENTER(d);
    if (!out)
        SPY_LEAVE(d, spy_fail(SPY_E_INVALID_ARG, -1, "null output"));
    spy_block *b = spy_alloc_find(&d->mem, addr, 1);
    if (!b || b->addr != addr)
        SPY_LEAVE(d, spy_fail(SPY_E_BAD_ADDRESS, -1, "0x%llx is not the start of a live allocation",
                              (unsigned long long)addr));
    if (b->layout.itemsize == 0)
        SPY_LEAVE(d, spy_fail(SPY_E_BAD_ADDRESS, -1, "the allocation at 0x%llx records no layout",
                              (unsigned long long)addr));
    *out = b->layout;
    SPY_LEAVE(d, SPY_OK);
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
    d->mem.reserved_peak = d->mem.allocated + d->mem.cached;
    SPY_LEAVE(d, SPY_OK);
}

spy_status spy_mem_reset_accumulated(spy_device *d)
{
    SPY_ENTER(d);
    d->mem.total_allocs = 0;
    d->mem.total_frees = 0;
    d->mem.ooms = 0;
    SPY_LEAVE(d, SPY_OK);
}

/* The backed block holding [addr, addr+len), which ptr (the host side) is to copy. */
static spy_status mem_access(spy_device *d, uint64_t addr, const void *ptr, uint64_t len, spy_block **out)
{
    if (d->lost)
        return spy_fail(SPY_E_DEVICE_LOST, -1, "device %u is lost; reset it", d->ordinal);
    if (len && !ptr)
        return spy_fail(SPY_E_INVALID_ARG, -1, "a null host pointer for %llu bytes", (unsigned long long)len);
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
    spy_block *b;
    spy_status s = mem_access(d, addr, dst, len, &b);
    if (s == SPY_OK && len)
        memcpy(dst, b->backing + (addr - b->addr), len);
    SPY_LEAVE(d, s);
}

spy_status spy_mem_write(spy_device *d, uint64_t addr, const void *src, uint64_t len)
{
    SPY_ENTER(d);
    spy_block *b;
    spy_status s = mem_access(d, addr, src, len, &b);
    if (s == SPY_OK && b->plan_owned)
        s = spy_fail(SPY_E_BAD_ADDRESS, -1, "0x%llx belongs to a graph plan", (unsigned long long)addr);
    if (s == SPY_OK) {
        if (len)
            memcpy(b->backing + (addr - b->addr), src, len);
        spy_block_uncommit(b);
    }
    SPY_LEAVE(d, s);
}

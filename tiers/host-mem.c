/* host-mem.c -- see host-mem.h. */
#include "host-mem.h"

#include <hwloc.h>
#include <pthread.h>
#include <stdlib.h>

static hwloc_topology_t topo;
static bool topo_ok;
static pthread_once_t topo_once = PTHREAD_ONCE_INIT;

static void topo_load(void)
{
    if (hwloc_topology_init(&topo) != 0)
        return;
    /* PCI devices are needed to find the GPU's node */
    hwloc_topology_set_io_types_filter(topo, HWLOC_TYPE_FILTER_KEEP_IMPORTANT);
    if (hwloc_topology_load(topo) != 0) {
        hwloc_topology_destroy(topo);
        return;
    }
    topo_ok = true;
}

int tkv_host_numa_nodes(void)
{
    pthread_once(&topo_once, topo_load);
    if (!topo_ok)
        return 1;
    int n = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_NUMANODE);
    return n > 0 ? n : 1;
}

/* The nodeset to bind to, or NULL (caller frees a non-NULL result). */
static hwloc_nodeset_t target_nodeset(const char *pci_bus_id)
{
    hwloc_nodeset_t set = hwloc_bitmap_alloc();
    if (!set)
        return NULL;
    if (pci_bus_id) {
        hwloc_obj_t dev = hwloc_get_pcidev_by_busidstring(topo, pci_bus_id);
        hwloc_obj_t anc = dev ? hwloc_get_non_io_ancestor_obj(topo, dev) : NULL;
        if (anc && anc->nodeset && !hwloc_bitmap_iszero(anc->nodeset)) {
            hwloc_bitmap_copy(set, anc->nodeset);
            return set;
        }
        TKV_LOG_W("host-mem: GPU %s not found in the hwloc topology; binding to the local NUMA node", pci_bus_id);
    }
    hwloc_cpuset_t cpus = hwloc_bitmap_alloc();
    if (cpus && hwloc_get_last_cpu_location(topo, cpus, HWLOC_CPUBIND_THREAD) == 0) {
        hwloc_cpuset_to_nodeset(topo, cpus, set);
        hwloc_bitmap_free(cpus);
        if (!hwloc_bitmap_iszero(set)) {
            /* one node: the first of those the thread last ran on */
            int first = hwloc_bitmap_first(set);
            hwloc_bitmap_only(set, (unsigned)first);
            return set;
        }
    } else if (cpus) {
        hwloc_bitmap_free(cpus);
    }
    hwloc_bitmap_free(set);
    return NULL;
}

tkv_status tkv_host_mem_alloc(size_t bytes, const char *pci_bus_id, struct tkv_host_mem *out)
{
    *out = (struct tkv_host_mem){.node = -1};
    if (bytes == 0)
        return tkv_err(TKV_ERR_INVALID_ARG, "host-mem: zero-byte allocation");
    pthread_once(&topo_once, topo_load);
    if (topo_ok) {
        hwloc_nodeset_t set = target_nodeset(pci_bus_id);
        if (set) {
            void *p = hwloc_alloc_membind(topo, bytes, set, HWLOC_MEMBIND_BIND, HWLOC_MEMBIND_BYNODESET);
            if (p) {
                *out = (struct tkv_host_mem){.ptr = p, .bytes = bytes, .node = hwloc_bitmap_first(set),
                                             .bound = true, .hwloc = true};
                hwloc_bitmap_free(set);
                return TKV_OK;
            }
            hwloc_bitmap_free(set);
        }
    }
    static bool warned;
    if (!warned) {
        warned = true;
        TKV_LOG_I("host-mem: NUMA binding unavailable; using unbound page-aligned memory");
    }
    void *p = NULL;
    if (posix_memalign(&p, 4096, bytes) != 0)
        return tkv_err(TKV_ERR_NOMEM, "host-mem: cannot allocate %zu bytes of host memory", bytes);
    *out = (struct tkv_host_mem){.ptr = p, .bytes = bytes, .node = -1};
    return TKV_OK;
}

void tkv_host_mem_free(struct tkv_host_mem *m)
{
    if (!m || !m->ptr)
        return;
    if (m->hwloc)
        hwloc_free(topo, m->ptr, m->bytes);
    else
        free(m->ptr);
    *m = (struct tkv_host_mem){.node = -1};
}

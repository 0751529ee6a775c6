/*
 * host-mem.h -- host memory for KV tiers, placed with hwloc.
 *
 * Memory is bound to one NUMA node: the node nearest the GPU when the
 * backend names the GPU's PCI bus id, else the node of the calling thread.
 * Where binding is impossible (no NUMA support, hwloc refuses), the memory
 * is still allocated (page-aligned) and `bound` says so; that is logged once.
 */
#ifndef TKV_HOST_MEM_H
#define TKV_HOST_MEM_H

#include "../runtime/tkv-impl.h"

struct tkv_host_mem {
    void  *ptr;
    size_t bytes;
    int    node;   /* NUMA node os index, -1 if unknown */
    bool   bound;  /* bound with hwloc (else plain page-aligned memory) */
    bool   hwloc;  /* allocated by hwloc (selects the matching free) */
};

/* pci_bus_id: "0000:3b:00.0" of the GPU the memory feeds, or NULL. */
tkv_status tkv_host_mem_alloc(size_t bytes, const char *pci_bus_id, struct tkv_host_mem *out);
void       tkv_host_mem_free(struct tkv_host_mem *m);

/* Number of NUMA nodes hwloc sees (>= 1). */
int tkv_host_numa_nodes(void);

#endif

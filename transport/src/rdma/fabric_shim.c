/* fabric_shim.c — the libfabric calls the RDMA link's libfabric NIC needs, as real functions.
 *
 * Why this exists: libfabric exports only fi_getinfo, fi_fabric, fi_freeinfo and a few more;
 * fi_domain, fi_endpoint, fi_mr_reg, fi_writedata, fi_cq_read, ... are static inline dispatches
 * through ops tables, which Rust cannot declare. This file (compiled by transport/build.rs with
 * feature `libfabric`, against the installed headers: Debian's 1.17 or newer) wraps exactly the
 * sequence the link uses and keeps every libfabric struct on this side, so the Rust side
 * (fabric.rs) depends on no struct layout.
 *
 * One handle = one RDM endpoint with its own fabric, domain, completion queue and address vector,
 * two registered rings (receive: remote-writable; staging: the source of writes), and one peer.
 * The caller serialises every call on a handle (FI_THREAD_DOMAIN).
 *
 * Pointers: recv_ring and staging are host memory of `cap` bytes owned by the caller, alive until
 * em_fab_close. Every function returns 0 or a negative libfabric error code (-FI_EAGAIN included)
 * and, where it takes `err`, writes a message naming the failing call there.
 */
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define EM_FAB_CTXS 512 /* >= the link's writes in flight (SEND_WRS) and receives (RECV_WRS) */

struct em_fab {
    struct fi_info *info;
    struct fid_fabric *fabric;
    struct fid_domain *domain;
    struct fid_cq *cq;
    struct fid_av *av;
    struct fid_ep *ep;
    struct fid_mr *recv_mr;
    struct fid_mr *send_mr;
    char *staging;
    fi_addr_t peer;
    uint64_t peer_base;
    uint64_t peer_key;
    int connected;
    /* Operation contexts (providers with FI_CONTEXT / FI_CONTEXT2 own them while in flight). */
    struct fi_context2 send_ctx[EM_FAB_CTXS];
    uint64_t send_wr[EM_FAB_CTXS];
    struct fi_context2 recv_ctx[EM_FAB_CTXS];
    unsigned next_recv;
};

static int fail(char *err, size_t errlen, const char *call, int rc) {
    if (err && errlen) snprintf(err, errlen, "%s failed: %s (%d)", call, fi_strerror(-rc), rc);
    return rc < 0 ? rc : -FI_EOTHER;
}

void em_fab_close(struct em_fab *h) {
    if (!h) return;
    if (h->recv_mr) fi_close(&h->recv_mr->fid);
    if (h->send_mr) fi_close(&h->send_mr->fid);
    if (h->ep) fi_close(&h->ep->fid);
    if (h->av) fi_close(&h->av->fid);
    if (h->cq) fi_close(&h->cq->fid);
    if (h->domain) fi_close(&h->domain->fid);
    if (h->fabric) fi_close(&h->fabric->fid);
    if (h->info) fi_freeinfo(h->info);
    free(h);
}

static int reg(struct em_fab *h, void *buf, size_t cap, uint64_t access, uint64_t key, struct fid_mr **mr,
               char *err, size_t errlen) {
    int rc = fi_mr_reg(h->domain, buf, cap, access, 0, key, 0, mr, NULL);
    if (rc) return fail(err, errlen, "fi_mr_reg", rc);
    if (h->info->domain_attr->mr_mode & FI_MR_ENDPOINT) {
        rc = fi_mr_bind(*mr, &h->ep->fid, 0);
        if (rc) return fail(err, errlen, "fi_mr_bind", rc);
        rc = fi_mr_enable(*mr);
        if (rc) return fail(err, errlen, "fi_mr_enable", rc);
    }
    return 0;
}

/* Opens an RDM endpoint of provider `prov` (e.g. "tcp;ofi_rxm") bound to `node` (an IP
 * address; NULL: any) and registers the two rings. */
int em_fab_open(const char *prov, const char *node, void *recv_ring, void *staging, size_t cap, struct em_fab **out,
                char *err, size_t errlen) {
    *out = NULL;
    struct em_fab *h = calloc(1, sizeof *h);
    if (!h) return fail(err, errlen, "calloc", -FI_ENOMEM);
    h->staging = staging;
    struct fi_info *hints = fi_allocinfo();
    if (!hints) {
        free(h);
        return fail(err, errlen, "fi_allocinfo", -FI_ENOMEM);
    }
    hints->ep_attr->type = FI_EP_RDM;
    hints->caps = FI_RMA | FI_WRITE | FI_REMOTE_WRITE;
    hints->mode = FI_CONTEXT | FI_CONTEXT2 | FI_RX_CQ_DATA;
    hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_ENDPOINT;
    hints->domain_attr->threading = FI_THREAD_DOMAIN;
    hints->fabric_attr->prov_name = strdup(prov);
    uint32_t version = FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION);
    if (fi_version() < version) version = fi_version();
    int rc = fi_getinfo(version, node, NULL, node ? FI_SOURCE : 0, hints, &h->info);
    fi_freeinfo(hints);
    if (rc) {
        em_fab_close(h);
        return fail(err, errlen, "fi_getinfo", rc);
    }
    struct fi_cq_attr cq_attr;
    memset(&cq_attr, 0, sizeof cq_attr);
    cq_attr.format = FI_CQ_FORMAT_DATA;
    cq_attr.size = 4096;
    cq_attr.wait_obj = FI_WAIT_NONE;
    struct fi_av_attr av_attr;
    memset(&av_attr, 0, sizeof av_attr);
    av_attr.type = FI_AV_TABLE;
    if ((rc = fi_fabric(h->info->fabric_attr, &h->fabric, NULL))) goto out_fabric;
    if ((rc = fi_domain(h->fabric, h->info, &h->domain, NULL))) goto out_domain;
    if ((rc = fi_cq_open(h->domain, &cq_attr, &h->cq, NULL))) goto out_cq;
    if ((rc = fi_av_open(h->domain, &av_attr, &h->av, NULL))) goto out_av;
    if ((rc = fi_endpoint(h->domain, h->info, &h->ep, NULL))) goto out_ep;
    if ((rc = fi_ep_bind(h->ep, &h->cq->fid, FI_TRANSMIT | FI_RECV))) goto out_bind;
    if ((rc = fi_ep_bind(h->ep, &h->av->fid, 0))) goto out_bind;
    if ((rc = fi_enable(h->ep))) goto out_enable;
    if ((rc = reg(h, recv_ring, cap, FI_REMOTE_WRITE, 1, &h->recv_mr, err, errlen))) goto out;
    if ((rc = reg(h, staging, cap, FI_WRITE, 2, &h->send_mr, err, errlen))) goto out;
    *out = h;
    return 0;
out_fabric: rc = fail(err, errlen, "fi_fabric", rc); goto out;
out_domain: rc = fail(err, errlen, "fi_domain", rc); goto out;
out_cq: rc = fail(err, errlen, "fi_cq_open", rc); goto out;
out_av: rc = fail(err, errlen, "fi_av_open", rc); goto out;
out_ep: rc = fail(err, errlen, "fi_endpoint", rc); goto out;
out_bind: rc = fail(err, errlen, "fi_ep_bind", rc); goto out;
out_enable: rc = fail(err, errlen, "fi_enable", rc); goto out;
out:
    em_fab_close(h);
    return rc;
}

/* This endpoint's address (`name`, at most *namelen bytes; *namelen set to its length) and the
 * receive ring's remote base and key. */
int em_fab_local_info(struct em_fab *h, void *recv_ring, uint8_t *name, size_t *namelen, uint64_t *base,
                      uint64_t *key) {
    int rc = fi_getname(&h->ep->fid, name, namelen);
    if (rc) return rc;
    *base = (h->info->domain_attr->mr_mode & FI_MR_VIRT_ADDR) ? (uint64_t)(uintptr_t)recv_ring : 0;
    *key = fi_mr_key(h->recv_mr);
    return 0;
}

/* The peer's address and receive ring. */
int em_fab_connect(struct em_fab *h, const uint8_t *name, uint64_t base, uint64_t key, char *err, size_t errlen) {
    int n = fi_av_insert(h->av, name, 1, &h->peer, 0, NULL);
    if (n != 1) return fail(err, errlen, "fi_av_insert", n < 0 ? n : -FI_EINVAL);
    h->peer_base = base;
    h->peer_key = key;
    h->connected = 1;
    return 0;
}

/* Writes staging [off, off + len) to the peer's ring at `off` with immediate `imm`. */
ssize_t em_fab_write(struct em_fab *h, size_t off, size_t len, uint32_t imm, uint64_t wr_id) {
    if (!h->connected) return -FI_ENOTCONN;
    unsigned slot = (unsigned)(wr_id % EM_FAB_CTXS);
    h->send_wr[slot] = wr_id;
    return fi_writedata(h->ep, h->staging + off, len, fi_mr_desc(h->send_mr), imm, h->peer, h->peer_base + off,
                        h->peer_key, &h->send_ctx[slot]);
}

/* Whether each write with data consumes a posted receive here (mode FI_RX_CQ_DATA). */
int em_fab_needs_receives(struct em_fab *h) { return (h->info->mode & FI_RX_CQ_DATA) != 0; }

ssize_t em_fab_post_recv(struct em_fab *h) {
    unsigned slot = h->next_recv++ % EM_FAB_CTXS;
    return fi_recv(h->ep, NULL, 0, NULL, FI_ADDR_UNSPEC, &h->recv_ctx[slot]);
}

/* Drives the endpoint's progress, discarding completions, until none has come for `idle_ms`
 * or `max_ms` have passed: called before em_fab_close so that the endpoint is closed quiescent
 * (what the peer sent has been read whole, this end's writes have completed). libfabric 1.17's
 * ofi_rxm flushes each connection's message queue when the endpoint closes and has been seen to
 * dereference a bad operation context there (rxm_close_conn -> rxm_handle_comp_error, SIGSEGV)
 * when the close met traffic in flight. Returns the completions discarded. */
size_t em_fab_quiesce(struct em_fab *h, unsigned idle_ms, unsigned max_ms) {
    struct fi_cq_data_entry e[32];
    struct timespec start, last, now;
    clock_gettime(CLOCK_MONOTONIC, &start);
    last = start;
    size_t discarded = 0;
    for (;;) {
        ssize_t n = fi_cq_read(h->cq, e, 32);
        clock_gettime(CLOCK_MONOTONIC, &now);
        if (n > 0) {
            discarded += (size_t)n;
            last = now;
        } else if (n == -FI_EAVAIL) {
            struct fi_cq_err_entry ce;
            memset(&ce, 0, sizeof ce);
            if (fi_cq_readerr(h->cq, &ce, 0) < 0) break;
            last = now;
        } else if (n != -FI_EAGAIN) {
            break;
        }
        long since_start = (now.tv_sec - start.tv_sec) * 1000 + (now.tv_nsec - start.tv_nsec) / 1000000;
        long since_last = (now.tv_sec - last.tv_sec) * 1000 + (now.tv_nsec - last.tv_nsec) / 1000000;
        if (since_start >= (long)max_ms || since_last >= (long)idle_ms) break;
        if (n <= 0) {
            struct timespec pause = {0, 100000}; /* 100 us */
            nanosleep(&pause, NULL);
        }
    }
    return discarded;
}

/* Reads at most `max` completions: kind[i] = 0 (a write completed; value = its wr_id), 1 (a
 * remote write with data landed; value = the immediate), 2 (an error; `err` says which). Returns
 * the count (0 when idle) or a negative error. Reading also drives the provider's progress. */
ssize_t em_fab_poll(struct em_fab *h, int *kind, uint64_t *value, size_t max, char *err, size_t errlen) {
    struct fi_cq_data_entry e[32];
    if (max > 32) max = 32;
    ssize_t n = fi_cq_read(h->cq, e, max);
    if (n == -FI_EAGAIN) return 0;
    if (n == -FI_EAVAIL) {
        struct fi_cq_err_entry ce;
        memset(&ce, 0, sizeof ce);
        ssize_t r = fi_cq_readerr(h->cq, &ce, 0);
        if (r < 0) return fail(err, errlen, "fi_cq_readerr", (int)r);
        char buf[128];
        const char *what = fi_cq_strerror(h->cq, ce.prov_errno, ce.err_data, buf, sizeof buf);
        snprintf(err, errlen, "%s (err %d: %s, provider errno %d)", what ? what : "completion error", ce.err,
                 fi_strerror(ce.err), ce.prov_errno);
        kind[0] = 2;
        value[0] = 0;
        return 1;
    }
    if (n < 0) return fail(err, errlen, "fi_cq_read", (int)n);
    ssize_t out = 0;
    for (ssize_t i = 0; i < n; ++i) {
        if (e[i].flags & FI_REMOTE_CQ_DATA) {
            kind[out] = 1;
            value[out] = (uint32_t)e[i].data;
            ++out;
        } else if (e[i].op_context >= (void *)&h->send_ctx[0] && e[i].op_context < (void *)&h->send_ctx[EM_FAB_CTXS]) {
            size_t slot = (size_t)((struct fi_context2 *)e[i].op_context - &h->send_ctx[0]);
            kind[out] = 0;
            value[out] = h->send_wr[slot];
            ++out;
        }
        /* anything else (a receive without data) carries nothing for the link */
    }
    return out;
}

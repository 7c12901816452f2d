//! The libfabric NIC (feature `libfabric`): an RDM endpoint per link, `fi_writedata` with remote
//! CQ data into the peer's registered ring.
//!
//! Why this exists: libfabric reaches RoCE (`verbs;ofi_rxm`), AWS EFA (`efa`) and, on any host,
//! plain TCP (`tcp;ofi_rxm`), so the RDMA link's data path runs for real between processes here
//! and in CI, and on clusters whose NICs libfabric drives better than raw verbs. The calls go
//! through `fabric_shim.c` (libfabric's API is mostly static inline functions); this side holds
//! the rings and serialises every call on the endpoint (libfabric's `FI_THREAD_DOMAIN`: the
//! link's writer posts from its task while the poller thread polls, and polling also drives the
//! provider's progress, so a write refused with `-FI_EAGAIN` goes through once the poller has run).
//!
//! Endpoint description sent to the peer: the provider name (both ends must use the same
//! string: `tcp;ofi_rxm` and 1.18's native `tcp` are not wire-compatible), the endpoint address
//! from `fi_getname`, and the receive ring's remote base (its address when the provider uses
//! virtual addresses, else 0) and key.

use super::RdmaError;
use super::nic::{Completion, Nic, Posted};
use super::wire::{FabricEndpoint, decode_fabric_endpoint};
use expertmesh_quant::aligned::AlignedVec;
use std::ffi::{CString, c_char, c_int, c_void};
use std::net::IpAddr;
use std::sync::{Arc, Mutex, MutexGuard};

/// `-FI_EAGAIN`.
const FI_EAGAIN: isize = -11;

#[repr(C)]
struct EmFab {
    _opaque: [u8; 0],
}

unsafe extern "C" {
    /// Host pointers: `recv_ring` and `staging` are `cap` bytes of host memory alive until
    /// `em_fab_close`; `err` is `errlen` bytes of host memory.
    fn em_fab_open(
        prov: *const c_char,
        node: *const c_char,
        recv_ring: *mut c_void,
        staging: *mut c_void,
        cap: usize,
        out: *mut *mut EmFab,
        err: *mut c_char,
        errlen: usize,
    ) -> c_int;
    fn em_fab_local_info(
        h: *mut EmFab,
        recv_ring: *mut c_void,
        name: *mut u8,
        namelen: *mut usize,
        base: *mut u64,
        key: *mut u64,
    ) -> c_int;
    fn em_fab_connect(
        h: *mut EmFab,
        name: *const u8,
        base: u64,
        key: u64,
        err: *mut c_char,
        errlen: usize,
    ) -> c_int;
    fn em_fab_write(h: *mut EmFab, off: usize, len: usize, imm: u32, wr_id: u64) -> isize;
    fn em_fab_needs_receives(h: *mut EmFab) -> c_int;
    fn em_fab_post_recv(h: *mut EmFab) -> isize;
    /// `kind` and `value`: host arrays of at least `max` entries.
    fn em_fab_poll(
        h: *mut EmFab,
        kind: *mut c_int,
        value: *mut u64,
        max: usize,
        err: *mut c_char,
        errlen: usize,
    ) -> isize;
    fn em_fab_quiesce(h: *mut EmFab, idle_ms: u32, max_ms: u32) -> usize;
    fn em_fab_close(h: *mut EmFab);
    fn fi_strerror(errnum: c_int) -> *const c_char;
}

/// The endpoint handle; every use goes through the mutex.
struct Handle(*mut EmFab);

// SAFETY: the handle is only used under `FabricNic::h`'s mutex (libfabric FI_THREAD_DOMAIN).
unsafe impl Send for Handle {}

/// One libfabric endpoint.
pub(crate) struct FabricNic {
    provider: String,
    h: Mutex<Handle>,
    recv: AlignedVec<u8>,
    staging_ptr: *mut u8,
    _staging: AlignedVec<u8>,
    needs_receives: bool,
}

// SAFETY: the endpoint is used under the mutex; the rings are written by the provider and the
// link per the RDMA link's protocol (see `super`).
unsafe impl Send for FabricNic {}
// SAFETY: as above.
unsafe impl Sync for FabricNic {}

fn text(buf: &[u8]) -> String {
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

fn strerror(rc: isize) -> String {
    // SAFETY: fi_strerror returns a static NUL-terminated string for any code.
    let s = unsafe { std::ffi::CStr::from_ptr(fi_strerror((-rc) as c_int)) };
    format!("{} ({rc})", s.to_string_lossy())
}

impl FabricNic {
    /// Opens an endpoint of libfabric provider `provider` on `ip` with rings of `capacity`.
    pub(crate) fn new(provider: &str, ip: IpAddr, capacity: usize) -> Result<Self, RdmaError> {
        let err = |detail: String| RdmaError::Provider {
            provider: format!("libfabric:{provider}"),
            detail,
        };
        let prov = CString::new(provider).map_err(|e| err(e.to_string()))?;
        let node = (!ip.is_unspecified())
            .then(|| CString::new(ip.to_string()))
            .transpose()
            .map_err(|e| err(e.to_string()))?;
        let mut recv: AlignedVec<u8> = AlignedVec::zeroed(capacity);
        let mut staging: AlignedVec<u8> = AlignedVec::zeroed(capacity);
        let mut h = std::ptr::null_mut();
        let mut msg = [0u8; 256];
        // SAFETY: the rings are `capacity` bytes owned by the returned value, which closes the
        // handle (deregistering them) before they are freed; `msg` is 256 writable bytes.
        let rc = unsafe {
            em_fab_open(
                prov.as_ptr(),
                node.as_ref().map_or(std::ptr::null(), |n| n.as_ptr()),
                recv.as_mut_ptr().cast(),
                staging.as_mut_ptr().cast(),
                capacity,
                &mut h,
                msg.as_mut_ptr().cast(),
                msg.len(),
            )
        };
        if rc != 0 || h.is_null() {
            return Err(err(format!(
                "{} (is the provider available? `fi_info -l` lists them)",
                text(&msg)
            )));
        }
        // SAFETY: h is a live handle.
        let needs_receives = unsafe { em_fab_needs_receives(h) } != 0;
        Ok(Self {
            provider: provider.to_string(),
            h: Mutex::new(Handle(h)),
            staging_ptr: staging.as_mut_ptr(),
            recv,
            _staging: staging,
            needs_receives,
        })
    }

    fn lock(&self) -> MutexGuard<'_, Handle> {
        self.h.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn err(&self, detail: String) -> RdmaError {
        RdmaError::Provider {
            provider: format!("libfabric:{}", self.provider),
            detail,
        }
    }
}

/// How long a closing endpoint keeps driving progress with nothing arriving before it closes.
const QUIESCE_IDLE_MS: u32 = 20;
/// The most a closing endpoint waits to be quiescent.
const QUIESCE_MAX_MS: u32 = 250;

/// Closes an endpoint quiescent: progress is driven until nothing has arrived for
/// [`QUIESCE_IDLE_MS`] (at most [`QUIESCE_MAX_MS`]), then the endpoint is closed and the rings
/// it registered are freed, in that order. Runs on its own thread (see [`FabricNic`]'s `Drop`).
fn close_quiescent(h: Handle, rings: [AlignedVec<u8>; 2]) {
    // SAFETY: a live handle, used by this thread only from now on; it is closed once, before
    // the rings it registered (moved here with it) are freed.
    unsafe {
        em_fab_quiesce(h.0, QUIESCE_IDLE_MS, QUIESCE_MAX_MS);
        em_fab_close(h.0);
    }
    drop(rings);
}

impl Drop for FabricNic {
    /// The link is gone (its poller and writer dropped their references); its peer learns that
    /// from the control connection and stops writing. Closing at once could meet the peer's last
    /// writes half-read, which libfabric 1.17's `ofi_rxm` mishandles on close (a segmentation
    /// fault in `rxm_close_conn`, seen in CI), so the endpoint is first drained until quiet, on a
    /// thread of its own: a drop in an async task must not block its runtime for that long.
    fn drop(&mut self) {
        let h = Handle(std::mem::replace(&mut self.lock().0, std::ptr::null_mut()));
        let rings = [
            std::mem::replace(&mut self.recv, AlignedVec::zeroed(0)),
            std::mem::replace(&mut self._staging, AlignedVec::zeroed(0)),
        ];
        // The job is taken by the thread, or here when no thread can be started (never both).
        let job = Arc::new(Mutex::new(Some((h, rings))));
        let for_thread = Arc::clone(&job);
        let spawned = std::thread::Builder::new()
            .name("rdma-fab-close".into())
            .spawn(move || {
                let taken = for_thread.lock().unwrap_or_else(|e| e.into_inner()).take();
                if let Some((h, rings)) = taken {
                    close_quiescent(h, rings);
                }
            });
        if let Err(e) = spawned {
            tracing::warn!(
                "cannot spawn a thread to close a libfabric endpoint ({e}): closing it here"
            );
            let taken = job.lock().unwrap_or_else(|e| e.into_inner()).take();
            if let Some((h, rings)) = taken {
                close_quiescent(h, rings);
            }
        }
    }
}

impl Nic for FabricNic {
    fn local_info(&self) -> Vec<u8> {
        let h = self.lock();
        let mut name = [0u8; 256];
        let mut len = name.len();
        let (mut base, mut key) = (0u64, 0u64);
        // SAFETY: live handle; `name` has `len` writable bytes; the ring pointer is the one
        // registered.
        let rc = unsafe {
            em_fab_local_info(
                h.0,
                self.recv.as_ptr() as *mut c_void,
                name.as_mut_ptr(),
                &mut len,
                &mut base,
                &mut key,
            )
        };
        let len = if rc == 0 { len.min(name.len()) } else { 0 };
        let mut v = Vec::with_capacity(64 + len);
        FabricEndpoint {
            provider: self.provider.as_bytes(),
            name: &name[..len],
            base,
            key,
        }
        .encode(&mut v);
        v
    }

    fn connect(&self, peer: &[u8]) -> Result<(), RdmaError> {
        let ep = decode_fabric_endpoint(peer)?;
        if ep.provider != self.provider.as_bytes() {
            return Err(RdmaError::BadPeerInfo(format!(
                "the peer uses libfabric provider {:?}, this end {:?}: configure the same on both",
                String::from_utf8_lossy(ep.provider),
                self.provider
            )));
        }
        let (name, base, key) = (ep.name, ep.base, ep.key);
        let h = self.lock();
        let mut msg = [0u8; 256];
        // SAFETY: live handle; `name` is the peer's fi_getname bytes; msg is writable.
        let rc = unsafe {
            em_fab_connect(
                h.0,
                name.as_ptr(),
                base,
                key,
                msg.as_mut_ptr().cast(),
                msg.len(),
            )
        };
        if rc != 0 {
            return Err(self.err(text(&msg)));
        }
        Ok(())
    }

    fn ring_capacity(&self) -> usize {
        self.recv.len()
    }

    fn recv_ring(&self) -> *const u8 {
        self.recv.as_ptr()
    }

    fn staging(&self) -> *mut u8 {
        self.staging_ptr
    }

    fn post_write(
        &self,
        off: usize,
        len: usize,
        imm: u32,
        wr_id: u64,
    ) -> Result<Posted, RdmaError> {
        let h = self.lock();
        // SAFETY: live handle; [off, off + len) lies in the registered staging ring (the link
        // checks it against the capacity).
        let rc = unsafe { em_fab_write(h.0, off, len, imm, wr_id) };
        match rc {
            0 => Ok(Posted::Accepted),
            FI_EAGAIN => Ok(Posted::Again),
            e => Err(self.err(format!("fi_writedata: {}", strerror(e)))),
        }
    }

    fn needs_receives(&self) -> bool {
        self.needs_receives
    }

    fn post_recv(&self) -> Result<(), RdmaError> {
        let h = self.lock();
        // SAFETY: live handle.
        let rc = unsafe { em_fab_post_recv(h.0) };
        if rc == 0 {
            Ok(())
        } else {
            Err(self.err(format!("fi_recv: {}", strerror(rc))))
        }
    }

    fn poll(&self, out: &mut Vec<Completion>, max: usize) -> Result<(), RdmaError> {
        let mut kind = [0 as c_int; 32];
        let mut value = [0u64; 32];
        let mut msg = [0u8; 256];
        let n = {
            let h = self.lock();
            // SAFETY: live handle; kind/value hold 32 entries; msg is writable.
            unsafe {
                em_fab_poll(
                    h.0,
                    kind.as_mut_ptr(),
                    value.as_mut_ptr(),
                    max.min(32),
                    msg.as_mut_ptr().cast(),
                    msg.len(),
                )
            }
        };
        if n < 0 {
            return Err(self.err(text(&msg)));
        }
        for i in 0..n as usize {
            out.push(match kind[i] {
                0 => Completion::Sent { wr_id: value[i] },
                1 => Completion::Received {
                    imm: value[i] as u32,
                },
                _ => Completion::Failed(text(&msg)),
            });
        }
        Ok(())
    }
}

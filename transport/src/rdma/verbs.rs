//! The raw ibverbs NIC (feature `rdma`): one reliable-connected queue pair per link, RoCE or
//! InfiniBand.
//!
//! Why this exists: on hosts with RDMA NICs and no libfabric, or where the last microsecond
//! matters, the link's writes go straight to an RC queue pair. This module implements only the
//! [`Nic`] interface (queue pair setup, registered rings, posting, completions); the ring
//! records, credits and the poller are the link's ([`super`]).
//!
//! Set-up: the queue pair is created and both rings registered when the endpoint opens; the
//! queue pair number, PSN, LID, GID and the ring's address and key are its endpoint
//! description. The GID is the port's entry whose IPv4-mapped address equals this rank's listen
//! address (RoCE v2 preferred), so the topology's IP plan selects the NIC port.
//!
//! Verbs are called through `ibverbs-sys` (the `ibverbs` crate's FFI) because the safe crate
//! offers no write-with-immediate; device discovery and the GID table use the `ibverbs` crate.

use super::nic::{Completion, Nic, Posted};
use super::{RECV_WRS, RdmaError, SEND_WRS};
use crate::link::nonce;
use expertmesh_quant::aligned::AlignedVec;
use ibverbs_sys as ffi;
use std::net::IpAddr;
use std::sync::OnceLock;

const IB_PORT: u8 = 1;

fn verbs(call: &'static str) -> RdmaError {
    RdmaError::Verbs {
        call,
        source: std::io::Error::last_os_error(),
    }
}

fn verbs_rc(call: &'static str, rc: i32) -> Result<(), RdmaError> {
    if rc == 0 {
        Ok(())
    } else {
        Err(RdmaError::Verbs {
            call,
            source: std::io::Error::from_raw_os_error(rc.abs()),
        })
    }
}

/// Verbs objects of one link, destroyed in reverse order.
struct Resources {
    ctx: *mut ffi::ibv_context,
    pd: *mut ffi::ibv_pd,
    cq: *mut ffi::ibv_cq,
    qp: *mut ffi::ibv_qp,
    recv_mr: *mut ffi::ibv_mr,
    send_mr: *mut ffi::ibv_mr,
    recv_ring: AlignedVec<u8>,
    send_ring: AlignedVec<u8>,
    gid_index: u8,
    gid: [u8; 16],
    lid: u16,
    mtu: ffi::ibv_mtu,
}

// SAFETY: verbs objects may be used from any thread (libibverbs serialises per-QP posting
// internally); the rings are only touched per the SPSC protocol described in the module docs.
unsafe impl Send for Resources {}
// SAFETY: as above.
unsafe impl Sync for Resources {}

impl Drop for Resources {
    fn drop(&mut self) {
        // SAFETY: each pointer was created by the matching verbs call and is destroyed once.
        unsafe {
            if !self.qp.is_null() {
                ffi::ibv_destroy_qp(self.qp);
            }
            if !self.send_mr.is_null() {
                ffi::ibv_dereg_mr(self.send_mr);
            }
            if !self.recv_mr.is_null() {
                ffi::ibv_dereg_mr(self.recv_mr);
            }
            if !self.cq.is_null() {
                ffi::ibv_destroy_cq(self.cq);
            }
            if !self.pd.is_null() {
                ffi::ibv_dealloc_pd(self.pd);
            }
            if !self.ctx.is_null() {
                ffi::ibv_close_device(self.ctx);
            }
        }
    }
}

/// The queue pair description exchanged in the hello attachment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct QpInfo {
    qpn: u32,
    psn: u32,
    lid: u16,
    gid: [u8; 16],
    ring_addr: u64,
    ring_rkey: u32,
    ring_capacity: u64,
}

const QP_INFO_LEN: usize = 4 + 4 + 2 + 16 + 8 + 4 + 8;

impl QpInfo {
    fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(QP_INFO_LEN);
        v.extend_from_slice(&self.qpn.to_le_bytes());
        v.extend_from_slice(&self.psn.to_le_bytes());
        v.extend_from_slice(&self.lid.to_le_bytes());
        v.extend_from_slice(&self.gid);
        v.extend_from_slice(&self.ring_addr.to_le_bytes());
        v.extend_from_slice(&self.ring_rkey.to_le_bytes());
        v.extend_from_slice(&self.ring_capacity.to_le_bytes());
        v
    }

    fn decode(b: &[u8]) -> Result<Self, RdmaError> {
        if b.len() != QP_INFO_LEN {
            return Err(RdmaError::BadPeerInfo(format!("{} bytes", b.len())));
        }
        let u32_at = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        let u64_at = |o: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[o..o + 8]);
            u64::from_le_bytes(a)
        };
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[10..26]);
        Ok(Self {
            qpn: u32_at(0),
            psn: u32_at(4),
            lid: u16::from_le_bytes([b[8], b[9]]),
            gid,
            ring_addr: u64_at(26),
            ring_rkey: u32_at(34),
            ring_capacity: u64_at(38),
        })
    }
}

/// Chooses the GID index whose IPv4-mapped address equals `ip` (RoCE v2 preferred).
fn choose_gid(device: Option<&str>, ip: IpAddr) -> Result<(String, u8, [u8; 16]), RdmaError> {
    let list = ibverbs::devices().map_err(|source| {
        // Without the kernel's RDMA subsystem the device list call fails with ENOSYS.
        if matches!(
            source.raw_os_error(),
            Some(libc::ENOSYS) | Some(libc::ENODEV)
        ) {
            RdmaError::NoDevice(device.map(str::to_owned))
        } else {
            RdmaError::Verbs {
                call: "ibv_get_device_list",
                source,
            }
        }
    })?;
    let dev = list
        .iter()
        .find(|d| device.is_none_or(|want| d.name().is_some_and(|n| n.to_string_lossy() == want)))
        .ok_or_else(|| RdmaError::NoDevice(device.map(str::to_owned)))?;
    let name = dev
        .name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let ctx = dev.open().map_err(|source| RdmaError::Verbs {
        call: "ibv_open_device",
        source,
    })?;
    let mut candidates = Vec::new();
    let mut best: Option<(bool, u8, [u8; 16])> = None;
    for e in ctx.gid_table() {
        if e.port_num != IB_PORT as u32 {
            continue;
        }
        let raw_gid: ffi::ibv_gid = e.gid.into();
        // SAFETY: every bit pattern is a valid [u8; 16].
        let raw = unsafe { raw_gid.raw };
        let is_v4 = raw[..10].iter().all(|&b| b == 0) && raw[10] == 0xFF && raw[11] == 0xFF;
        if !is_v4 {
            continue;
        }
        let v4 = std::net::Ipv4Addr::new(raw[12], raw[13], raw[14], raw[15]);
        candidates.push(format!("{}:{v4}", e.gid_index));
        let matches = match ip {
            IpAddr::V4(a) => a == v4 || a.is_unspecified(),
            IpAddr::V6(_) => false,
        };
        let v2 = e.gid_type == ffi::IBV_GID_TYPE_ROCE_V2;
        if matches && best.is_none_or(|(bv2, _, _)| v2 && !bv2) {
            best = Some((v2, e.gid_index as u8, raw));
        }
    }
    best.map(|(_, i, g)| (name, i, g))
        .ok_or_else(|| RdmaError::NoGid {
            port: IB_PORT,
            ip: ip.to_string(),
            candidates: if candidates.is_empty() {
                "none".into()
            } else {
                candidates.join(", ")
            },
        })
}

/// Access flags of the receive ring and the queue pair: local and remote writes.
fn remote_write_access() -> i32 {
    (ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE)
        .0 as i32
}

impl Resources {
    /// Opens the device owning the GID of `ip` and sets up a queue pair in INIT with
    /// registered receive and staging rings of `capacity` bytes each.
    fn new(device: Option<&str>, ip: IpAddr, capacity: usize) -> Result<Self, RdmaError> {
        let (name, gid_index, gid) = choose_gid(device, ip)?;
        let mut res = Resources {
            ctx: std::ptr::null_mut(),
            pd: std::ptr::null_mut(),
            cq: std::ptr::null_mut(),
            qp: std::ptr::null_mut(),
            recv_mr: std::ptr::null_mut(),
            send_mr: std::ptr::null_mut(),
            recv_ring: AlignedVec::zeroed(capacity),
            send_ring: AlignedVec::zeroed(capacity),
            gid_index,
            gid,
            lid: 0,
            mtu: ffi::IBV_MTU_1024,
        };
        // Each step checks every pointer it gets and stores it in `res`, whose Drop releases
        // whatever was created before a failure.
        res.open_device(&name)?;
        res.alloc_pd_and_cq()?;
        res.register_rings()?;
        res.create_qp()?;
        res.init_qp()?;
        Ok(res)
    }

    /// Opens the device called `name` and reads its port's LID and MTU.
    fn open_device(&mut self, name: &str) -> Result<(), RdmaError> {
        // SAFETY: the device list is used only between get and free; the opened context is
        // owned by `self` (closed by Drop); `port` is a valid out-parameter.
        unsafe {
            let mut n = 0;
            let list = ffi::ibv_get_device_list(&mut n);
            if list.is_null() {
                return Err(verbs("ibv_get_device_list"));
            }
            for i in 0..n.max(0) as usize {
                let d = *list.add(i);
                let dn = std::ffi::CStr::from_ptr(ffi::ibv_get_device_name(d));
                if dn.to_string_lossy() == name {
                    self.ctx = ffi::ibv_open_device(d);
                    break;
                }
            }
            ffi::ibv_free_device_list(list);
            if self.ctx.is_null() {
                return Err(RdmaError::NoDevice(Some(name.to_owned())));
            }
            let mut port = ffi::ibv_port_attr::default();
            verbs_rc(
                "ibv_query_port",
                ffi::ibv_query_port(
                    self.ctx,
                    IB_PORT,
                    &mut port as *mut ffi::ibv_port_attr as *mut _,
                ),
            )?;
            self.lid = port.lid;
            self.mtu = port.active_mtu;
        }
        Ok(())
    }

    /// Allocates the protection domain and the completion queue shared by sends and receives.
    fn alloc_pd_and_cq(&mut self) -> Result<(), RdmaError> {
        // SAFETY: ctx is a live context (open_device succeeded); results are checked and owned.
        unsafe {
            self.pd = ffi::ibv_alloc_pd(self.ctx);
            if self.pd.is_null() {
                return Err(verbs("ibv_alloc_pd"));
            }
            self.cq = ffi::ibv_create_cq(
                self.ctx,
                (RECV_WRS + SEND_WRS) as i32,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                0,
            );
            if self.cq.is_null() {
                return Err(verbs("ibv_create_cq"));
            }
        }
        Ok(())
    }

    /// Registers the receive ring (remote-writable) and the staging ring (local only).
    fn register_rings(&mut self) -> Result<(), RdmaError> {
        let capacity = self.recv_ring.len();
        // SAFETY: pd is live; the rings are heap buffers owned by `self` that outlive their
        // registrations (Drop deregisters before the buffers are freed).
        unsafe {
            self.recv_mr = ffi::ibv_reg_mr(
                self.pd,
                self.recv_ring.as_mut_ptr().cast(),
                capacity,
                remote_write_access(),
            );
            if self.recv_mr.is_null() {
                return Err(verbs("ibv_reg_mr (receive ring)"));
            }
            self.send_mr = ffi::ibv_reg_mr(
                self.pd,
                self.send_ring.as_mut_ptr().cast(),
                capacity,
                ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0 as i32,
            );
            if self.send_mr.is_null() {
                return Err(verbs("ibv_reg_mr (send ring)"));
            }
        }
        Ok(())
    }

    /// Creates the reliable-connected queue pair on the completion queue.
    fn create_qp(&mut self) -> Result<(), RdmaError> {
        let mut init = ffi::ibv_qp_init_attr {
            qp_context: std::ptr::null_mut(),
            send_cq: self.cq,
            recv_cq: self.cq,
            srq: std::ptr::null_mut(),
            cap: ffi::ibv_qp_cap {
                max_send_wr: SEND_WRS,
                max_recv_wr: RECV_WRS,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            qp_type: ffi::ibv_qp_type::IBV_QPT_RC,
            sq_sig_all: 0,
        };
        // SAFETY: pd and cq are live; `init` is valid for the call; the QP is owned by `self`.
        self.qp = unsafe { ffi::ibv_create_qp(self.pd, &mut init) };
        if self.qp.is_null() {
            return Err(verbs("ibv_create_qp"));
        }
        Ok(())
    }

    /// Moves the queue pair to INIT on the port, allowing remote writes.
    fn init_qp(&mut self) -> Result<(), RdmaError> {
        let mut attr = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_INIT,
            pkey_index: 0,
            port_num: IB_PORT,
            qp_access_flags: remote_write_access() as u32,
            ..Default::default()
        };
        let mask = ffi::ibv_qp_attr_mask::IBV_QP_STATE
            | ffi::ibv_qp_attr_mask::IBV_QP_PKEY_INDEX
            | ffi::ibv_qp_attr_mask::IBV_QP_PORT
            | ffi::ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS;
        // SAFETY: qp is live (create_qp succeeded); `attr` is valid for the call.
        let rc = unsafe { ffi::ibv_modify_qp(self.qp, &mut attr, mask.0 as i32) };
        verbs_rc("ibv_modify_qp (INIT)", rc)
    }

    fn post_recv(&self) -> Result<(), RdmaError> {
        // Zero-length receive: WRITE_WITH_IMM only needs a WR to deliver the immediate.
        let mut wr = ffi::ibv_recv_wr {
            wr_id: 0,
            next: std::ptr::null_mut(),
            sg_list: std::ptr::null_mut(),
            num_sge: 0,
        };
        let mut bad: *mut ffi::ibv_recv_wr = std::ptr::null_mut();
        // SAFETY: qp is a live RC QP; the WR is valid for the duration of the call.
        let rc = unsafe {
            let ctx = (*self.qp).context;
            match (*ctx).ops.post_recv {
                Some(f) => f(self.qp, &mut wr, &mut bad),
                None => libc::ENOSYS,
            }
        };
        verbs_rc("ibv_post_recv", rc)
    }

    fn connect(&self, local_psn: u32, remote: &QpInfo) -> Result<(), RdmaError> {
        // SAFETY: qp is live; attributes follow the RC INIT → RTR → RTS sequence.
        unsafe {
            let mut rtr = ffi::ibv_qp_attr {
                qp_state: ffi::ibv_qp_state::IBV_QPS_RTR,
                path_mtu: self.mtu,
                dest_qp_num: remote.qpn,
                rq_psn: remote.psn,
                max_dest_rd_atomic: 1,
                min_rnr_timer: 12,
                ..Default::default()
            };
            rtr.ah_attr.is_global = 1;
            rtr.ah_attr.dlid = remote.lid;
            rtr.ah_attr.port_num = IB_PORT;
            rtr.ah_attr.grh.dgid.raw = remote.gid;
            rtr.ah_attr.grh.sgid_index = self.gid_index;
            rtr.ah_attr.grh.hop_limit = 64;
            let mask = ffi::ibv_qp_attr_mask::IBV_QP_STATE
                | ffi::ibv_qp_attr_mask::IBV_QP_AV
                | ffi::ibv_qp_attr_mask::IBV_QP_PATH_MTU
                | ffi::ibv_qp_attr_mask::IBV_QP_DEST_QPN
                | ffi::ibv_qp_attr_mask::IBV_QP_RQ_PSN
                | ffi::ibv_qp_attr_mask::IBV_QP_MAX_DEST_RD_ATOMIC
                | ffi::ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER;
            verbs_rc(
                "ibv_modify_qp (RTR)",
                ffi::ibv_modify_qp(self.qp, &mut rtr, mask.0 as i32),
            )?;
            let mut rts = ffi::ibv_qp_attr {
                qp_state: ffi::ibv_qp_state::IBV_QPS_RTS,
                timeout: 14,
                retry_cnt: 7,
                rnr_retry: 7,
                sq_psn: local_psn,
                max_rd_atomic: 1,
                ..Default::default()
            };
            let mask = ffi::ibv_qp_attr_mask::IBV_QP_STATE
                | ffi::ibv_qp_attr_mask::IBV_QP_TIMEOUT
                | ffi::ibv_qp_attr_mask::IBV_QP_RETRY_CNT
                | ffi::ibv_qp_attr_mask::IBV_QP_RNR_RETRY
                | ffi::ibv_qp_attr_mask::IBV_QP_SQ_PSN
                | ffi::ibv_qp_attr_mask::IBV_QP_MAX_QP_RD_ATOMIC;
            verbs_rc(
                "ibv_modify_qp (RTS)",
                ffi::ibv_modify_qp(self.qp, &mut rts, mask.0 as i32),
            )?;
        }
        Ok(())
    }
}

/// The verbs endpoint of one link.
pub(crate) struct VerbsNic {
    res: Resources,
    psn: u32,
    remote: OnceLock<QpInfo>,
}

impl VerbsNic {
    /// Opens the device owning the GID of `ip` (or `device`) with rings of `capacity` bytes.
    pub(crate) fn new(
        device: Option<&str>,
        ip: IpAddr,
        capacity: usize,
    ) -> Result<Self, RdmaError> {
        let res = Resources::new(device, ip, capacity)?;
        let n = nonce();
        Ok(Self {
            res,
            psn: u32::from_le_bytes([n[0], n[1], n[2], 0]),
            remote: OnceLock::new(),
        })
    }
}

impl Nic for VerbsNic {
    fn local_info(&self) -> Vec<u8> {
        // SAFETY: qp and recv_mr are live for the life of `res`.
        let (qpn, rkey) = unsafe { ((*self.res.qp).qp_num, (*self.res.recv_mr).rkey) };
        QpInfo {
            qpn,
            psn: self.psn,
            lid: self.res.lid,
            gid: self.res.gid,
            ring_addr: self.res.recv_ring.as_ptr() as u64,
            ring_rkey: rkey,
            ring_capacity: self.res.recv_ring.len() as u64,
        }
        .encode()
    }

    fn connect(&self, peer: &[u8]) -> Result<(), RdmaError> {
        let remote = QpInfo::decode(peer)?;
        if remote.ring_capacity != self.res.send_ring.len() as u64 {
            return Err(RdmaError::BadPeerInfo(format!(
                "ring of {} bytes, this end {}",
                remote.ring_capacity,
                self.res.send_ring.len()
            )));
        }
        self.res.connect(self.psn, &remote)?;
        self.remote
            .set(remote)
            .map_err(|_| RdmaError::BadPeerInfo("connected twice".into()))
    }

    fn ring_capacity(&self) -> usize {
        self.res.recv_ring.len()
    }

    fn recv_ring(&self) -> *const u8 {
        self.res.recv_ring.as_ptr()
    }

    fn staging(&self) -> *mut u8 {
        self.res.send_ring.as_ptr() as *mut u8
    }

    fn post_write(
        &self,
        off: usize,
        len: usize,
        imm: u32,
        wr_id: u64,
    ) -> Result<Posted, RdmaError> {
        let remote = self.remote.get().ok_or(RdmaError::Closed)?;
        let staging = self.staging();
        let mut sge = ffi::ibv_sge {
            addr: staging as u64 + off as u64,
            length: len as u32,
            // SAFETY: send_mr is live.
            lkey: unsafe { (*self.res.send_mr).lkey },
        };
        let mut wr = ffi::ibv_send_wr {
            wr_id,
            next: std::ptr::null_mut(),
            sg_list: &mut sge,
            num_sge: 1,
            opcode: ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM,
            send_flags: ffi::ibv_send_flags::IBV_SEND_SIGNALED.0,
            ..Default::default()
        };
        wr.__bindgen_anon_1.imm_data = imm.to_be();
        wr.wr.rdma = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 {
            remote_addr: remote.ring_addr + off as u64,
            rkey: remote.ring_rkey,
        };
        let mut bad: *mut ffi::ibv_send_wr = std::ptr::null_mut();
        // SAFETY: qp is live and in RTS; sge points into the registered staging ring.
        let rc = unsafe {
            let ctx = (*self.res.qp).context;
            match (*ctx).ops.post_send {
                Some(f) => f(self.res.qp, &mut wr, &mut bad),
                None => libc::ENOSYS,
            }
        };
        if rc == libc::ENOMEM {
            return Ok(Posted::Again); // the send queue is full
        }
        verbs_rc("ibv_post_send (RDMA_WRITE_WITH_IMM)", rc).map(|()| Posted::Accepted)
    }

    fn needs_receives(&self) -> bool {
        true
    }

    fn post_recv(&self) -> Result<(), RdmaError> {
        self.res.post_recv()
    }

    fn poll(&self, out: &mut Vec<Completion>, max: usize) -> Result<(), RdmaError> {
        let mut wcs = [ffi::ibv_wc::default(); 32];
        let want = max.min(wcs.len()) as i32;
        // SAFETY: cq is live; wcs has room for `want` completions.
        let n = unsafe {
            let ctx = (*self.res.cq).context;
            match (*ctx).ops.poll_cq {
                Some(f) => f(self.res.cq, want, wcs.as_mut_ptr()),
                None => -1,
            }
        };
        if n < 0 {
            return Err(verbs("ibv_poll_cq"));
        }
        for wc in &wcs[..n as usize] {
            out.push(if let Some((status, vendor)) = wc.error() {
                Completion::Failed(format!(
                    "work completion status {status}, vendor error {vendor:#x}"
                ))
            } else if wc.opcode() == ffi::ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM {
                Completion::Received {
                    imm: u32::from_be(wc.imm_data().unwrap_or(u32::MAX)),
                }
            } else {
                Completion::Sent { wr_id: wc.wr_id() }
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qp_info_round_trips() {
        let i = QpInfo {
            qpn: 0x12345,
            psn: 77,
            lid: 3,
            gid: [9; 16],
            ring_addr: 0xdead_beef_0000,
            ring_rkey: 42,
            ring_capacity: 1 << 20,
        };
        assert_eq!(QpInfo::decode(&i.encode()).unwrap(), i);
        assert!(QpInfo::decode(&[0; 5]).is_err());
    }

    #[test]
    fn device_setup_or_skip() {
        use std::io::Write;
        // Written to the real stderr (not the captured eprintln!) so a skip is always visible.
        match Resources::new(None, "127.0.0.1".parse().unwrap(), 1 << 20) {
            Ok(r) => assert_eq!(r.recv_ring.len(), 1 << 20),
            Err(RdmaError::NoDevice(_)) => {
                let _ = writeln!(std::io::stderr(), "skipped: no RDMA device");
            }
            Err(e) => {
                let _ = writeln!(
                    std::io::stderr(),
                    "skipped: RDMA device present but unusable: {e}"
                );
            }
        }
    }
}

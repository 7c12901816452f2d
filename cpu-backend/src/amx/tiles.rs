//! The AMX tile-operation layer: the configuration image, the operations the kernel uses, and
//! two implementations of them.
//!
//! Why this exists: AMX kernels cannot run on machines without AMX (AMD, older Intel, CI), yet
//! their tiling and their exactness must be tested everywhere. So the kernel is written against
//! [`Tiles`], implemented twice: [`Emulator`] follows the Intel SDM's definitions of
//! `LDTILECFG`, `TILEZERO`, `TILELOADD`, `TILESTORED` and `TDPB[SU][SU]D` literally (element
//! order, the VNNI layout of B, i32 wrap-around, and a panic on every shape or configuration the
//! hardware would fault on, so a kernel bug that would be SIGILL on Intel fails a test on AMD),
//! and [`Amx`] issues the instructions (`asm!`: stable Rust has no AMX intrinsics). On an AMX
//! machine both run the same kernel and must agree bit for bit.
//!
//! Facts used here (checked on an AMX Xeon: `../shared/research/amx.md`): tile arithmetic is
//! integer and wraps mod 2^32; tile state is per thread (configure in every thread that uses
//! tiles); Linux grants tile data per process through `arch_prctl(ARCH_REQ_XCOMP_PERM, 18)`.

/// Tiles in palette 1.
pub const TILES: usize = 8;
/// Maximum rows of a tile.
pub const MAX_ROWS: usize = 16;
/// Maximum bytes per tile row.
pub const MAX_COLSB: usize = 64;

/// The 64-byte `LDTILECFG` image (palette 1: tiles 0..8; the fields for tiles 8..16 are
/// reserved and must stay zero).
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TileCfg {
    /// 0 = release every tile (init state), 1 = the only palette.
    pub palette_id: u8,
    /// Restart row after a fault inside a load or store; always 0 here.
    pub start_row: u8,
    reserved: [u8; 14],
    /// Bytes per row of each tile (`colsb[8..]` reserved, zero).
    pub colsb: [u16; 16],
    /// Rows of each tile (`rows[8..]` reserved, zero).
    pub rows: [u8; 16],
}

impl TileCfg {
    /// Palette 1 with no tile configured.
    pub fn palette1() -> Self {
        Self {
            palette_id: 1,
            start_row: 0,
            reserved: [0; 14],
            colsb: [0; 16],
            rows: [0; 16],
        }
    }

    /// Configure tile `t` as `rows × colsb` bytes.
    pub fn tile(mut self, t: u8, rows: u8, colsb: u16) -> Self {
        self.rows[t as usize] = rows;
        self.colsb[t as usize] = colsb;
        self
    }

    /// Why `LDTILECFG` would raise #GP on this image, if it would.
    pub fn fault(&self) -> Option<String> {
        if self.palette_id > 1 {
            return Some(format!("palette {} (only 0 and 1 exist)", self.palette_id));
        }
        if self.reserved.iter().any(|&b| b != 0)
            || self.colsb[TILES..].iter().any(|&c| c != 0)
            || self.rows[TILES..].iter().any(|&r| r != 0)
        {
            return Some("a reserved byte is not zero".into());
        }
        for t in 0..TILES {
            let (r, c) = (self.rows[t], self.colsb[t]);
            if r as usize > MAX_ROWS || c as usize > MAX_COLSB {
                return Some(format!("tile {t} is {r} rows × {c} bytes (max 16 × 64)"));
            }
            if (r == 0) != (c == 0) {
                return Some(format!(
                    "tile {t} has only one of rows ({r}) and colsb ({c}) zero"
                ));
            }
        }
        None
    }
}

/// The tile operations the AMX kernels use. Tile numbers are const generics, as the
/// instructions encode them.
///
/// # Safety
/// Every method is `unsafe`: on [`Amx`] the pointers are dereferenced by the CPU without
/// checks (a load reads `rows × colsb` bytes at `base + r·stride`, a store writes as many), and
/// a shape the hardware rejects raises SIGILL; [`Emulator`] reads and writes the same bytes and
/// panics instead.
pub trait Tiles {
    /// `LDTILECFG`: set the shapes and zero every tile.
    ///
    /// # Safety
    /// See the trait.
    unsafe fn config(&mut self, cfg: &TileCfg);
    /// `TILEZERO tmm{T}`.
    ///
    /// # Safety
    /// See the trait.
    unsafe fn zero<const T: u8>(&mut self);
    /// `TILELOADD tmm{T}, [base + stride]`: row `r` ← `colsb` bytes at `base + r·stride`
    /// (memory: host, `rows` rows of `colsb` readable bytes at that stride).
    ///
    /// # Safety
    /// See the trait.
    unsafe fn load<const T: u8>(&mut self, base: *const u8, stride: usize);
    /// `TILESTORED [base + stride], tmm{T}` (memory: host, `rows` rows of `colsb` writable
    /// bytes at that stride).
    ///
    /// # Safety
    /// See the trait.
    unsafe fn store<const T: u8>(&mut self, base: *mut u8, stride: usize);
    /// `TDPBSSD tmm{C}, tmm{A}, tmm{B}`: C (i32) += A (s8) · B (s8, VNNI layout).
    ///
    /// # Safety
    /// See the trait.
    unsafe fn dpbssd<const C: u8, const A: u8, const B: u8>(&mut self);
    /// `TDPBSUD`: A signed, B unsigned.
    ///
    /// # Safety
    /// See the trait.
    unsafe fn dpbsud<const C: u8, const A: u8, const B: u8>(&mut self);
    /// `TDPBUSD`: A unsigned, B signed.
    ///
    /// # Safety
    /// See the trait.
    unsafe fn dpbusd<const C: u8, const A: u8, const B: u8>(&mut self);
    /// `TDPBUUD`: both unsigned.
    ///
    /// # Safety
    /// See the trait.
    unsafe fn dpbuud<const C: u8, const A: u8, const B: u8>(&mut self);
    /// `TILERELEASE`: back to the init state (nothing configured).
    ///
    /// # Safety
    /// See the trait.
    unsafe fn release(&mut self);
}

/// The SDM's tile operations in plain Rust, with the hardware's faults as panics.
#[derive(Clone)]
pub struct Emulator {
    cfg: Option<TileCfg>,
    data: [[[u8; MAX_COLSB]; MAX_ROWS]; TILES],
}

impl Default for Emulator {
    fn default() -> Self {
        Self::new()
    }
}

impl Emulator {
    /// Nothing configured (the init state).
    pub fn new() -> Self {
        Self {
            cfg: None,
            data: [[[0; MAX_COLSB]; MAX_ROWS]; TILES],
        }
    }

    /// `(rows, colsb)` of a configured tile whose colsb is a multiple of 4; panics (the
    /// hardware's #UD) otherwise.
    fn shape(&self, t: u8, op: &str) -> (usize, usize) {
        let cfg = self
            .cfg
            .as_ref()
            .unwrap_or_else(|| panic!("{op} on tmm{t}: no tile configuration (#UD)"));
        let (r, c) = (
            cfg.rows[t as usize] as usize,
            cfg.colsb[t as usize] as usize,
        );
        assert!(r > 0, "{op} on tmm{t}: tile not configured (#UD)");
        assert!(
            c % 4 == 0,
            "{op} on tmm{t}: colsb {c} is not a multiple of 4 (#UD)"
        );
        (r, c)
    }

    /// `TDPB<sa><sb>D` per the SDM: for each row m, each K dword k and each column n, four
    /// products (sign- or zero-extended bytes) added to `C[m].i32[n]` modulo 2^32.
    fn dp(&mut self, c: u8, a: u8, b: u8, sa: bool, sb: bool) {
        assert!(
            c != a && a != b && c != b,
            "TDPB*D tmm{c}, tmm{a}, tmm{b}: operands must be distinct tiles (#UD)"
        );
        let (rc, cc) = self.shape(c, "TDPB*D C");
        let (ra, ca) = self.shape(a, "TDPB*D A");
        let (rb, cb) = self.shape(b, "TDPB*D B");
        assert!(
            cc == cb && rc == ra && ca / 4 == rb,
            "TDPB*D shapes: C {rc}×{cc}, A {ra}×{ca}, B {rb}×{cb} (need C.colsb = B.colsb, \
             C.rows = A.rows, A.colsb / 4 = B.rows) (#UD)"
        );
        let ext = |v: u8, signed: bool| if signed { v as i8 as i32 } else { v as i32 };
        let (ta, tb) = (self.data[a as usize], self.data[b as usize]);
        let tc = &mut self.data[c as usize];
        for m in 0..rc {
            for k in 0..ca / 4 {
                for n in 0..cc / 4 {
                    let mut acc = i32::from_le_bytes(tc[m][4 * n..4 * n + 4].try_into().unwrap());
                    for i in 0..4 {
                        let x = ext(ta[m][4 * k + i], sa);
                        let y = ext(tb[k][4 * n + i], sb);
                        acc = acc.wrapping_add(x.wrapping_mul(y));
                    }
                    tc[m][4 * n..4 * n + 4].copy_from_slice(&acc.to_le_bytes());
                }
            }
        }
        // Bytes beyond colsb and rows beyond `rows` are zero in the written tile.
        for (m, row) in tc.iter_mut().enumerate() {
            let from = if m < rc { cc } else { 0 };
            row[from..].fill(0);
        }
    }
}

impl Tiles for Emulator {
    unsafe fn config(&mut self, cfg: &TileCfg) {
        if let Some(why) = cfg.fault() {
            panic!("LDTILECFG: {why} (#GP)");
        }
        self.cfg = (cfg.palette_id == 1).then_some(*cfg);
        self.data = [[[0; MAX_COLSB]; MAX_ROWS]; TILES];
    }

    unsafe fn zero<const T: u8>(&mut self) {
        self.shape(T, "TILEZERO");
        self.data[T as usize] = [[0; MAX_COLSB]; MAX_ROWS];
    }

    unsafe fn load<const T: u8>(&mut self, base: *const u8, stride: usize) {
        let (rows, colsb) = self.shape(T, "TILELOADD");
        let tile = &mut self.data[T as usize];
        for (r, row) in tile.iter_mut().enumerate() {
            row.fill(0);
            if r < rows {
                // SAFETY: the caller guarantees `rows` rows of `colsb` readable bytes.
                let src = unsafe { std::slice::from_raw_parts(base.add(r * stride), colsb) };
                row[..colsb].copy_from_slice(src);
            }
        }
    }

    unsafe fn store<const T: u8>(&mut self, base: *mut u8, stride: usize) {
        let (rows, colsb) = self.shape(T, "TILESTORED");
        for r in 0..rows {
            // SAFETY: the caller guarantees `rows` rows of `colsb` writable bytes.
            let dst = unsafe { std::slice::from_raw_parts_mut(base.add(r * stride), colsb) };
            dst.copy_from_slice(&self.data[T as usize][r][..colsb]);
        }
    }

    unsafe fn dpbssd<const C: u8, const A: u8, const B: u8>(&mut self) {
        self.dp(C, A, B, true, true);
    }

    unsafe fn dpbsud<const C: u8, const A: u8, const B: u8>(&mut self) {
        self.dp(C, A, B, true, false);
    }

    unsafe fn dpbusd<const C: u8, const A: u8, const B: u8>(&mut self) {
        self.dp(C, A, B, false, true);
    }

    unsafe fn dpbuud<const C: u8, const A: u8, const B: u8>(&mut self) {
        self.dp(C, A, B, false, false);
    }

    unsafe fn release(&mut self) {
        self.cfg = None;
        self.data = [[[0; MAX_COLSB]; MAX_ROWS]; TILES];
    }
}

/// Why the AMX instructions cannot be used in this process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AmxUnavailable {
    /// Not an x86-64 Linux build.
    NotX86Linux,
    /// The CPU does not report AMX-TILE and AMX-INT8 (CPUID leaf 7).
    NoCpuSupport,
    /// The OS has not enabled the tile state in XCR0 (bits 17 and 18).
    NotEnabledByOs,
    /// `arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)` failed with this errno (e.g. a kernel older
    /// than 5.16, or a thread whose signal stack is too small for the AMX frame).
    PermissionRefused(i32),
}

impl std::fmt::Display for AmxUnavailable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AmxUnavailable::NotX86Linux => write!(f, "AMX needs x86-64 Linux"),
            AmxUnavailable::NoCpuSupport => write!(f, "this CPU has no AMX-INT8"),
            AmxUnavailable::NotEnabledByOs => {
                write!(f, "the OS has not enabled AMX tile state (XCR0 bits 17/18)")
            }
            AmxUnavailable::PermissionRefused(e) => write!(
                f,
                "arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA) refused (errno {e}): Linux >= 5.16 \
                 is needed, and signal stacks must be at least AT_MINSIGSTKSZ"
            ),
        }
    }
}

impl std::error::Error for AmxUnavailable {}

/// Whether this process may run AMX-INT8 instructions: CPU support, OS support, and the
/// per-process permission for tile data (requested once, on the first call).
pub fn amx_available() -> Result<(), AmxUnavailable> {
    use std::sync::OnceLock;
    static STATE: OnceLock<Result<(), AmxUnavailable>> = OnceLock::new();
    STATE.get_or_init(hw::enable).clone()
}

/// The AMX instructions. A value exists only once [`amx_available`] succeeded, so holding one
/// proves the process may execute tile instructions.
#[derive(Debug)]
pub struct Amx(());

impl Amx {
    /// The instructions, if this process may run them.
    pub fn new() -> Result<Self, AmxUnavailable> {
        amx_available().map(|()| Amx(()))
    }
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
mod hw {
    //! `asm!` bodies of the tile operations, and the Linux enabling sequence.
    use super::{Amx, AmxUnavailable, TileCfg, Tiles};
    use std::arch::asm;

    /// `asm!` with every tile register declared clobbered (tile registers can only be
    /// clobbers: the compiler never allocates them, so values stay in them between blocks).
    macro_rules! tmm_asm {
        ($($t:tt)*) => {
            asm!($($t)*,
                out("tmm0") _, out("tmm1") _, out("tmm2") _, out("tmm3") _,
                out("tmm4") _, out("tmm5") _, out("tmm6") _, out("tmm7") _)
        };
    }

    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;

    /// XCR0 (the OS-enabled state components).
    ///
    /// # Safety
    /// The CPU must support XSAVE with OSXSAVE set (checked by the caller).
    #[target_feature(enable = "xsave")]
    unsafe fn xcr0() -> u64 {
        // SAFETY: OSXSAVE is set (caller), so XGETBV(0) is defined.
        unsafe { std::arch::x86_64::_xgetbv(0) }
    }

    pub(super) fn enable() -> Result<(), AmxUnavailable> {
        use std::arch::x86_64::__cpuid_count;
        let leaf1 = __cpuid_count(1, 0);
        let leaf7 = __cpuid_count(7, 0);
        let (tile, int8) = (leaf7.edx & (1 << 24) != 0, leaf7.edx & (1 << 25) != 0);
        if !(tile && int8) {
            return Err(AmxUnavailable::NoCpuSupport);
        }
        if leaf1.ecx & (1 << 27) == 0 {
            return Err(AmxUnavailable::NotEnabledByOs);
        }
        // SAFETY: OSXSAVE is set (checked above).
        let xcr0 = unsafe { xcr0() };
        if xcr0 & (0b11 << 17) != 0b11 << 17 {
            return Err(AmxUnavailable::NotEnabledByOs);
        }
        // SAFETY: arch_prctl with an integer argument; no memory is passed.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_arch_prctl,
                ARCH_REQ_XCOMP_PERM,
                XFEATURE_XTILEDATA,
            )
        };
        if rc != 0 {
            return Err(AmxUnavailable::PermissionRefused(
                std::io::Error::last_os_error().raw_os_error().unwrap_or(0),
            ));
        }
        Ok(())
    }

    impl Tiles for Amx {
        #[inline(always)]
        unsafe fn config(&mut self, cfg: &TileCfg) {
            debug_assert!(cfg.fault().is_none(), "{:?}", cfg.fault());
            // SAFETY: the image is 64 readable bytes; holding `Amx` proves permission.
            unsafe {
                tmm_asm!("ldtilecfg [{}]", in(reg) cfg as *const TileCfg, options(nostack, readonly))
            }
        }

        #[inline(always)]
        unsafe fn zero<const T: u8>(&mut self) {
            // SAFETY: see the trait; T is a configured tile (caller).
            unsafe { tmm_asm!("tilezero tmm{t}", t = const T, options(nostack, nomem)) }
        }

        #[inline(always)]
        unsafe fn load<const T: u8>(&mut self, base: *const u8, stride: usize) {
            // SAFETY: the caller guarantees the rows are readable.
            unsafe {
                tmm_asm!("tileloadd tmm{t}, [{p} + {s}*1]", t = const T, p = in(reg) base,
                    s = in(reg) stride, options(nostack, readonly))
            }
        }

        #[inline(always)]
        unsafe fn store<const T: u8>(&mut self, base: *mut u8, stride: usize) {
            // SAFETY: the caller guarantees the rows are writable.
            unsafe {
                tmm_asm!("tilestored [{p} + {s}*1], tmm{t}", t = const T, p = in(reg) base,
                    s = in(reg) stride, options(nostack))
            }
        }

        #[inline(always)]
        unsafe fn dpbssd<const C: u8, const A: u8, const B: u8>(&mut self) {
            // SAFETY: shapes are the caller's (see the trait).
            unsafe {
                tmm_asm!("tdpbssd tmm{c}, tmm{a}, tmm{b}", c = const C, a = const A, b = const B,
                    options(nostack, nomem))
            }
        }

        #[inline(always)]
        unsafe fn dpbsud<const C: u8, const A: u8, const B: u8>(&mut self) {
            // SAFETY: as above.
            unsafe {
                tmm_asm!("tdpbsud tmm{c}, tmm{a}, tmm{b}", c = const C, a = const A, b = const B,
                    options(nostack, nomem))
            }
        }

        #[inline(always)]
        unsafe fn dpbusd<const C: u8, const A: u8, const B: u8>(&mut self) {
            // SAFETY: as above.
            unsafe {
                tmm_asm!("tdpbusd tmm{c}, tmm{a}, tmm{b}", c = const C, a = const A, b = const B,
                    options(nostack, nomem))
            }
        }

        #[inline(always)]
        unsafe fn dpbuud<const C: u8, const A: u8, const B: u8>(&mut self) {
            // SAFETY: as above.
            unsafe {
                tmm_asm!("tdpbuud tmm{c}, tmm{a}, tmm{b}", c = const C, a = const A, b = const B,
                    options(nostack, nomem))
            }
        }

        #[inline(always)]
        unsafe fn release(&mut self) {
            // SAFETY: always defined once permission is held.
            unsafe { tmm_asm!("tilerelease", options(nostack, nomem)) }
        }
    }
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
mod hw {
    //! No AMX outside x86-64 Linux: [`super::Amx`] can never be constructed there.
    use super::{Amx, AmxUnavailable, TileCfg, Tiles};

    pub(super) fn enable() -> Result<(), AmxUnavailable> {
        Err(AmxUnavailable::NotX86Linux)
    }

    impl Tiles for Amx {
        unsafe fn config(&mut self, _: &TileCfg) {
            unreachable!("no Amx value exists on this target")
        }
        unsafe fn zero<const T: u8>(&mut self) {
            unreachable!()
        }
        unsafe fn load<const T: u8>(&mut self, _: *const u8, _: usize) {
            unreachable!()
        }
        unsafe fn store<const T: u8>(&mut self, _: *mut u8, _: usize) {
            unreachable!()
        }
        unsafe fn dpbssd<const C: u8, const A: u8, const B: u8>(&mut self) {
            unreachable!()
        }
        unsafe fn dpbsud<const C: u8, const A: u8, const B: u8>(&mut self) {
            unreachable!()
        }
        unsafe fn dpbusd<const C: u8, const A: u8, const B: u8>(&mut self) {
            unreachable!()
        }
        unsafe fn dpbuud<const C: u8, const A: u8, const B: u8>(&mut self) {
            unreachable!()
        }
        unsafe fn release(&mut self) {
            unreachable!()
        }
    }
}

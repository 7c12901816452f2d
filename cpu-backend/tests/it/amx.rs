//! The AMX tile layer and the AMX exact kernel: the emulator against the SDM's definitions and
//! the kernel against the contract's scalar dot on every machine; on AMX machines the
//! instructions against the emulator, bit for bit. The hardware tests say which ran.

use super::cpu_backend::spec_strategy;
use expertmesh_cpu_backend::amx::tiles::{self, Amx, Emulator, TileCfg, Tiles};
use expertmesh_cpu_backend::amx::{self, EmulatedGlue, TokenRows};
use expertmesh_cpu_backend::layout::R16Matrix;
use expertmesh_quant::format::{PackedMatrix, QuantSpec, ScaleDtype};
use expertmesh_quant::reference::{self, QuantizedVec};
use expertmesh_quant::synth::{self, SplitMix64};
use proptest::prelude::*;

/// `ntok` tokens' quantized activations in one buffer, token rows `stride` apart (the gap
/// filled with codes that must not be read), and the same tokens as reference vectors.
struct Tokens {
    acts: Vec<QuantizedVec>,
    q: Vec<i8>,
    d: Vec<f32>,
    stride: usize,
    d_stride: usize,
}

impl Tokens {
    fn new(cols: usize, ntok: usize, gap: usize, seed: u64) -> Self {
        let mut rng = SplitMix64::new(seed);
        let acts: Vec<QuantizedVec> = (0..ntok)
            .map(|_| QuantizedVec::new(&synth::normal_vec(&mut rng, cols, 1.0)))
            .collect();
        let (stride, d_stride) = (cols + gap, cols / 32 + gap);
        let mut q = vec![127i8; ntok * stride];
        let mut d = vec![f32::NAN; ntok * d_stride];
        for (t, a) in acts.iter().enumerate() {
            q[t * stride..t * stride + cols].copy_from_slice(&a.q);
            d[t * d_stride..t * d_stride + cols / 32].copy_from_slice(&a.d);
        }
        Self {
            acts,
            q,
            d,
            stride,
            d_stride,
        }
    }

    fn rows(&self) -> TokenRows<'_> {
        TokenRows {
            q: &self.q,
            q_stride: self.stride,
            q_block: 32,
            d: &self.d,
            d_stride: self.d_stride,
            tokens: self.acts.len(),
        }
    }
}

/// Every row block of `m` through `kernel` equals the contract's scalar row dot bit for bit.
type Kernel<'k> = &'k dyn Fn(&R16Matrix, usize, &TokenRows<'_>, &mut [[f32; 16]]);

fn check_kernel(m: &PackedMatrix, toks: &Tokens, kernel: Kernel<'_>) -> Result<(), TestCaseError> {
    let r16 = R16Matrix::from_canonical(m);
    for rb in 0..r16.row_blocks() {
        let mut out = [[f32::NAN; 16]; 16];
        kernel(&r16, rb, &toks.rows(), &mut out);
        for (t, a) in toks.acts.iter().enumerate() {
            for r in 0..16.min(m.rows() - rb * 16) {
                let want = reference::row_dot_exact(m, rb * 16 + r, a);
                prop_assert_eq!(
                    out[t][r].to_bits(),
                    want.to_bits(),
                    "row {} token {}: {} vs {}",
                    rb * 16 + r,
                    t,
                    out[t][r],
                    want
                );
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 40, ..ProptestConfig::default() })]

    /// The AMX kernel through the emulator: bit-identical to the contract for 1..=16 tokens,
    /// every format, K not a multiple of 16 blocks, N not a multiple of 16, strided tokens.
    #[test]
    fn emulated_amx_kernel_is_bit_identical(
        spec in spec_strategy(), rows in 1usize..40, kb in 1usize..40, ntok in 1usize..=16,
        gap in 0usize..3, seed in any::<u64>()
    ) {
        let cols = (kb * 32).div_ceil(spec.group_size as usize) * spec.group_size as usize;
        let mut rng = SplitMix64::new(seed);
        let m = synth::random_packed("test", spec, rows, cols, &mut rng).unwrap();
        let toks = Tokens::new(cols, ntok, gap * 32, seed ^ 1);
        for glue in [EmulatedGlue::Portable, EmulatedGlue::Avx512] {
            check_kernel(&m, &toks, &|m, rb, x, out| {
                amx::rowblock_exact_emulated(m, rb, x, out, glue);
            })?;
        }
    }
}

/// The largest products the contract can produce (every code 0 or 15 against ±127 / −128
/// activations, zero points 0 and 15) stay exact through the tiles.
#[test]
fn emulated_amx_kernel_is_exact_at_the_extremes() {
    let spec = QuantSpec {
        group_size: 32,
        scale_dtype: ScaleDtype::Bf16,
        zero_points: true,
    };
    let (rows, cols) = (16, 128);
    let mut m = PackedMatrix::zeroed("extreme", spec, rows, cols).unwrap();
    for n in 0..rows {
        for k in 0..cols {
            m.set_code(n, k, if (n + k / 32) % 2 == 0 { 15 } else { 0 });
        }
        for g in 0..cols / 32 {
            m.set_zero(n, g, if n % 2 == 0 { 0 } else { 15 });
            m.scales_mut()[n * (cols / 32) + g] = ScaleDtype::Bf16.from_f32(0.5 + n as f32);
        }
    }
    let mut toks = Tokens::new(cols, 16, 0, 7);
    for (t, a) in toks.acts.iter_mut().enumerate() {
        let v = if t % 2 == 0 { -128 } else { 127 };
        a.q.fill(v);
        toks.q[t * toks.stride..t * toks.stride + cols].fill(v);
    }
    for glue in [EmulatedGlue::Portable, EmulatedGlue::Avx512] {
        check_kernel(&m, &toks, &|m, rb, x, out| {
            amx::rowblock_exact_emulated(m, rb, x, out, glue);
        })
        .unwrap();
    }
}

/// Which glue code the emulator tests ran with on this machine (the AVX-512 glue is the one
/// the instructions run with; it needs an AVX-512 CPU).
#[test]
fn emulated_glue_coverage_is_reported() {
    let mut rng = SplitMix64::new(3);
    let m = synth::random_packed("glue", QuantSpec::G32_BF16, 16, 64, &mut rng).unwrap();
    let r16 = R16Matrix::from_canonical(&m);
    let toks = Tokens::new(64, 3, 0, 4);
    let mut out = [[0f32; 16]; 16];
    let ran = amx::rowblock_exact_emulated(&r16, 0, &toks.rows(), &mut out, EmulatedGlue::Avx512);
    if ran == EmulatedGlue::Avx512 {
        say("ran: the AVX-512 glue with the tile emulator");
    } else {
        say("skipped: the AVX-512 glue (no AVX-512 here); the portable glue ran");
    }
}

use crate::say;

fn amx_or_skip(what: &str) -> Option<Amx> {
    match Amx::new() {
        Ok(a) => {
            say(&format!("ran: {what} on the AMX instructions"));
            Some(a)
        }
        Err(why) => {
            say(&format!(
                "skipped: {what} on the AMX instructions ({why}); the emulator tests ran"
            ));
            None
        }
    }
}

/// On AMX machines: the kernel on the instructions equals the contract (and so the emulator).
#[test]
fn hardware_amx_kernel_is_bit_identical() {
    if amx_or_skip("the AMX exact kernel").is_none() {
        return;
    }
    let mut rng = SplitMix64::new(11);
    for (case, &(group, dtype, zp, rows, kb, ntok, gap)) in [
        (
            32u32,
            ScaleDtype::Bf16,
            false,
            48usize,
            224usize,
            16usize,
            0usize,
        ),
        (128, ScaleDtype::F16, true, 20, 40, 5, 64),
        (64, ScaleDtype::Bf16, true, 33, 18, 1, 0),
        (32, ScaleDtype::F16, false, 16, 17, 16, 32),
    ]
    .iter()
    .enumerate()
    {
        let spec = QuantSpec {
            group_size: group,
            scale_dtype: dtype,
            zero_points: zp,
        };
        let cols = kb * 32;
        let m = synth::random_packed("hw", spec, rows, cols, &mut rng).unwrap();
        let toks = Tokens::new(cols, ntok, gap, case as u64);
        check_kernel(&m, &toks, &|m, rb, x, out| {
            amx::rowblock_exact_amx(m, rb, x, out).expect("AMX was available");
        })
        .unwrap();
    }
}

/// Random tiles through each TDPB*D form, on the emulator and (on AMX machines) the
/// instructions: the same bytes out. On machines without AMX the emulator is checked against
/// a direct evaluation of the SDM's formula instead.
#[test]
fn tile_ops_agree_with_the_sdm() {
    let mut rng = SplitMix64::new(5);
    let hw = amx_or_skip("the tile-op comparison");
    for case in 0..64 {
        let m = 1 + (rng.next_u64() % 16) as usize;
        let k4 = 1 + (rng.next_u64() % 16) as usize;
        let n = 1 + (rng.next_u64() % 16) as usize;
        let a: Vec<u8> = (0..m * 4 * k4).map(|_| rng.next_u64() as u8).collect();
        let b: Vec<u8> = (0..k4 * 4 * n).map(|_| rng.next_u64() as u8).collect();
        let c0: Vec<i32> = (0..m * n)
            .map(|i| {
                if i % 3 == 0 {
                    i32::MAX - (rng.next_u64() % 100) as i32
                } else {
                    rng.next_u64() as i32
                }
            })
            .collect();
        let cfg = TileCfg::palette1()
            .tile(0, m as u8, (4 * k4) as u16)
            .tile(2, k4 as u8, (4 * n) as u16)
            .tile(5, m as u8, (4 * n) as u16);
        let form = case % 4;
        let run = |t: &mut dyn FnMut(&mut [i32])| {
            let mut c = c0.clone();
            t(&mut c);
            c
        };
        fn go<T: Tiles>(
            t: &mut T,
            cfg: &TileCfg,
            form: usize,
            a: &[u8],
            b: &[u8],
            c: &mut [i32],
            (k4, n): (usize, usize),
        ) {
            // SAFETY: the buffers hold exactly the configured rows × colsb bytes.
            unsafe {
                t.config(cfg);
                t.load::<0>(a.as_ptr(), 4 * k4);
                t.load::<2>(b.as_ptr(), 4 * n);
                t.load::<5>(c.as_ptr().cast(), 4 * n);
                match form {
                    0 => t.dpbssd::<5, 0, 2>(),
                    1 => t.dpbsud::<5, 0, 2>(),
                    2 => t.dpbusd::<5, 0, 2>(),
                    _ => t.dpbuud::<5, 0, 2>(),
                }
                t.store::<5>(c.as_mut_ptr().cast(), 4 * n);
                t.release();
            }
        }
        let emu = run(&mut |c| go(&mut Emulator::new(), &cfg, form, &a, &b, c, (k4, n)));
        // The SDM's formula, evaluated directly (sum order is irrelevant mod 2^32).
        let (sa, sb) = [(true, true), (true, false), (false, true), (false, false)][form];
        let ext = |v: u8, s: bool| if s { v as i8 as i32 } else { v as i32 };
        for mi in 0..m {
            for ni in 0..n {
                let mut acc = c0[mi * n + ni];
                for k in 0..4 * k4 {
                    let x = ext(a[mi * 4 * k4 + k], sa);
                    let y = ext(b[(k / 4) * 4 * n + 4 * ni + k % 4], sb);
                    acc = acc.wrapping_add(x * y);
                }
                assert_eq!(
                    emu[mi * n + ni],
                    acc,
                    "case {case} form {form} ({mi}, {ni})"
                );
            }
        }
        if let Some(mut hw) = Amx::new().ok().filter(|_| hw.is_some()) {
            let got = run(&mut |c| go(&mut hw, &cfg, form, &a, &b, c, (k4, n)));
            assert_eq!(
                got, emu,
                "case {case} form {form}: instructions vs emulator"
            );
        }
    }
}

/// i32 accumulation wraps (the figures measured on hardware in the research notes).
#[test]
fn emulator_wraps_like_the_hardware() {
    let a = [0xFFu8; 64]; // −1 as s8
    let b = [0xFFu8; 64];
    let mut c = [i32::MAX - 10];
    let cfg = TileCfg::palette1()
        .tile(0, 1, 64)
        .tile(1, 16, 4)
        .tile(2, 1, 4);
    let mut e = Emulator::new();
    // SAFETY: buffers match the configured shapes.
    unsafe {
        e.config(&cfg);
        e.load::<0>(a.as_ptr(), 64);
        e.load::<1>(b.as_ptr(), 4);
        e.load::<2>(c.as_ptr().cast(), 4);
        e.dpbssd::<2, 0, 1>();
        e.store::<2>(c.as_mut_ptr().cast(), 4);
    }
    assert_eq!(c[0], -2147483595);
}

/// Runs `op` on an emulator configured with `cfg`; returns the panic message.
fn panic_of(cfg: &TileCfg, op: impl FnOnce(&mut Emulator)) -> String {
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let mut e = Emulator::new();
        // SAFETY: the emulator touches no memory here (no loads or stores).
        unsafe { e.config(cfg) };
        op(&mut e);
    }));
    let msg = r.expect_err("the emulator should have faulted");
    msg.downcast_ref::<String>()
        .cloned()
        .or_else(|| msg.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}

/// Shapes and configurations the hardware faults on make the emulator panic, naming the rule.
#[test]
fn emulator_panics_where_the_hardware_faults() {
    let cfg = TileCfg::palette1()
        .tile(0, 4, 32)
        .tile(1, 8, 64)
        .tile(2, 4, 64)
        .tile(3, 4, 30);
    /// Operation `i` of the cases below.
    fn op(e: &mut Emulator, i: usize) {
        // SAFETY: register-only operations on the emulator (no memory is touched).
        unsafe {
            match i {
                0 => e.dpbssd::<2, 1, 0>(),
                1 => e.dpbssd::<2, 2, 1>(),
                2 => e.zero::<3>(),
                _ => e.zero::<6>(),
            }
        }
    }
    let wants = [
        "A.colsb / 4 = B.rows",
        "distinct",
        "not a multiple of 4",
        "not configured",
    ];
    for (i, want) in wants.iter().enumerate() {
        let msg = panic_of(&cfg, |e| op(e, i));
        assert!(msg.contains(want), "{msg:?} should mention {want:?}");
    }
    // Nothing configured at all, and invalid images.
    let mut unconfigured = TileCfg::palette1();
    unconfigured.palette_id = 0;
    let msg = panic_of(&unconfigured, |e| op(e, 2));
    assert!(msg.contains("no tile configuration"), "{msg}");
    for bad in [
        TileCfg::palette1().tile(0, 17, 64),
        TileCfg::palette1().tile(0, 16, 68),
        TileCfg::palette1().tile(0, 0, 64),
    ] {
        assert!(bad.fault().is_some(), "{bad:?}");
        let msg = panic_of(&bad, |_| {});
        assert!(msg.contains("LDTILECFG"), "{msg}");
    }
    // The availability check names its reason when it fails (and never panics).
    if let Err(why) = tiles::amx_available() {
        assert!(!why.to_string().is_empty());
    }
}

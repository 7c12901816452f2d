//! OCP FP8 E4M3FN: the one encoder and decoder of the project.
//!
//! Why this exists: fp8 e4m3 is both a wire dtype for activations (transport) and a storage
//! dtype of checkpoints (DeepSeek-V3 and Kimi K2 weights); both must read the same bits the
//! same way. E4M3FN: bias 7, 3 mantissa bits, subnormals, no infinities, `0x7F`/`0xFF` NaN,
//! largest finite ±448.

/// Largest finite e4m3 magnitude.
pub const E4M3_MAX: f32 = 448.0;

/// Encodes one f32 as fp8 e4m3 (round to nearest even, saturating to ±448; NaN → 0x7F).
pub fn f32_to_e4m3(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7F;
    }
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    let a = x.abs();
    if a >= E4M3_MAX {
        return sign | 0x7E;
    }
    // Subnormal range: values below 2^-6 are multiples of 2^-9.
    if a < 2f32.powi(-6) {
        let q = (a * 512.0).round_ties_even(); // 0..=8; 8 means the smallest normal
        return sign | q as u8;
    }
    let bits = a.to_bits();
    let exp = ((bits >> 23) & 0xFF) as i32 - 127; // -6..=8
    let mant = bits & 0x7F_FFFF;
    // Keep 3 mantissa bits, round half to even on the 20 dropped bits.
    let mut m3 = mant >> 20;
    let rest = mant & 0xF_FFFF;
    let half = 0x8_0000;
    if rest > half || (rest == half && (m3 & 1) == 1) {
        m3 += 1;
    }
    let mut e = exp + 7;
    if m3 == 8 {
        m3 = 0;
        e += 1;
    }
    let code = ((e as u32) << 3) | m3;
    if code > 0x7E {
        return sign | 0x7E;
    }
    sign | code as u8
}

/// Every E4M3FN code as `f32`, built from the bits at compile time.
static E4M3_TABLE: [f32; 256] = e4m3_table();

const fn e4m3_table() -> [f32; 256] {
    let mut table = [0.0f32; 256];
    let mut code = 0;
    while code < 256 {
        let sign = ((code >> 7) as u32) << 31;
        let exp = ((code >> 3) & 0xF) as u32;
        let man = (code & 0x7) as u32;
        let magnitude = if exp == 0xF && man == 0x7 {
            f32::NAN
        } else if exp == 0 {
            // Subnormal: man × 2^-9, exact in f32.
            man as f32 / 512.0
        } else {
            // Normal: rebias 7 → 127 and widen the mantissa 3 → 23 bits.
            f32::from_bits(((exp + 120) << 23) | (man << 20))
        };
        table[code] = f32::from_bits(magnitude.to_bits() | sign);
        code += 1;
    }
    table
}

/// Decodes one OCP FP8 E4M3FN byte (bias 7, no infinities, `0x7F`/`0xFF` are NaN).
pub fn e4m3_to_f32(code: u8) -> f32 {
    E4M3_TABLE[code as usize]
}

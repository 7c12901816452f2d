//! Byte sizes as people write them (`"180 GiB"`, `"64 GB"`, `1073741824`) and as reports show them.
//!
//! Why this exists: memory budgets in topology files are written by hand from datasheets, which
//! mix decimal (GB) and binary (GiB) units; one parser with exact integer arithmetic keeps the
//! budget checks exact. Reports use decimal GB (as the byte figures in the design brief and the
//! research notes do), except for sizes that were written in binary units: those are shown in
//! binary units ([`SizeUnit`], [`format_bytes_in`]), so that `"256 MiB"` reads back as
//! `256.00 MiB`, not `268.44 MB`.

/// The family of units a size was written in, and is shown in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum SizeUnit {
    /// Powers of 1000 (`GB`, `MB`), and plain byte counts.
    #[default]
    Decimal,
    /// Powers of 1024 (`GiB`, `MiB`).
    Binary,
}

/// Parse a byte size: an integer followed by an optional unit, or a decimal number with a unit.
///
/// Units (case-insensitive): `B`, `kB`/`KB`, `MB`, `GB`, `TB` (powers of 1000) and `KiB`, `MiB`,
/// `GiB`, `TiB` (powers of 1024). A space between number and unit is optional. Fractions are
/// allowed with a unit (`"1.5 TB"`) and rounded down to whole bytes.
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    parse_bytes_unit(text).map(|(b, _)| b)
}

/// [`parse_bytes`], plus the family of the unit it was written in ([`SizeUnit::Binary`] for
/// `KiB`/`MiB`/`GiB`/`TiB`, else [`SizeUnit::Decimal`]).
pub fn parse_bytes_unit(text: &str) -> Result<(u64, SizeUnit), String> {
    let unit_of = |u: &str| {
        if u.to_ascii_lowercase().ends_with("ib") {
            SizeUnit::Binary
        } else {
            SizeUnit::Decimal
        }
    };
    let s = text.trim();
    let unit = s
        .trim_start_matches(|c: char| c.is_ascii_digit() || c == '.' || c == '_')
        .trim();
    parse_number_and_unit(text, s).map(|b| (b, unit_of(unit)))
}

fn parse_number_and_unit(text: &str, s: &str) -> Result<u64, String> {
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '_'))
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let num = num.replace('_', "");
    let unit = unit.trim();
    let hint = "write an integer byte count or a size like \"180 GiB\" or \"64 GB\"";
    if num.is_empty() {
        return Err(format!("\"{text}\" does not start with a number; {hint}"));
    }
    let mult: u64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        "tib" => 1 << 40,
        _ => {
            return Err(format!(
                "unknown unit \"{unit}\" in \"{text}\"; use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB"
            ));
        }
    };
    let too_big = || format!("\"{text}\" is too large");
    match num.split_once('.') {
        None => num
            .parse::<u64>()
            .map_err(|_| format!("\"{text}\" is not a valid size; {hint}"))?
            .checked_mul(mult)
            .ok_or_else(too_big),
        Some((int, frac)) => {
            if frac.contains('.') || (int.is_empty() && frac.is_empty()) {
                return Err(format!("\"{text}\" is not a valid size; {hint}"));
            }
            let int: u64 = if int.is_empty() {
                0
            } else {
                int.parse()
                    .map_err(|_| format!("\"{text}\" is not a valid size; {hint}"))?
            };
            let frac_digits = frac.len().min(18) as u32;
            let frac_val: u64 = if frac.is_empty() {
                0
            } else {
                frac[..frac_digits as usize]
                    .parse()
                    .map_err(|_| format!("\"{text}\" is not a valid size; {hint}"))?
            };
            let whole = int.checked_mul(mult).ok_or_else(too_big)?;
            let part = (frac_val as u128 * mult as u128) / 10u128.pow(frac_digits);
            whole.checked_add(part as u64).ok_or_else(too_big)
        }
    }
}

/// Format bytes in decimal gigabytes with two decimals (`"17.84 GB"`), or MB below 1 GB.
pub fn format_bytes(bytes: u64) -> String {
    if bytes >= 1_000_000_000 {
        format!("{:.2} GB", bytes as f64 / 1e9)
    } else {
        format!("{:.2} MB", bytes as f64 / 1e6)
    }
}

/// Format bytes in the given family: [`format_bytes`] for decimal, else GiB with two decimals
/// (`"180.00 GiB"`), or MiB below 1 GiB.
pub fn format_bytes_in(bytes: u64, unit: SizeUnit) -> String {
    match unit {
        SizeUnit::Decimal => format_bytes(bytes),
        SizeUnit::Binary if bytes >= 1 << 30 => {
            format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
        }
        SizeUnit::Binary => format!("{:.2} MiB", bytes as f64 / (1u64 << 20) as f64),
    }
}

/// The sum of byte counts, or `None` when it does not fit in 64 bits (2^64 B = 18.4 EB):
/// byte totals are summed with this, never with wrapping arithmetic.
pub fn checked_sum(sizes: impl IntoIterator<Item = u64>) -> Option<u64> {
    sizes.into_iter().try_fold(0u64, u64::checked_add)
}

/// What a report says for a byte total that does not fit in 64 bits.
pub const TOO_MANY_BYTES: &str = "more than 2^64 bytes (18.45 EB), which this build cannot count";

/// Decimal gigabytes as a float, for messages that compute differences.
pub fn gb(bytes: u64) -> f64 {
    bytes as f64 / 1e9
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units() {
        assert_eq!(parse_bytes("180 GiB"), Ok(180 << 30));
        assert_eq!(parse_bytes("64 GB"), Ok(64_000_000_000));
        assert_eq!(parse_bytes("64gb"), Ok(64_000_000_000));
        assert_eq!(parse_bytes("512MiB"), Ok(512 << 20));
        assert_eq!(parse_bytes("1.5 TB"), Ok(1_500_000_000_000));
        assert_eq!(parse_bytes("0.5 KiB"), Ok(512));
        assert_eq!(parse_bytes("1_000"), Ok(1000));
        assert_eq!(parse_bytes("4096 B"), Ok(4096));
        assert!(
            parse_bytes("GB")
                .unwrap_err()
                .contains("does not start with a number")
        );
        assert!(parse_bytes("12 GiBs").unwrap_err().contains("unknown unit"));
        assert!(parse_bytes("1.2.3 GB").is_err());
        assert!(
            parse_bytes("99999999999 TB")
                .unwrap_err()
                .contains("too large")
        );
    }

    #[test]
    fn formatting() {
        assert_eq!(format_bytes(570_760_888_320), "570.76 GB");
        assert_eq!(format_bytes(884_736), "0.88 MB");
        assert_eq!(format_bytes_in(256 << 20, SizeUnit::Binary), "256.00 MiB");
        assert_eq!(format_bytes_in(180 << 30, SizeUnit::Binary), "180.00 GiB");
        assert_eq!(format_bytes_in(256 << 20, SizeUnit::Decimal), "268.44 MB");
    }

    #[test]
    fn units_are_remembered() {
        assert_eq!(
            parse_bytes_unit("256 MiB"),
            Ok((256 << 20, SizeUnit::Binary))
        );
        assert_eq!(parse_bytes_unit("1.5gib"), Ok((3 << 29, SizeUnit::Binary)));
        assert_eq!(
            parse_bytes_unit("64 GB"),
            Ok((64_000_000_000, SizeUnit::Decimal))
        );
        assert_eq!(parse_bytes_unit("4096"), Ok((4096, SizeUnit::Decimal)));
    }

    #[test]
    fn sums_do_not_wrap() {
        assert_eq!(checked_sum([1 << 63, 1 << 63]), None);
        assert_eq!(checked_sum([1, 2, 3]), Some(6));
    }
}

//! Checks of single values: ranges, ports, names, hosts, enumerations.
//!
//! Why this exists: each section validator turns a raw field into a [`Val`] through one of these
//! conversions, so a value is judged the same way wherever it is written.

use super::types::{DeviceKind, IntraLinkKind, NicKind};
use crate::diag::{Ctx, Field, nearest, split};
use std::net::IpAddr;
use std::ops::Range;

pub(super) type Sp = Option<Range<usize>>;

/// A value that may be absent, present but invalid (already reported), or valid.
#[derive(Clone, Debug)]
pub(super) enum Val<T> {
    Absent,
    Invalid,
    Ok(T, Sp),
}

impl<T: Clone> Val<T> {
    pub(super) fn or(self, fallback: &Val<T>) -> Val<T> {
        match self {
            Val::Absent => fallback.clone(),
            v => v,
        }
    }
    pub(super) fn get(&self) -> Option<T> {
        match self {
            Val::Ok(v, _) => Some(v.clone()),
            _ => None,
        }
    }
    pub(super) fn span(&self) -> Sp {
        match self {
            Val::Ok(_, s) => s.clone(),
            _ => None,
        }
    }
    pub(super) fn is_absent(&self) -> bool {
        matches!(self, Val::Absent)
    }
}

pub(super) fn check<T: Clone, U>(
    ctx: &mut Ctx<'_>,
    f: &Field<T>,
    item: &str,
    convert: impl FnOnce(T) -> Result<U, String>,
) -> Val<U> {
    match split(f) {
        (None, _) => Val::Absent,
        (Some(v), span) => match convert(v) {
            Ok(u) => Val::Ok(u, span),
            Err(msg) => {
                ctx.at(span, item, msg);
                Val::Invalid
            }
        },
    }
}

pub(super) fn int_in(
    key: &'static str,
    lo: i64,
    hi: i64,
) -> impl FnOnce(i64) -> Result<i64, String> {
    move |v| {
        if (lo..=hi).contains(&v) {
            Ok(v)
        } else {
            Err(format!("{key} = {v} is out of range; use {lo} to {hi}"))
        }
    }
}

/// A port number (1-65535) as a `check` conversion.
pub(super) fn port(key: &'static str) -> impl FnOnce(i64) -> Result<u16, String> {
    move |v| int_in(key, 1, 65535)(v).map(|v| v as u16)
}

/// An integer in `lo..=hi` as a `u32`, as a `check` conversion.
pub(super) fn small_u32(
    key: &'static str,
    lo: i64,
    hi: i64,
) -> impl FnOnce(i64) -> Result<u32, String> {
    move |v| int_in(key, lo, hi)(v).map(|v| v as u32)
}

pub(super) fn positive(key: &'static str) -> impl FnOnce(f64) -> Result<f64, String> {
    move |v| {
        if v.is_finite() && v > 0.0 {
            Ok(v)
        } else {
            Err(format!("{key} = {v} must be a positive number"))
        }
    }
}

pub(super) fn non_negative(key: &'static str) -> impl FnOnce(f64) -> Result<f64, String> {
    move |v| {
        if v.is_finite() && v >= 0.0 {
            Ok(v)
        } else {
            Err(format!("{key} = {v} must be zero or a positive number"))
        }
    }
}

pub(super) fn valid_name(what: &'static str) -> impl FnOnce(String) -> Result<String, String> {
    move |s| {
        if s.is_empty() || s.len() > 64 {
            Err(format!("{what} name \"{s}\" must be 1 to 64 characters"))
        } else if let Some(c) = s
            .chars()
            .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
        {
            Err(format!(
                "{what} name \"{s}\" contains '{c}'; use only letters, digits, '.', '_' and '-'"
            ))
        } else if s.starts_with('.') {
            // Names become file and folder names (deploy bundles, logs): "." and ".." would
            // leave their folder, and a leading dot hides the file.
            Err(format!(
                "{what} name \"{s}\" starts with '.'; start it with a letter, a digit, '_' or '-'"
            ))
        } else {
            Ok(s)
        }
    }
}

pub(super) fn valid_host(key: &'static str) -> impl FnOnce(String) -> Result<String, String> {
    move |s| {
        if is_valid_host(&s) {
            Ok(s)
        } else {
            Err(format!(
                "{key} \"{s}\" is neither an IP address nor a valid hostname"
            ))
        }
    }
}

/// An IPv4/IPv6 address or an RFC 1123 hostname.
pub fn is_valid_host(s: &str) -> bool {
    if s.parse::<IpAddr>().is_ok() {
        return true;
    }
    !s.is_empty()
        && s.len() <= 253
        && s.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        })
        && !s.chars().all(|c| c.is_ascii_digit() || c == '.')
}

pub(super) fn one_of<T: Copy>(
    key: &'static str,
    options: &'static [(&'static str, T)],
) -> impl FnOnce(String) -> Result<T, String> {
    move |s| {
        if let Some((_, v)) = options.iter().find(|(n, _)| *n == s) {
            return Ok(*v);
        }
        let names: Vec<&str> = options.iter().map(|(n, _)| *n).collect();
        let hint = match nearest(&s, names.iter().copied()) {
            Some(n) => format!("; did you mean \"{n}\"?"),
            None => String::new(),
        };
        Err(format!(
            "{key} \"{s}\" is not one of {}{hint}",
            names
                .iter()
                .map(|n| format!("\"{n}\""))
                .collect::<Vec<_>>()
                .join(", ")
        ))
    }
}

pub(super) const DEVICE_KINDS: &[(&str, DeviceKind)] =
    &[("gpu", DeviceKind::Gpu), ("cpu", DeviceKind::Cpu)];
pub(super) const NIC_KINDS: &[(&str, NicKind)] = &[("roce", NicKind::Roce), ("tcp", NicKind::Tcp)];

pub(super) const LINK_KINDS: &[(&str, IntraLinkKind)] = &[
    ("xgmi", IntraLinkKind::Xgmi),
    ("pcie", IntraLinkKind::Pcie),
    ("shm", IntraLinkKind::Shm),
];

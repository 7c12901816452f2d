//! Device keys and `[device_types.X]` templates: parsing them, merging a device with its
//! type, and reporting keys missing from both.
//!
//! Why this exists: a device's keys may come from itself or from its type, so what is missing is
//! reported once per type (naming its devices) or once per device.

use super::raw::RawDeviceType;
use super::types::DeviceKind;
use super::values::{
    DEVICE_KINDS, Sp, Val, check, non_negative, one_of, positive, small_u32, valid_name,
};

use crate::diag::{Ctx, Field, RawBytes, did_you_mean, span_of};
use crate::units::SizeUnit;
use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use toml::Spanned;

/// The device keys that a `[device_types.X]` entry may also provide, parsed.
#[derive(Clone)]
pub(super) struct DeviceFields {
    pub(super) kind: Val<DeviceKind>,
    pub(super) arch: Val<String>,
    pub(super) memory_total: Val<(u64, SizeUnit)>,
    pub(super) expert_memory: Val<(u64, SizeUnit)>,
    pub(super) memory_bandwidth_gb_s: Val<f64>,
    pub(super) int8_tops: Val<f64>,
    pub(super) bf16_tflops: Val<f64>,
    pub(super) threads: Val<u32>,
    pub(super) price_usd_per_hour: Val<f64>,
}

impl DeviceFields {
    pub(super) fn or(self, t: &DeviceFields) -> DeviceFields {
        DeviceFields {
            kind: self.kind.or(&t.kind),
            arch: self.arch.or(&t.arch),
            memory_total: self.memory_total.or(&t.memory_total),
            expert_memory: self.expert_memory.or(&t.expert_memory),
            memory_bandwidth_gb_s: self.memory_bandwidth_gb_s.or(&t.memory_bandwidth_gb_s),
            int8_tops: self.int8_tops.or(&t.int8_tops),
            bf16_tflops: self.bf16_tflops.or(&t.bf16_tflops),
            threads: self.threads.or(&t.threads),
            price_usd_per_hour: self.price_usd_per_hour.or(&t.price_usd_per_hour),
        }
    }

    /// Stands in for an unknown device type: nothing it would supply is reported as missing.
    pub(super) fn unknown() -> DeviceFields {
        DeviceFields {
            kind: Val::Invalid,
            arch: Val::Invalid,
            memory_total: Val::Invalid,
            expert_memory: Val::Invalid,
            memory_bandwidth_gb_s: Val::Invalid,
            int8_tops: Val::Invalid,
            bf16_tflops: Val::Invalid,
            threads: Val::Invalid,
            price_usd_per_hour: Val::Invalid,
        }
    }
}

#[allow(clippy::too_many_arguments)]
pub(super) fn device_fields(
    ctx: &mut Ctx<'_>,
    item: &str,
    kind: &Field<String>,
    arch: &Field<String>,
    memory_total: &Field<RawBytes>,
    expert_memory: &Field<RawBytes>,
    memory_bandwidth_gb_s: &Field<f64>,
    (int8_tops, bf16_tflops): (&Field<f64>, &Field<f64>),
    threads: &Field<i64>,
    price_usd_per_hour: &Field<f64>,
) -> DeviceFields {
    let bytes = |key: &'static str| {
        move |b: RawBytes| {
            b.bytes_unit()
                .map_err(|e| format!("{key}: {e}"))
                .and_then(|v| {
                    if v.0 == 0 {
                        Err(format!("{key} must be more than 0 bytes"))
                    } else {
                        Ok(v)
                    }
                })
        }
    };
    DeviceFields {
        kind: check(ctx, kind, item, one_of("kind", DEVICE_KINDS)),
        arch: check(ctx, arch, item, |s: String| {
            if s == "cpu" || is_gfx_target(&s) {
                Ok(s)
            } else {
                Err(format!(
                    "arch \"{s}\" is not a gfx target (\"gfx90a\", \"gfx942\", \"gfx1100\", ...) or \"cpu\""
                ))
            }
        }),
        memory_total: check(ctx, memory_total, item, bytes("memory_total")),
        expert_memory: check(ctx, expert_memory, item, bytes("expert_memory")),
        memory_bandwidth_gb_s: check(
            ctx,
            memory_bandwidth_gb_s,
            item,
            positive("memory_bandwidth_gb_s"),
        ),
        int8_tops: check(ctx, int8_tops, item, positive("int8_tops")),
        bf16_tflops: check(ctx, bf16_tflops, item, positive("bf16_tflops")),
        threads: check(
            ctx,
            threads,
            item,
            small_u32("threads", 1, i64::from(super::MAX_THREADS)),
        ),
        price_usd_per_hour: check(
            ctx,
            price_usd_per_hour,
            item,
            non_negative("price_usd_per_hour"),
        ),
    }
}

/// `gfx` followed by 2–6 lowercase hex digits/letters (`gfx90a`, `gfx942`, `gfx1100`).
pub(super) fn is_gfx_target(s: &str) -> bool {
    s.strip_prefix("gfx").is_some_and(|rest| {
        (2..=6).contains(&rest.len())
            && rest
                .chars()
                .all(|c| c.is_ascii_digit() || ('a'..='f').contains(&c))
    })
}

/// (type, key) → what the key is, and the devices that lack it.
pub(super) type TypeMissing = BTreeMap<(String, &'static str), (&'static str, Vec<String>)>;

/// The `[device_types.X]` templates, parsed, with where each is defined.
pub(super) struct DeviceTypes {
    pub(super) fields: HashMap<String, DeviceFields>,
    pub(super) spans: HashMap<String, Range<usize>>,
}

/// Step: parse the `[device_types.X]` templates.
pub(super) fn validate_device_types(
    ctx: &mut Ctx<'_>,
    raw: &Option<BTreeMap<String, Spanned<RawDeviceType>>>,
) -> DeviceTypes {
    let mut types = DeviceTypes {
        fields: HashMap::new(),
        spans: HashMap::new(),
    };
    for (tname, t) in raw.iter().flatten() {
        let item = format!("device type \"{tname}\"");
        let tr = t.get_ref();
        if let Err(e) = valid_name("device type")(tname.clone()) {
            ctx.at(Some(t.span()), &item, e);
        }
        let fields = device_fields(
            ctx,
            &item,
            &tr.kind,
            &tr.arch,
            &tr.memory_total,
            &tr.expert_memory,
            &tr.memory_bandwidth_gb_s,
            (&tr.int8_tops, &tr.bf16_tflops),
            &tr.threads,
            &tr.price_usd_per_hour,
        );
        types.fields.insert(tname.clone(), fields);
        types.spans.insert(tname.clone(), t.span());
    }
    types
}

/// Step: a device's own keys over those of its `type`; an unknown type is reported (with a
/// hint) and stands in for every key it might have supplied.
pub(super) fn merge_device_type(
    ctx: &mut Ctx<'_>,
    types: &DeviceTypes,
    dlabel: &str,
    type_name: &Field<String>,
    own: DeviceFields,
) -> DeviceFields {
    let Some(t) = type_name.as_ref().map(|t| t.get_ref()) else {
        return own;
    };
    if let Some(tf) = types.fields.get(t) {
        return own.or(tf);
    }
    let hint = did_you_mean(t, types.fields.keys().map(String::as_str), || {
        if types.fields.is_empty() {
            "add a [device_types.NAME] table or remove `type`".to_owned()
        } else {
            format!(
                "defined types: {}",
                types.fields.keys().cloned().collect::<Vec<_>>().join(", ")
            )
        }
    });
    ctx.at(
        span_of(type_name),
        dlabel,
        format!("unknown device type \"{t}\"; {hint}"),
    );
    // Keys the unknown type would have supplied are not reported as missing.
    own.or(&DeviceFields::unknown())
}

/// Who hears about a device's missing key: its known type (once per type, listing the
/// devices), else the device itself.
pub(super) struct MissingKeyOwner<'a> {
    pub(super) known_type: Option<&'a String>,
    pub(super) device_id: String,
    pub(super) span: Sp,
    pub(super) label: &'a str,
}

/// Step: the keys a device of its kind needs, from the device or its type.
pub(super) fn report_missing_device_keys(
    ctx: &mut Ctx<'_>,
    merged: &DeviceFields,
    owner: &MissingKeyOwner<'_>,
    type_missing: &mut TypeMissing,
) {
    let kind = merged.kind.get();
    let gpu = kind == Some(DeviceKind::Gpu);
    let cpu = kind == Some(DeviceKind::Cpu);
    let needed: [(bool, bool, &'static str, &'static str); 7] = [
        (true, merged.kind.is_absent(), "kind", "\"gpu\" or \"cpu\""),
        (
            true,
            merged.arch.is_absent(),
            "arch",
            "e.g. \"gfx942\" or \"cpu\"",
        ),
        (
            true,
            merged.expert_memory.is_absent(),
            "expert_memory",
            "memory budget for experts, e.g. \"176 GB\"",
        ),
        (
            true,
            merged.memory_bandwidth_gb_s.is_absent(),
            "memory_bandwidth_gb_s",
            "memory read bandwidth in GB/s",
        ),
        (
            gpu,
            merged.int8_tops.is_absent(),
            "int8_tops",
            "peak dense int8 TOPS",
        ),
        (
            gpu,
            merged.bf16_tflops.is_absent(),
            "bf16_tflops",
            "peak dense bf16 TFLOPS",
        ),
        (
            cpu,
            merged.threads.is_absent(),
            "threads",
            "worker thread-pool size for the CPU backend",
        ),
    ];
    for (applies, absent, key, what) in needed {
        if !(applies && absent) {
            continue;
        }
        match owner.known_type {
            Some(t) => type_missing
                .entry((t.clone(), key))
                .or_insert_with(|| (what, Vec::new()))
                .1
                .push(owner.device_id.clone()),
            None => ctx.at(
                owner.span.clone(),
                owner.label,
                format!(
                    "missing `{key}` ({what}); set it on the device (or use a [device_types.NAME] template via `type`)"
                ),
            ),
        }
    }
}

/// Step: report each key missing from a device type and all of its devices, once per type.
pub(super) fn report_type_missing(
    ctx: &mut Ctx<'_>,
    types: &DeviceTypes,
    type_missing: TypeMissing,
) {
    for ((tname, key), (what, devices)) in type_missing {
        let n = devices.len();
        let shown = if n <= 4 {
            devices.join(", ")
        } else {
            format!("{}, ... ({n} in all)", devices[..3].join(", "))
        };
        ctx.at(
            types.spans.get(&tname).cloned(),
            format!("device type \"{tname}\""),
            format!(
                "missing `{key}` ({what}), needed by device{} {shown}; set it here or on each device",
                if n == 1 { "" } else { "s" }
            ),
        );
    }
}

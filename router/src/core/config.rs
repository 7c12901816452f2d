//! The router's settings, the serving modes, and what the core is built from.
//!
//! Why this exists: a router is configured once (batching, deadlines, bounds, the serving mode)
//! and built from per-layer setups (gate, owners, where the shared experts run). These types
//! are what the command line, the launcher and the tests fill in; the core only reads them.
//! The serving mode ([`LayerMode`]) names a kernel contract and a result wire together; the
//! wire format every dispatch and result follows derives from it
//! ([`RouterConfig::wire_format`]).

use crate::gating::GateWeights;
use crate::plan::LayerOwners;
use expertmesh_backend::BackendError;
use expertmesh_quant::contract::ComputeMode;
use expertmesh_topology::model::ModelSpec;
use expertmesh_transport::codec::{OutputLayout, WireFormat};
use expertmesh_transport::dtype::{ActivationDtype, OutputDtype};
use std::time::Duration;

/// Router settings.
#[derive(Clone, Debug)]
pub struct RouterConfig {
    /// The serving mode: the kernels' numerical contract and what workers send back (one
    /// named mode, so the two cannot disagree; the wire format derives from it:
    /// [`RouterConfig::wire_format`]).
    pub mode: LayerMode,
    /// Largest request accepted (tokens).
    pub max_request_tokens: usize,
    /// Largest merged batch (tokens).
    pub max_batch_tokens: usize,
    /// Tokens per micro-batch: a batch is split so the first parts compute while later ones
    /// are still on the wire.
    pub micro_batch_tokens: usize,
    /// How long a batch waits for more requests of the same layer (0: dispatch at once).
    pub batch_window: Duration,
    /// Deadline of requests that do not carry one.
    pub default_deadline: Duration,
    /// A part unanswered this long is re-sent to a replica when one exists.
    pub straggler_timeout: Duration,
    /// Batches in flight at most; beyond this requests are refused (`Overloaded`).
    pub max_inflight_batches: usize,
    /// The longest deadline a request may ask for: a longer one (`deadline_us = u64::MAX`
    /// included) is cut to this.
    pub max_deadline: Duration,
    /// Requests admitted and not yet answered, all frontend connections together. The service
    /// decides from each request's header, before its payload is read: beyond this, or beyond
    /// the connection's fair share, the request is refused with `Overloaded`.
    pub max_inflight_requests: usize,
    /// Tokens of the requests admitted and not yet answered, all connections together (the
    /// router's memory for requests grows with this).
    pub max_inflight_tokens: usize,
    /// Dispatch encoding in accurate mode (exact mode always sends `q8-block32`, which is
    /// lossless for it).
    pub accurate_dtype: ActivationDtype,
}

/// What a worker sends back for its share of a layer call, and who combines it (derived from
/// the [`LayerMode`]: [`LayerMode::results`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ResultWire {
    /// The compute mode's full-precision wire: in exact mode one f32 row per (token, slot),
    /// combined on the router in slot order (placement-independent bits); in accurate mode one
    /// f32 row per (device, token), pre-combined on the worker.
    #[default]
    Full,
    /// One row per (token, slot), each expert output (routed and shared) rounded to bf16 as GPU
    /// MoE kernels emit it, combined on the router in slot order in f32: half the result bytes
    /// of exact mode and still placement-independent (bit-identical to
    /// `reference::moe_layer_backend_rounded` with bf16 rounding).
    SlotsBf16,
    /// One row per (device, token): the worker sums its slots in slot order in f32 and rounds
    /// the sum to bf16; the router adds the devices' rows in part order. The fewest bytes (a
    /// token's result crosses the wire once per device, 2 bytes a value); the bits depend on
    /// which experts share a device.
    CombinedBf16,
}

/// The serving modes: a kernel contract and a result wire, by name (`--mode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LayerMode {
    /// W4A8 kernels, per-slot f32 results: bit-identical to the exact reference whatever the
    /// placement (the demo and the bit-exact tests use it).
    Exact,
    /// W4A8 kernels, per-slot results rounded to bf16: half of exact's result bytes, bits still
    /// independent of the placement (the reference with every expert output rounded to bf16).
    ExactBf16,
    /// W4A16 kernels, f32 results pre-combined per (device, token): within 1e-4 of the output
    /// RMS of the f64 reference.
    Accurate,
    /// W4A8 kernels (q8 dispatch), results pre-combined per (device, token) on the worker and
    /// sent in bf16: the leanest wire, within the exact mode's tolerance of the f64 reference
    /// plus bf16 rounding of each device's partial sum; the default of `up` and `router`.
    Serving,
}

impl LayerMode {
    /// Every mode, in the order reports list them.
    pub const ALL: [LayerMode; 4] = [
        LayerMode::Exact,
        LayerMode::ExactBf16,
        LayerMode::Accurate,
        LayerMode::Serving,
    ];

    /// The kernels' numerical contract.
    pub fn compute(self) -> ComputeMode {
        match self {
            Self::Accurate => ComputeMode::Accurate,
            _ => ComputeMode::Exact,
        }
    }

    /// The result wire.
    pub fn results(self) -> ResultWire {
        match self {
            Self::Exact | Self::Accurate => ResultWire::Full,
            Self::ExactBf16 => ResultWire::SlotsBf16,
            Self::Serving => ResultWire::CombinedBf16,
        }
    }

    /// The name on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Self::Exact => "exact",
            Self::ExactBf16 => "exact-bf16",
            Self::Accurate => "accurate",
            Self::Serving => "serving",
        }
    }

    /// Whether the outputs' bits are independent of the placement and replica choice.
    pub fn placement_independent(self) -> bool {
        matches!(self, Self::Exact | Self::ExactBf16)
    }

    /// `cfg` in this mode.
    pub fn apply(self, cfg: RouterConfig) -> RouterConfig {
        RouterConfig { mode: self, ..cfg }
    }
}

impl From<ComputeMode> for LayerMode {
    /// The mode of a kernel contract with its full-precision results: [`LayerMode::Exact`] or
    /// [`LayerMode::Accurate`].
    fn from(mode: ComputeMode) -> Self {
        match mode {
            ComputeMode::Exact => Self::Exact,
            ComputeMode::Accurate => Self::Accurate,
        }
    }
}

/// A serving mode name that is not one of [`LayerMode::ALL`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown mode {0:?}: give exact, exact-bf16, accurate or serving")]
pub struct UnknownLayerMode(pub String);

impl std::str::FromStr for LayerMode {
    type Err = UnknownLayerMode;

    /// The mode named `s` ([`LayerMode::name`]; case-insensitive, `_` for `-` accepted).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let want = s.trim().replace('_', "-");
        Self::ALL
            .into_iter()
            .find(|m| m.name().eq_ignore_ascii_case(&want))
            .ok_or_else(|| UnknownLayerMode(s.to_owned()))
    }
}

impl std::fmt::Display for LayerMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The most experts of one token a part to one device can carry in model `spec`: the routed
/// top-k, plus the shared experts where a worker runs them (dispatched as extra slots).
pub fn part_slots(spec: &ModelSpec, shared_on_a_worker: bool) -> usize {
    let shared = if shared_on_a_worker {
        spec.shared_experts
    } else {
        0
    };
    (spec.top_k + shared) as usize
}

impl RouterConfig {
    /// The most tokens a micro-batch of `spec` can have in this configuration's wire format
    /// when a part may carry `slots` experts per token ([`part_slots`]): both its dispatch and
    /// its result frame within `max_frame_bytes`, and their heads within the codec's head limit
    /// (0: not even one token fits).
    pub fn largest_micro_batch(
        &self,
        spec: &ModelSpec,
        slots: usize,
        max_frame_bytes: usize,
    ) -> usize {
        expertmesh_transport::codec::max_tokens_per_frame(
            self.wire_format(),
            spec.hidden as usize,
            slots,
            max_frame_bytes,
        )
    }

    /// What a dispatch and its result look like on the wire in this configuration (feed it to
    /// `codec::wire_bytes_per_token` for the bytes per token).
    pub fn wire_format(&self) -> WireFormat {
        let (compute, results) = (self.mode.compute(), self.mode.results());
        let per_slot = match results {
            ResultWire::Full => compute == ComputeMode::Exact,
            ResultWire::SlotsBf16 => true,
            ResultWire::CombinedBf16 => false,
        };
        WireFormat {
            dispatch: match compute {
                ComputeMode::Exact => ActivationDtype::Q8Block32,
                ComputeMode::Accurate => self.accurate_dtype,
            },
            layout: if per_slot {
                OutputLayout::PerSlot
            } else {
                OutputLayout::PreCombined
            },
            result: match results {
                ResultWire::Full => OutputDtype::F32,
                ResultWire::SlotsBf16 | ResultWire::CombinedBf16 => OutputDtype::Bf16,
            },
        }
    }
}

/// Default [`RouterConfig::max_deadline`]: one minute.
pub const DEFAULT_MAX_DEADLINE: Duration = Duration::from_secs(60);

impl Default for RouterConfig {
    fn default() -> Self {
        Self {
            mode: LayerMode::Exact,
            max_request_tokens: 256,
            max_batch_tokens: 256,
            micro_batch_tokens: 32,
            batch_window: Duration::from_micros(200),
            default_deadline: Duration::from_secs(10),
            straggler_timeout: Duration::from_secs(3),
            max_inflight_batches: 64,
            max_deadline: DEFAULT_MAX_DEADLINE,
            max_inflight_requests: 64,
            max_inflight_tokens: 2048,
            accurate_dtype: ActivationDtype::F32,
        }
    }
}

/// Where a layer's shared experts run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SharedSite {
    /// The model has no shared experts.
    None,
    /// On the router host ([`SharedRunner`]).
    Router,
    /// On the worker with this mesh rank (dispatched as extra slots with weight 1).
    Rank(u32),
}

/// Everything the router knows about one MoE layer.
#[derive(Clone, Debug)]
pub struct LayerSetup {
    /// Layer index.
    pub layer: u32,
    /// Gate weights and selection bias.
    pub gate: GateWeights,
    /// Owners of each routed expert, as mesh ranks.
    pub owners: LayerOwners,
    /// Where the shared experts run.
    pub shared: SharedSite,
}

/// Runs shared experts on the router host (the CPU backend in the service; a stub in tests).
pub trait SharedRunner: Send {
    /// Write `[tokens][shared][hidden]` outputs of `layer`'s shared experts for `x`
    /// (`[tokens][hidden]`) into `out`, computed in `mode`.
    fn run(
        &mut self,
        layer: u32,
        x: &[f32],
        tokens: usize,
        mode: ComputeMode,
        out: &mut [f32],
    ) -> Result<(), BackendError>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_mode_has_its_wire() {
        let wire = |m: LayerMode| m.apply(RouterConfig::default()).wire_format();
        let f = |dispatch, layout, result| WireFormat {
            dispatch,
            layout,
            result,
        };
        let (q8, f32in) = (ActivationDtype::Q8Block32, ActivationDtype::F32);
        let (slots, combined) = (OutputLayout::PerSlot, OutputLayout::PreCombined);
        let (f32out, bf16) = (OutputDtype::F32, OutputDtype::Bf16);
        assert_eq!(wire(LayerMode::Exact), f(q8, slots, f32out));
        assert_eq!(wire(LayerMode::ExactBf16), f(q8, slots, bf16));
        assert_eq!(wire(LayerMode::Accurate), f(f32in, combined, f32out));
        assert_eq!(wire(LayerMode::Serving), f(q8, combined, bf16));
        for m in LayerMode::ALL {
            assert_eq!(m.apply(RouterConfig::default()).mode, m);
        }
        assert_eq!(RouterConfig::default().mode, LayerMode::Exact);
        // A configuration holds one mode: no pair of kernel contract and result wire outside
        // LayerMode::ALL can be configured.
        assert_eq!(LayerMode::from(ComputeMode::Exact), LayerMode::Exact);
        assert_eq!(LayerMode::from(ComputeMode::Accurate), LayerMode::Accurate);
    }

    #[test]
    fn every_mode_parses_from_its_name() {
        for m in LayerMode::ALL {
            assert_eq!(m.name().parse::<LayerMode>(), Ok(m));
            assert_eq!(m.to_string().to_uppercase().parse::<LayerMode>(), Ok(m));
        }
        assert_eq!("exact_bf16".parse::<LayerMode>(), Ok(LayerMode::ExactBf16));
        let err = "fast".parse::<LayerMode>().unwrap_err();
        assert!(err.to_string().contains("exact-bf16"), "{err}");
    }
}

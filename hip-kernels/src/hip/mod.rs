//! The HIP backend: packed-INT4 experts on AMD GPUs (feature `hip`).
//!
//! Why this exists: GPU workers pin their experts in device memory and run the kernels of
//! `hip-kernels/kernels/` on grouped batches. With the `hip` feature, [`HipBackend`] opens the HIP
//! runtime at run time, loads the embedded code object that matches the device, allocates every
//! buffer once in [`ExpertBackend::load`], and runs each
//! batch on one stream (quantize → decode or prefill → optional pre-combine). Without the
//! feature, the same type exists and reports [`BackendError::NotCompiled`], so callers need no
//! `cfg`. Without a usable device it reports [`BackendError::NoDevice`] with the reason, and the
//! worker falls back to the CPU backend.

use expertmesh_backend::{
    BackendError, BatchLimits, ExpertBackend, ExpertKey, ExpertSource, ExpertStager, GroupedBatch,
    StagedExperts,
};
use expertmesh_quant::format::ExpertWeights;

#[cfg(feature = "hip")]
mod device;
#[cfg(feature = "hip")]
mod ffi;

#[cfg(feature = "hip")]
mod objects {
    //! Code objects compiled by build.rs.
    include!(concat!(env!("OUT_DIR"), "/hip_objects.rs"));
}

/// The environment variable naming the HIP runtime library to open instead of searching for
/// `libamdhip64` (`$HIP_PATH/lib`, `$ROCM_PATH/lib`, `/opt/rocm/lib`, then the loader's path): a
/// ROCm installed elsewhere, or the test stand-in that runs the kernels on the CPU
/// (`hip-kernels/standin/`). [`HipBackend::with_library`] names one for a single backend.
pub const LIBRARY_ENV: &str = "EXPERTMESH_HIP_LIBRARY";

/// AMD targets whose code objects are embedded in this build (empty without the feature).
pub fn compiled_targets() -> Vec<&'static str> {
    #[cfg(feature = "hip")]
    {
        let mut t: Vec<&'static str> = objects::CODE_OBJECTS.iter().map(|(t, _, _)| *t).collect();
        t.dedup();
        t
    }
    #[cfg(not(feature = "hip"))]
    Vec::new()
}

/// Requested targets the build's compiler could not build (empty without the feature).
pub fn skipped_targets() -> Vec<&'static str> {
    #[cfg(feature = "hip")]
    {
        objects::SKIPPED_TARGETS.to_vec()
    }
    #[cfg(not(feature = "hip"))]
    Vec::new()
}

/// Packed-INT4 experts on one HIP device. See the module docs.
pub struct HipBackend {
    #[cfg(feature = "hip")]
    inner: device::HipDevice,
    #[cfg(not(feature = "hip"))]
    _never: std::convert::Infallible,
}

impl HipBackend {
    /// Open HIP device `device` (0-based).
    ///
    /// Errors: [`BackendError::NotCompiled`] without the `hip` feature; [`BackendError::NoDevice`]
    /// when the HIP runtime is missing, reports no device, or no embedded code object matches it.
    pub fn new(device: usize) -> Result<Self, BackendError> {
        Self::open(device, None)
    }

    /// Open HIP device `device` through the HIP runtime library at `library` (and no other):
    /// like [`HipBackend::new`] with [`LIBRARY_ENV`] set, for this backend only.
    pub fn with_library(device: usize, library: &std::path::Path) -> Result<Self, BackendError> {
        Self::open(device, Some(library))
    }

    fn open(device: usize, library: Option<&std::path::Path>) -> Result<Self, BackendError> {
        #[cfg(feature = "hip")]
        {
            Ok(Self {
                inner: device::HipDevice::open(device, library)?,
            })
        }
        #[cfg(not(feature = "hip"))]
        {
            let _ = (device, library);
            Err(BackendError::NotCompiled {
                backend: "hip",
                feature: "hip",
            })
        }
    }

    /// Choose how decode batches run: one fused launch (phase-2 tiles wait for their expert's
    /// phase-1 tiles; the default) or two launches. Both give identical bits.
    pub fn set_fused_decode(&mut self, fused: bool) {
        #[cfg(feature = "hip")]
        self.inner.set_fused(fused);
        #[cfg(not(feature = "hip"))]
        let _ = fused;
    }
}

impl ExpertBackend for HipBackend {
    fn name(&self) -> String {
        #[cfg(feature = "hip")]
        {
            self.inner.name()
        }
        #[cfg(not(feature = "hip"))]
        match self._never {}
    }

    fn load(
        &mut self,
        experts: Vec<(ExpertKey, ExpertWeights)>,
        limits: BatchLimits,
    ) -> Result<(), BackendError> {
        #[cfg(feature = "hip")]
        {
            self.inner.load(experts, limits)
        }
        #[cfg(not(feature = "hip"))]
        {
            let _ = (experts, limits);
            match self._never {}
        }
    }

    fn execute(&mut self, batch: &GroupedBatch<'_>, out: &mut [f32]) -> Result<(), BackendError> {
        #[cfg(feature = "hip")]
        {
            self.inner.execute(batch, out)
        }
        #[cfg(not(feature = "hip"))]
        {
            let _ = (batch, out);
            match self._never {}
        }
    }

    fn loaded_bytes(&self) -> u64 {
        #[cfg(feature = "hip")]
        {
            self.inner.loaded_bytes()
        }
        #[cfg(not(feature = "hip"))]
        match self._never {}
    }

    /// Gains experts while serving: each in a device allocation of its own, next to the loaded
    /// ones, between batches; all or nothing.
    fn add_experts(&mut self, source: &mut dyn ExpertSource) -> Result<(), BackendError> {
        #[cfg(feature = "hip")]
        {
            self.inner.add_experts(source)
        }
        #[cfg(not(feature = "hip"))]
        {
            let _ = source;
            match self._never {}
        }
    }

    /// Gains are read on the worker's loader thread (the host's shards and their checksums, or
    /// a copy from another device) into host memory while this device serves; only their
    /// upload to the device happens between batches ([`ExpertBackend::install`]).
    fn stager(&self) -> Option<Box<dyn ExpertStager>> {
        #[cfg(feature = "hip")]
        {
            Some(Box::new(HostStager))
        }
        #[cfg(not(feature = "hip"))]
        match self._never {}
    }

    /// Uploads experts the HIP stager (`HostStager`) read, next to the loaded ones, as
    /// [`ExpertBackend::add_experts`] does (all or nothing); experts staged by another backend
    /// are an error.
    fn install(&mut self, staged: StagedExperts) -> Result<(), BackendError> {
        #[cfg(feature = "hip")]
        {
            let host = staged.packed.downcast::<HostStaged>().map_err(|_| {
                BackendError::Source("these experts were staged by another backend".into())
            })?;
            self.inner
                .add_experts(&mut expertmesh_backend::VecSource::new(host.experts))
        }
        #[cfg(not(feature = "hip"))]
        {
            let _ = staged;
            match self._never {}
        }
    }

    /// Releases experts and frees their device memory; a key not loaded is an error and
    /// nothing is released.
    fn release_experts(&mut self, keys: &[ExpertKey]) -> Result<(), BackendError> {
        #[cfg(feature = "hip")]
        {
            self.inner.release_experts(keys)
        }
        #[cfg(not(feature = "hip"))]
        {
            let _ = keys;
            match self._never {}
        }
    }
}

/// Checks that the weights a source handed over are what it declared for them (else
/// `nothing was {undone}`): a smaller expert would have the kernels read past its device
/// allocation.
#[cfg(feature = "hip")]
fn as_declared(
    s: &expertmesh_backend::ExpertShape,
    w: &ExpertWeights,
    undone: &str,
) -> Result<(), BackendError> {
    if (w.hidden(), w.inter(), w.spec()) == (s.hidden, s.inter, s.quant) {
        return Ok(());
    }
    Err(BackendError::Shape(format!(
        "{}: the source declared {}x{} {} but handed over {}x{} {}; nothing was {undone}",
        s.key,
        s.hidden,
        s.inter,
        s.quant,
        w.hidden(),
        w.inter(),
        w.spec()
    )))
}

/// The HIP backend's stager: reads every expert of a source into host memory on the calling
/// thread (the worker's loader thread), each checked against the shape its source declared (a
/// smaller expert would have the kernels read past its device allocation).
#[cfg(feature = "hip")]
struct HostStager;

/// Experts [`HostStager`] read, in host memory, waiting for [`ExpertBackend::install`].
#[cfg(feature = "hip")]
struct HostStaged {
    experts: Vec<(ExpertKey, ExpertWeights)>,
}

#[cfg(feature = "hip")]
impl ExpertStager for HostStager {
    fn stage(&self, source: &mut dyn ExpertSource) -> Result<StagedExperts, BackendError> {
        let shapes = source.shapes().to_vec();
        let mut experts = Vec::with_capacity(shapes.len());
        for (i, s) in shapes.iter().enumerate() {
            let w = source.expert(i)?;
            as_declared(s, &w, "staged")?;
            experts.push((s.key, w));
        }
        source.finish()?;
        Ok(StagedExperts {
            keys: shapes.iter().map(|s| s.key).collect(),
            bytes: experts.iter().map(|(_, w)| w.bytes() as u64).sum(),
            packed: Box::new(HostStaged { experts }),
        })
    }
}

#[cfg(all(test, not(feature = "hip")))]
mod tests {
    use super::*;

    #[test]
    fn without_the_feature_it_says_how_to_enable_it() {
        let err = HipBackend::new(0)
            .err()
            .expect("no HIP backend without the feature");
        assert!(matches!(
            err,
            BackendError::NotCompiled { feature: "hip", .. }
        ));
        assert!(err.to_string().contains("--features hip"), "{err}");
        assert!(compiled_targets().is_empty());
    }
}

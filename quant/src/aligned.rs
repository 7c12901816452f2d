//! Cache-line aligned, fixed-length buffers.
//!
//! Why this exists: packed weights and activation blocks are read with 16-, 32- and 64-byte SIMD
//! loads (and, on the GPU side, copied with 16-byte transactions). `Vec<T>` only guarantees the
//! alignment of `T`, so every hot buffer in this crate is an [`AlignedVec`] aligned to 64 bytes.
//! The length is fixed at construction: the data path allocates once and never grows.

use std::alloc::{self, Layout};
use std::fmt;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

/// Alignment of every [`AlignedVec`], in bytes (one x86 cache line, one AVX-512 register).
pub const BUFFER_ALIGN: usize = 64;
/// Buffers of at least this many bytes are aligned to 2 MiB and advised as huge-page
/// candidates, so streaming gigabytes of expert weights does not thrash the TLB.
pub const HUGE_THRESHOLD: usize = 4 << 20;
const HUGE_ALIGN: usize = 2 << 20;
/// Zeroed buffers of at least this many bytes (and below [`HUGE_THRESHOLD`]) are their own
/// anonymous mappings too (page aligned, no huge-page advice): fresh pages read as zero, where
/// the global allocator's aligned path would memset them (the backend's scratch buffers, a few
/// MiB per load: 7 % of a worker load's time on the EPYC VM went to that memset). Only
/// `zeroed` takes this tier: buffers filled at once keep the allocator, so a process holding
/// thousands of mid-size matrices does not hold thousands of mappings.
pub const ZERO_MAP_THRESHOLD: usize = 256 << 10;

/// Element types an [`AlignedVec`] may hold: plain old data for which all-zero bytes are a valid
/// value and which has no destructor.
///
/// # Safety
/// Implementors must be `Copy`, have no padding-dependent invariants, and accept the all-zero
/// bit pattern as a valid value.
pub unsafe trait Pod: Copy + Default + 'static {}
// SAFETY: primitive integers and floats are valid for every bit pattern, including all zeros.
unsafe impl Pod for u8 {}
// SAFETY: as above.
unsafe impl Pod for i8 {}
// SAFETY: as above.
unsafe impl Pod for u16 {}
// SAFETY: as above.
unsafe impl Pod for i16 {}
// SAFETY: as above.
unsafe impl Pod for u32 {}
// SAFETY: as above.
unsafe impl Pod for i32 {}
// SAFETY: as above.
unsafe impl Pod for f32 {}
// SAFETY: as above.
unsafe impl Pod for f64 {}

/// A zero-initialised, 64-byte aligned, fixed-length buffer of `T`.
pub struct AlignedVec<T: Pod> {
    ptr: NonNull<T>,
    len: usize,
    /// The buffer is its own anonymous mapping (`huge::map`), not the global allocator's
    /// (never on other systems).
    #[cfg_attr(not(target_os = "linux"), allow(dead_code))]
    mapped: bool,
}

// SAFETY: AlignedVec owns its allocation exactly like Vec<T>; T: Pod is Send + Sync data.
unsafe impl<T: Pod + Send> Send for AlignedVec<T> {}
// SAFETY: shared references only hand out &[T].
unsafe impl<T: Pod + Sync> Sync for AlignedVec<T> {}

impl<T: Pod> AlignedVec<T> {
    fn layout(len: usize) -> Layout {
        let bytes = len
            .checked_mul(size_of::<T>())
            .expect("AlignedVec size overflows usize");
        let align = if bytes >= HUGE_THRESHOLD {
            HUGE_ALIGN
        } else {
            BUFFER_ALIGN
        };
        Layout::from_size_align(bytes.max(1), align.max(align_of::<T>()))
            .expect("AlignedVec layout")
    }

    /// A buffer of `len` zeroed elements.
    pub fn zeroed(len: usize) -> Self {
        let layout = Self::layout(len);
        #[cfg(target_os = "linux")]
        if layout.size() >= ZERO_MAP_THRESHOLD {
            // Fresh anonymous pages read as zero: no pass over the memory here (the pages fault
            // in, huge when the buffer is, where they are first written).
            let huge = layout.size() >= HUGE_THRESHOLD;
            return Self {
                ptr: huge::map(layout.size(), huge).cast::<T>(),
                len,
                mapped: true,
            };
        }
        // SAFETY: the layout has non-zero size (max(1)).
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(raw.cast::<T>()) else {
            alloc::handle_alloc_error(layout)
        };
        Self {
            ptr,
            len,
            mapped: false,
        }
    }

    /// A buffer holding a copy of `src` (written once: no zeroing first).
    pub fn from_slice(src: &[T]) -> Self {
        let mut it = src.iter().copied();
        Self::from_fn(src.len(), || it.next().expect("src.len() elements"))
    }

    /// A buffer of `len` elements, element `i` the `i`-th value of `next` (called exactly `len`
    /// times, in order). Each element is written once, so loading weights does not pay for
    /// zeroing memory it overwrites at once.
    pub fn from_fn(len: usize, mut next: impl FnMut() -> T) -> Self {
        let layout = Self::layout(len);
        let mapped = cfg!(target_os = "linux") && layout.size() >= HUGE_THRESHOLD;
        #[cfg(target_os = "linux")]
        let ptr = if mapped {
            huge::map(layout.size(), true).cast::<T>()
        } else {
            Self::alloc(layout)
        };
        #[cfg(not(target_os = "linux"))]
        let ptr = Self::alloc(layout);
        // If `next` panics the buffer leaks (never reads uninitialised memory): acceptable
        // for a panic path, and it keeps this free of a drop guard.
        for i in 0..len {
            // SAFETY: i < len, inside the allocation; T is Pod (no drop, any bits valid), and
            // every element is written before the slice is ever formed.
            unsafe { ptr.as_ptr().add(i).write(next()) };
        }
        Self { ptr, len, mapped }
    }

    /// Uninitialised memory for `layout` from the global allocator.
    fn alloc(layout: Layout) -> NonNull<T> {
        // SAFETY: the layout has non-zero size (max(1)).
        let raw = unsafe { alloc::alloc(layout) };
        let Some(ptr) = NonNull::new(raw.cast::<T>()) else {
            alloc::handle_alloc_error(layout)
        };
        ptr
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the buffer holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The buffer as raw bytes (native endianness).
    pub fn as_bytes(&self) -> &[u8] {
        // SAFETY: T is Pod, the allocation spans len * size_of::<T>() initialised bytes.
        unsafe {
            std::slice::from_raw_parts(self.ptr.as_ptr().cast::<u8>(), self.len * size_of::<T>())
        }
    }
}

impl<T: Pod> Drop for AlignedVec<T> {
    fn drop(&mut self) {
        let layout = Self::layout(self.len);
        #[cfg(target_os = "linux")]
        if self.mapped {
            // SAFETY: mapped by `huge::map` with this size; nothing borrows it any more.
            unsafe { huge::unmap(self.ptr.cast::<u8>(), layout.size()) };
            return;
        }
        // SAFETY: allocated in `alloc` or `zeroed` with the same layout.
        unsafe { alloc::dealloc(self.ptr.as_ptr().cast::<u8>(), layout) }
    }
}

impl<T: Pod> Deref for AlignedVec<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: ptr is valid for len initialised elements for the lifetime of self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: Pod> DerefMut for AlignedVec<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as above, and &mut self guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: Pod> Clone for AlignedVec<T> {
    fn clone(&self) -> Self {
        Self::from_slice(self)
    }
}

impl<T: Pod + fmt::Debug> fmt::Debug for AlignedVec<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "AlignedVec(len={})", self.len)
    }
}

impl<T: Pod + PartialEq> PartialEq for AlignedVec<T> {
    fn eq(&self, other: &Self) -> bool {
        self[..] == other[..]
    }
}

/// Buffers of [`HUGE_THRESHOLD`] bytes or more: their own anonymous mappings, 2 MiB aligned
/// and advised as huge pages; zeroed buffers of [`ZERO_MAP_THRESHOLD`] bytes or more: their
/// own page-aligned mappings. Fresh anonymous memory reads as zero, so a zeroed buffer costs no
/// pass over it (the global allocator's aligned path would memset it, and the kernel zeroes
/// the pages again when they fault in).
#[cfg(target_os = "linux")]
mod huge {
    use super::HUGE_ALIGN;
    use std::alloc::{self, Layout};
    use std::ptr::NonNull;

    const PAGE: usize = 4096;

    /// Map `size` bytes (non-zero): with `huge`, aligned to [`HUGE_ALIGN`] and advised as huge
    /// pages, else page aligned; out of memory is the global allocator's error.
    pub(super) fn map(size: usize, huge: bool) -> NonNull<u8> {
        let span = size.next_multiple_of(PAGE);
        let align = if huge { HUGE_ALIGN } else { PAGE };
        let fail = || -> ! {
            alloc::handle_alloc_error(
                Layout::from_size_align(size, align).expect("a valid mapped layout"),
            )
        };
        let whole = if huge { span + HUGE_ALIGN } else { span };
        // SAFETY: a fresh private anonymous mapping; no existing memory is touched.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                whole,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            fail();
        }
        let base = base as usize;
        let start = base.next_multiple_of(align);
        // SAFETY: both trimmed ranges lie inside the mapping just made and are page aligned
        // (mmap returns page-aligned memory; `start` and `span` are multiples of PAGE).
        unsafe {
            if start > base {
                libc::munmap(base as *mut libc::c_void, start - base);
            }
            let end = start + span;
            if base + whole > end {
                libc::munmap(end as *mut libc::c_void, base + whole - end);
            }
            // Only advice: without transparent huge pages the buffer works in 4 KiB pages.
            if huge {
                libc::madvise(start as *mut libc::c_void, span, libc::MADV_HUGEPAGE);
            }
        }
        NonNull::new(start as *mut u8).unwrap_or_else(|| fail())
    }

    /// Unmap a buffer from [`map`].
    ///
    /// # Safety
    /// `ptr` and `size` must be those of one [`map`] call, not used afterwards.
    pub(super) unsafe fn unmap(ptr: NonNull<u8>, size: usize) {
        // SAFETY: per the contract, this is exactly the mapping `map` kept.
        unsafe { libc::munmap(ptr.as_ptr().cast(), size.next_multiple_of(PAGE)) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_and_zeroed() {
        for len in [0usize, 1, 3, 63, 64, 1000] {
            let v = AlignedVec::<u16>::zeroed(len);
            assert_eq!(v.as_ptr() as usize % BUFFER_ALIGN, 0);
            assert_eq!(v.len(), len);
            assert!(v.iter().all(|&x| x == 0));
        }
        let v = AlignedVec::from_slice(&[1.5f32, -2.0]);
        assert_eq!(&v[..], &[1.5, -2.0]);
        assert_eq!(v.clone(), v);
        let big: Vec<u8> = (0..HUGE_THRESHOLD + 77)
            .map(|i| (i * 7 % 251) as u8)
            .collect();
        let b = AlignedVec::from_slice(&big);
        assert_eq!(&b[..], &big[..]);
        assert_eq!(AlignedVec::<u16>::from_slice(&[]).len(), 0);
    }

    /// `rounds` zeroed buffers of `len(round)` u32 and as many filled at once: aligned to
    /// `align`, zero or filled, writable to the last byte, freed on drop (many in a row do not
    /// run out of address space or memory).
    fn buffers_are_aligned_zeroed_and_freed(
        rounds: usize,
        len: impl Fn(usize) -> usize,
        align: usize,
    ) {
        for round in 0..rounds {
            let len = len(round);
            let mut v = AlignedVec::<u32>::zeroed(len);
            assert_eq!(v.as_ptr() as usize % align, 0);
            assert!(v.iter().step_by(997).all(|&x| x == 0) && v[len - 1] == 0);
            v[len - 1] = round as u32;
            v[0] = 7;
            assert_eq!((v[0], v[len - 1]), (7, round as u32));
            let w = AlignedVec::from_fn(len, || round as u32);
            assert_eq!(w.as_ptr() as usize % align, 0);
            assert!(w.iter().all(|&x| x == round as u32));
            assert_eq!(v.clone()[len - 1], round as u32);
        }
    }

    /// Zeroed buffers of the middle tier (their own page mappings on Linux; buffers of the same
    /// size filled at once stay the allocator's).
    #[test]
    fn mid_size_buffers_are_aligned_zeroed_and_freed() {
        let len = |round: usize| ZERO_MAP_THRESHOLD / 4 + 4097 * (round % 64);
        buffers_are_aligned_zeroed_and_freed(256, len, BUFFER_ALIGN);
    }

    /// Huge buffers (their own mappings on Linux): aligned to 2 MiB.
    #[test]
    fn huge_buffers_are_aligned_zeroed_and_freed() {
        let len = |round: usize| HUGE_THRESHOLD / 4 + 4099 * round;
        let align = if cfg!(target_os = "linux") {
            HUGE_ALIGN
        } else {
            BUFFER_ALIGN
        };
        buffers_are_aligned_zeroed_and_freed(64, len, align);
    }
}

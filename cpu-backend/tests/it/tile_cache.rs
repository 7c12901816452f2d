//! The tile cache: a load of a named source keeps its repacked arena in a file, a later load of
//! the same name maps it without taking anything from the source and computes the same bits,
//! and a file that is damaged, truncated, made for other weights or kept in a folder others can
//! write is never used (the load repacks, correctly).

use crate::load_from::{LIMITS, experts, run};
use expertmesh_backend::{BackendError, ExpertBackend, ExpertShape, ExpertSource, VecSource};
use expertmesh_cpu_backend::CpuBackend;
use expertmesh_cpu_backend::tile_cache::{TileCache, TileCacheUse};
use expertmesh_quant::format::ExpertWeights;
use std::path::{Path, PathBuf};

/// [`VecSource`] with a content id, counting what the backend takes from it.
struct Named {
    inner: VecSource,
    id: String,
    taken: usize,
    finished: bool,
    fail_finish: bool,
}

fn named(id: &str) -> Named {
    Named {
        inner: VecSource::new(experts()),
        id: id.into(),
        taken: 0,
        finished: false,
        fail_finish: false,
    }
}

impl ExpertSource for Named {
    fn shapes(&self) -> &[ExpertShape] {
        self.inner.shapes()
    }
    fn expert(&mut self, i: usize) -> Result<ExpertWeights, BackendError> {
        self.taken += 1;
        self.inner.expert(i)
    }
    fn finish(&mut self) -> Result<(), BackendError> {
        self.finished = true;
        if self.fail_finish {
            return Err(BackendError::Source("checksum mismatch".into()));
        }
        Ok(())
    }
    fn content_id(&self) -> Option<String> {
        Some(self.id.clone())
    }
}

/// Load `src` on a backend with the cache in `dir`; the backend and what it did.
fn load(dir: &Path, src: &mut Named) -> (CpuBackend, TileCacheUse) {
    let mut b = CpuBackend::new(2).unwrap();
    b.set_tile_cache(Some(TileCache::new(dir)));
    b.load_from(src, LIMITS).unwrap();
    let used = b.tile_cache_use().clone();
    (b, used)
}

/// The output bits of a plain load (no cache) of the same experts.
fn plain_bits() -> Vec<u32> {
    let mut b = CpuBackend::new(1).unwrap();
    b.load(experts(), LIMITS).unwrap();
    run(&mut b)
}

fn cache_files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "r16"))
        .collect();
    v.sort();
    v
}

fn written(used: &TileCacheUse) -> (PathBuf, String) {
    match used {
        TileCacheUse::Written { file, miss } => (file.clone(), miss.clone()),
        other => panic!("expected a repack kept in the cache, got {other:?}"),
    }
}

/// Overwrite the byte at `at` of `file` (made writable first: the cache writes 0400).
fn poke(file: &Path, at: u64, value: u8) {
    use std::os::unix::fs::{FileExt, PermissionsExt};
    std::fs::set_permissions(file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let f = std::fs::OpenOptions::new().write(true).open(file).unwrap();
    f.write_all_at(&[value], at).unwrap();
}

#[test]
fn a_second_load_maps_the_tiles_the_first_kept_and_computes_the_same_bits() {
    use std::os::unix::fs::PermissionsExt;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("tiles");
    let mut first_src = named("shard a");
    let (mut first, used) = load(&dir, &mut first_src);
    let (file, miss) = written(&used);
    assert!(miss.contains("no cache file"), "{miss}");
    assert_eq!(first_src.taken, 4, "the first load repacks every expert");
    assert!(first_src.finished, "a repacking load finishes its source");
    assert_eq!(cache_files(&dir), vec![file.clone()]);
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!((mode(&dir), mode(&file)), (0o700, 0o400));

    let mut second_src = named("shard a");
    let (mut second, used) = load(&dir, &mut second_src);
    match &used {
        TileCacheUse::Mapped { file: f, .. } => assert_eq!(f, &file),
        other => panic!("expected the kept tiles mapped, got {other:?}"),
    }
    assert_eq!(
        second_src.taken, 0,
        "a mapped load takes nothing from the source"
    );
    assert!(!second_src.finished, "nor finishes it");
    assert_eq!(first.loaded_bytes(), second.loaded_bytes());
    let want = plain_bits();
    assert_eq!(run(&mut first), want);
    assert_eq!(run(&mut second), want);
}

#[test]
fn damaged_truncated_or_foreign_files_are_misses_and_are_replaced() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("tiles");
    let (_, used) = load(&dir, &mut named("shard a"));
    let (file, _) = written(&used);
    let len = std::fs::metadata(&file).unwrap().len();
    // The first chunk checksum: after the magic, the description's length and itself, the
    // arena size and the chunk size.
    let bytes = std::fs::read(&file).unwrap();
    let crcs = 12 + u64::from(u32::from_le_bytes(bytes[8..12].try_into().unwrap())) + 12;
    let want = plain_bits();
    // Each damage, then a load: repacked (the source is read again), right, and replaced.
    // The arena size's top byte: a file claiming 2^62 bytes of tiles allocates nothing by it.
    let size_top = crcs - 12 + 7;
    let cases: [(&str, &dyn Fn()); 5] = [
        ("states", &|| poke(&file, size_top, 0x40)),
        ("damaged", &|| poke(&file, len - 100, 0x5a)),
        ("header does not match its checksum", &|| {
            poke(&file, crcs, bytes[crcs as usize] ^ 1)
        }),
        ("truncated", &|| {
            poke(&file, 0, b'E');
            let f = std::fs::OpenOptions::new().write(true).open(&file).unwrap();
            f.set_len(len - 4096).unwrap();
        }),
        ("not a tile cache file", &|| poke(&file, 0, b'X')),
    ];
    for (why, damage) in cases {
        damage();
        let mut src = named("shard a");
        let (mut b, used) = load(&dir, &mut src);
        let (again, miss) = written(&used);
        assert_eq!(again, file);
        assert!(miss.contains(why), "{why}: {miss}");
        assert_eq!(src.taken, 4, "{why}: repacked from the source");
        assert_eq!(run(&mut b), want, "{why}");
        // The replacement maps.
        let (_, used) = load(&dir, &mut named("shard a"));
        assert!(matches!(used, TileCacheUse::Mapped { .. }), "{used:?}");
    }
}

#[test]
fn a_file_made_for_another_source_is_not_used_even_under_its_name() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("tiles");
    let (_, used) = load(&dir, &mut named("shard a"));
    let (file_a, _) = written(&used);
    let (_, used) = load(&dir, &mut named("shard b"));
    let (file_b, miss) = written(&used);
    assert_ne!(file_a, file_b);
    assert!(miss.contains("no cache file"), "{miss}");
    // Shard a's tiles under shard b's name: the description differs, a miss.
    std::fs::remove_file(&file_b).unwrap();
    std::fs::copy(&file_a, &file_b).unwrap();
    let mut src = named("shard b");
    let (mut b, used) = load(&dir, &mut src);
    let (_, miss) = written(&used);
    assert!(miss.contains("made for other experts"), "{miss}");
    assert_eq!(src.taken, 4);
    assert_eq!(run(&mut b), plain_bits());
}

#[test]
fn a_folder_others_can_write_is_refused_and_the_load_repacks() {
    use std::os::unix::fs::PermissionsExt;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("tiles");
    let (_, used) = load(&dir, &mut named("shard a"));
    written(&used);
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    let mut src = named("shard a");
    let (mut b, used) = load(&dir, &mut src);
    match &used {
        TileCacheUse::NotWritten { miss, error } => {
            assert!(miss.contains("not private"), "{miss}");
            assert!(error.contains("not private"), "{error}");
        }
        other => panic!("expected the cache refused, got {other:?}"),
    }
    assert_eq!(src.taken, 4);
    assert_eq!(run(&mut b), plain_bits());
}

#[test]
fn a_cache_that_cannot_be_written_leaves_the_load_served() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("a-file");
    std::fs::write(&file, b"not a folder").unwrap();
    let mut src = named("shard a");
    let (mut b, used) = load(&file.join("tiles"), &mut src);
    assert!(matches!(used, TileCacheUse::NotWritten { .. }), "{used:?}");
    assert_eq!(run(&mut b), plain_bits());
}

#[test]
fn nothing_is_kept_from_a_source_whose_check_fails_or_that_has_no_name() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("tiles");
    let mut b = CpuBackend::new(1).unwrap();
    b.set_tile_cache(Some(TileCache::new(&dir)));
    let mut src = named("shard a");
    src.fail_finish = true;
    let e = b.load_from(&mut src, LIMITS).unwrap_err().to_string();
    assert!(e.contains("checksum mismatch"), "{e}");
    assert!(!dir.exists() || cache_files(&dir).is_empty());

    b.load_from(&mut VecSource::new(experts()), LIMITS).unwrap();
    assert_eq!(b.tile_cache_use(), &TileCacheUse::NoContentId);
    assert!(!dir.exists() || cache_files(&dir).is_empty());
    assert_eq!(run(&mut b), plain_bits());
}

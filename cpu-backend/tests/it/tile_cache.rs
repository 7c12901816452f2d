//! The tile cache: a load of a named source keeps its repacked arena in a file, a later load of
//! the same name maps it (or copies it, where it may not lock it) without taking anything from
//! the source and computes the same bits, new content at the same place replaces the file, and
//! a file that is damaged, truncated, made for other weights or kept in a folder others can
//! write is never used (the load repacks, correctly).

use crate::load_from::{LIMITS, experts, run};
use expertmesh_backend::{
    BackendError, ContentId, ExpertBackend, ExpertKey, ExpertShape, ExpertSource, VecSource,
};
use expertmesh_cpu_backend::CpuBackend;
use expertmesh_cpu_backend::tile_cache::{TileCache, TileCacheUse};
use expertmesh_quant::format::ExpertWeights;
use std::path::{Path, PathBuf};

/// [`VecSource`] with a content id (at place "shard"), counting what the backend takes.
struct Named {
    inner: VecSource,
    place: String,
    id: String,
    taken: usize,
    finished: bool,
    fail_finish: bool,
}

fn named(id: &str) -> Named {
    named_with("shard", id, experts())
}

fn named_with(place: &str, id: &str, experts: Vec<(ExpertKey, ExpertWeights)>) -> Named {
    Named {
        inner: VecSource::new(experts),
        place: place.into(),
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
    fn content_id(&self) -> Option<ContentId> {
        Some(ContentId {
            place: self.place.clone(),
            id: self.id.clone(),
        })
    }
}

/// Load `src` on a backend with the cache in `dir`; the backend and what it did.
fn load(dir: &Path, src: &mut Named) -> (CpuBackend, TileCacheUse) {
    load_with(TileCache::new(dir), src)
}

/// [`load`] with `cache`; a repack's tiles are written on a thread of their own, whose
/// outcome is waited for and returned.
fn load_with(cache: TileCache, src: &mut Named) -> (CpuBackend, TileCacheUse) {
    let mut b = CpuBackend::new(2).unwrap();
    b.set_tile_cache(Some(cache));
    b.load_from(src, LIMITS).unwrap();
    let used = match b.take_tile_cache_writer() {
        Some(w) => {
            assert!(
                matches!(b.tile_cache_use(), TileCacheUse::Writing { .. }),
                "{:?}",
                b.tile_cache_use()
            );
            w.join().unwrap()
        }
        None => b.tile_cache_use().clone(),
    };
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
        TileCacheUse::Written { file, miss, .. } => (file.clone(), miss.clone()),
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

/// Change the byte at `at` of `file` (whatever it holds).
fn flip(file: &Path, at: u64) {
    let old = std::fs::read(file).unwrap()[at as usize];
    poke(file, at, old ^ 0x5a);
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
        TileCacheUse::Reused {
            file: f,
            lock_error,
        } => {
            assert_eq!(f, &file);
            // Served from the locked map wherever this process may lock that much.
            if may_lock() {
                assert_eq!(lock_error, &None);
            } else {
                eprintln!("note: mlock not allowed here ({lock_error:?}): the tiles were copied");
            }
        }
        other => panic!("expected the kept tiles reused, got {other:?}"),
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

    // Where the file may not be locked in memory, the tiles are copied: the same bits.
    let mut third_src = named("shard a");
    let (mut third, used) = load_with(TileCache::new(&dir).without_lock(), &mut third_src);
    assert_eq!(
        used,
        TileCacheUse::Reused {
            file: file.clone(),
            lock_error: Some("not asked to lock".into())
        }
    );
    assert_eq!(third_src.taken, 0);
    assert_eq!(run(&mut third), want);

    // Damage is found on the copy path too (the checksums run over the copy).
    flip(&file, std::fs::metadata(&file).unwrap().len() - 1);
    let mut src = named("shard a");
    let (mut b, used) = load_with(TileCache::new(&dir).without_lock(), &mut src);
    let (_, miss) = written(&used);
    assert!(miss.contains("damaged"), "{miss}");
    assert_eq!(src.taken, 4);
    assert_eq!(run(&mut b), want);
}

/// Whether this process may lock a few MiB (root, or a memory lock limit of 16 MiB or more).
fn may_lock() -> bool {
    // SAFETY: plain libc calls with a valid out-pointer.
    unsafe {
        let mut lim: libc::rlimit = std::mem::zeroed();
        libc::geteuid() == 0
            || (libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut lim) == 0
                && (lim.rlim_cur == libc::RLIM_INFINITY || lim.rlim_cur >= 16 << 20))
    }
}

/// A writer killed mid-write leaves its temporary file; the next write removes it (and one of
/// this process's own id, which only an earlier life of a container's process 1 can have
/// left), but never a file the cache did not name, nor one a live writer holds locked.
#[test]
fn temporary_files_of_gone_writers_are_removed_and_nothing_else() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("tiles");
    std::fs::create_dir(&dir).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
    // A process id that runs no process: past the kernel's largest.
    let gone = expertmesh_files::pid_past_max();
    let me = std::process::id();
    let left = [
        format!(".0123456789abcdef.r16.tmp-{gone}-7"),
        format!(".fedcba9876543210.r16.tmp-{me}-1"),
    ];
    let kept = [
        format!(
            ".0123456789abcdef.r16.tmp-{}-7",
            std::os::unix::process::parent_id()
        ),
        format!(".shard.emshard.tmp-{gone}-1"),
        "notes.txt".to_string(),
    ];
    for n in left.iter().chain(&kept) {
        std::fs::write(dir.join(n), b"x").unwrap();
    }
    // Held locked by a live writer whose id means nothing here (another PID namespace).
    let held = format!(".00112233445566ff.r16.tmp-{gone}-3");
    let lock = expertmesh_files::create_locked(&dir.join(&held), Some(0o400)).unwrap();
    let (_, used) = load(&dir, &mut named("shard a"));
    written(&used);
    for n in &left {
        assert!(!dir.join(n).exists(), "{n} left behind");
    }
    for n in kept.iter().chain([&held]) {
        assert!(dir.join(n).exists(), "{n} removed");
    }
    drop(lock);
}

/// `.`, `..`, `/` and the like are refused: they name no folder whose parent can be checked.
#[test]
fn folders_without_a_name_of_their_own_are_refused() {
    for bad in [".", "..", "/", "tiles/..", "./."] {
        let mut src = named("shard a");
        let (mut b, used) = load(Path::new(bad), &mut src);
        match &used {
            TileCacheUse::NotWritten { error, .. } => {
                assert!(error.contains("a folder of its own"), "{bad}: {error}")
            }
            other => panic!("{bad}: expected the cache refused, got {other:?}"),
        }
        assert_eq!(run(&mut b), plain_bits());
    }
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
        ("damaged", &|| flip(&file, len - 100)),
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
        assert!(matches!(used, TileCacheUse::Reused { .. }), "{used:?}");
    }
}

#[test]
fn new_content_at_a_place_replaces_its_file_and_other_places_keep_theirs() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("tiles");
    let (_, used) = load(&dir, &mut named("shard a"));
    let (file, _) = written(&used);
    // A backend serving from the kept file (mapped where it may lock it).
    let (mut serving, used) = load(&dir, &mut named("shard a"));
    assert!(matches!(used, TileCacheUse::Reused { .. }), "{used:?}");
    // Other content at the same place (a re-conversion, other weights of the same shapes): the
    // kept file is not used, and is replaced.
    let reconverted = || {
        let mut e = experts();
        for (k, w) in &mut e {
            *w = expertmesh_quant::synth::synthetic_expert(
                w.spec(),
                w.hidden(),
                w.inter(),
                6,
                k.layer,
                k.expert,
            )
            .unwrap();
        }
        e
    };
    let mut plain = CpuBackend::new(1).unwrap();
    plain.load(reconverted(), LIMITS).unwrap();
    let new_bits = run(&mut plain);
    assert_ne!(new_bits, plain_bits());
    let mut src = named_with("shard", "shard b", reconverted());
    let (mut b, used) = load(&dir, &mut src);
    let (again, miss) = written(&used);
    assert_eq!(again, file);
    assert!(miss.contains("made for other experts"), "{miss}");
    assert_eq!(src.taken, 4);
    assert_eq!(run(&mut b), new_bits);
    assert_eq!(cache_files(&dir), vec![file.clone()]);
    // The file it mapped was replaced, not rewritten: it still serves its own weights.
    assert_eq!(run(&mut serving), plain_bits());
    let (mut b, used) = load(&dir, &mut named_with("shard", "shard b", reconverted()));
    assert!(matches!(used, TileCacheUse::Reused { .. }), "{used:?}");
    assert_eq!(run(&mut b), new_bits);
    // The first content is now the stranger there.
    let mut src = named("shard a");
    let (_, used) = load(&dir, &mut src);
    let (_, miss) = written(&used);
    assert!(miss.contains("made for other experts"), "{miss}");
    assert_eq!(src.taken, 4);
    // Another place gets a file of its own, and both are reused.
    let (_, used) = load(&dir, &mut named_with("other shard", "shard a", experts()));
    let (other, _) = written(&used);
    assert_ne!(other, file);
    assert_eq!(cache_files(&dir).len(), 2);
    let (_, used) = load(&dir, &mut named("shard a"));
    assert!(matches!(used, TileCacheUse::Reused { .. }), "{used:?}");
}

/// Experts whose arena spans several 4 MiB chunks (checked on two threads): damage in the last
/// chunk is found, and an intact file is reused with the same bits as a repack.
#[test]
fn every_chunk_of_a_large_arena_is_checked() {
    use expertmesh_quant::format::QuantSpec;
    use expertmesh_quant::synth::synthetic_expert;
    let big = || -> Vec<(ExpertKey, ExpertWeights)> {
        (0..6u32)
            .map(|e| {
                let key = ExpertKey {
                    layer: 1,
                    expert: e,
                };
                (
                    key,
                    synthetic_expert(QuantSpec::G32_BF16, 1024, 1024, 5, 1, e).unwrap(),
                )
            })
            .collect()
    };
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("tiles");
    let (mut first, used) = load(&dir, &mut named_with("big", "big", big()));
    let (file, _) = written(&used);
    let len = std::fs::metadata(&file).unwrap().len();
    assert!(len > 2 * (4 << 20), "{len} bytes: not several chunks");
    let (mut second, used) = load(&dir, &mut named_with("big", "big", big()));
    assert!(matches!(used, TileCacheUse::Reused { .. }), "{used:?}");
    let pairs = [(0, 0), (0, 5), (1, 2), (1, 3)];
    let bits = |b: &mut CpuBackend| {
        let x: Vec<f32> = (0..2 * 1024)
            .map(|i| ((i * 13 % 11) as f32 - 5.0) / 4.0)
            .collect();
        let mut g = expertmesh_backend::Grouping::with_capacity(pairs.len());
        for (row, &(t, e)) in pairs.iter().enumerate() {
            g.push(e, t, 0.5, row as u32);
        }
        let mut out = vec![0f32; pairs.len() * 1024];
        g.with_groups(1, |groups| {
            let batch = expertmesh_backend::GroupedBatch {
                mode: expertmesh_quant::contract::ComputeMode::Exact,
                hidden: 1024,
                tokens: 2,
                input: expertmesh_backend::Activations::F32(&x),
                groups,
                layout: expertmesh_backend::OutputLayout::PerSlot,
            };
            b.execute(&batch, &mut out)
        })
        .unwrap();
        out.iter().map(|v| v.to_bits()).collect::<Vec<u32>>()
    };
    assert_eq!(bits(&mut first), bits(&mut second));
    flip(&file, len - 10);
    let (_, used) = load(&dir, &mut named_with("big", "big", big()));
    let (_, miss) = written(&used);
    // The header fits one page here, so the arena is everything after the first 4096 bytes.
    let last = (len - 4096 - 1) / (4 << 20);
    assert!(last >= 2, "{len}");
    assert!(
        miss.contains(&format!("chunk {last} of its tiles")),
        "{miss}"
    );
    assert!(miss.contains("damaged"), "{miss}");
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

    // A private folder whose parent others may write (no sticky bit) could be replaced by
    // them: refused too. With the sticky bit (as /tmp) it is used.
    let open = tmp.path().join("open");
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
    let (_, used) = load(&open.join("tiles"), &mut named("shard a"));
    match &used {
        TileCacheUse::NotWritten { error, .. } => {
            assert!(error.contains("lets others replace"), "{error}");
        }
        other => panic!("expected the cache refused, got {other:?}"),
    }
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let (_, used) = load(&open.join("tiles"), &mut named("shard a"));
    written(&used);
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

/// Tiles of a shard that no longer exists (a weights folder retired after an upgrade) are
/// removed by the cache's next write; those of shards still there stay, and a place that is
/// not an absolute path is never taken for gone.
#[test]
fn tiles_of_shards_that_are_gone_are_removed_by_the_next_write() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("tiles");
    let shard = |name: &str| {
        let p = tmp.path().join(name);
        std::fs::write(&p, b"shard").unwrap();
        p.display().to_string()
    };
    let (old, kept, new) = (shard("old.shard"), shard("kept.shard"), shard("new.shard"));
    let (_, used) = load(&dir, &mut named_with(&old, "old", experts()));
    let (old_tiles, _) = written(&used);
    let (_, used) = load(&dir, &mut named_with(&kept, "kept", experts()));
    let (kept_tiles, _) = written(&used);
    let (_, used) = load(&dir, &mut named_with("relative", "rel", experts()));
    let (relative_tiles, _) = written(&used);
    assert_eq!(cache_files(&dir).len(), 3);
    std::fs::remove_file(&old).unwrap();
    // Nothing is removed until the cache writes again.
    assert!(old_tiles.exists());
    let (_, used) = load(&dir, &mut named_with(&new, "new", experts()));
    let (new_tiles, _) = written(&used);
    let mut want = vec![kept_tiles, new_tiles, relative_tiles];
    want.sort();
    assert_eq!(cache_files(&dir), want);
    assert!(!old_tiles.exists());
}

/// A folder several hosts share (a home folder over NFS): a shard path absent on this host
/// may be another host's live shard, so only the host that wrote a file removes it as
/// retired; and a file any host wrote serves every host (the writer is not part of the match).
#[test]
fn only_the_host_that_wrote_a_file_removes_it_as_retired() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("tiles");
    let on = |host: &str| TileCache::new(&dir).with_writer(host);
    let shard = |name: &str| {
        let p = tmp.path().join(name);
        std::fs::write(&p, b"shard").unwrap();
        p.display().to_string()
    };
    let (a_shard, b_shard, b_other) = (shard("a.shard"), shard("b.shard"), shard("b2.shard"));
    let (_, used) = load_with(on("host-a"), &mut named_with(&a_shard, "a", experts()));
    let (a_tiles, _) = written(&used);
    // Host b reads host a's file: the same tiles, no repack.
    let mut again = named_with(&a_shard, "a", experts());
    let (mut b, used) = load_with(on("host-b"), &mut again);
    assert!(matches!(used, TileCacheUse::Reused { .. }), "{used:?}");
    assert_eq!(again.taken, 0);
    assert_eq!(run(&mut b), plain_bits());
    // a's shard is not on host b (here: removed); b's write leaves a's file alone.
    std::fs::remove_file(&a_shard).unwrap();
    let (_, used) = load_with(on("host-b"), &mut named_with(&b_shard, "b", experts()));
    let (b_tiles, _) = written(&used);
    assert!(a_tiles.exists(), "host b removed host a's file");
    // Host a's next write removes it (its own shard is gone).
    let (_, used) = load_with(on("host-a"), &mut named_with(&b_other, "b2", experts()));
    written(&used);
    assert!(
        !a_tiles.exists(),
        "host a kept the tiles of its retired shard"
    );
    assert!(b_tiles.exists());
}

/// A FIFO where a cache file should be (put there by mistake or by another user's process)
/// is a miss that names it, not an open that waits for a writer for ever; it is replaced.
#[test]
fn a_fifo_in_place_of_a_cache_file_is_a_miss_not_a_hang() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("tiles");
    let (_, used) = load(&dir, &mut named("shard a"));
    let (file, _) = written(&used);
    std::fs::remove_file(&file).unwrap();
    let made = std::process::Command::new("mkfifo")
        .arg(&file)
        .status()
        .unwrap();
    assert!(made.success());
    // A hang guard: the load runs on a thread of its own.
    let (tx, rx) = std::sync::mpsc::channel();
    let d = dir.clone();
    std::thread::spawn(move || {
        let _ = tx.send(load(&d, &mut named("shard a")).1);
    });
    let used = rx
        .recv_timeout(std::time::Duration::from_secs(120))
        .expect("the load waited on the FIFO");
    let (again, miss) = written(&used);
    assert_eq!(again, file);
    assert!(miss.contains("not a regular file"), "{miss}");
    assert!(std::fs::metadata(&file).unwrap().is_file());
    let (_, used) = load(&dir, &mut named("shard a"));
    assert!(matches!(used, TileCacheUse::Reused { .. }), "{used:?}");
}

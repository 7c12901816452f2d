//! Build script: with feature `libfabric`, compiles `src/rdma/fabric_shim.c` (the libfabric
//! calls the RDMA link uses, as real functions) against the installed libfabric headers and links
//! `libfabric`; without it, does nothing (the default build needs only Rust).

fn main() {
    println!("cargo:rerun-if-env-changed=CARGO_FEATURE_LIBFABRIC");
    #[cfg(feature = "libfabric")]
    {
        println!("cargo:rerun-if-changed=src/rdma/fabric_shim.c");
        if !std::path::Path::new("/usr/include/rdma/fabric.h").is_file()
            && std::env::var_os("LIBFABRIC_INCLUDE").is_none()
        {
            println!(
                "cargo:warning=feature `libfabric`: rdma/fabric.h not found in /usr/include; install libfabric-dev \
                 or set LIBFABRIC_INCLUDE"
            );
        }
        let mut build = cc::Build::new();
        build.file("src/rdma/fabric_shim.c").warnings(true);
        if let Some(dir) = std::env::var_os("LIBFABRIC_INCLUDE") {
            build.include(dir);
        }
        build.compile("em_fabric_shim");
        println!("cargo:rerun-if-env-changed=LIBFABRIC_INCLUDE");
        println!("cargo:rustc-link-lib=fabric");
    }
}

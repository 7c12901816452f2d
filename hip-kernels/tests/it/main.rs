//! The HIP kernels' integration tests, one binary: the kernels' arithmetic on the CPU and the HIP
//! backend's behaviour without a GPU (`cargo test -p expertmesh-hip-kernels --features hip --test it`).

mod backend_check;
mod kernel_host;
mod matrix_emu;
#[cfg(feature = "hip")]
mod standin;
mod support;

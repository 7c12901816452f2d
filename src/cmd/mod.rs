//! One module per command of `expertmesh`.
//!
//! Why this exists: a command is a thin layer between its arguments and a library, and each
//! has one home: `models`, `validate`, `plan` and `convert` work on files; `demo`, `up`,
//! `worker`, `router` and `infer` run or call a fabric; `rebalance` changes a running
//! fabric's placement; `keys` makes credentials; `deploy` writes the files that run a fabric on
//! a cluster engine; `bench` runs
//! the measurements.

pub(crate) mod bench;
pub(crate) mod convert;
pub(crate) mod demo;
pub(crate) mod deploy;
pub(crate) mod infer;
pub(crate) mod keys;
pub(crate) mod models;
pub(crate) mod plan;
pub(crate) mod rebalance;
pub(crate) mod router;
pub(crate) mod up;
pub(crate) mod validate;
pub(crate) mod worker;

//! The shard format's integration tests, one binary: round trips and damage.

mod shard_file;

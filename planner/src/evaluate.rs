//! What a placement will do: expected load per device, destinations and bytes on the wire per
//! token, and a roofline estimate of decode throughput and cost.
//!
//! Why this exists: a cluster builder compares placements (and clusters) by what they serve and
//! where they choke, before anything runs. The model here is deliberately simple, stated, and
//! the same for every placement it compares.
//!
//! # Traffic model
//!
//! Per MoE layer, token `t` picks expert `e` with probability `pi_e = k * load_e / sum(load)`
//! (uniform `k / E` without statistics); a replicated expert's tokens split evenly over its `r_e`
//! replicas (`q = pi_e / r_e` per replica slot). A set of slots (a device, a node, the nodes
//! other than the router's) is *touched* by a token when one of its slots receives it:
//! - without co-selection statistics, a token's k experts are k distinct draws: a set holding
//!   `m = (E / k) * sum(q)` experts' worth of load is missed by all of them with
//!   `P(untouched) = prod_{j<k} (1 - m / (E - j))` — exactly `C(E - m, k) / C(E, k)` with
//!   uniform load (treating slots as independent, `prod(1 - q)`, would undercount touches:
//!   by 6% for one device of 4 experts out of 16 with top-4);
//! - for models with group-limited routing (`n_group > 1`, `topk_group < n_group`) and no
//!   co-selection statistics, tokens are sampled: `topk_group` groups in proportion to their
//!   load, then k experts among theirs in proportion to load (so a plan that keeps groups on
//!   nodes shows the fan-out it saves);
//! - with co-selection statistics (`count(a, b)` = tokens that chose both `a` and `b`), tokens
//!   are sampled ([`SAMPLED_TOKENS`] per layer, seeded by the layer id so every placement is
//!   judged on the same tokens): the first expert in proportion to load, each further one in
//!   proportion to its co-selection counts with the experts already chosen (in proportion to
//!   load when those are all zero). With independent routing this reproduces the load-only model;
//!   with clustered routing it reproduces the clusters. A replicated expert goes to a replica on
//!   a device, else a node, the token already goes to, else the replicas take turns — the
//!   router's preference. Co-selected experts on one node mean fewer nodes per token, which is
//!   what locality buys. Pairwise counts cannot tell an expert's appearances inside its own
//!   cluster from stray ones in other clusters' tokens, so under strongly clustered routing the
//!   estimate errs toward more nodes (conservative: the gain it reports is a lower bound); with
//!   independent routing it matches the load-only model.
//!
//! Bytes are the fabric's own ([`crate::wire::WireModel`], built from the transport codec's
//! frame lengths by the binary): the router sends one dispatch frame per (micro-batch, device)
//! carrying the tokens that device needs (q8 block-32 activations in exact mode, f32 in
//! accurate mode) and their (expert, weight) pairs, and each device answers with one f32 row
//! per (token, slot) in exact mode, one pre-combined row per token otherwise. With per-node
//! deduplication (`node_dedup`, what the fabric does: a remote node's parts are merged into one
//! for a leader device, which fans the pairs out over shared memory) a token crosses the
//! network once per node touched, in one frame per (micro-batch, node), and the leader answers
//! the node's per-slot rows, or one row per token summed over the node's devices; without it
//! (the planner's own default wire) once per device touched.
//! Bytes on the network are those to and from devices on other nodes than the router's; with
//! several routers (`[[router]]`) the calls are spread evenly over them, each judged from its
//! own node. Every device's frames also cross its intra-node link.
//!
//! # Roofline
//!
//! For a batch of `B` tokens per layer call and `C` such batches in flight, each MoE layer takes
//! the slowest of:
//! - **memory**: the busiest device's weight bytes read ÷ its memory bandwidth, bytes =
//!   `expert_bytes * sum over its slots of (1 - (1 - q)^B)` (with uniform load this spreads
//!   `U(B) = E (1 - (1 - k/E)^B)` touched experts over the devices) plus its shared experts;
//! - **compute**: the busiest device's `2 * 3HF` int8 operations per (token, expert) pair ÷ its
//!   `int8_tops` (devices without a figure are skipped);
//! - **network**: the busiest NIC direction's bytes ÷ its bandwidth: a router's node sends the
//!   dispatches to, and receives the results from, every device on another node; that node
//!   receives the dispatches and sends the results. A TCP NIC's bandwidth is its line rate
//!   times the share TCP/IP and Ethernet headers leave at its MTU
//!   ([`crate::wire::tcp_payload_share`]) unless a measured figure replaces it;
//! - **intra-node**: the busiest device link's bytes (its dispatches in, or its results out) ÷
//!   the node's device-to-device bandwidth;
//!
//! each of these ×C (the C batches share the hardware), and
//!
//! - **latency**: `2 * (P(any remote node) * inter-node hop + intra-node hop)` (dispatch and
//!   combine; the C batches overlap it).
//!
//! Summed over the MoE layers this is the time one step of the C batches takes; tokens/s =
//! `C * B / step`. The bottleneck is the term that binds for the most time. Attention and dense
//! layers are not part of the fabric and not modeled. Cost per million tokens = the devices'
//! summed `price_usd_per_hour` ÷ (tokens/s × 3600) × 10^6, when every device has a price.
//!
//! # Modules
//!
//! `hardware` (the figures used and where each came from), `sampling` (sampled tokens and the
//! distinct-draw touch probabilities), `evaluation` ([`Evaluator`]: load balance and traffic),
//! `roofline` (the throughput estimate).

mod evaluation;
mod hardware;
mod roofline;
mod sampling;
#[cfg(test)]
mod tests;
pub use evaluation::{DEFAULT_MICRO_BATCH, Evaluation, Evaluator, LoadBalance, NicBytes, Traffic};
pub(crate) use hardware::nic_gb_s;
pub use hardware::{FigureSource, Hardware, INTRA_HOP_US, ROCE_HOP_US, TCP_HOP_US};
pub use roofline::{Roofline, Terms};
pub use sampling::SAMPLED_TOKENS;

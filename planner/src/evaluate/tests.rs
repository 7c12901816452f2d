//! Unit tests of the evaluation: every roofline term against its closed form, the traffic
//! model against brute-force counts, and the hardware figures' sources.

use super::sampling::untouched;
use super::*;
use crate::wire::WireModel;
use crate::{PlanOptions, plan};
use expertmesh_topology::model::preset_by_name;
use expertmesh_topology::topology::Topology;
use std::path::Path;

/// Kimi K2 spread evenly over 32 MI300X: every roofline term against its closed form.
#[test]
fn roofline_terms_match_closed_forms() {
    let t =
        Topology::load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/mi300x-4x8.toml"))
            .unwrap();
    let m = preset_by_name("kimi-k2").unwrap();
    let p = plan(&t, &m, None, None, &PlanOptions::default()).unwrap();
    let hw = Hardware::from_topology(&t);
    let ev = Evaluator::new(&t, &m, &p.placement, None, None, hw.router_node);
    let (e, k, layers) = (384.0f64, 8.0f64, 60.0);
    let q = k / e;
    // P(a set of m experts is missed by a token's 8 distinct experts) = C(384 - m, 8) / C(384, 8).
    let miss = |m: f64| (0..8).map(|j| 1.0 - m / (e - j as f64)).product::<f64>();
    let s = m.expert_bytes() as f64;
    for b in [1usize, 8, 64, 256] {
        let r = ev.roofline(&hw, b, 1);
        // U(B) touched experts spread over 32 devices, read at 5300 GB/s.
        let u = e * (1.0 - (1.0 - q).powf(b as f64));
        let memory = layers * u / 32.0 * s / 5300e9 * 1e3;
        assert!((r.terms.memory_ms - memory).abs() < 1e-9 * memory, "B={b}");
        // Exact mode: the router's node receives one f32 row (4 x 7168 bytes) per slot on
        // each of the 24 devices of the other nodes (12 experts each), plus a 64-byte
        // result frame per (micro-batch of 32, device) touched, over 8 x 400 Gbit/s
        // (RoCE: line rate); the dispatches (q8) going out are fewer bytes.
        let bf = b as f64;
        let p_dev = 1.0 - miss(12.0);
        let (full, rest) = ((bf / 32.0).floor(), bf % 32.0);
        let mut frames = full * (1.0 - (1.0 - p_dev).powi(32));
        if rest > 0.0 {
            frames += 1.0 - (1.0 - p_dev).powf(rest);
        }
        let per_device = frames * 64.0 + bf * 12.0 * q * 4.0 * 7168.0;
        let network = layers * 24.0 * per_device / 400e9 * 1e3;
        assert!(
            (r.terms.network_ms - network).abs() < 1e-9 * network,
            "B={b}"
        );
        // Dispatch + combine: a RoCE hop (3 us) when any remote node is touched, plus the
        // xGMI hop (2 us).
        let any_remote = 1.0 - miss(288.0);
        let latency = layers * 2.0 * (any_remote * 3.0 + 2.0) * 1e-3;
        assert!(
            (r.terms.latency_ms - latency).abs() < 1e-9 * latency,
            "B={b}"
        );
        // Int8 compute: B k pairs spread over 32 devices at 2614.9 TOPS.
        let compute =
            layers * 2.0 * m.expert_params() as f64 * b as f64 * k / 32.0 / 2614.9e12 * 1e3;
        assert!(
            (r.terms.compute_ms - compute).abs() < 1e-9 * compute,
            "B={b}"
        );
        let step = r.step_ms / 1e3;
        assert!((r.tokens_per_s - b as f64 / step).abs() < 1e-6 * r.tokens_per_s);
        let cost = 64.0 / (r.tokens_per_s * 3600.0) * 1e6;
        assert!((r.usd_per_million_tokens.unwrap() - cost).abs() < 1e-9 * cost);
    }
    // Weight reads and arithmetic one after the other on each device: 12 slots per device,
    // each streamed when touched, plus its 12 q pairs per token of int8 arithmetic.
    for b in [1usize, 16, 256] {
        let bf = b as f64;
        let memory = 12.0 * (1.0 - (1.0 - q).powf(bf)) * s / 5300e9;
        let compute = 2.0 * m.expert_params() as f64 * bf * 12.0 * q / 2614.9e12;
        let want = bf / (layers * (memory + compute));
        let got = ev.device_serial_tokens_per_s(&hw, b);
        assert!((got - want).abs() < 1e-9 * want, "B={b}: {got} vs {want}");
        // Slower than memory or compute alone (the roofline's terms: they overlap there).
        let r = ev.roofline(&hw, b, 1);
        for t in [r.terms.memory_ms, r.terms.compute_ms] {
            assert!(got < bf / (t / 1e3), "B={b}");
        }
    }
    let tr = ev.evaluate(&hw).traffic;
    let remote = 3.0 * (1.0 - miss(96.0));
    assert!((tr.remote_nodes_per_token - remote).abs() < 1e-12);
    // Per token, frames at full micro-batches of 32: q8 activations (7168 + 896 scales +
    // 2 bytes) per device touched and 8 bytes per pair out, an f32 row per slot back.
    let p_dev = 1.0 - miss(12.0);
    let frames = (1.0 - (1.0 - p_dev).powi(32)) / 32.0;
    let dispatch = 24.0 * (frames * 96.0 + p_dev * 8066.0 + 12.0 * q * 8.0);
    let result = 24.0 * (frames * 64.0 + 12.0 * q * 28672.0);
    assert!((tr.network_dispatch_bytes_per_token - dispatch).abs() < 1e-6 * dispatch);
    assert!((tr.network_result_bytes_per_token - result).abs() < 1e-6 * result);
    assert!((tr.network_bytes_per_token - dispatch - result).abs() < 1e-6 * result);
    let devices = 32.0 * (1.0 - miss(12.0));
    assert!((tr.devices_per_token - devices).abs() < 1e-12);
}

/// A star of `n` one-CPU nodes on 100 Mbit/s TCP, with one router or one per node.
fn star(n: usize, routers: usize) -> Topology {
    let mut text = String::from("format = 1\nname = \"star\"\n");
    for r in 0..routers {
        text += &format!("[[router]]\nnode = \"n{r}\"\nport = 7000\n");
    }
    for i in 0..n {
        text += &format!(
            "[[nodes]]\nname = \"n{i}\"\naddress = \"10.9.0.{}\"\ncontrol_port = 7100\ndata_port = 7200\nnics = [{{ name = \"eth0\", kind = \"tcp\", speed_gbit_s = 0.1, mtu = 9000 }}]\ndevices = [{{ name = \"cpu0\", kind = \"cpu\", arch = \"cpu\", threads = 1, expert_memory = \"64 MiB\", memory_bandwidth_gb_s = 20 }}]\n",
            i + 1
        );
    }
    Topology::from_toml_str(&text).unwrap_or_else(|p| panic!("{p:?}"))
}

/// One router per node spreads the network load: with the network binding, tokens/s grow
/// with the routers, and every NIC direction is counted.
#[test]
fn routers_per_node_scale_a_network_bound_cluster() {
    let m = preset_by_name("demo-small").unwrap();
    let tps = |routers: usize| {
        let t = star(4, routers);
        let p = plan(&t, &m, None, None, &PlanOptions::default()).unwrap();
        let hw = Hardware::from_topology(&t);
        assert_eq!(hw.router_nodes.len(), routers);
        let ev = Evaluator::new(&t, &m, &p.placement, None, None, hw.router_node);
        let r = ev.roofline(&hw, 64, 1);
        assert_eq!(r.bottleneck, "network");
        (r.tokens_per_s, ev.evaluate(&hw).traffic)
    };
    let (one, tr1) = tps(1);
    {
        let t = star(4, 1);
        let p = plan(&t, &m, None, None, &PlanOptions::default()).unwrap();
        let hw = Hardware::from_topology(&t);
        let ev = Evaluator::new(&t, &m, &p.placement, None, None, 0);
        let nic = ev.nic_bytes_per_token(&hw, 32);
        let tr = ev.evaluate(&hw).traffic;
        // One router: its node receives every remote result and sends every dispatch.
        assert!((nic[0].received - tr.network_result_bytes_per_token).abs() < 1e-6);
        assert!((nic[0].sent - tr.network_dispatch_bytes_per_token).abs() < 1e-6);
        let rest: f64 = nic[1..].iter().map(|n| n.sent).sum();
        assert!((rest - nic[0].received).abs() < 1e-6);
    }
    let (four, tr4) = tps(4);
    // Each router sees 3 of 4 devices remote either way: same bytes per token.
    assert!((tr1.network_bytes_per_token - tr4.network_bytes_per_token).abs() < 1e-6);
    // The single router's NIC receives every remote result; four routers split that over
    // four NICs, each also receiving the others' dispatches.
    let scale = four / one;
    assert!(scale > 3.0 && scale < 4.0, "{scale}");
    // The network term against its closed form for one router: results dominate.
    let t = star(4, 1);
    let p = plan(&t, &m, None, None, &PlanOptions::default()).unwrap();
    let hw = Hardware::from_topology(&t);
    let ev = Evaluator::new(&t, &m, &p.placement, None, None, 0);
    // B = 64 is two full micro-batches of 32, as the per-token figure counts frames.
    assert_eq!(ev.wire().micro_batch_tokens, 32);
    let per_token = tr1.network_result_bytes_per_token;
    let bw = 0.1e9 / 8.0 * (8948.0 / 9038.0);
    let expect = m.moe_layers() as f64 * 64.0 / bw;
    let r = ev.roofline(&hw, 64, 1);
    assert!(
        (r.terms.network_ms / 1e3 - expect * per_token).abs() < 1e-9 * r.terms.network_ms,
        "{} vs {}",
        r.terms.network_ms,
        expect * per_token * 1e3
    );
}

/// Per-node dedup: a token crosses to a remote node once, so dispatch bytes drop with
/// 8 devices per node; per-slot rows are the same bytes; pre-combined rows are one per node.
#[test]
fn node_dedup_sends_once_per_node() {
    let t =
        Topology::load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/mi300x-4x8.toml"))
            .unwrap();
    let m = preset_by_name("kimi-k2").unwrap();
    let p = plan(&t, &m, None, None, &PlanOptions::default()).unwrap();
    let hw = Hardware::from_topology(&t);
    let traffic = |w: WireModel| {
        Evaluator::new(&t, &m, &p.placement, None, None, 0)
            .with_wire(w)
            .evaluate(&hw)
            .traffic
    };
    let dedup = |w: WireModel| WireModel {
        node_dedup: true,
        ..w
    };
    let (e, d) = (
        traffic(WireModel::exact(m.hidden, 32)),
        traffic(dedup(WireModel::exact(m.hidden, 32))),
    );
    assert!(d.network_dispatch_bytes_per_token < 0.5 * e.network_dispatch_bytes_per_token);
    let rows = |t: &Traffic| t.network_result_bytes_per_token;
    assert!((rows(&d) - rows(&e)).abs() < 0.01 * rows(&e));
    assert!((d.network_bytes_per_token_without_dedup - e.network_bytes_per_token).abs() < 1e-6);
    let a = traffic(dedup(WireModel::accurate(m.hidden, 32)));
    // One pre-combined f32 row per remote node touched.
    let per_node = a.network_result_bytes_per_token / a.remote_nodes_per_token;
    assert!((per_node - 4.0 * 7168.0).abs() < 64.0, "{per_node}");
}

/// A token's k experts are distinct: with uniform load a set of m experts is missed with
/// probability C(E - m, k) / C(E, k), not (1 - k/E)^m.
#[test]
fn touches_follow_distinct_draws() {
    // 4 of 16 experts, top-4: 1 pair per token expected.
    let miss = untouched(1.0, 16, 4);
    assert!((miss - 495.0 / 1820.0).abs() < 1e-12, "{miss}");
    assert!(miss < 0.75f64.powi(4));
    assert_eq!(untouched(0.0, 16, 4), 1.0);
    assert_eq!(untouched(4.0, 16, 4), 0.0);
}

//! The operator's view through a real `expertmesh up` (issue 16 item 7): scraping `/metrics`
//! on the router and on every worker shows the series the README promises, with values that
//! match the traffic sent; the live load file is the planner's format and counts every token
//! top_k times; the logs say when workers join.
//!
//! One `up` (router in the launcher, one process per worker) on free loopback ports; a client
//! sends known calls (and one bad-shape request), then the test scrapes over plain HTTP and
//! parses the text exposition format itself.

use crate::support::{free_pair, free_port, root, two_cpu_topology};
use expertmesh_router::client::{ClientError, RouterClient};
use expertmesh_router::reference;
use expertmesh_topology::model::preset_by_name;
use std::collections::BTreeMap;
use std::io::{BufRead, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// `up` running; interrupted (SIGINT) and reaped when dropped.
struct Up(Child);

impl Drop for Up {
    fn drop(&mut self) {
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.0.id() as i32, libc::SIGINT) };
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(20) {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// What `up` printed before "Ctrl-C to stop.": the frontend, and the metrics URLs by name
/// ("router 0", "worker local/cpu0 (rank 0)").
struct Started {
    frontend: SocketAddr,
    metrics: BTreeMap<String, String>,
    load_file: bool,
}

fn read_banner(child: &mut Child) -> Started {
    let stdout = child.stdout.take().unwrap();
    let mut lines = std::io::BufReader::new(stdout).lines();
    let (mut frontend, mut metrics, mut load_file) = (None, BTreeMap::new(), false);
    for line in lines.by_ref() {
        let line = line.unwrap();
        let l = line.trim();
        if let Some(rest) = l.strip_prefix("frontends: ") {
            frontend = rest.split_whitespace().next().map(|a| a.parse().unwrap());
        }
        if let Some(rest) = l.strip_prefix("metrics: ") {
            let (who, url) = rest.rsplit_once(" at ").expect("metrics: WHO at URL");
            metrics.insert(who.to_string(), url.to_string());
        }
        load_file |= l.starts_with("load statistics: ");
        if l == "Ctrl-C to stop." {
            break;
        }
    }
    // Keep draining stdout so `up` never blocks on a full pipe.
    std::thread::spawn(move || for _ in lines {});
    Started {
        frontend: frontend.expect("up printed where frontends connect"),
        metrics,
        load_file,
    }
}

/// GET `url` (http://HOST:PORT/PATH): (status line, body). Retries connecting for up to 60 s
/// (a worker's endpoint starts just after it joins; a hang guard, not a budget).
pub(crate) fn http_get(url: &str) -> (String, String) {
    let rest = url.strip_prefix("http://").expect("an http URL");
    let (host, path) = rest.split_once('/').unwrap();
    let t = Instant::now();
    let mut s = loop {
        match TcpStream::connect(host) {
            Ok(s) => break s,
            Err(e) if t.elapsed() < Duration::from_secs(60) => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => panic!("connecting to {url}: {e}"),
        }
    };
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    write!(
        s,
        "GET /{path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").expect("an HTTP response");
    (
        head.lines().next().unwrap_or_default().to_string(),
        body.to_string(),
    )
}

/// A scrape: `name{labels}` → value (labels as written, in order).
pub(crate) struct Scrape(BTreeMap<String, f64>);

impl Scrape {
    pub(crate) fn parse(text: &str) -> Self {
        let mut m = BTreeMap::new();
        for line in text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
        {
            let (key, value) = line.rsplit_once(' ').expect("NAME VALUE");
            let v: f64 = value
                .parse()
                .unwrap_or_else(|_| panic!("value in {line:?}"));
            assert!(m.insert(key.to_string(), v).is_none(), "sample {key} twice");
        }
        Self(m)
    }

    /// Samples of series `name` as (labels, value); labels parsed into a map.
    fn series(&self, name: &str) -> Vec<(BTreeMap<String, String>, f64)> {
        self.0
            .iter()
            .filter_map(|(k, &v)| {
                let (n, labels) = k.split_once('{').unwrap_or((k.as_str(), "}"));
                (n == name).then(|| (parse_labels(labels.trim_end_matches('}')), v))
            })
            .collect()
    }

    pub(crate) fn sum(&self, name: &str, want: &[(&str, &str)]) -> f64 {
        self.series(name)
            .iter()
            .filter(|(l, _)| {
                want.iter()
                    .all(|(k, v)| l.get(*k).map(String::as_str) == Some(v))
            })
            .map(|(_, v)| v)
            .sum()
    }

    fn has(&self, name: &str) -> bool {
        !self.series(name).is_empty()
    }
}

fn parse_labels(s: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut rest = s;
    while let Some((k, v)) = rest.split_once("=\"") {
        let end = v.find('"').expect("closing quote");
        out.insert(k.trim_start_matches(',').to_string(), v[..end].to_string());
        rest = &v[end + 1..];
    }
    out
}

#[test]
fn scraping_a_running_up_shows_the_traffic() {
    let _machine = crate::support::shared();
    let spec = preset_by_name("demo-small").unwrap();
    let (h, k) = (spec.hidden as usize, spec.top_k as f64);
    let dir = tempfile::tempdir().unwrap();
    let load_path = dir.path().join("live-load.json");
    let stderr_path = dir.path().join("up.stderr");
    let child = Command::new(env!("CARGO_BIN_EXE_expertmesh"))
        .current_dir(root())
        .arg("up")
        .arg("--topology")
        .arg(two_cpu_topology(
            &dir.path().join("single-host.toml"),
            "single-host",
            free_port(),
            free_port(),
            free_pair(),
        ))
        .args(["--model", "demo-small", "--mode", "exact"])
        .arg("--placement")
        .arg(root().join("examples/single-host-demo-small.placement.toml"))
        .args(["--metrics", "127.0.0.1:0", "--load-stats-every", "0.2"])
        .arg("--load-stats")
        .arg(&load_path)
        .env_remove("EXPERTMESH_LOG")
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&stderr_path).unwrap())
        .spawn()
        .unwrap();
    let mut up = Up(child);
    let started = read_banner(&mut up.0);
    assert!(started.load_file, "up says where the load file is");
    let router_url = started
        .metrics
        .get("router 0")
        .expect("router 0's metrics URL")
        .clone();
    let workers: Vec<(String, String)> = started
        .metrics
        .iter()
        .filter(|(w, _)| w.starts_with("worker "))
        .map(|(w, u)| (w.clone(), u.clone()))
        .collect();
    assert_eq!(
        workers.len(),
        2,
        "one endpoint per worker: {:?}",
        started.metrics
    );
    let mut ports: Vec<&str> = started.metrics.values().map(String::as_str).collect();
    ports.sort_unstable();
    ports.dedup();
    assert_eq!(
        ports.len(),
        3,
        "each process its own port: {:?}",
        started.metrics
    );

    // Traffic: known calls per layer, then one request of the wrong shape.
    let layers = spec.moe_layer_ids();
    let plan: Vec<(u32, usize, usize)> = vec![(layers[0], 3, 5), (layers[1], 2, 7)]; // (layer, calls, tokens)
    let rt = crate::support::rt();
    let cfg = expertmesh_transport::frontend::FrontendConfig::new("single-host");
    let mut c = rt
        .block_on(RouterClient::connect(started.frontend, &cfg))
        .unwrap();
    for &(layer, calls, tokens) in &plan {
        for i in 0..calls {
            let x = reference::synthetic_hidden(100 + i as u64, tokens, h);
            let y = rt.block_on(c.call(layer, &x, h, None, None)).unwrap();
            assert_eq!(y.len(), tokens * h);
        }
    }
    let bad = reference::synthetic_hidden(9, 2, h);
    let err = rt
        .block_on(c.call(layers[0], &bad, h / 2, None, None))
        .expect_err("a hidden size of h/2 is refused");
    let ClientError::Server { code, .. } = err else {
        panic!("refused by the router: {err}")
    };
    let code_label = expertmesh_router::metrics::code_label(code);

    // The router's series.
    let (status, text) = http_get(&router_url);
    assert!(status.contains(" 200 "), "{status}");
    let r = Scrape::parse(&text);
    let calls: usize = plan.iter().map(|p| p.1).sum();
    assert_eq!(
        r.sum("expertmesh_router_requests_total", &[]),
        calls as f64,
        "{text}"
    );
    assert_eq!(
        r.sum("expertmesh_router_responses_total", &[]),
        calls as f64
    );
    for &(layer, n, tokens) in &plan {
        let l = layer.to_string();
        let want_tokens = (n * tokens) as f64;
        assert_eq!(
            r.sum("expertmesh_router_requests_total", &[("layer", &l)]),
            n as f64
        );
        assert_eq!(
            r.sum("expertmesh_router_tokens_total", &[("layer", &l)]),
            want_tokens
        );
        assert_eq!(
            r.sum("expertmesh_router_expert_tokens_total", &[("layer", &l)]),
            want_tokens * k,
            "each token counts top_k = {k} experts on layer {l}"
        );
    }
    assert_eq!(
        r.series("expertmesh_router_errors_total"),
        vec![(
            BTreeMap::from([("code".to_string(), code_label.clone())]),
            1.0
        )],
        "exactly the one refusal, by its code"
    );
    assert_eq!(
        r.sum("expertmesh_router_request_duration_seconds_count", &[]),
        calls as f64
    );
    for stage in ["queue", "dispatch", "compute", "combine"] {
        assert!(
            r.sum(
                "expertmesh_router_stage_duration_seconds_count",
                &[("stage", stage)]
            ) >= 1.0,
            "stage {stage} timed:\n{text}"
        );
    }
    let routed: f64 = plan.iter().map(|p| (p.1 * p.2) as f64 * k).sum();
    assert!(r.sum("expertmesh_router_device_pairs_total", &[]) >= routed);
    for (l, v) in r.series("expertmesh_router_link_sent_bytes_total") {
        assert!(v > 0.0, "bytes sent to {l:?}");
    }
    for (l, v) in r.series("expertmesh_router_link_received_bytes_total") {
        assert!(v > 0.0, "bytes received from {l:?}");
    }
    assert_eq!(r.series("expertmesh_router_link_sent_bytes_total").len(), 2);
    assert_eq!(r.sum("expertmesh_router_worker_connected", &[]), 2.0);
    for name in [
        "expertmesh_router_hedges_total",
        "expertmesh_router_quarantines_total",
        "expertmesh_router_stale_results_total",
    ] {
        assert!(r.has(name), "{name} missing:\n{text}");
    }

    // Each worker's series: what it computed adds up to what the router sent it.
    let resent = r.sum("expertmesh_router_redispatches_total", &[]);
    let mut pairs_on_workers = 0.0;
    let mut all_text = text.clone();
    for (who, url) in &workers {
        let (status, text) = http_get(url);
        assert!(status.contains(" 200 "), "{who}: {status}");
        let w = Scrape::parse(&text);
        all_text.push_str(&text);
        let device = who.trim_start_matches("worker ").split(' ').next().unwrap();
        let pairs = w.sum("expertmesh_worker_pairs_total", &[("device", device)]);
        let sent = r.sum(
            "expertmesh_router_device_pairs_total",
            &[("device", device)],
        );
        // A re-sent part (a hedge on a slow machine) may still be computing on its first
        // device when the router is scraped: then the device has computed at most what it got.
        if resent == 0.0 {
            assert_eq!(
                pairs, sent,
                "{who}: pairs computed = pairs the router sent it"
            );
        } else {
            assert!(
                pairs <= sent && pairs > 0.0,
                "{who}: {pairs} pairs computed of {sent}"
            );
        }
        pairs_on_workers += pairs;
        assert!(
            w.sum("expertmesh_worker_dispatches_total", &[]) > 0.0,
            "{who}"
        );
        assert!(w.sum("expertmesh_worker_compute_duration_seconds_count", &[]) > 0.0);
        assert!(
            w.sum(
                "expertmesh_worker_link_sent_bytes_total",
                &[("peer", "router")]
            ) > 0.0
        );
        assert!(
            w.sum(
                "expertmesh_worker_link_received_bytes_total",
                &[("peer", "router")]
            ) > 0.0
        );
        assert_eq!(
            w.sum("expertmesh_worker_link_connected", &[("peer", "router")]),
            1.0
        );
        // Its start: the load took time and brought in its experts; no tile cache was set.
        assert!(w.sum("expertmesh_worker_load_duration_seconds", &[]) > 0.0);
        assert!(w.sum("expertmesh_worker_load_bytes", &[]) > 0.0);
        assert_eq!(
            w.sum("expertmesh_worker_tile_cache", &[("outcome", "unused")]),
            1.0
        );
        assert_eq!(w.sum("expertmesh_worker_tile_cache", &[]), 1.0);
    }
    if resent == 0.0 {
        assert_eq!(
            pairs_on_workers,
            r.sum("expertmesh_router_device_pairs_total", &[])
        );
    }

    // The Grafana dashboard is valid JSON whose every query uses series these endpoints serve.
    let dash: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root().join("grafana/expertmesh.json")).unwrap(),
    )
    .expect("grafana/expertmesh.json is valid JSON");
    let mut exprs = Vec::new();
    for p in dash["panels"].as_array().unwrap() {
        for t in p["targets"].as_array().into_iter().flatten() {
            exprs.push(t["expr"].as_str().unwrap().to_string());
        }
    }
    assert!(exprs.len() >= 10, "{} queries", exprs.len());
    for e in &exprs {
        for name in e.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
            if name.starts_with("expertmesh_") {
                assert!(
                    all_text.contains(&format!("\n{name}{{"))
                        || all_text.contains(&format!("\n{name} "))
                        || all_text.contains(&format!("# TYPE {name} ")),
                    "the dashboard queries {name}, which no endpoint serves"
                );
            }
        }
    }

    // The live load file, read with the planner's own parser: every token counts top_k.
    let t = Instant::now();
    let want: Vec<f64> = layers
        .iter()
        .map(|&l| {
            plan.iter()
                .filter(|p| p.0 == l)
                .map(|p| (p.1 * p.2) as f64 * k)
                .sum()
        })
        .collect();
    let got = loop {
        let s = expertmesh_planner::stats::LoadStats::load(&load_path, &spec)
            .unwrap_or_else(|e| panic!("the planner reads the live file: {e}"));
        let got: Vec<f64> = (0..layers.len())
            .map(|li| s.layer(li).map_or(0.0, |c| c.iter().sum()))
            .collect();
        if got == want || t.elapsed() > Duration::from_secs(20) {
            break got;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(got, want, "per-layer load = tokens x top_k");
    let out = Command::new(env!("CARGO_BIN_EXE_expertmesh"))
        .current_dir(root())
        .args(["plan", "--topology", "examples/single-host.toml"])
        .args(["--model", "demo-small", "--load"])
        .arg(&load_path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "plan --load reads the live file:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // Logs: the joins are there at the default level.
    drop(up);
    let log = std::fs::read_to_string(&stderr_path).unwrap();
    assert!(
        log.contains("INFO") && log.contains("worker connected") && log.contains("link=\"tcp\""),
        "the router logs each join with its link kind:\n{log}"
    );
}

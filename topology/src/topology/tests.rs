//! Unit tests of topology parsing and validation: each problem kind, all problems at once,
//! line:column, nearest-key suggestions, and the examples shipped in `examples/`.

use super::device_types::is_gfx_target;
use super::*;
use crate::diag::Problem;
use std::path::Path;

fn examples_dir() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples")
}

fn problems(text: &str) -> Vec<Problem> {
    match Topology::from_toml_str(text) {
        Ok(t) => panic!("expected problems, got a valid topology {}", t.name()),
        Err(p) => p,
    }
}

fn rendered(p: &[Problem]) -> String {
    p.iter()
        .map(|p| p.to_string())
        .collect::<Vec<_>>()
        .join("\n")
}

/// Line (1-based) of the first occurrence of `needle` in `text`.
fn line_of(text: &str, needle: &str) -> usize {
    let at = text
        .find(needle)
        .unwrap_or_else(|| panic!("{needle} not in text"));
    text[..at].matches('\n').count() + 1
}

const GOOD: &str = r#"
format = 1
name = "two-nodes"

[router]
node = "a"
port = 9000

[device_types.big]
kind = "gpu"
arch = "gfx942"
memory_total = "192 GB"
expert_memory = "160 GB"
memory_bandwidth_gb_s = 5300
int8_tops = 2614.9
bf16_tflops = 1307.4

[[nodes]]
name = "a"
address = "10.0.0.1"
control_port = 9100
data_port = 9200
intra_link = "xgmi"
intra_bandwidth_gb_s = 64
nics = [
  { name = "mlx5_0", kind = "roce", speed_gbit_s = 400, mtu = 9000, gid_ipv4 = "10.1.0.1", traffic_class = 106 },
  { name = "mlx5_1", kind = "roce", speed_gbit_s = 400, mtu = 9000, gid_index = 3 },
]
devices = [
  { name = "gpu0", type = "big", nic = "mlx5_0", numa = 0 },
  { name = "gpu1", type = "big", nic = "mlx5_1", numa = 1, data_port = 9300, expert_memory = "150 GiB" },
]

[[nodes]]
name = "b"
address = "host-b.example"
data_address = "10.1.0.2"
control_port = 9100
data_port = 9200
nics = [{ name = "eth0", kind = "tcp", speed_gbit_s = 100, mtu = 1500 }]
devices = [
  { name = "cpu0", kind = "cpu", arch = "cpu", threads = 8, expert_memory = 1073741824, memory_bandwidth_gb_s = 200, price_usd_per_hour = 0.1 },
]
"#;

#[test]
fn valid_file_gives_ids_ranks_ports_and_defaults() {
    let t = Topology::from_toml_str(GOOD).unwrap_or_else(|p| panic!("{}", rendered(&p)));
    assert_eq!(t.name(), "two-nodes");
    let ids: Vec<&str> = t.devices().iter().map(|d| d.id()).collect();
    assert_eq!(ids, ["a/gpu0", "a/gpu1", "b/cpu0"]);
    for (i, d) in t.devices().iter().enumerate() {
        assert_eq!(d.rank(), DeviceRank(i as u32));
        assert_eq!(t.device(d.rank()), Some(d));
        assert_eq!(t.device_by_id(d.id()), Some(d));
    }
    let g0 = &t.devices()[0];
    let g1 = &t.devices()[1];
    let c0 = &t.devices()[2];
    // type fields flow through; the device's own expert_memory wins
    assert_eq!(g0.expert_memory_bytes(), 160_000_000_000);
    assert_eq!(g1.expert_memory_bytes(), 150 << 30);
    assert_eq!(g0.memory_total_bytes(), Some(192_000_000_000));
    assert_eq!(g0.type_name(), Some("big"));
    assert_eq!(g0.int8_tops(), Some(2614.9));
    // ports: data_port + index, or the device's own
    assert_eq!(g0.data_port(), 9200);
    assert_eq!(g1.data_port(), 9300);
    assert_eq!(c0.data_port(), 9200);
    // gpu_index defaults to order among the node's gpus; cpu has none
    assert_eq!(
        (g0.gpu_index(), g1.gpu_index(), c0.gpu_index()),
        (Some(0), Some(1), None)
    );
    assert_eq!(c0.threads(), Some(8));
    assert_eq!(c0.expert_memory_bytes(), 1 << 30);
    // NIC choice: explicit, or the only NIC
    assert_eq!(t.nic_of(g1).name(), "mlx5_1");
    assert_eq!(t.nic_of(g1).gid(), GidSelection::Index(3));
    assert_eq!(
        t.nic_of(g0).gid(),
        GidSelection::Ipv4("10.1.0.1".parse().unwrap())
    );
    assert_eq!(t.nic_of(g0).traffic_class(), Some(106));
    assert_eq!(t.nic_of(c0).name(), "eth0");
    assert_eq!(t.nic_of(c0).rdma_path_mtu(), None);
    assert_eq!(t.nic_of(g0).rdma_path_mtu(), Some(4096));
    // addresses and endpoints
    let b = &t.nodes()[1];
    assert_eq!(b.data_address(), "10.1.0.2");
    assert_eq!(t.data_endpoint(c0), "10.1.0.2:9200");
    assert_eq!(t.nodes()[0].data_address(), "10.0.0.1");
    assert_eq!(t.router().unwrap().listen_endpoint(), "10.0.0.1:9000");
    assert_eq!(b.intra_link(), None);
    assert_eq!(
        t.nodes()[0].intra_link().unwrap().kind(),
        IntraLinkKind::Xgmi
    );
    let ranks: Vec<DeviceRank> = t.nodes()[0].device_ranks().collect();
    assert_eq!(ranks, [DeviceRank(0), DeviceRank(1)]);
    assert_eq!(
        t.total_expert_memory(),
        160_000_000_000 + (150u64 << 30) + (1 << 30)
    );
}

#[test]
fn every_problem_is_reported_in_one_run() {
    let text = r#"format = 1
name = "broken"

[[nodes]]
name = "a"
adress = "10.0.0.1"
control_port = 70000
data_port = 9200
intra_bandwith_gb_s = 64
nics = [
  { name = "eth0", kind = "tcp", speed_gbit_s = 100, mtu = 1500, gid_index = 2 },
  { name = "mlx5_0", kind = "rocee", speed_gbit_s = 400, mtu = 9000 },
  { name = "mlx5_1", kind = "roce", speed_gbit_s = 400, mtu = 9000, gid_index = 1, gid_ipv4 = "10.0.0.9" },
]
devices = [
  { name = "gpu0", kind = "gpu", arch = "gfx942", expert_memory = "200 GB", memory_total = "192 GB", memory_bandwidth_gb_s = 5300, int8_tops = 1, bf16_tflops = 1, nic = "mlx5_9", threads = 4 },
  { name = "gpu1", kind = "gpu", arch = "cpu", expert_memory = "12 GiBs", memory_bandwidth_gb_s = -1, nic = "eth0" },
  { name = "cpu0", kind = "cpu", arch = "cpu", expert_memory = "1 GB", memory_bandwidth_gb_s = 10, nic = "eth0" },
]

[[nodes]]
name = "a"
address = "bad_host!"
control_port = 9100
devices = [{ name = "x/y", kind = "cpu", arch = "cpu", threads = 1, expert_memory = "1 GB", memory_bandwidth_gb_s = 10 }]
"#;
    let p = problems(text);
    let all = rendered(&p);
    let expect = [
        // unknown keys, with suggestions and positions
        (
            line_of(text, "adress"),
            "node \"a\": unknown key \"adress\"; did you mean \"address\"?",
        ),
        (
            line_of(text, "intra_bandwith"),
            "node \"a\": unknown key \"intra_bandwith_gb_s\"; did you mean \"intra_bandwidth_gb_s\"?",
        ),
        // missing and out-of-range node keys
        (
            line_of(text, "control_port = 70000"),
            "control_port = 70000 is out of range; use 1 to 65535",
        ),
        (line_of(text, "[[nodes]]"), "node \"a\": missing `address`"),
        // NICs
        (
            line_of(text, "gid_index = 2"),
            "node \"a\" NIC \"eth0\": gid_index only applies to kind = \"roce\"",
        ),
        (
            line_of(text, "rocee"),
            "node \"a\" NIC \"mlx5_0\": kind \"rocee\" is not one of \"roce\", \"tcp\"; did you mean \"roce\"?",
        ),
        (
            line_of(text, "gid_index = 1"),
            "node \"a\" NIC \"mlx5_1\": set either gid_ipv4 or gid_index, not both",
        ),
        // devices
        (
            line_of(text, "mlx5_9"),
            "node \"a\" device \"gpu0\": expert_memory 200.00 GB exceeds memory_total 192.00 GB",
        ),
        (
            line_of(text, "mlx5_9"),
            "node \"a\" device \"gpu0\": unknown NIC \"mlx5_9\"; did you mean \"mlx5_0\"?",
        ),
        (
            line_of(text, "mlx5_9"),
            "node \"a\" device \"gpu0\": threads only applies to cpu devices",
        ),
        (
            line_of(text, "GiBs"),
            "node \"a\" device \"gpu1\": expert_memory: unknown unit \"GiBs\"",
        ),
        (
            line_of(text, "GiBs"),
            "node \"a\" device \"gpu1\": memory_bandwidth_gb_s = -1 must be a positive number",
        ),
        (
            line_of(text, "GiBs"),
            "node \"a\" device \"gpu1\": a gpu device needs a gfx arch",
        ),
        (
            line_of(text, "GiBs"),
            "node \"a\" device \"gpu1\": missing `int8_tops`",
        ),
        (
            line_of(text, "\"cpu0\""),
            "node \"a\" device \"cpu0\": missing `threads`",
        ),
        // second node
        (
            line_of(text, "bad_host") - 1,
            "node \"a\": node name \"a\" is already used by node #1",
        ),
        (
            line_of(text, "bad_host"),
            "address \"bad_host!\" is neither an IP address nor a valid hostname",
        ),
        (line_of(text, "x/y"), "device name \"x/y\" contains '/'"),
    ];
    for (line, needle) in expect {
        let hit = p.iter().find(|q| q.to_string().contains(needle));
        let hit = hit.unwrap_or_else(|| panic!("missing {needle:?} in\n{all}"));
        assert_eq!(
            hit.location().map(|l| l.line()),
            Some(line),
            "{needle:?} at the wrong line in\n{all}"
        );
    }
    // second node has no NICs, no data port for its device
    assert!(all.contains("node \"a\": no NICs"), "{all}");
    assert!(all.contains("no data port"), "{all}");
    // the node has several devices but its intra link is missing (the typo)
    assert!(all.contains("missing `intra_bandwidth_gb_s`"), "{all}");
}

#[test]
fn several_typos_across_the_file_are_all_suggested() {
    let text = GOOD
        .replace("port = 9000", "prot = 9000")
        .replace("int8_tops = 2614.9", "int8_top = 2614.9")
        .replace("traffic_class = 106", "trafic_class = 106")
        .replace("numa = 1,", "numa_node = 1,");
    let p = problems(&text);
    let all = rendered(&p);
    for (item, typo, fix) in [
        ("[router]", "prot", "port"),
        ("device type \"big\"", "int8_top", "int8_tops"),
        ("node \"a\" NIC \"mlx5_0\"", "trafic_class", "traffic_class"),
        ("node \"a\" device \"gpu1\"", "numa_node", "numa"),
    ] {
        let line = format!("{item}: unknown key \"{typo}\"; did you mean \"{fix}\"?");
        assert!(all.contains(&line), "missing {line:?} in\n{all}");
        let hit = p.iter().find(|q| q.to_string().contains(&line)).unwrap();
        assert_eq!(hit.location().unwrap().line(), line_of(&text, typo));
    }
    // the typo'd router port is also missing; the typo'd int8_tops makes it missing on devices
    assert!(all.contains("[router]: missing `port`"), "{all}");
    assert!(all.contains("missing `int8_tops`"), "{all}");
}

#[test]
fn unknown_key_without_a_close_match_lists_the_valid_keys() {
    let text = GOOD.replace("name = \"two-nodes\"", "name = \"two-nodes\"\nzzzzzz = 1");
    let all = rendered(&problems(&text));
    assert!(
        all.contains("4:1: top level: unknown key \"zzzzzz\"; valid keys here: format, name,"),
        "{all}"
    );
}

#[test]
fn type_errors_carry_line_column_and_item() {
    let text = GOOD.replace(
        "control_port = 9100\ndata_port = 9200\nintra_link",
        "control_port = \"9100\"\ndata_port = 9200\nintra_link",
    );
    let p = problems(&text);
    assert_eq!(p.len(), 1, "{}", rendered(&p));
    let loc = p[0].location().unwrap();
    assert_eq!(loc.line(), line_of(&text, "control_port = \"9100\""));
    assert_eq!(loc.column(), "control_port = ".len() + 1);
    assert_eq!(p[0].item(), "node \"a\"");
    assert!(
        p[0].message()
            .starts_with("`control_port`: wrong type: string \"9100\", expected an integer"),
        "{}",
        p[0]
    );
}

#[test]
fn syntax_errors_carry_line_and_column() {
    let text = GOOD.replace("kind = \"gpu\"", "kind = \"gpu");
    let p = problems(&text);
    assert_eq!(p.len(), 1, "{}", rendered(&p));
    assert_eq!(
        p[0].location().unwrap().line(),
        line_of(&text, "kind = \"gpu")
    );
    assert!(p[0].message().starts_with("TOML syntax error"), "{}", p[0]);
}

/// A topology written as JSON is told so (the files are TOML), not given a TOML syntax error
/// at its first brace; a TOML file with a table header and an error stays a syntax error.
#[test]
fn a_json_file_is_told_the_files_are_toml() {
    for json in [
        "{\"format\": 1, \"name\": \"x\"}",
        "\u{feff}  [ {\"kind\": \"gpu\"} ]",
        "[]",
    ] {
        let p = problems(json);
        assert_eq!(p.len(), 1, "{}", rendered(&p));
        assert!(
            p[0].message().contains("looks like JSON") && p[0].message().contains("TOML"),
            "{json}: {}",
            p[0]
        );
    }
    let p = problems("[[devices]]\nkind = \"gpu");
    assert!(p[0].message().starts_with("TOML syntax error"), "{}", p[0]);
}

#[test]
fn format_and_name_are_required() {
    let text = GOOD.replace("format = 1\nname = \"two-nodes\"\n", "");
    let all = rendered(&problems(&text));
    assert!(all.contains("missing `format`; add `format = 1`"), "{all}");
    assert!(all.contains("missing `name`"), "{all}");
    let text = GOOD.replace("format = 1", "format = 2");
    let all = rendered(&problems(&text));
    assert!(all.contains("3:1") || all.contains("2:10"), "{all}");
    assert!(
        all.contains("unsupported format 2; this build reads topology format 1"),
        "{all}"
    );
}

#[test]
fn unknown_device_type_is_suggested_and_not_cascaded() {
    let text = GOOD.replace(
        "type = \"big\", nic = \"mlx5_0\"",
        "type = \"bgi\", nic = \"mlx5_0\"",
    );
    let p = problems(&text);
    assert_eq!(p.len(), 1, "{}", rendered(&p));
    assert!(
        p[0].to_string().contains(
            "node \"a\" device \"gpu0\": unknown device type \"bgi\"; did you mean \"big\"?"
        ),
        "{}",
        p[0]
    );
}

#[test]
fn port_collisions_on_one_machine_are_reported() {
    // gpu1's own port collides with the control port; the router port with gpu0's data port.
    let text = GOOD
        .replace("data_port = 9300", "data_port = 9100")
        .replace("port = 9000", "port = 9200");
    let all = rendered(&problems(&text));
    assert!(
        all.contains("device \"a/gpu1\" data port uses port 9100 on 10.0.0.1, which node \"a\" control_port already uses"),
        "{all}"
    );
    assert!(
        all.contains("the router port uses port 9200 on 10.0.0.1, which device \"a/gpu0\" data port already uses"),
        "{all}"
    );
    // Nodes on different addresses may reuse ports (GOOD already does: both use 9100/9200).
    assert!(Topology::from_toml_str(GOOD).is_ok());
}

#[test]
fn data_port_overflow_and_missing_nic_choice() {
    let text = GOOD
        .replace(
            "data_port = 9200\nintra_link",
            "data_port = 65535\nintra_link",
        )
        .replace("nic = \"mlx5_1\", ", "")
        .replace("data_port = 9300, ", "");
    let all = rendered(&problems(&text));
    assert!(
        all.contains("data_port 65535 + device index 1 = 65536 exceeds 65535"),
        "{all}"
    );
    assert!(
        all.contains(
            "node \"a\" device \"gpu1\": missing `nic`; this node has 2 NICs (mlx5_0, mlx5_1)"
        ),
        "{all}"
    );
}

#[test]
fn router_must_name_a_node() {
    let text = GOOD.replace("node = \"a\"\nport", "node = \"aa\"\nport");
    let all = rendered(&problems(&text));
    assert!(
        all.contains("[router]: unknown node \"aa\"; did you mean \"a\"?"),
        "{all}"
    );
}

#[test]
fn hostnames_and_addresses() {
    for ok in [
        "127.0.0.1",
        "::1",
        "fe80::1",
        "node-0",
        "a.b.example",
        "localhost",
    ] {
        assert!(is_valid_host(ok), "{ok}");
    }
    for bad in ["", "bad_host", "-a", "a-", "a..b", "300.1.1.1", "1.2.3"] {
        assert!(!is_valid_host(bad), "{bad}");
    }
}

#[test]
fn gfx_targets() {
    for ok in ["gfx90a", "gfx942", "gfx1100", "gfx950", "gfx1201"] {
        assert!(is_gfx_target(ok), "{ok}");
    }
    for bad in ["gfx", "gfx9", "GFX942", "gfx94z", "sm90"] {
        assert!(!is_gfx_target(bad), "{bad}");
    }
}

#[test]
fn shipped_examples_are_valid_and_have_the_documented_shape() {
    let t = Topology::load(&examples_dir().join("single-host.toml")).unwrap();
    assert_eq!(t.devices().len(), 2);
    assert!(
        t.devices()
            .iter()
            .all(|d| d.kind() == DeviceKind::Cpu && d.threads() == Some(1))
    );
    assert_eq!(t.nodes()[0].address(), "127.0.0.1");
    assert_eq!(t.nic_of(&t.devices()[0]).kind(), NicKind::Tcp);

    let t = Topology::load(&examples_dir().join("mi300x-4x8.toml")).unwrap();
    assert_eq!((t.nodes().len(), t.devices().len()), (4, 32));
    let d = t.device(DeviceRank(8)).unwrap();
    assert_eq!(d.id(), "node1/gpu0");
    assert_eq!(t.nic_of(d).speed_gbit_s(), 400.0);
    assert_eq!(t.nic_of(d).kind(), NicKind::Roce);
    assert_eq!(d.arch(), "gfx942");
    assert_eq!(d.memory_bandwidth_gb_s(), 5300.0);

    let t = Topology::load(&examples_dir().join("rx7900xtx-8x4.toml")).unwrap();
    assert_eq!((t.nodes().len(), t.devices().len()), (8, 32));
    assert_eq!(t.devices()[0].expert_memory_bytes(), 21 << 30);
    assert_eq!(t.nic_of(&t.devices()[0]).speed_gbit_s(), 100.0);

    let t = Topology::load(&examples_dir().join("mi210-4x4.toml")).unwrap();
    assert_eq!(t.devices().len(), 16);
    assert!(t.devices().iter().all(|d| d.arch() == "gfx90a"));
}

#[test]
fn missing_file_is_an_io_error() {
    let e = Topology::load(Path::new("/nonexistent/topology.toml")).unwrap_err();
    assert!(e.is_io());
    assert!(
        e.to_string()
            .contains("cannot read /nonexistent/topology.toml"),
        "{e}"
    );
}

#[test]
fn single_bracket_tables_get_a_double_bracket_hint() {
    let p = problems("format = 1\nname = \"x\"\n[nodes]\nname = \"a\"\n");
    assert_eq!(p.len(), 1);
    assert_eq!(
        p[0].to_string(),
        "3:1: top level: `nodes`: wrong type: a table, expected an array of tables; write [[nodes]] \
         for each entry (double brackets), or nodes = [ {...}, {...} ]"
    );
    let p = problems("format = 1\nname = \"x\"\nnodes = [1]\n");
    assert_eq!(
        p[0].to_string(),
        "3:10: top level: `nodes`: wrong type: integer `1`, expected a table"
    );
}

#[test]
fn non_utf8_file_is_invalid_not_io() {
    let dir = std::env::temp_dir().join(format!("em-topo-utf8-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("t.toml");
    std::fs::write(&path, b"format = 1\nname = \"\xff\"\n").unwrap();
    let e = Topology::load(&path).unwrap_err();
    assert!(!e.is_io());
    assert_eq!(e.problems().len(), 1);
    assert_eq!(e.problems()[0].location().unwrap().to_string(), "2:9");
    std::fs::remove_dir_all(&dir).unwrap();
}

const TWO_ROUTERS: &str =
    "[[router]]\nnode = \"a\"\nport = 9000\n\n[[router]]\nnode = \"b\"\nport = 9000\n";

#[test]
fn several_routers_each_get_ports_and_mesh_ports() {
    let text = GOOD.replace("[router]\nnode = \"a\"\nport = 9000\n", TWO_ROUTERS);
    let t = Topology::from_toml_str(&text).unwrap_or_else(|p| panic!("{}", rendered(&p)));
    let r = t.routers();
    assert_eq!(r.len(), 2);
    assert_eq!((r[0].node_index(), r[1].node_index()), (0, 1));
    // the mesh listener defaults to the node's control port
    assert_eq!((r[0].mesh_port(), r[1].mesh_port()), (9100, 9100));
    assert_eq!(t.router(), Some(&r[0]));
    // a single [[router]] is the same as [router]
    let one = GOOD.replace("[router]\n", "[[router]]\n");
    let t1 = Topology::from_toml_str(&one).unwrap_or_else(|p| panic!("{}", rendered(&p)));
    assert_eq!(t1.routers().len(), 1);
    assert_eq!(t1.router().unwrap().mesh_port(), 9100);
}

#[test]
fn two_routers_on_one_node_need_their_own_mesh_port() {
    let two_on_a = TWO_ROUTERS.replace("node = \"b\"\nport = 9000", "node = \"a\"\nport = 9001");
    let text = GOOD.replace("[router]\nnode = \"a\"\nport = 9000\n", &two_on_a);
    let all = rendered(&problems(&text));
    assert!(
        all.contains("router 2: router 1 already listens for workers on node \"a\"'s control_port 9100; give this router its own `mesh_port`"),
        "{all}"
    );
    // with its own mesh port it is valid; one colliding with a data port is refused
    let fixed = two_on_a.replace("port = 9001", "port = 9001\nmesh_port = 9101");
    let text = GOOD.replace("[router]\nnode = \"a\"\nport = 9000\n", &fixed);
    let t = Topology::from_toml_str(&text).unwrap_or_else(|p| panic!("{}", rendered(&p)));
    assert_eq!(t.routers()[1].mesh_port(), 9101);
    let clash = two_on_a.replace("port = 9001", "port = 9001\nmesh_port = 9200");
    let text = GOOD.replace("[router]\nnode = \"a\"\nport = 9000\n", &clash);
    let all = rendered(&problems(&text));
    assert!(
        all.contains("the router 2 mesh_port uses port 9200 on 10.0.0.1"),
        "{all}"
    );
}

#[test]
fn router_array_entries_are_checked_one_by_one() {
    let bad = TWO_ROUTERS.replace("node = \"b\"\nport = 9000", "node = \"bb\"\nprot = 9000");
    let text = GOOD.replace("[router]\nnode = \"a\"\nport = 9000\n", &bad);
    let all = rendered(&problems(&text));
    assert!(all.contains("unknown node \"bb\""), "{all}");
    assert!(all.contains("router 2: missing `port`"), "{all}");
    assert!(all.contains("unknown key \"prot\""), "{all}");
}

/// Names become file and folder names (deploy bundles): "..", "." and other names starting
/// with a dot are refused.
#[test]
fn names_starting_with_a_dot_are_refused() {
    let text = include_str!("../../../examples/single-host.toml");
    for bad in ["..", ".", ".hidden"] {
        let edited = text.replace("name = \"local\"", &format!("name = \"{bad}\""));
        let problems = Topology::from_toml_str(&edited).unwrap_err();
        let all: Vec<String> = problems.iter().map(ToString::to_string).collect();
        assert!(
            all.iter()
                .any(|p| p.contains(&format!("node name \"{bad}\" starts with '.'"))),
            "{bad}: {all:?}"
        );
    }
}

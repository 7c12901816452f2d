//! Unit tests of the protocol core: handshake and authentication outcomes, link setup, credits
//! and heartbeats, driven by shuttling frames between two [`Connection`]s.

use super::*;
use crate::codec::{Body, CLIENT_RANK, CodecConfig, Credit, ErrorCode, Heartbeat, Hello};
use crate::codec::{ExpertResult, OutputLayout};
use crate::crypto::{self, Credentials, Key};
use crate::dtype::OutputDtype;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[test]
fn every_link_kind_parses_from_its_name() {
    for k in LinkKind::ALL {
        assert_eq!(k.name().parse::<LinkKind>(), Ok(k));
        assert_eq!(k.to_string().to_uppercase().parse::<LinkKind>(), Ok(k));
    }
    let err = "ib".parse::<LinkKind>().unwrap_err();
    assert!(err.to_string().contains("tcp, shm or rdma"), "{err}");
}

fn cfg(rank: u32, secret: Option<&[u8]>) -> Arc<ProtocolConfig> {
    let mut c = ProtocolConfig::new("test", rank, 4);
    c.credentials = secret.map(|s| Arc::new(Credentials::shared_secret(s)));
    c.recv_window_bytes = 1 << 20;
    c.codec.max_frame_bytes = 256 << 10;
    c.validate().unwrap();
    Arc::new(c)
}

/// Shuttles protocol frames between two ends until both are quiet.
fn pump(a: &mut Connection, b: &mut Connection, now: Instant) -> Result<(), ProtocolError> {
    loop {
        let mut moved = false;
        while let Some(f) = a.poll_transmit() {
            moved = true;
            b.handle_frame(now, &f, 64)?;
        }
        while let Some(f) = b.poll_transmit() {
            moved = true;
            a.handle_frame(now, &f, 64)?;
        }
        if !moved {
            return Ok(());
        }
    }
}

fn pair(
    sa: Option<&[u8]>,
    sb: Option<&[u8]>,
) -> (Connection, Connection, Result<(), ProtocolError>) {
    pair_at(sa, sb, Instant::now())
}

/// [`pair`] set up at `now` (the timer tests' clock starts there).
fn pair_at(
    sa: Option<&[u8]>,
    sb: Option<&[u8]>,
    now: Instant,
) -> (Connection, Connection, Result<(), ProtocolError>) {
    let mut a = Connection::new(cfg(0, sa), Some(1), [1; 32], vec![], now);
    let mut b = Connection::new(cfg(1, sb), None, [2; 32], vec![7], now);
    let r = pump(&mut a, &mut b, now);
    (a, b, r)
}

#[test]
fn handshake_with_matching_secret_establishes() {
    let (mut a, mut b, r) = pair(Some(b"s3cret"), Some(b"s3cret"));
    r.unwrap();
    assert!(a.is_established() && b.is_established());
    assert_eq!(
        a.poll_event().unwrap(),
        Event::Established(PeerInfo {
            rank: 1,
            recv_window_bytes: 1 << 20,
            attachment: vec![7],
            incarnation: 0,
            identity: String::new(),
        })
    );
    assert!(matches!(b.poll_event(), Some(Event::Established(p)) if p.rank == 0));
    assert_eq!(a.send_credit(), 1 << 20);
}

/// Ends whose fingerprint tables say what every rank serves: rank `r` announces
/// `[r + own_offset; 32]`, and each end expects `[r; 32]` of rank `r`.
fn fingerprinted(rank: u32, own_offset: u8, incarnation: u64) -> Arc<ProtocolConfig> {
    let mut c = (*cfg(rank, Some(b"s"))).clone();
    c.fingerprint = [rank as u8 + own_offset; 32];
    c.incarnation = incarnation;
    c.peer_fingerprints = Some((0..4u8).map(|r| [r; 32]).collect());
    Arc::new(c)
}

#[test]
fn matching_fingerprints_establish_and_carry_the_incarnation() {
    let now = Instant::now();
    let mut a = Connection::new(fingerprinted(0, 0, 11), Some(1), [1; 32], vec![], now);
    let mut b = Connection::new(fingerprinted(1, 0, 22), None, [2; 32], vec![], now);
    pump(&mut a, &mut b, now).unwrap();
    assert!(matches!(a.poll_event(), Some(Event::Established(p)) if p.incarnation == 22));
    assert!(matches!(b.poll_event(), Some(Event::Established(p)) if p.incarnation == 11));
}

#[test]
fn a_rank_serving_other_weights_is_refused_on_both_sides() {
    let now = Instant::now();
    // Rank 1 announces [2; 32] where everyone expects [1; 32] (another seed or placement).
    let mut a = Connection::new(fingerprinted(0, 0, 1), Some(1), [1; 32], vec![], now);
    let mut b = Connection::new(fingerprinted(1, 1, 2), None, [2; 32], vec![], now);
    let r = pump(&mut a, &mut b, now);
    assert!(r.is_err(), "a mismatched rank must not establish");
    assert!(!a.is_established() && !b.is_established());
    let ea = a.close_reason().expect("rank 0 closed").to_string();
    assert!(ea.contains("rank 1 serves other weights"), "{ea}");
    assert!(ea.contains("020202") && ea.contains("010101"), "{ea}");
    // The refused side learns why from the refusal frame rank 0 queued.
    let refusal = a.poll_transmit().expect("a refusal frame");
    let Body::Error(e) = &refusal else {
        panic!("expected an error frame, got {refusal:?}")
    };
    b.handle_frame(now, &refusal, 0).ok();
    let eb = b.close_reason().expect("rank 1 closed").to_string();
    assert!(eb.contains("serves other weights"), "{eb} / {}", e.message);
}

#[test]
fn wrong_secret_is_refused_on_both_sides() {
    let (a, b, r) = pair(Some(b"one"), Some(b"two"));
    assert!(
        matches!(
            r,
            Err(ProtocolError::AuthFailed(_))
                | Err(ProtocolError::Refused {
                    code: ErrorCode::AuthFailed,
                    ..
                })
        ),
        "{r:?}"
    );
    assert!(!a.is_established() || !b.is_established());
    let reasons = [a.close_reason(), b.close_reason()];
    assert!(
        reasons
            .iter()
            .flatten()
            .any(|e| matches!(e, ProtocolError::AuthFailed(m) if m.contains("wrong MAC"))),
        "{reasons:?}"
    );
}

#[test]
fn missing_secret_is_refused() {
    let (_a, b, r) = pair(None, Some(b"two"));
    assert!(r.is_err());
    assert!(!b.is_established());
}

/// An application frame (a result with no rows) for the credit tests.
fn empty_result() -> Body {
    Body::Result(ExpertResult {
        batch_id: 1,
        layer: 0,
        part: 0,
        layout: OutputLayout::PerSlot,
        rows: 0,
        hidden: 0,
        dtype: OutputDtype::F32,
    })
}

#[test]
fn credit_window_bounds_sends_and_is_returned() {
    let (mut a, mut b, r) = pair(None, None);
    r.unwrap();
    let now = Instant::now();
    let frame = 100 << 10;
    let body = empty_result();
    let mut sent = 0;
    while a.try_reserve(frame).unwrap() {
        assert_eq!(
            b.handle_frame(now, &body, frame).unwrap(),
            Disposition::Deliver
        );
        sent += 1;
    }
    assert_eq!(
        sent,
        (1 << 20) / frame,
        "window admits exactly floor(W / len) frames"
    );
    assert_eq!(b.recv_outstanding(), sent * frame);
    // A frame beyond the window is a violation.
    let err = b.handle_frame(now, &body, frame).unwrap_err();
    assert!(matches!(err, ProtocolError::CreditViolation { .. }));
    // Fresh pair: releasing returns credit.
    let (mut a, mut b, _) = pair(None, None);
    while a.try_reserve(frame).unwrap() {
        b.handle_frame(now, &body, frame).unwrap();
    }
    for _ in 0..3 {
        b.release(frame);
    }
    let credit = b.poll_transmit().expect("credit after W/4 released");
    a.handle_frame(now, &credit, 64).unwrap();
    assert!(a.try_reserve(frame).unwrap());
}

/// A ring-capped window (shared memory, RDMA) can be barely larger than the largest frame; a
/// receiver that has released everything must then have returned enough credit for it, however
/// small the frames before were (W/4 alone would hold back up to a quarter of the window).
#[test]
fn a_drained_receiver_never_leaves_its_peer_short_of_its_largest_frame() {
    let max_frame = 64 << 10;
    let max_cost = (crate::codec::PAYLOAD_ALIGN + max_frame) as u64;
    let config = |rank| {
        let mut c = ProtocolConfig::new("test", rank, 4);
        c.codec.max_frame_bytes = max_frame;
        c.recv_window_bytes = max_cost + 64;
        Arc::new(c)
    };
    let now = Instant::now();
    let mut a = Connection::new(config(0), Some(1), [1; 32], vec![], now);
    let mut b = Connection::new(config(1), None, [2; 32], vec![7], now);
    pump(&mut a, &mut b, now).unwrap();
    let body = empty_result();
    for (i, cost) in [1024u64, 15488, 4096, 640, 15488, 15488, 64]
        .into_iter()
        .enumerate()
    {
        assert!(a.try_reserve(cost).unwrap(), "frame {i} fits");
        b.handle_frame(now, &body, cost).unwrap();
        b.release(cost);
        while let Some(f) = b.poll_transmit() {
            a.handle_frame(now, &f, 64).unwrap();
        }
        assert!(
            a.send_credit() >= max_cost,
            "after frame {i} the largest frame ({max_cost}) fits in the credit ({})",
            a.send_credit()
        );
    }
}

/// Drives `c`'s timers as a driver does (woken at its deadline, at most every `step`) from
/// `from` to `to`, handing every heartbeat over; returns the heartbeats sent.
fn tick(c: &mut Connection, from: Instant, to: Instant, step: Duration) -> usize {
    let mut heartbeats = 0;
    let mut now = from;
    loop {
        let due = c.poll_timeout().unwrap_or(to);
        now = due
            .clamp(now + Duration::from_millis(1), now + step)
            .min(to);
        c.handle_timeout(now);
        while let Some(b) = c.poll_transmit() {
            heartbeats += usize::from(matches!(b, Body::Heartbeat(_)));
            c.on_transmit(now);
        }
        if now >= to || c.close_reason().is_some() {
            return heartbeats;
        }
    }
}

#[test]
fn heartbeats_and_idle_timeout() {
    let t0 = Instant::now();
    let (mut a, _b, r) = pair_at(None, None, t0);
    r.unwrap();
    // Silence from the peer: a heartbeat every second (1 s interval), closed at 10 s.
    let sent = closes_idle_between(&mut a, t0, Duration::from_secs(10));
    assert!((9..=10).contains(&sent), "{sent} heartbeats in 9.9 s");
}

/// Drives `c` from `from` as a driver does: still open 100 ms before `from + after`, closed
/// for idleness 100 ms after it. Returns the heartbeats sent.
fn closes_idle_between(c: &mut Connection, from: Instant, after: Duration) -> usize {
    let margin = Duration::from_millis(100);
    let sent = tick(c, from, from + after - margin, Duration::from_millis(250));
    assert!(c.close_reason().is_none(), "open {margin:?} before");
    tick(
        c,
        from + after - margin,
        from + after + margin,
        Duration::from_millis(50),
    );
    assert!(
        matches!(c.close_reason(), Some(ProtocolError::IdleTimeout(_))),
        "closed for idleness {margin:?} after"
    );
    sent
}

/// An end whose timers did not run for longer than the idle timeout (its process stalled)
/// does not close at once: frames the peer sent meanwhile are still to be read. It closes one
/// heartbeat interval later only if nothing arrives.
#[test]
fn a_stalled_end_reads_before_it_judges_the_peer_idle() {
    let t0 = Instant::now();
    let (mut a, mut b, r) = pair_at(None, None, t0);
    r.unwrap();
    tick(
        &mut a,
        t0,
        t0 + Duration::from_millis(500),
        Duration::from_millis(250),
    );
    // Stalled from 0.5 s to 15 s; the peer's heartbeat (sent at 1 s) is read right after.
    let woke = t0 + Duration::from_secs(15);
    a.handle_timeout(woke);
    assert!(
        a.close_reason().is_none(),
        "not closed by a stall of its own"
    );
    b.handle_timeout(t0 + Duration::from_secs(1));
    let hb = std::iter::from_fn(|| b.poll_transmit())
        .find(|f| matches!(f, Body::Heartbeat(_)))
        .expect("the peer's heartbeat");
    a.handle_frame(woke + Duration::from_millis(1), &hb, 64)
        .unwrap();
    tick(
        &mut a,
        woke,
        woke + Duration::from_secs(9),
        Duration::from_millis(250),
    );
    assert!(
        a.close_reason().is_none(),
        "the peer was heard after the stall"
    );
    // Another stall, and this time the peer stays silent: closed one interval later.
    let woke = woke + Duration::from_secs(30);
    a.handle_timeout(woke);
    assert!(a.close_reason().is_none());
    closes_idle_between(&mut a, woke, Duration::from_secs(1));
}

/// The stall's grace is given once per frame heard: a host starved stall after stall, with
/// nothing read in between, still closes a link whose peer is silent.
#[test]
fn stall_after_stall_without_a_frame_still_closes() {
    let t0 = Instant::now();
    let (mut a, _b, r) = pair_at(None, None, t0);
    r.unwrap();
    a.handle_timeout(t0 + Duration::from_millis(500));
    a.handle_timeout(t0 + Duration::from_secs(15));
    assert!(
        a.close_reason().is_none(),
        "the first stall is given its grace"
    );
    // Stalled again (3 s, past two heartbeat intervals) and still nothing from the peer.
    a.handle_timeout(t0 + Duration::from_secs(18));
    assert!(
        matches!(a.close_reason(), Some(ProtocolError::IdleTimeout(_))),
        "no second grace without a frame"
    );
}

#[test]
fn world_size_mismatch_is_refused() {
    let now = Instant::now();
    let mut a = Connection::new(cfg(0, None), Some(1), [1; 32], vec![], now);
    let mut other = ProtocolConfig::new("test", 1, 5);
    other.recv_window_bytes = 1 << 20;
    other.codec.max_frame_bytes = 256 << 10;
    let mut b = Connection::new(Arc::new(other), None, [2; 32], vec![], now);
    let r = pump(&mut a, &mut b, now);
    assert!(
        matches!(r, Err(ProtocolError::Config(ref m)) if m.contains("ranks")),
        "{r:?}"
    );
}

/// Handshakes two ends whose hellos carry `att_a` and `att_b`.
fn pair_with(att_a: &[u8], att_b: &[u8], now: Instant) -> (Connection, Connection) {
    let mut a = Connection::new(cfg(0, Some(b"k")), Some(1), [1; 32], att_a.to_vec(), now);
    let mut b = Connection::new(cfg(1, Some(b"k")), None, [2; 32], att_b.to_vec(), now);
    pump(&mut a, &mut b, now).unwrap();
    (a, b)
}

/// Both ends create their side after authentication and swap link infos.
fn exchange_infos(a: &mut Connection, b: &mut Connection, ia: &[u8], ib: &[u8], now: Instant) {
    a.link_prepared(ia.to_vec());
    b.link_prepared(ib.to_vec());
    pump(a, b, now).unwrap();
}

#[test]
fn shm_link_setup_exchanges_one_sync_byte_each_way() {
    let t0 = Instant::now();
    let (mut a, mut b) = pair_with(b"shm:", b"shm:", t0);
    for c in [&mut a, &mut b] {
        match c.poll_event() {
            Some(Event::LinkSetup { kind, peer }) => {
                assert_eq!(kind, LinkKind::Shm);
                assert_eq!(peer.attachment, b"shm:", "the hello only asks for the link");
            }
            other => panic!("expected LinkSetup, got {other:?}"),
        }
        assert!(!c.is_established() && c.pending_link() == Some(LinkKind::Shm));
        assert_eq!(c.poll_timeout(), Some(t0 + Duration::from_secs(5)));
        assert!(
            c.try_reserve(64).is_err(),
            "no application frames before the link is up"
        );
        assert!(c.awaits_link_info() && c.peer_link_info().is_none());
        c.link_ready(t0);
        assert_eq!(
            c.poll_transmit_raw(),
            None,
            "not ready before the link infos"
        );
    }
    exchange_infos(&mut a, &mut b, b"shm:/dev/shm/a", b"shm:/dev/shm/b", t0);
    assert_eq!(a.peer_link_info(), Some(&b"shm:/dev/shm/b"[..]));
    assert_eq!(b.peer_link_info(), Some(&b"shm:/dev/shm/a"[..]));
    // a finishes first: it owes its sync byte and waits for b's.
    a.link_ready(t0);
    assert_eq!(a.poll_transmit_raw(), Some(SHM_SYNC_BYTE));
    assert_eq!(a.poll_transmit_raw(), None);
    assert!(a.awaits_raw() && a.pending_link().is_none());
    assert_eq!(a.poll_timeout(), Some(t0 + Duration::from_secs(5)));
    // a's byte reaches b before b has mapped a's ring: b remembers it.
    assert_eq!(b.handle_raw(&[SHM_SYNC_BYTE, 9]).unwrap(), 1);
    assert!(!b.is_established());
    b.link_ready(t0);
    assert_eq!(b.poll_transmit_raw(), Some(SHM_SYNC_BYTE));
    assert!(b.is_established());
    assert!(matches!(b.poll_event(), Some(Event::Established(p)) if p.rank == 0));
    assert_eq!(a.handle_raw(&[SHM_SYNC_BYTE]).unwrap(), 1);
    assert!(a.is_established());
    assert!(matches!(a.poll_event(), Some(Event::Established(p)) if p.rank == 1));
    assert!(a.try_reserve(64).unwrap());
    // After setup a raw byte is a protocol violation.
    assert!(a.handle_raw(&[1]).is_err());
}

#[test]
fn a_side_that_cannot_create_its_ring_makes_both_use_tcp() {
    let t0 = Instant::now();
    for (ia, ib) in [(&b""[..], &b"shm:/b"[..]), (b"shm:/a", b"")] {
        let (mut a, mut b) = pair_with(b"shm:", b"shm:", t0);
        exchange_infos(&mut a, &mut b, ia, ib, t0);
        for c in [&mut a, &mut b] {
            assert!(c.is_established(), "{ia:?} / {ib:?}");
            assert!(matches!(c.poll_event(), Some(Event::LinkSetup { .. })));
            assert!(matches!(c.poll_event(), Some(Event::Established(_))));
            assert_eq!(c.poll_transmit_raw(), None, "no sync byte on TCP");
        }
    }
    // A description of another link kind is a protocol violation.
    let (mut a, mut b) = pair_with(b"shm:", b"shm:", t0);
    a.link_prepared(b"shm:/a".to_vec());
    b.link_prepared(b"rdma:x".to_vec());
    assert!(pump(&mut a, &mut b, t0).is_err());
    assert!(
        a.close_reason()
            .is_some_and(|e| e.to_string().contains("rdma link"))
    );
}

#[test]
fn link_kind_falls_back_to_tcp_unless_both_hellos_agree() {
    let now = Instant::now();
    for (x, y) in [
        (&b"shm:"[..], &b""[..]),
        (b"", b"shm:"),
        (b"rdma:", b"shm:"),
        (b"", b""),
    ] {
        let (mut a, mut b) = pair_with(x, y, now);
        assert!(a.is_established() && b.is_established(), "{x:?} / {y:?}");
        assert!(matches!(a.poll_event(), Some(Event::Established(_))));
        assert_eq!(a.pending_link(), None);
        assert_eq!(b.poll_transmit_raw(), None);
    }
    assert_eq!(LinkKind::of_attachment(b"rdma:x"), LinkKind::Rdma);
    let hello = |att: &[u8]| {
        let mut c = Connection::new(cfg(2, None), None, [0; 32], att.to_vec(), now);
        c.poll_transmit().unwrap()
    };
    assert_eq!(requested_link(&hello(b"shm:")), (LinkKind::Shm, 2));
    assert_eq!(requested_link(&hello(b"")), (LinkKind::Tcp, 2));
    let credit = Body::Credit(Credit { bytes: 1 });
    assert_eq!(requested_link(&credit), (LinkKind::Tcp, u32::MAX));
}

#[test]
fn rdma_link_setup_needs_no_sync_byte() {
    let now = Instant::now();
    let (mut a, mut b) = pair_with(b"rdma:", b"rdma:", now);
    assert!(matches!(
        a.poll_event(),
        Some(Event::LinkSetup {
            kind: LinkKind::Rdma,
            ..
        })
    ));
    exchange_infos(&mut a, &mut b, b"rdma:qp-a", b"rdma:qp-b", now);
    assert!(!a.awaits_raw());
    a.link_ready(now);
    assert_eq!(a.poll_transmit_raw(), None);
    assert!(a.is_established());
    assert!(matches!(a.poll_event(), Some(Event::Established(_))));
}

#[test]
fn link_setup_times_out_or_fails_without_a_frame() {
    let t0 = Instant::now();
    let (mut a, mut b) = pair_with(b"shm:", b"shm:", t0);
    exchange_infos(&mut a, &mut b, b"shm:/a", b"shm:/b", t0);
    a.link_ready(t0);
    a.handle_timeout(t0 + Duration::from_millis(4999));
    assert!(a.close_reason().is_none());
    a.handle_timeout(t0 + Duration::from_secs(5));
    assert!(matches!(
        a.close_reason(),
        Some(ProtocolError::HandshakeTimeout(_))
    ));
    assert_eq!(
        a.poll_transmit_raw(),
        None,
        "a closed connection sends no sync byte"
    );
    assert!(a.handle_raw(&[1]).is_err());

    let (mut b, _a) = pair_with(b"shm:", b"shm:", t0);
    let e = b.link_setup_failed("cannot map ring");
    assert!(matches!(e, ProtocolError::Closed(ref m) if m == "link setup: cannot map ring"));
    assert!(
        b.poll_transmit().is_none(),
        "the peer learns from the closed connection"
    );
    assert!(b.poll_transmit_raw().is_none());
    // A frame during link setup is refused.
    let (mut c, _d) = pair_with(b"shm:", b"shm:", t0);
    let hb = Body::Heartbeat(Heartbeat {
        seq: 1,
        sent_at_us: 0,
    });
    let err = c.handle_frame(t0, &hb, 64).unwrap_err();
    assert!(matches!(
        err,
        ProtocolError::UnexpectedFrame {
            state: "during link setup",
            ..
        }
    ));
}

#[test]
fn data_before_handshake_is_rejected() {
    let now = Instant::now();
    let mut a = Connection::new(cfg(0, None), None, [1; 32], vec![], now);
    let body = Body::Credit(Credit { bytes: 5 });
    assert!(a.handle_frame(now, &body, 64).is_err());
    assert!(matches!(a.poll_transmit(), Some(Body::Error(_))));
}

// ----- Identity, transcript binding and pre-auth bounds -----

fn master(b: u8) -> Key {
    Key::from_bytes([b; 32])
}

/// An end of cluster "test" (4 ranks, rank 0 the router) holding `creds`.
fn with_creds(rank: u32, creds: Option<Credentials>) -> Arc<ProtocolConfig> {
    let mut c = (*cfg(rank, None)).clone();
    c.credentials = creds.map(Arc::new);
    c.accept_clients = rank == 0;
    Arc::new(c)
}

fn issued(m: &Key, rank: u32) -> Credentials {
    Credentials::issue_rank(m, "test", rank, 4, 1)
}

/// Dialer `a` (expecting rank 0) against acceptor `b`.
fn handshake(
    a: Arc<ProtocolConfig>,
    b: Arc<ProtocolConfig>,
) -> (Connection, Connection, Result<(), ProtocolError>) {
    let now = Instant::now();
    let mut a = Connection::new(a, Some(0), [1; 32], vec![], now);
    let mut b = Connection::new(b, None, [2; 32], vec![], now);
    let r = pump_each(&mut a, &mut b, now);
    (a, b, r)
}

/// Moves one frame at a time each way (as drivers do: each end answers before it reads
/// on), ignoring failures, until both ends are quiet; `Err` if either end closed.
fn pump_each(a: &mut Connection, b: &mut Connection, now: Instant) -> Result<(), ProtocolError> {
    loop {
        let mut moved = false;
        if let Some(f) = a.poll_transmit() {
            moved = true;
            let _ = b.handle_frame(now, &f, 64);
        }
        if let Some(f) = b.poll_transmit() {
            moved = true;
            let _ = a.handle_frame(now, &f, 64);
        }
        if !moved {
            break;
        }
    }
    match (a.close_reason(), b.close_reason()) {
        (Some(e), _) | (_, Some(e)) => Err(e.clone()),
        _ => Ok(()),
    }
}

fn auth_failure(c: &Connection) -> String {
    match c.close_reason() {
        Some(ProtocolError::AuthFailed(m)) => m.clone(),
        other => panic!("expected an authentication failure, got {other:?}"),
    }
}

#[test]
fn issued_credentials_authenticate_and_agree_on_session_keys() {
    let m = master(1);
    let (a, b, r) = handshake(
        with_creds(2, Some(issued(&m, 2))),
        with_creds(0, Some(issued(&m, 0))),
    );
    r.unwrap();
    assert!(a.is_established() && b.is_established());
    let (ka, kb) = (a.session_keys().unwrap(), b.session_keys().unwrap());
    assert_eq!(ka.send, kb.recv);
    assert_eq!(ka.recv, kb.send);
    // A frame sealed by one end opens at the other.
    let mut s = crypto::Sealer::new(&ka.send);
    let mut o = crypto::Opener::new(&kb.recv);
    let head = crate::codec::encode_frame(
        &Body::Credit(Credit { bytes: 3 }),
        &[],
        &CodecConfig::default(),
    )
    .unwrap();
    let mut wire = Vec::new();
    s.seal_frame(&head, &[], &mut wire).unwrap();
    assert_eq!(
        crypto::open_frame(&mut o, &wire, &CodecConfig::default())
            .unwrap()
            .0,
        head
    );
}

#[test]
fn a_rank_claimed_with_another_ranks_keys_is_refused() {
    let m = master(1);
    // The holder of rank 2's file relabels it as rank 1's and claims rank 1.
    let text = issued(&m, 2).to_file_text().replace("rank = 2", "rank = 1");
    let forged = Credentials::parse(&text, "forged").unwrap();
    let (a, b, r) = handshake(
        with_creds(1, Some(forged)),
        with_creds(0, Some(issued(&m, 0))),
    );
    assert!(r.is_err() && !b.is_established() && !a.is_established());
    let why = auth_failure(&b);
    assert!(why.contains("rank 1") && why.contains("wrong MAC"), "{why}");
    // Its own file cannot act as rank 1 at all.
    let (a, _b, r) = handshake(
        with_creds(1, Some(issued(&m, 2))),
        with_creds(0, Some(issued(&m, 0))),
    );
    assert!(r.is_err());
    assert!(auth_failure(&a).contains("holds no key"));
}

#[test]
fn another_clusters_key_is_refused() {
    let (_a, b, r) = handshake(
        with_creds(2, Some(issued(&master(9), 2))),
        with_creds(0, Some(issued(&master(1), 0))),
    );
    assert!(r.is_err());
    assert!(auth_failure(&b).contains("wrong MAC"));
}

#[test]
fn a_frontend_credential_cannot_join_the_mesh() {
    let m = master(1);
    let fe = Credentials::issue_frontend(&m, "test", "fe", 1);
    // As a mesh rank, the frontend's credential holds no pair key.
    let (a, _b, r) = handshake(
        with_creds(2, Some(fe.clone())),
        with_creds(0, Some(issued(&m, 0))),
    );
    assert!(r.is_err());
    assert!(auth_failure(&a).contains("holds no key"));
    // Its frontend key passed off as a pair key does not verify either.
    let key_hex: String = fe
        .router_key("test", 0, "fe")
        .unwrap()
        .bytes()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let text =
        format!("# expertmesh credential v1\ncluster = test\nrank = 2\npair 0 = {key_hex}\n");
    let forged = Credentials::parse(&text, "forged").unwrap();
    let (_a, b, r) = handshake(
        with_creds(2, Some(forged)),
        with_creds(0, Some(issued(&m, 0))),
    );
    assert!(r.is_err());
    assert!(auth_failure(&b).contains("wrong MAC"));
    // As a frontend it authenticates with the router (and only under its own name).
    let mut client = (*with_creds(CLIENT_RANK, Some(fe))).clone();
    client.world_size = 1;
    let (a, b, r) = handshake(Arc::new(client), with_creds(0, Some(issued(&m, 0))));
    r.unwrap();
    assert!(a.is_established() && b.is_established());
    assert_eq!(b.peer().unwrap().identity, "fe");
    // A worker does not accept frontends (it derives no frontend key).
    let mut worker = (*with_creds(3, Some(issued(&m, 3)))).clone();
    worker.accept_clients = true;
    let mut c2 = (*with_creds(
        CLIENT_RANK,
        Some(Credentials::issue_frontend(&m, "test", "fe", 4)),
    ))
    .clone();
    c2.world_size = 4;
    let now = Instant::now();
    let mut a = Connection::new(Arc::new(c2), Some(3), [1; 32], vec![], now);
    let mut b = Connection::new(Arc::new(worker), None, [2; 32], vec![], now);
    assert!(pump_each(&mut a, &mut b, now).is_err());
    assert!(auth_failure(&b).contains("holds no key"));
}

/// Runs a handshake with `tamper` applied to the acceptor's hello on its way to the dialer.
fn tampered(tamper: impl Fn(&mut Hello)) -> (Connection, Connection) {
    let m = master(1);
    let now = Instant::now();
    let mut a = Connection::new(
        with_creds(2, Some(issued(&m, 2))),
        Some(0),
        [1; 32],
        vec![],
        now,
    );
    let mut b = Connection::new(
        with_creds(0, Some(issued(&m, 0))),
        None,
        [2; 32],
        vec![],
        now,
    );
    for _ in 0..4 {
        while let Some(f) = a.poll_transmit() {
            let _ = b.handle_frame(now, &f, 64);
        }
        while let Some(mut f) = b.poll_transmit() {
            if let Body::Hello(h) = &mut f {
                tamper(h);
            }
            let _ = a.handle_frame(now, &f, 64);
        }
    }
    (a, b)
}

#[test]
fn the_auth_mac_covers_every_hello_field() {
    let (a, b) = tampered(|_| {});
    assert!(
        a.is_established() && b.is_established(),
        "untampered handshake"
    );
    type Tamper<'a> = (&'a str, &'a dyn Fn(&mut Hello));
    let fields: [Tamper<'_>; 6] = [
        ("nonce", &|h| h.nonce[0] ^= 1),
        ("incarnation", &|h| h.incarnation ^= 1),
        ("fingerprint", &|h| h.fingerprint[5] ^= 1),
        ("window", &|h| h.recv_window_bytes += 64 << 10),
        ("link request", &|h| h.attachment = b"shm:".to_vec()),
        ("name", &|h| h.identity = "x".into()),
    ];
    for (what, f) in fields {
        let (a, b) = tampered(f);
        assert!(
            !a.is_established() && !b.is_established(),
            "tampered {what} went unnoticed"
        );
    }
}

#[test]
fn credentials_on_one_side_only_are_refused() {
    let m = master(1);
    let (a, b, r) = handshake(with_creds(2, None), with_creds(0, Some(issued(&m, 0))));
    assert!(r.is_err() && !a.is_established() && !b.is_established());
    assert!(auth_failure(&b).contains("insecure"));
    let (a, b, r) = handshake(with_creds(2, Some(issued(&m, 2))), with_creds(0, None));
    assert!(r.is_err() && !a.is_established());
    assert!(auth_failure(&b).contains("this node has none"));
}

#[test]
fn frames_larger_than_the_pre_auth_cap_are_refused_before_authentication() {
    let now = Instant::now();
    let mut a = Connection::new(cfg(0, Some(b"k")), None, [1; 32], vec![], now);
    let hb = Body::Heartbeat(Heartbeat {
        seq: 1,
        sent_at_us: 0,
    });
    let err = a
        .handle_frame(now, &hb, PRE_AUTH_MAX_FRAME_BYTES as u64 + 1)
        .unwrap_err();
    assert!(
        matches!(err, ProtocolError::PreAuthTooLarge { .. }),
        "{err}"
    );
    assert!(err.to_string().contains("before authentication"));
}

#[test]
fn a_frontend_authenticates_with_whichever_router_answers() {
    let m = master(1);
    let fe = Credentials::issue_frontend(&m, "test", "fe", 2);
    for router in 0..2u32 {
        let mut server = (*cfg(router, None)).clone();
        server.credentials = Some(Arc::new(Credentials::issue_rank(&m, "test", router, 4, 2)));
        server.accept_clients = true;
        // As a router's frontend listener announces itself: the last rank of its world.
        server.world_size = router + 1;
        let mut client = (*cfg(CLIENT_RANK, None)).clone();
        client.world_size = 1;
        client.credentials = Some(Arc::new(fe.clone()));
        let now = Instant::now();
        let mut a = Connection::new(Arc::new(client), None, [1; 32], vec![], now);
        let mut b = Connection::new(Arc::new(server), None, [2; 32], vec![], now);
        pump_each(&mut a, &mut b, now).unwrap();
        assert!(a.is_established() && b.is_established(), "router {router}");
        assert_eq!(a.peer().unwrap().rank, router);
    }
}

/// A router's frontend listener takes frontends only: a mesh rank (router 0's credential,
/// say) dialling router 1's frontend port is refused at its hello. Accepted, its pair key with
/// router 1 would authenticate the connection and the frontend name its hello claims (an
/// admin's, allowed to move experts) would be taken unchecked.
#[test]
fn a_frontend_listener_refuses_mesh_ranks() {
    let m = master(1);
    let mut server = (*cfg(1, None)).clone();
    server.credentials = Some(Arc::new(Credentials::issue_rank(&m, "test", 1, 4, 2)));
    server.accept_clients = true;
    server.clients_only = true;
    server.world_size = 2;
    let mut rank0 = (*cfg(0, None)).clone();
    rank0.credentials = Some(Arc::new(Credentials::issue_rank(&m, "test", 0, 4, 2)));
    rank0.world_size = 2;
    let now = Instant::now();
    let mut a = Connection::new(Arc::new(rank0), Some(1), [1; 32], vec![], now);
    let mut b = Connection::new(Arc::new(server), None, [2; 32], vec![], now);
    assert!(pump_each(&mut a, &mut b, now).is_err());
    assert!(!b.is_established());
    let why = auth_failure(&b);
    assert!(
        why.contains("rank 0 dialled a router's frontend port"),
        "{why}"
    );
}

/// With credentials a hello carries no incarnation and no fingerprint in the clear (issue 27:
/// a value anyone on the path can read must not say who a process is); they arrive sealed in
/// the auth answer, and a sealed identity that was altered does not open.
#[test]
fn with_credentials_identity_travels_sealed_not_in_the_hello() {
    let now = Instant::now();
    let mut a = Connection::new(fingerprinted(0, 0, 11), Some(1), [1; 32], vec![], now);
    let mut b = Connection::new(fingerprinted(1, 0, 22), None, [2; 32], vec![], now);
    let hello = a.poll_transmit().expect("a's hello");
    let Body::Hello(h) = &hello else {
        panic!("expected a hello, got {hello:?}")
    };
    assert_eq!(h.incarnation, 0);
    assert_eq!(h.fingerprint, [0; 32]);
    b.handle_frame(now, &hello, 64).unwrap();
    let mut b_frames = Vec::new();
    while let Some(f) = b.poll_transmit() {
        b_frames.push(f);
    }
    for f in &b_frames {
        if let Body::Hello(h) = f {
            assert_eq!((h.incarnation, h.fingerprint), (0, [0; 32]));
        }
        a.handle_frame(now, f, 64).unwrap();
    }
    // a's auth answer, with one bit of its sealed identity flipped.
    let mut auth = a.poll_transmit().expect("a's auth answer");
    let Body::Auth(x) = &mut auth else {
        panic!("expected an auth answer, got {auth:?}")
    };
    x.identity.as_mut().expect("a sealed identity")[3] ^= 1;
    let e = b.handle_frame(now, &auth, 64).unwrap_err();
    assert!(e.to_string().contains("sealed identity"), "{e}");
    assert!(!b.is_established());
}
